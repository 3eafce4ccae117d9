#!/usr/bin/python3
"""What a user would run instead: the same Llama training step in plain
Python PyTorch (Debian's python3-torch), fp32, AdamW, random tokens; at
--world 2 and up, DistributedDataParallel over Gloo on 127.0.0.1.

The model is make_llama_golden.py's independent transcription of
transformers' Llama math (transformers is not installed here), with the
weights as trainable parameters. Prints one JSON line on rank 0:
{"step_seconds": mean of the timed steps (slowest rank), "loss": last loss}.
scripts/bench-vs-pytorch runs it interleaved with bench_train_step.

Threads: set OMP_NUM_THREADS and OPENBLAS_NUM_THREADS in the environment as
for the C++ side (OpenBLAS ignores torch.set_num_threads); this script also
calls torch.set_num_threads(--threads).

Usage: /usr/bin/python3 scripts/bench_pytorch.py [--model-config F] [--world N]
       [--seq-len 256] [--micro-batch 4] [--steps 3] [--skip 1]
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_llama_golden as llama  # noqa: E402  (the shared transcription)


class Llama(torch.nn.Module):
    def __init__(self, cfg, gen):
        super().__init__()
        self.cfg = cfg
        std = cfg.get("initializer_range", 0.02)
        weights = llama.random_weights(cfg, gen)
        self.names = [name for name, _ in weights]
        # transformers' init: normal(0, initializer_range) matrices, unit norms.
        self.weights = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(t.shape, generator=gen) * std if t.dim() == 2 else torch.ones(t.shape))
             for _, t in weights])

    def forward(self, input_ids):
        _, loss = llama.forward(self.cfg, dict(zip(self.names, self.weights)), input_ids)
        return loss


def run(rank, args):
    torch.set_num_threads(args.threads)
    if args.world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                                world_size=args.world)
    with open(args.model_config) as f:
        cfg = json.load(f)
    cfg.setdefault("tie_word_embeddings", False)
    model = Llama(cfg, torch.Generator().manual_seed(0))
    trained = torch.nn.parallel.DistributedDataParallel(model) if args.world > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    timed, loss = 0.0, None
    for step in range(args.skip + args.steps):
        gen = torch.Generator().manual_seed(1000 * step + rank + 1)
        tokens = torch.randint(cfg["vocab_size"], (args.micro_batch, args.seq_len), generator=gen)
        start = time.perf_counter()
        loss = trained(tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        if step >= args.skip:
            timed += seconds
    mean = torch.tensor([timed / args.steps], dtype=torch.float64)
    if args.world > 1:
        dist.all_reduce(mean, op=dist.ReduceOp.MAX)
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"step_seconds": mean.item(), "loss": loss.item()}), flush=True)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-config", default=os.path.join(here, "..", "bench", "models", "llama_58m.json"))
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--skip", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--port", type=int, default=29611)
    args = parser.parse_args()
    if args.world > 1:
        mp.spawn(run, args=(args,), nprocs=args.world, join=True)
    else:
        run(0, args)


if __name__ == "__main__":
    main()
