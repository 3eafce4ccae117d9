#!/usr/bin/env python3
"""PyTorch's side of scripts/gpu-check's benchmark: the Llama step that
llama_finetune times, in Python on the node's own torch, on the same device.

--mode:
  eager   the plain loop a PyTorch user writes: fp32 parameters, the forward
          under torch.autocast(bf16), fp32 loss, torch.optim.AdamW (fused on
          CUDA), zero_grad(set_to_none=True);
  fsdp2   FSDP2 fully_shard at world 1 (each decoder layer, then the root),
          MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): fp32
          sharded parameters, bf16 compute, as shardtrain's zero-3 / fsdp
          standard keep them;
  gemm    the device's bf16 GEMM rate (8192^3, or --gemm-size), the
          denominator of "MFU against the measured GEMM".
The model is scripts/torch_llama.py (transformers' Llama in plain torch: the
node has no registry to install transformers from), randomly initialised
from --model-config, AdamW lr 1e-4, weight decay 0.01, random tokens (a
generator seeded 1000 * step + 1 draws [micro_batch, seq_len + 1] ids).

Prints one JSON line: {"mode", "device", "step_seconds" (median of the timed
steps), "tokens_per_s", "losses" (every step), "peak_allocated_bytes"
(torch.cuda.max_memory_allocated; 0 on the CPU), "parameters"}; for gemm
{"mode", "device", "tflops", "size"}.

--dtype fp32 runs without autocast (the CPU dry run uses it with tiny
shapes, only to prove the plumbing).

Usage: python3 scripts/gpu_bench_peer.py --mode eager|fsdp2|gemm
       [--model-config F] [--seq-len 2048] [--micro-batch 4] [--steps 8]
       [--skip 2] [--device cuda] [--dtype bf16] [--json-out FILE]
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_llama  # noqa: E402


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_tflops(device, size, dtype):
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    synchronize(device)
    reps = 20 if device.type == "cuda" else 2
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    synchronize(device)
    return 2.0 * size ** 3 * reps / (time.perf_counter() - start) / 1e12


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(args, cfg, device):
    torch.manual_seed(0)
    with torch.device(device):
        model = torch_llama.Llama(cfg, device=device)
    model.train()
    if args.mode == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                                device_id=device if device.type == "cuda" else None)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if args.dtype == "bf16" else MixedPrecisionPolicy()
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=fused)
    return model, optimizer


def train(args, cfg, device):
    model, optimizer = build(args, cfg, device)
    parameters = sum(p.numel() for p in model.parameters())
    # Under fsdp2 the policy casts; eager needs autocast for bf16 compute.
    autocast = args.dtype == "bf16" and args.mode == "eager"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, seconds = [], []
    for step in range(args.skip + args.steps):
        gen = torch.Generator().manual_seed(1000 * step + 1)
        tokens = torch.randint(cfg["vocab_size"], (args.micro_batch, args.seq_len + 1), generator=gen).to(device)
        synchronize(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, cfg["vocab_size"]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # synchronizes
        synchronize(device)
        if step >= args.skip:
            seconds.append(time.perf_counter() - start)
    step_seconds = statistics.median(seconds)
    result = {"mode": args.mode, "device": str(device), "dtype": args.dtype, "parameters": parameters,
              "step_seconds": step_seconds, "tokens_per_s": args.micro_batch * args.seq_len / step_seconds,
              "losses": losses,
              "peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0}
    if args.mode == "fsdp2":
        import torch.distributed as dist
        dist.destroy_process_group()
    return result


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["eager", "fsdp2", "gemm"], required=True)
    parser.add_argument("--model-config", default=os.path.join(here, "..", "configs", "models", "llama-1b.json"))
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--gemm-size", type=int, default=8192)
    parser.add_argument("--json-out", help="also write the JSON line to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:  # set_device and init_process_group's device_id need an index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cuda.matmul.allow_tf32 = False  # shardtrain leaves TF32 off too
        torch.cuda.set_device(device)
    if args.mode == "gemm":
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        result = {"mode": "gemm", "device": str(device), "size": args.gemm_size,
                  "tflops": gemm_tflops(device, args.gemm_size, dtype)}
    else:
        with open(args.model_config) as f:
            cfg = json.load(f)
        torch_llama.check_config(cfg)
        if args.seq_len > cfg["max_position_embeddings"]:
            cfg = dict(cfg, max_position_embeddings=args.seq_len)
        result = train(args, cfg, device)
    line = json.dumps(result)
    print(line, flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
