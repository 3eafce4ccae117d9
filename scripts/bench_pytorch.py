#!/usr/bin/env python3
"""The peers of scripts/bench-vs-pytorch: the same Llama training step that
bench_train_step times, in Python on the same torch (the project's .venv):
Hugging Face transformers' LlamaForCausalLM built from the same config.json,
fp32, AdamW (lr 1e-4, weight decay 0.01), the same random tokens (a
generator seeded 1000 * step + rank + 1 draws [micro_batch, seq_len + 1]
ids, as bench_train_step does), the next-token cross entropy.

--mode:
  plain      one process, the plain training loop;
  ddp        DistributedDataParallel over Gloo;
  fsdp2      FSDP2 fully_shard (each decoder layer, then the root) over Gloo;
  deepspeed  DeepSpeed ZeRO-3 (DS_ACCELERATOR=cpu) over Gloo, torch's AdamW
             as the client optimizer (DeepSpeed's own CPU Adam would be a
             different optimizer kernel); with --bf16 DeepSpeed's bf16 mode.
--lora R: PEFT's get_peft_model with LoraConfig(r=R, lora_alpha=2R,
target_modules q/k/v/o_proj, dropout 0) on the model before wrapping, the
optimizer over the adapters only (what PEFT users run; bench_train_step's
*_lora configurations apply the same adapters).
Prints one JSON line on rank 0: {"step_seconds": mean of the timed steps of
the slowest rank, "loss": the last loss, "peak_rss_mib": the largest rank's
high-water mark of resident memory from just before the model is built to
the end (reset through /proc/self/clear_refs as bench_train_step does)}.

Threads: set OMP_NUM_THREADS and OPENBLAS_NUM_THREADS in the environment as
for the C++ side; this script also calls torch.set_num_threads(--threads).
Offline: nothing is downloaded.

Usage: .venv/bin/python scripts/bench_pytorch.py --mode plain|ddp|fsdp2|deepspeed
       [--world 2] [--model-config F] [--seq-len 256] [--micro-batch 4]
       [--steps 3] [--skip 1] [--threads 1] [--port 29611] [--lora 8] [--bf16]
"""
import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import deepspeed_peer  # noqa: E402  (this directory's; imports deepspeed only when called)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def peak_rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def reset_peak_rss():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def build(args, cfg):
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    if args.lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.train()
    return model


def decoder_layers(model):
    """The decoder layers, under PEFT's wrapper too."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model.layers


def wrap(args, model):
    """The trained module and its optimizer for --mode."""
    if args.mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif args.mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
    elif args.mode == "deepspeed":
        import deepspeed
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = adamw(trained)
        config = deepspeed_peer.zero_config(args.micro_batch, 3, bf16=args.bf16)
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        return engine, optimizer
    trained = [p for p in model.parameters() if p.requires_grad]
    return model, adamw(trained)


def adamw(params):
    # fused=True: torch's one-pass CPU kernel. Left at its default, AdamW on
    # the CPU runs its per-tensor loop (foreach is CUDA-only), far slower than
    # the fused flat-buffer pass shardtrain's engines run: the strongest peer
    # is the fair one.
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)


def run(rank, args):
    torch.set_num_threads(args.threads)
    world = 1 if args.mode == "plain" else args.world
    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
        if args.mode == "deepspeed":
            deepspeed_peer.init_on_gloo(rank, world)  # starts the Gloo group from MASTER_ADDR / MASTER_PORT
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world)
    from transformers import LlamaConfig
    cfg = LlamaConfig.from_json_file(args.model_config)
    reset_peak_rss()
    trained, optimizer = wrap(args, build(args, cfg))
    deepspeed_engine = args.mode == "deepspeed"
    timed, loss = 0.0, None
    for step in range(args.skip + args.steps):
        gen = torch.Generator().manual_seed(1000 * step + rank + 1)
        tokens = torch.randint(cfg.vocab_size, (args.micro_batch, args.seq_len + 1), generator=gen)
        start = time.perf_counter()
        # use_cache=False: training builds no KV cache (LlamaConfig defaults it on).
        logits = trained(input_ids=tokens[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
        if deepspeed_engine:
            trained.backward(loss)
            trained.step()
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        if step >= args.skip:
            timed += seconds
    result = torch.tensor([timed / args.steps, peak_rss_mib()], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(result, op=dist.ReduceOp.MAX)
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"mode": args.mode, "world": world, "step_seconds": result[0].item(),
                          "loss": loss.item(), "peak_rss_mib": result[1].item()}), flush=True)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["plain", "ddp", "fsdp2", "deepspeed"], default="plain")
    parser.add_argument("--model-config", default=os.path.join(here, "..", "bench", "models", "llama_58m.json"))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--skip", type=int, default=1)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")),
                        help="torch threads per rank (default: OMP_NUM_THREADS, as the C++ side takes)")
    parser.add_argument("--port", type=int, default=29611)
    parser.add_argument("--lora", type=int, default=0, help="PEFT LoRA of this rank on q/k/v/o_proj (0: none)")
    parser.add_argument("--bf16", action="store_true", help="--mode deepspeed: DeepSpeed's bf16 (the module in "
                        "bf16, fp32 masters of the trained partitions)")
    args = parser.parse_args()
    if args.bf16 and args.mode != "deepspeed":
        parser.error("--bf16 is DeepSpeed's (--mode deepspeed); the other peers train in fp32")
    if args.mode == "deepspeed":
        deepspeed_peer.use_cpu_accelerator()
    if args.mode == "plain":
        run(0, args)
    else:
        mp.spawn(run, args=(args,), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
