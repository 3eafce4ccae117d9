#!/usr/bin/env python3
"""The peers that shardtrain's ZeRO-3 and FSDP engines are held against in
DistPeerFsdp2 and DistPeerDeepSpeed (tests/dist/test_peer_training.cpp):
PyTorch's own FSDP2 (`fully_shard`, each decoder layer then the root), or
DeepSpeed's ZeRO-3 (--engine deepspeed), training Hugging Face transformers'
LlamaForCausalLM over Gloo, fp32, on this machine's torch.

Writes OUT_DIR/batches.safetensors (input_ids [steps, world, micro_batch,
seq_len] int64, drawn here from a seeded generator so both sides train on the
same tokens) and OUT_DIR/peer.json:
  {"adamw": [loss per step], "sgd": [...], "world": 2, ...}
Each step's loss is the mean next-token cross entropy of the global batch
(every rank's micro-batch has the same number of tokens, so the mean of the
ranks' means). The two optimizers: AdamW (lr 1e-3, betas 0.9/0.999, eps 1e-8,
weight decay 0.01, gradients clipped to norm 1.0), what users run; plain SGD
(lr 0.5, no clipping), whose step is proportional to the gradient, so a
gradient summed instead of averaged over the ranks shows in the losses
(Adam's step and a clipped gradient are both blind to that scale).

--optimizers picks which of the two run (default both; with --lora, AdamW).
With --lora R the model trains LoRA adapters instead (Hugging Face PEFT:
r R, lora_alpha 2R, q/k/v/o, no dropout): the adapters start
from PEFT's own initialisation, saved to OUT_DIR/lora_init (a PEFT adapter
directory) so shardtrain starts from the same values (DistPeerPeft). With
--make-base CONFIG the base is a random model of that config.json (seeded),
saved to OUT_DIR/base, and MODEL_DIR is ignored. With --qlora (and --lora)
the base is loaded as QLoRA does it, through bitsandbytes
(BitsAndBytesConfig: 4-bit NF4, double quantization, compute dtype fp32):
every Linear but lm_head becomes bitsandbytes' Linear4bit, which decodes its
weight and multiplies in fp32. FSDP2 cannot shard bitsandbytes' Params4bit,
so `fully_shard` is told to ignore them (`ignored_params`): each rank keeps
the frozen 4-bit base whole and FSDP2 shards the rest (DistPeerPeft's _qlora
cases).

Before it trains, the peer is checked against DDP (pytorch#162338: FSDP2 over
Gloo has summed gradients where it should average): one backward on the same
weights and batch under FSDP2 and under DistributedDataParallel must give the
same gradients (relative 1e-5: two fp32 reductions of one sum, each within a
few ulps), else this script stops naming the mismatch.

With --engine deepspeed the same training runs under DeepSpeed's ZeRO-3
instead (DS_ACCELERATOR=cpu, over the same Gloo group; DistPeerDeepSpeed):
torch's optimizer as DeepSpeed's client optimizer, stepping its flat fp32
partitions, with DeepSpeed's own gradient clipping and averaging over the
ranks. The full model only (no --lora).

Usage: scripts/peer_train.py MODEL_DIR OUT_DIR [--steps 20] [--world 2]
       [--micro-batch 2] [--seq-len 16] [--seed 5] [--lora R [--qlora]] [--make-base CONFIG]
       [--engine fsdp2|deepspeed] [--optimizers adamw,sgd]
Offline: nothing is downloaded. Threads: 1 per rank.
"""
import argparse
import faulthandler
import json
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import deepspeed_peer  # noqa: E402  (this directory's; imports deepspeed only when called)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

OPTIMIZERS = {
    "adamw": {"clip": 1.0,
              "make": lambda params: torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                                       weight_decay=0.01, foreach=False)},
    "sgd": {"clip": 0.0, "make": lambda params: torch.optim.SGD(params, lr=0.5)},
}


def load_model(model_dir, nf4=False):
    # SDPA, as shardtrain's Llama; fp32 weights as stored (with nf4, quantized
    # from those fp32 weights as they load).
    quantization = {}
    if nf4:
        from transformers import BitsAndBytesConfig
        quantization["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32)
        quantization["device_map"] = "cpu"
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa",
                                                **quantization)


def shard(model):
    # A PeftModel wraps the transformers model: base_model.model is it.
    inner = model.base_model.model if hasattr(model, "base_model") and hasattr(model, "peft_config") else model
    four_bit = {p for p in model.parameters() if type(p).__name__ == "Params4bit"}
    for layer in inner.model.layers:
        fully_shard(layer, ignored_params=four_bit)
    fully_shard(model, ignored_params=four_bit)
    return model


def lora_config(args):
    from peft import LoraConfig
    return LoraConfig(r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def training_model(args):
    model = load_model(args.model_dir, nf4=args.qlora)
    if args.lora:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, os.path.join(args.out_dir, "lora_init"), is_trainable=True)
    # from_pretrained returns the model in eval mode, where bitsandbytes'
    # Linear4bit, on a CPU with AVX-512 BF16, repacks its weight for a bf16
    # inference kernel whenever its input needs no gradient (the first
    # layer's): training mode keeps every product the fp32 one trained.
    return model.train()


def next_token_loss(model, input_ids):
    logits = model(input_ids=input_ids).logits
    vocab = logits.shape[-1]
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), input_ids[:, 1:].reshape(-1))


