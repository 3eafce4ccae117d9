"""DeepSpeed as a peer on this machine's CPUs: how the correctness peer
(peer_train.py --engine deepspeed) and the benchmark peer (bench_pytorch.py
--mode deepspeed) start it and configure its ZeRO, decided here once so the
two cannot drift apart.

Call use_cpu_accelerator() before anything imports deepspeed (DeepSpeed picks
its accelerator at first import), then init_on_gloo() in each rank, then
deepspeed.initialize(..., config=zero_config(...)).
"""
import os
import sys


def use_cpu_accelerator():
    """DeepSpeed reads DS_ACCELERATOR when it is first imported; without it,
    it looks for a GPU."""
    os.environ["DS_ACCELERATOR"] = "cpu"


def init_on_gloo(rank, world):
    """Joins DeepSpeed's communication to the rank's Gloo process group.

    When torch.distributed is already initialised, DeepSpeed adopts that group;
    otherwise it starts one from MASTER_ADDR / MASTER_PORT, which the caller
    sets. RANK, LOCAL_RANK and WORLD_SIZE are what a launcher would export."""
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401 (sys.modules below: the package's `torch` attribute is torch itself)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    # DeepSpeed compiles a shared-memory all-reduce at init (a C++ extension
    # built against Python's headers into ~/.cache, under a lock that a killed
    # build leaves behind, 20 s on a fresh machine); only its
    # inference_all_reduce uses it, never training, so the peers do without it.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")


def zero_config(micro_batch, stage, clip=0.0, bf16=False):
    """DeepSpeed's config for ZeRO `stage` at one micro-batch per step, with
    torch's optimizer as the client optimizer (DeepSpeed's own CPU Adam is
    another kernel). With bf16, DeepSpeed casts the module to bf16 and keeps
    fp32 masters of the trained partitions only. A clip of 0 is DeepSpeed's
    "no clipping"."""
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": clip, "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True, "bf16": {"enabled": bf16}, "steps_per_print": 1 << 30}
