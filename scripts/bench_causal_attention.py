#!/usr/bin/env python3
"""Causal attention with and without a mask tensor, on this CPU, side by side.

What shardtrain's Llama attention chose between (src/kernels/mixed_attention.cpp):
SDPA with the [B,1,T,T] causal mask, or SDPA's own causal form (is_causal,
no mask tensor), forward and backward, fp32 and bf16. Rounds alternate the
two so drift hits both; prints the mean milliseconds per call and the ratio,
and checks that the two give the same bits. One thread unless
OMP_NUM_THREADS says otherwise.

Usage: .venv/bin/python scripts/bench_causal_attention.py [rounds]
"""
import os
import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
CALLS = 10
B, HEADS, T, D = 4, 8, 256, 64

torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    q, k, v = (torch.randn(B, HEADS, T, D, dtype=dtype, requires_grad=True) for _ in range(3))
    g = torch.randn(B, HEADS, T, D, dtype=dtype)
    idx = torch.arange(T)
    mask = ((idx[:, None] - idx[None, :]) >= 0).view(1, 1, T, T).expand(B, 1, T, T)

    def masked():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return [out.detach(), *torch.autograd.grad(out, (q, k, v), g)]

    def causal():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return [out.detach(), *torch.autograd.grad(out, (q, k, v), g)]

    same = all(torch.equal(a, b) for a, b in zip(masked(), causal()))
    seconds = {"masked": 0.0, "causal": 0.0}
    for _ in range(ROUNDS):
        for name, call in (("masked", masked), ("causal", causal)):
            start = time.perf_counter()
            for _ in range(CALLS):
                call()
            seconds[name] += time.perf_counter() - start
    calls = ROUNDS * CALLS
    print(f"{str(dtype):15} masked {seconds['masked'] / calls * 1e3:7.2f} ms  causal "
          f"{seconds['causal'] / calls * 1e3:7.2f} ms  causal/masked {seconds['causal'] / seconds['masked']:.3f}  "
          f"same bits: {same}  (B {B}, heads {HEADS}, T {T}, d {D}, {torch.get_num_threads()} thread(s), "
          f"{ROUNDS} rounds of {CALLS} calls)")