def full_grads(model):
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def check_against_ddp(args, rank, batch):
    """FSDP2's averaged gradient equals DDP's on the same weights and batch."""
    ddp = torch.nn.parallel.DistributedDataParallel(load_model(args.model_dir))
    next_token_loss(ddp, batch).backward()
    reference = {name: p.grad.detach().clone() for name, p in ddp.module.named_parameters()}
    fsdp = shard(load_model(args.model_dir))
    next_token_loss(fsdp, batch).backward()
    for name, grad in full_grads(fsdp).items():
        ratio = (grad.norm() / reference[name].norm()).item()
        error = ((grad - reference[name]).norm() / reference[name].norm()).item()
        if error > 1e-5:
            raise SystemExit(f"peer_train: FSDP2's gradient of {name} differs from DDP's (relative {error:.3g}, "
                             f"norm ratio {ratio:.6f}; a ratio of {args.world} is pytorch#162338's sum instead "
                             "of average): the peer cannot be trusted on this torch")


def train(args, rank, batches, optimizer_name):
    spec = OPTIMIZERS[optimizer_name]
    if args.engine == "deepspeed":
        return train_deepspeed(args, rank, batches, spec)
    model = shard(training_model(args))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = spec["make"](trainable)
    losses = []
    for step in range(args.steps):
        loss = next_token_loss(model, batches[step, rank])
        loss.backward()
        if spec["clip"] > 0:
            torch.nn.utils.clip_grad_norm_(trainable, spec["clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(global_mean(loss, args.world))
    return losses


def global_mean(loss, world):
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return (mean / world).item()


def train_deepspeed(args, rank, batches, spec):
    """DeepSpeed ZeRO (--zero-stage) in fp32 with torch's optimizer as the client
    optimizer (DeepSpeed's own CPU Adam is another kernel), stepping its
    flat fp32 partitions; DeepSpeed clips (gradient_clipping) and averages
    the gradients over the ranks itself."""
    import deepspeed
    model = training_model(args)
    trainable = [p for p in model.parameters() if p.requires_grad]
    config = deepspeed_peer.zero_config(args.micro_batch, args.zero_stage, clip=spec["clip"])
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=spec["make"](trainable), config=config)
    losses = []
    for step in range(args.steps):
        loss = next_token_loss(engine, batches[step, rank])
        engine.backward(loss)
        engine.step()
        losses.append(global_mean(loss, args.world))
    engine.destroy()
    return losses


def run(rank, args, store_file):
    # A rank that aborts in native code (SIGABRT) prints every thread's Python
    # stack to the peer's log: where it died, not only that it did.
    faulthandler.enable()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=args.world)
    batches = torch.load(os.path.join(args.out_dir, "batches.pt"))
    if args.engine == "deepspeed":
        deepspeed_peer.init_on_gloo(rank, args.world)  # adopts the group above
    else:
        check_against_ddp(args, rank, batches[0, rank])
    result = {"engine": args.engine, "world": args.world, "micro_batch": args.micro_batch,
              "seq_len": args.seq_len, "torch": torch.__version__}
    for name in args.optimizers.split(","):
        result[name] = train(args, rank, batches, name)
    if rank == 0:
        with open(os.path.join(args.out_dir, "peer.json"), "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--lora", type=int, default=0)
    parser.add_argument("--qlora", action="store_true")
    parser.add_argument("--make-base")
    parser.add_argument("--engine", choices=["fsdp2", "deepspeed"], default="fsdp2")
    parser.add_argument("--zero-stage", type=int, choices=[1, 2, 3], default=3, help="with --engine deepspeed")
    parser.add_argument("--optimizers", help="comma-separated, of " + ", ".join(OPTIMIZERS))
    args = parser.parse_args()
    if args.optimizers is None:
        args.optimizers = "adamw" if args.lora else ",".join(OPTIMIZERS)
    unknown = set(args.optimizers.split(",")) - set(OPTIMIZERS)
    if unknown:
        parser.error(f"--optimizers: {', '.join(sorted(unknown))} not among {', '.join(OPTIMIZERS)}")
    if args.engine == "deepspeed":
        if args.lora:
            parser.error("--engine deepspeed trains the full model (no --lora)")
        deepspeed_peer.use_cpu_accelerator()
    if args.qlora and not args.lora:
        parser.error("--qlora trains LoRA adapters on the 4-bit base: give --lora R too")
    os.makedirs(args.out_dir, exist_ok=True)
    if args.make_base:
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(args.seed)
        base = LlamaForCausalLM(LlamaConfig.from_json_file(args.make_base))
        args.model_dir = os.path.join(args.out_dir, "base")
        base.save_pretrained(args.model_dir, safe_serialization=True)
    if args.lora:
        from peft import get_peft_model
        torch.manual_seed(args.seed + 1)
        get_peft_model(load_model(args.model_dir), lora_config(args)).save_pretrained(
            os.path.join(args.out_dir, "lora_init"))
    with open(os.path.join(args.model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    gen = torch.Generator().manual_seed(args.seed)
    batches = torch.randint(vocab, (args.steps, args.world, args.micro_batch, args.seq_len), generator=gen)
    save_file({"input_ids": batches}, os.path.join(args.out_dir, "batches.safetensors"))
    torch.save(batches, os.path.join(args.out_dir, "batches.pt"))
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run, args=(args, os.path.join(tmp, "store")), nprocs=args.world, join=True)
    os.remove(os.path.join(args.out_dir, "batches.pt"))
    if not os.path.exists(os.path.join(args.out_dir, "peer.json")):
        sys.exit("peer_train: no peer.json written")


if __name__ == "__main__":
    main()
