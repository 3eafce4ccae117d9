#!/usr/bin/env python3
"""Driver of scripts/bench-vs-pytorch: shardtrain against what a user would run
instead, on the same torch, side by side in one run.

The same Llama (bench/models/llama_58m.json, 58M parameters, fp32, seq 256 x
micro-batch 4 per rank, AdamW lr 1e-4 / weight decay 0.01, the same random
tokens), the same threads (OMP_NUM_THREADS and OPENBLAS_NUM_THREADS, default
1 per rank, exported to both sides). Each round runs every configuration once,
each in its own processes (so each peak RSS is its own), interleaved:
  world 1: Python plain loop | shardtrain plain LibTorch loop | shardtrain zero-0
  world 2: Python DDP | FSDP2 | DeepSpeed ZeRO-3 | shardtrain zero-0, zero-1,
           zero-2, zero-3, fsdp standard, fsdp pure (bf16)
With --lora, the LoRA table instead (r --lora-r, alpha 2r, q/k/v/o_proj):
  world 1: PEFT + PyTorch plain loop | PyTorch full fine-tune | shardtrain
           zero-0 LoRA | zero-0 full
  world 2: PEFT + FSDP2 | shardtrain zero-3 LoRA, fsdp LoRA, zero-3 full,
           and fsdp pure LoRA (bf16-only base) and fsdp pure QLoRA (NF4 base);
           PEFT + DeepSpeed ZeRO-3 bf16 | shardtrain zero-3 LoRA bf16
with issue 27's targets: a LoRA step <= 0.5x the full fine-tune's, <= 1.00x
PEFT's, and QLoRA's model states (at rest plus the gathered peak) <= 0.35x
the bf16-base LoRA's.
Python sides: scripts/bench_pytorch.py; shardtrain: bench_train_step under
`shardtrain launch`. Reports the median step time over the rounds, the peak
RSS per rank, the ratios shardtrain / peer (the median of each round's ratio,
with their range; the rounds start at rotating places of the schedule) and
the targets. The Python peers run torch's fused CPU AdamW, the fastest it has.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PEERS = [("python_plain", 1, "plain"), ("python_ddp", 2, "ddp"), ("python_fsdp2", 2, "fsdp2"),
         ("python_deepspeed", 2, "deepspeed")]
# (name, world, bench_train_step configuration)
SHARDTRAIN = [("cpp_plain", 1, "plain"), ("zero0_w1", 1, "ddp"), ("zero0", 2, "ddp"), ("zero1", 2, "zero1"),
              ("zero2", 2, "zero2"), ("zero3", 2, "zero3"), ("fsdp_standard", 2, "fsdp_full_shard"),
              ("fsdp_pure_bf16", 2, "fsdp_pure")]
# (shardtrain run, peer, target ratio or None for information only)
RATIOS = [("zero0_w1", "python_plain", 1.00), ("cpp_plain", "python_plain", None),
          ("zero0", "python_ddp", None), ("zero1", "python_ddp", 1.05), ("zero2", "python_ddp", 1.05),
          ("zero3", "python_fsdp2", 1.00), ("zero3", "python_ddp", 1.10), ("zero3", "python_deepspeed", None),
          ("fsdp_standard", "python_fsdp2", 1.00), ("fsdp_standard", "python_ddp", 1.10),
          ("fsdp_pure_bf16", "python_fsdp2", None)]

# "MODE:full": the peer's full fine-tune of the same model (no --lora), for
# PEFT's own LoRA / full ratio beside shardtrain's.
# "MODE:bf16": DeepSpeed's bf16 mode (the module in bf16, fp32 masters of the adapters).
LORA_PEERS = [("peft_plain", 1, "plain"), ("peft_fsdp2", 2, "fsdp2"), ("torch_full_plain", 1, "plain:full"),
              ("peft_deepspeed_bf16", 2, "deepspeed:bf16")]
# (name, world, bench_train_step configuration, dtype)
LORA_SHARDTRAIN = [("lora_zero0_w1", 1, "ddp_lora", "fp32"), ("full_zero0_w1", 1, "ddp", "fp32"),
                   ("lora_zero3", 2, "zero3_lora", "fp32"), ("lora_fsdp", 2, "fsdp_full_shard_lora", "fp32"),
                   ("full_zero3", 2, "zero3", "fp32"), ("lora_pure_bf16", 2, "fsdp_pure_lora", "bf16"),
                   ("qlora_pure_bf16", 2, "fsdp_pure_qlora", "bf16"), ("lora_zero3_bf16", 2, "zero3_lora", "bf16")]
LORA_RATIOS = [("lora_zero0_w1", "full_zero0_w1", 0.5), ("lora_zero3", "full_zero3", 0.5),
               ("lora_zero0_w1", "peft_plain", 1.00), ("lora_zero3", "peft_fsdp2", 1.00),
               ("lora_fsdp", "peft_fsdp2", 1.00), ("lora_zero3_bf16", "peft_deepspeed_bf16", 1.00),
               ("peft_plain", "torch_full_plain", None)]
# (run, reference, target) on model states per rank, not time
# A bf16-base LoRA holds its base in bf16 alone: FSDP pure low precision (the
# adapters keep fp32 masters there); QLoRA the same with the base in NF4.
LORA_STATE_RATIOS = [("qlora_pure_bf16", "lora_pure_bf16", 0.35)]


def run_peer(args, mode, world):
    mode, _, variant = mode.partition(":")
    command = [sys.executable, os.path.join(ROOT, "scripts", "bench_pytorch.py"), "--mode", mode,
               "--world", str(world), "--steps", str(args.steps), "--skip", str(args.skip)]
    if args.lora and variant != "full":
        command += ["--lora", str(args.lora_r)]
    if variant == "bf16":
        command.append("--bf16")
    out = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"bench-vs-pytorch: {' '.join(command)} failed (exit {out.returncode}):\n"
                         f"{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    result = json.loads(lines[-1])
    return result["step_seconds"], result["peak_rss_mib"], None


def run_shardtrain(args, config, world, dtype="fp32"):
    command = [os.path.join(args.build, "bin", "shardtrain"), "launch", "--num_processes", str(world),
               os.path.join(args.build, "bin", "bench_train_step"), "--rounds", "1", "--configs", config,
               "--dtype", dtype, "--lora-r", str(args.lora_r), "--steps", str(args.steps), "--skip", str(args.skip)]
    env = dict(os.environ, SHARDTRAIN_LOG_LEVEL="warn")
    out = subprocess.run(command, capture_output=True, text=True, env=env)
    match = re.search(r"round 1 +\S+ +" + dtype + r" +([0-9.]+) s/step .*peak RSS ([0-9]+) MiB .*peak ([0-9.]+) MB",
                      out.stdout)
    if out.returncode != 0 or not match:
        raise SystemExit(f"bench-vs-pytorch: {' '.join(command)} failed (exit {out.returncode}):\n"
                         f"{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return float(match.group(1)), float(match.group(2)), float(match.group(3))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps per run (DeepSpeed's ZeRO-3 traces "
                        "its module order in the first steps)")
    parser.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed out")
    parser.add_argument("--lora", action="store_true", help="the LoRA/QLoRA table (issue 27) instead")
    parser.add_argument("--lora-r", type=int, default=8, help="adapter rank with --lora")
    parser.add_argument("--runs", nargs="+", metavar="RUN",
                        help="only these runs (names as in the table, e.g. python_plain cpp_plain zero0_w1): more "
                        "rounds of a few runs where the machine's noise is as large as the difference")
    parser.add_argument("--build", default=os.environ.get("SHARDTRAIN_BUILD_DIR", os.path.join(ROOT, "build")))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    peer_table, ours_table, ratio_table = (LORA_PEERS, LORA_SHARDTRAIN, LORA_RATIOS) if args.lora else (
        PEERS, [r + ("fp32",) for r in SHARDTRAIN], RATIOS)
    known = [p[0] for p in peer_table] + [r[0] for r in ours_table]
    unknown = sorted(set(args.runs or []) - set(known))
    if unknown:
        parser.error(f"unknown run(s) {', '.join(unknown)}; the runs are: {' '.join(known)}")
    wanted = lambda name: args.runs is None or name in args.runs
    peers = [p for p in peer_table if not (args.no_deepspeed and p[2] == "deepspeed") and wanted(p[0])]
    shardtrain_runs = [r for r in ours_table if wanted(r[0])]
    times, rss, states = {}, {}, {}
    for round_index in range(1, args.rounds + 1):
        # Peer, shardtrain, peer, ...: the two kinds alternate through the round.
        schedule = []
        for i in range(max(len(peers), len(shardtrain_runs))):
            if i < len(peers):
                schedule.append(("peer",) + peers[i])
            for entry in shardtrain_runs[2 * i:2 * i + 2]:
                schedule.append(("shardtrain",) + entry)
        # Each round starts further along the schedule, so no run always sits
        # in the same slot (beside the same neighbours) of every round.
        offset = (round_index - 1) * len(schedule) // args.rounds
        schedule = schedule[offset:] + schedule[:offset]
        for kind, name, world, what, *dtype in schedule:
            seconds, peak, state = (run_peer(args, what, world) if kind == "peer"
                                    else run_shardtrain(args, what, world, *dtype))
            times.setdefault(name, []).append(seconds)
            rss[name] = max(rss.get(name, 0.0), peak)
            if state is not None:
                states[name] = state
            print(f"round {round_index}  {name:<17} world {world}  {seconds:7.3f} s/step  peak RSS {peak:6.0f} MiB",
                  flush=True)
    median = {name: statistics.median(values) for name, values in times.items()}
    threads = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}"
    lora = f", LoRA r {args.lora_r} on q/k/v/o_proj" if args.lora else ""
    print(f"\nLlama 58M (fp32 where the dtype column does not say bf16){lora}, seq 256 x micro-batch 4 per rank, {threads} per rank, median of {args.rounds} "
          f"interleaved rounds ({args.steps} timed steps after {args.skip} warm-up each)")
    print("| run | world | dtype | step (s) | peak RSS/rank (MiB) | model states/rank, peak (MB) |\n"
          "|---|---:|---|---:|---:|---:|")
    for name, world, *rest in [(p[0], p[1], p[2], "bf16" if p[2].endswith(":bf16") else "fp32")
                               for p in peers] + shardtrain_runs:
        dtype = rest[1]
        # bench_train_step's fsdp_pure configurations train in bf16 whatever --dtype says.
        dtype = "bf16" if rest and rest[0].startswith("fsdp_pure") else dtype
        state = f"{states[name]:.2f}" if name in states else "-"
        print(f"| {name} | {world} | {dtype} | {median[name]:.3f} | {rss[name]:.0f} | {state} |")
    # Each ratio is the median of the rounds' own ratios (the two runs of one
    # round ran minutes apart under the same machine load), with their range.
    print("\n| shardtrain / reference (step time) | ratio (median of rounds) | rounds' range | target | met |\n"
          "|---|---:|---:|---:|---|")
    missed = 0
    for ours, peer, target in ratio_table:
        if peer not in times or ours not in times:
            continue
        per_round = [a / b for a, b in zip(times[ours], times[peer])]
        ratio = statistics.median(per_round)
        met = "-" if target is None else ("yes" if ratio <= target else "NO")
        missed += met == "NO"
        print(f"| {ours} / {peer} | {ratio:.3f} | {min(per_round):.3f}-{max(per_round):.3f} | "
              f"{'-' if target is None else f'<= {target:.2f}'} | {met} |")
    if args.lora:
        print("\n| model states (at rest + gathered peak) | ratio | target | met |\n|---|---:|---:|---|")
        for ours, reference, target in LORA_STATE_RATIOS:
            if ours not in states or reference not in states:
                continue
            ratio = states[ours] / states[reference]
            met = "yes" if ratio <= target else "NO"
            missed += met == "NO"
            print(f"| {ours} / {reference} | {ratio:.3f} | <= {target:.2f} | {met} |")
    print(f"\n{missed} target(s) missed")


if __name__ == "__main__":
    main()
