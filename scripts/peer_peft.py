#!/usr/bin/env python3
"""The PEFT peer of DistLora (tests/dist/test_lora.cpp): Hugging Face PEFT
and transformers from requirements.txt read what shardtrain wrote.

  peer_peft.py BASE_DIR WORK_DIR

BASE_DIR is the base model (a Hugging Face directory: the golden Llama).
WORK_DIR holds shardtrain's output: adapter/ (save_lora_adapter), merged/
(save_model of the LoRA model) and shardtrain.safetensors (input_ids, and
shardtrain's fp64 logits of the adapter it loaded back). Writes
WORK_DIR/peft.safetensors:
  peft_logits        PeftModel.from_pretrained(base, adapter/), in fp64 (RMSNorm and
                     softmax too, as scripts/hf_golden.py's reference), on input_ids
  peft_merged.NAME   PEFT's merge_and_unload() of the same adapter on the fp32 base
and fails (exit 1) when merged/ does not load into LlamaForCausalLM as a
plain model (a missing or an unexpected key).
"""
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from hf_golden import fp64_norm_and_softmax  # noqa: E402  (the golden tests' fp64 reference, as there)
from peft import PeftModel  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402


def main():
    base_dir, work = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    input_ids = load_file(f"{work}/shardtrain.safetensors")["input_ids"]

    # fp64 throughout, adapters included (PEFT keeps adapters in fp32 by
    # default), with RMSNorm and softmax in fp64 too, as the golden tests'
    # reference (transformers computes those two in fp32 whatever the dtype).
    base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float64, attn_implementation="eager")
    model = PeftModel.from_pretrained(base, f"{work}/adapter").double().eval()
    with torch.no_grad(), fp64_norm_and_softmax():
        logits = model(input_ids).logits

    base32 = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base32, f"{work}/adapter").merge_and_unload()
    out = {"peft_logits": logits.contiguous()}
    for name, tensor in merged.state_dict().items():
        out["peft_merged." + name] = tensor.contiguous()

    _, info = LlamaForCausalLM.from_pretrained(f"{work}/merged", dtype=torch.float32, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if problems:
        print(f"shardtrain's merged export does not load as a plain LlamaForCausalLM: {problems}")
        return 1
    save_file(out, f"{work}/peft.safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
