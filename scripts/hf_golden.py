#!/usr/bin/env python3
"""The reference the Llama/Mistral golden tests compare against, computed by
Hugging Face transformers (LlamaForCausalLM, MistralForCausalLM with its
sliding window) on this machine's torch, at build time.

For each case under CASES_DIR (made once by scripts/make_llama_golden.py:
config.json, model.safetensors with random weights, inputs.safetensors with
input_ids, and for some cases prompt.json), writes OUT_DIR/<case>/:
  golden.safetensors  input_ids [B,T] int64, logits [B,T,V] fp32 and loss []
                      fp32 (mean next-token cross entropy), and logits_fp64 /
                      loss_fp64: the same weights run in fp64
  greedy.json         (cases with prompt.json) generate(do_sample=False) after
                      the prompt, with the smallest gap between the two best
                      logits over its steps (a near tie would make the ids
                      depend on rounding)
Eager attention: the plain softmax(QK^T)V that SDPA must agree with.
transformers computes RMSNorm and the attention softmax in float32 whatever
the model's dtype; the fp64 pass (a rounding-free reference, as shardtrain's
fp64 path is) computes those two in fp64 instead (fp64_norm_and_softmax).
Everything else is transformers' own code: weight names, GQA, rotary tables
and scalings, the causal and sliding-window masks, generate(). Computed
here rather than committed because the rotary tables are fp32 by design (as in
transformers), and which float32 cos/sin values the CPU's vector math rounds
the other way depends on the CPU: both sides must use this machine's torch.

Usage: scripts/hf_golden.py CASES_DIR OUT_DIR   (offline: nothing is downloaded)
"""
import contextlib
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def next_token_loss(logits, input_ids):
    vocab = logits.shape[-1]
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), input_ids[:, 1:].reshape(-1))


@contextlib.contextmanager
def fp64_norm_and_softmax():
    """RMSNorm and softmax keep a float64 input in float64 (transformers casts to float32)."""
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral

    def rms_norm(self, hidden_states):
        compute = torch.promote_types(hidden_states.dtype, torch.float32)
        x = hidden_states.to(compute)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(hidden_states.dtype)

    softmax = torch.nn.functional.softmax

    def softmax_keeping_fp64(input, *args, dtype=None, **kwargs):
        if dtype is not None and input.dtype == torch.float64:
            dtype = torch.float64
        return softmax(input, *args, dtype=dtype, **kwargs)

    saved = [(cls, cls.forward) for cls in (modeling_llama.LlamaRMSNorm, modeling_mistral.MistralRMSNorm)]
    for cls, _ in saved:
        cls.forward = rms_norm
    torch.nn.functional.softmax = softmax_keeping_fp64
    try:
        yield
    finally:
        for cls, forward in saved:
            cls.forward = forward
        torch.nn.functional.softmax = softmax


def load(case_dir, dtype):
    model = AutoModelForCausalLM.from_pretrained(case_dir, dtype=dtype, attn_implementation="eager",
                                                 local_files_only=True)
    return model.eval()


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    cases_dir, out_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    for name in sorted(os.listdir(cases_dir)):
        case = os.path.join(cases_dir, name)
        if not os.path.exists(os.path.join(case, "config.json")):
            continue
        input_ids = load_file(os.path.join(case, "inputs.safetensors"))["input_ids"]
        out = os.path.join(out_dir, name)
        os.makedirs(out, exist_ok=True)
        with torch.no_grad():
            model = load(case, torch.float32)
            logits = model(input_ids).logits.float()
            loss = next_token_loss(logits, input_ids)
            with fp64_norm_and_softmax():
                logits64 = load(case, torch.float64)(input_ids).logits
            loss64 = next_token_loss(logits64, input_ids)
        save_file({"input_ids": input_ids.contiguous(), "logits": logits.contiguous(), "loss": loss.reshape(()),
                   "logits_fp64": logits64.contiguous(), "loss_fp64": loss64.reshape(())},
                  os.path.join(out, "golden.safetensors"))
        prompt_file = os.path.join(case, "prompt.json")
        if os.path.exists(prompt_file):
            with open(prompt_file) as f:
                prompt = json.load(f)
            with torch.no_grad():
                generated = model.generate(torch.tensor([prompt["prompt_ids"]]), do_sample=False,
                                           max_new_tokens=prompt["max_new_tokens"],
                                           eos_token_id=prompt["eos_token_id"], pad_token_id=prompt["eos_token_id"],
                                           output_scores=True, return_dict_in_generate=True)
            ids = generated.sequences[0, len(prompt["prompt_ids"]):].tolist()
            gap = min(float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in generated.scores)
            # Two fp32 implementations of the same forward (shardtrain's SDPA,
            # transformers' eager attention) differ in the logits by summation
            # order alone: at most about n * 2^-24 * sum|terms| per logit, with
            # n ~ 2 layers x (hidden 24 + intermediate 32) products and terms of
            # these small random models below 10: ~7e-5, doubled for both
            # sides 1.3e-4. A step whose two best logits are closer than 1e-3
            # could flip the greedy id with rounding alone.
            if gap <= 1e-3:
                sys.exit(f"hf_golden: {name}: greedy step with near-tied logits ({gap}); pick another prompt")
            with open(os.path.join(out, "greedy.json"), "w") as f:
                json.dump(dict(prompt, greedy_ids=ids, min_top2_logit_gap=round(gap, 6)), f, indent=2)
                f.write("\n")
        print(f"hf_golden: {name}: loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
