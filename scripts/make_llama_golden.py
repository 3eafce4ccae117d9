#!/usr/bin/env python3
"""Writes the inputs of the golden Llama/Mistral cases under tests/data/golden/<name>/:
  config.json        Hugging Face style config
  model.safetensors  random fp32 weights under HF parameter names
  inputs.safetensors input_ids [B,T] int64
  prompt.json        (GREEDY_CASES only) a prompt (the first ids of one row of
                     input_ids), max_new_tokens and eos_token_id
The reference outputs are not made here: Hugging Face transformers computes
them from these files at build time (scripts/hf_golden.py), on the torch the
tests run on. Run this only to change the cases; the files are committed.

Usage: .venv/bin/python scripts/make_llama_golden.py [out_dir]
"""
import json
import os
import struct
import sys

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.int64: "I64"}


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, t in tensors:
        t = t.detach().contiguous().cpu()
        data = t.numpy().tobytes()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((8 - (8 + len(raw)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)


# ---- the model, as transformers computes it ---------------------------------

def eos_of(cfg):
    eos = cfg["eos_token_id"]
    return eos[0] if isinstance(eos, list) else eos


def random_weights(cfg, gen):
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = H // nh
    std = 0.2  # larger than initializer_range so attention patterns are not flat

    def mat(*shape):
        return torch.randn(*shape, generator=gen) * std

    def norm():
        return 1.0 + 0.1 * torch.randn(H, generator=gen)

    w = [("model.embed_tokens.weight", torch.randn(V, H, generator=gen) * 0.5)]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w += [(p + "self_attn.q_proj.weight", mat(nh * d, H)),
              (p + "self_attn.k_proj.weight", mat(nkv * d, H)),
              (p + "self_attn.v_proj.weight", mat(nkv * d, H)),
              (p + "self_attn.o_proj.weight", mat(H, nh * d)),
              (p + "mlp.gate_proj.weight", mat(I, H)),
              (p + "mlp.up_proj.weight", mat(I, H)),
              (p + "mlp.down_proj.weight", mat(H, I)),
              (p + "input_layernorm.weight", norm()),
              (p + "post_attention_layernorm.weight", norm())]
    w.append(("model.norm.weight", norm()))
    if not cfg["tie_word_embeddings"]:
        w.append(("lm_head.weight", mat(V, H)))
    return w


def base_config(model_type):
    return {
        "architectures": ["MistralForCausalLM" if model_type == "mistral" else "LlamaForCausalLM"],
        "model_type": model_type,
        "vocab_size": 48,
        "hidden_size": 24,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "torch_dtype": "float32",
    }


def cases():
    llama = base_config("llama")
    llama["rope_scaling"] = None

    tied = base_config("llama")
    tied["tie_word_embeddings"] = True
    tied["rope_theta"] = 500000.0
    tied["eos_token_id"] = [2, 3]
    # head_dim 6: wavelengths ~6, ~500, ~4e4 -> high, medium and low frequency bands.
    tied["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}

    linear = base_config("llama")
    linear["num_key_value_heads"] = 4
    linear["num_hidden_layers"] = 1  # keeps tests/data small
    # These two are written as transformers >= 5 writes a config.json: the
    # rotary settings in one rope_parameters object, no top-level rope_theta
    # (the two cases above keep the older layout).
    del linear["rope_theta"]
    linear["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0}

    mistral = base_config("mistral")
    mistral["sliding_window"] = 4
    del mistral["rope_theta"]
    mistral["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    return [("llama", llama, 1), ("llama_tied_llama3", tied, 2), ("llama_linear_mha", linear, 3),
            ("mistral_swa", mistral, 4)]


# Cases that also get greedy.json, with the prompt (row of input_ids, length):
# GQA Llama, and Mistral with a generation longer than its sliding window (4)
# so the cached window is exercised. Prompts picked for continuations that do
# not just repeat one token.
GREEDY_CASES = {"llama": (1, 8), "mistral_swa": (0, 5)}
MAX_NEW_TOKENS = 12


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out_root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "tests", "data", "golden")
    torch.set_num_threads(1)
    B, T = 2, 12  # keep every case small: the outputs are committed (< 200 KB in all)
    for name, cfg, seed in cases():
        gen = torch.Generator().manual_seed(seed)
        weights = random_weights(cfg, gen)
        input_ids = torch.randint(0, cfg["vocab_size"], (B, T), generator=gen, dtype=torch.int64)
        out = os.path.join(out_root, name)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
        write_safetensors(os.path.join(out, "model.safetensors"), weights)
        write_safetensors(os.path.join(out, "inputs.safetensors"), [("input_ids", input_ids)])
        if name in GREEDY_CASES:
            row, length = GREEDY_CASES[name]
            with open(os.path.join(out, "prompt.json"), "w") as f:
                json.dump({"prompt_ids": input_ids[row, :length].tolist(), "max_new_tokens": MAX_NEW_TOKENS,
                           "eos_token_id": eos_of(cfg)}, f, indent=2)
                f.write("\n")
        print(f"{name}: written to {out}")


if __name__ == "__main__":
    main()
