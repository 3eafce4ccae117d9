#!/usr/bin/python3
"""Writes the golden cases tests/unit/test_llama.cpp checks against.

An independent plain-PyTorch transcription of transformers' Llama / Mistral
math (modeling_llama.py, modeling_mistral.py, eager attention;
modeling_rope_utils.py for rope scaling), because transformers is not
installed here. For each case it writes under tests/data/golden/<name>/:
  config.json        Hugging Face style config
  model.safetensors  random fp32 weights under HF parameter names
  golden.safetensors input_ids [B,T] int64, logits [B,T,V] fp32, loss [] fp32
                     (mean next-token cross entropy), and logits_fp64 /
                     loss_fp64: the same weights run in fp64
  greedy.json        (GREEDY_CASES only) greedy continuation of a prompt (the
                     first ids of one row of input_ids), recomputing the
                     whole sequence each step as transformers' generate() with
                     do_sample=False does; stops after eos_token_id (included),
                     like generate(). tests/unit/test_generation.cpp checks the
                     KV-cached generation and the `generate` program against it.
Safetensors files are written by hand (no safetensors package on Debian 12).

Usage: /usr/bin/python3 scripts/make_llama_golden.py [out_dir]
"""
import json
import math
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

def at_least_fp32(dtype):
    """transformers computes norms, softmax and logits in fp32. In an fp64 run
    (the rounding-free reference the tests compare with) they stay fp64;
    everywhere else this is fp32, as in transformers."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm(x, weight, eps):
    input_dtype = x.dtype
    h = x.to(at_least_fp32(x.dtype))
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def inv_freq_for(cfg):
    dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    base = cfg["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.get("rope_scaling")
    if not rs:
        return inv_freq
    kind = rs.get("rope_type", rs.get("type"))
    factor = rs["factor"]
    if kind == "linear":
        return inv_freq / factor
    assert kind == "llama3"
    low, high = rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def forward(cfg, w, input_ids):
    B, T = input_ids.shape
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // nh
    eps = cfg["rms_norm_eps"]
    position_ids = torch.arange(T).unsqueeze(0).expand(B, T)
    inv_freq = inv_freq_for(cfg)
    freqs = (inv_freq[None, :, None].float().expand(B, -1, 1) @ position_ids[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # [B,1,T,d]

    min_value = torch.finfo(torch.float32).min
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    masked = j > i
    if cfg.get("sliding_window") is not None:
        masked = masked | (j <= i - cfg["sliding_window"])
    mask = torch.zeros(T, T).masked_fill(masked, min_value)[None, None]

    h = w["model.embed_tokens.weight"][input_ids]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        x = rms_norm(h, w[p + "input_layernorm.weight"], eps)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(B, T, nh, d).transpose(1, 2)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(B, T, nkv, d).transpose(1, 2)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(B, T, nkv, d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = nh // nkv
        k = k[:, :, None].expand(B, nkv, rep, T, d).reshape(B, nh, T, d)
        v = v[:, :, None].expand(B, nkv, rep, T, d).reshape(B, nh, T, d)
        scores = torch.matmul(q, k.transpose(2, 3)) * d ** -0.5 + mask
        probs = torch.softmax(scores, dim=-1, dtype=at_least_fp32(q.dtype)).to(q.dtype)
        attn = torch.matmul(probs, v).transpose(1, 2).reshape(B, T, nh * d)
        h = h + attn @ w[p + "self_attn.o_proj.weight"].T
        x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        gate = torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T)
        up = x @ w[p + "mlp.up_proj.weight"].T
        h = h + (gate * up) @ w[p + "mlp.down_proj.weight"].T
    h = rms_norm(h, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    logits = (h @ head.T).to(at_least_fp32(h.dtype))
    V = logits.shape[-1]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), input_ids[:, 1:].reshape(-1))
    return logits, loss


def eos_of(cfg):
    eos = cfg["eos_token_id"]
    return eos[0] if isinstance(eos, list) else eos


def greedy(cfg, w, prompt, max_new_tokens):
    """Greedy ids after `prompt` (a list), and the smallest gap between the two
    best logits over the steps (a tie-break margin the C++ side must not cross)."""
    ids = list(prompt)
    out, min_gap = [], float("inf")
    for _ in range(max_new_tokens):
        logits, _ = forward(cfg, w, torch.tensor([ids], dtype=torch.int64))
        last = logits[0, -1]
        top2 = torch.topk(last, 2).values
        min_gap = min(min_gap, (top2[0] - top2[1]).item())
        token = int(torch.argmax(last).item())
        out.append(token)
        ids.append(token)
        if token == eos_of(cfg):
            break
    return out, min_gap


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
    linear["rope_scaling"] = {"type": "linear", "factor": 2.0}

    mistral = base_config("mistral")
    mistral["sliding_window"] = 4
    mistral["rope_theta"] = 1000000.0
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
        with torch.no_grad():
            logits, loss = forward(cfg, dict(weights), input_ids)
            # The same weights in fp64 (rotary tables stay fp32, as in transformers).
            logits64, loss64 = forward(cfg, {k: v.double() for k, v in weights}, input_ids)
        out = os.path.join(out_root, name)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
        write_safetensors(os.path.join(out, "model.safetensors"), weights)
        write_safetensors(os.path.join(out, "golden.safetensors"),
                          [("input_ids", input_ids), ("logits", logits), ("loss", loss.reshape(())),
                           ("logits_fp64", logits64), ("loss_fp64", loss64.reshape(()))])
        print(f"{name}: loss {loss.item():.6f}")
        if name in GREEDY_CASES:
            # After the random draws above, and drawing none: the other outputs stay as they were.
            row, length = GREEDY_CASES[name]
            prompt = input_ids[row, :length].tolist()
            with torch.no_grad():
                ids, gap = greedy(cfg, dict(weights), prompt, MAX_NEW_TOKENS)
            assert gap > 1e-3, f"{name}: greedy step with near-tied logits ({gap}); pick another prompt"
            with open(os.path.join(out, "greedy.json"), "w") as f:
                json.dump({"prompt_ids": prompt, "max_new_tokens": MAX_NEW_TOKENS, "eos_token_id": eos_of(cfg),
                           "greedy_ids": ids, "min_top2_logit_gap": round(gap, 6)}, f, indent=2)
                f.write("\n")
            print(f"{name}: greedy {ids} (min top-2 gap {gap:.4f})")


if __name__ == "__main__":
    main()
