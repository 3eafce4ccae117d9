#!/usr/bin/env python3
"""The GPU benchmark's PyTorch peer (scripts/torch_llama.py) is transformers'
Llama: the same weights (transformers' state dict, loaded strictly: every
name and shape matches) give the same logits on the same tokens.

Compared in float64. Against transformers' SDPA attention (the path the peer
takes too) two correct implementations differ only by the order of a few
additions, ~1e-16 relative, amplified by the depth and the softmax's
condition to ~1e-12 at most: bound 1e-9 of the logits' scale. (Its eager
attention is not compared: it computes the softmax in float32 whatever the
dtype, a rounding no bound derived in float64 covers, and the peer does not
take that path.) A different formula (a norm's epsilon inside or outside the root, a rotary
half swapped, a mask off by one, a missing repeat of the kv heads) moves
logits by 1e-3 or more. Cases: the project's golden Llama (GQA) and the
bundled tiny Llama (random weights).

Usage: check_torch_llama.py SOURCE_DIR   (the project's .venv python)
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

src = sys.argv[1]
sys.path.insert(0, os.path.join(src, "scripts"))
import torch_llama  # noqa: E402

BOUND = 1e-9
cases = [os.path.join(src, "tests/data/golden/llama"), os.path.join(src, "examples/tiny_llama")]
failures = 0
for case in cases:
    with open(os.path.join(case, "config.json")) as f:
        cfg = json.load(f)
    torch.manual_seed(0)
    weights = os.path.join(case, "model.safetensors")
    for attention in ("sdpa",):
        reference = LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation=attention)).double().eval()
        if os.path.exists(weights):
            reference.load_state_dict({k: v.double() for k, v in load_file(weights).items()}, strict=False)
        peer = torch_llama.Llama(cfg).double().eval()
        state = {k: v for k, v in reference.state_dict().items() if "rotary_emb" not in k}
        peer.load_state_dict(state, strict=True)
        tokens = torch.randint(cfg["vocab_size"], (2, min(48, cfg["max_position_embeddings"])),
                               generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            expected = reference(input_ids=tokens).logits
            got = peer(tokens)
        scale = expected.abs().max().item()
        difference = (got - expected).abs().max().item()
        ok = difference <= BOUND * scale
        failures += not ok
        print(f"{'ok' if ok else 'FAIL'}: {os.path.basename(case)} vs transformers ({attention}): "
              f"max |difference| {difference:.3e} of logits up to {scale:.3f} (bound {BOUND:g} of that)")
sys.exit(1 if failures else 0)
