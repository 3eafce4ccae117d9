#pragma once
/// @file precision_plan.h
/// Which dtype each stage of a run uses and what it costs per parameter — the
/// table of docs/precision.md, resolved for one config, model size and world size.
/// Rank 0 prints it at start; tests compare the engines' measured memory to it.

#include <cstdint>
#include <string>

#include "shardtrain/config.h"

namespace shardtrain {

struct PrecisionPlan {
  std::string engine;           ///< "zero-3", "fsdp standard", "fsdp pure", ...
  std::string load_dtype;       ///< dtype the model arrives in
  std::string compute_dtype;    ///< dtype forward/backward run in
  std::string shard_dtype;      ///< dtype of the sharded parameters at rest (and the all-gather)
  std::string reduce_dtype;     ///< dtype of the gradient reduction
  /// dtype of the sharded gradient the optimizer reads: fp32, or the low
  /// dtype in pure mode and with fsdp_keep_low_precision_grads.
  std::string grad_dtype;
  std::string master_dtype;     ///< "fp32" or "none"
  /// No fp32 master: the parameters at rest are all there is (FSDP's pure low precision).
  bool no_master() const { return master_dtype == "none"; }
  std::string optimizer_dtype;  ///< dtype of m, v
  /// How the compute dtype's GEMMs run here (shardtrain::nn): cuBLAS, LibTorch's
  /// native CPU kernel, or widened to fp32 on a CPU without fast bf16.
  std::string gemm;
  /// Bytes per model parameter held by ONE rank, by kind (already divided by the world size).
  double params_bytes = 0, grads_bytes = 0, master_bytes = 0, optimizer_bytes = 0;
  /// Bytes per parameter of the parameters kept gathered at rest (stages 1/2, NO_SHARD), per rank.
  double gathered_at_rest_bytes = 0;
  /// fp32 runs: the fp32 shard is the master (counted once, under params).
  bool master_is_params = false;
  /// Trainable parameters: the rows above are per trainable parameter.
  int64_t num_params = 0;
  /// Parameters that do not train (a LoRA base): the engine keeps their
  /// shard at rest (and what stages 1/2 keep gathered) and its fp32 copy
  /// (frozen_copy_bytes), no gradient or optimizer state. Listed on rows of
  /// their own.
  int64_t frozen_params = 0;
  /// Bytes per frozen parameter per rank of the fp32 copy the engine keeps
  /// beside a low-precision frozen shard (what state dicts and checkpoints
  /// read); 0 where the shard is fp32 itself, or where the frozen base is held
  /// in the low dtype alone (DeepSpeed's ZeRO, fsdp pure, a base loaded in 16 bits).
  double frozen_copy_bytes = 0;
  /// Bytes of frozen weights held quantized (QLoRA's NF4 base, one copy): a
  /// row of their own, their shard at rest and what stages 1/2 keep gathered.
  int64_t frozen_nf4_bytes = 0;
  /// What the offload keeps in host memory, in words (or that it has
  /// nothing to move, with the model on the CPU); empty without offload.
  std::string offload;
  /// Bytes per trainable parameter per rank that the offload keeps in host
  /// memory: the master, the optimizer state, the gradient partition, and the
  /// parameter partition (a host copy the step writes, or under the
  /// parameter offload the partition itself). 0 without offload.
  double host_bytes = 0;
  /// Whether that host memory is page-locked (pinned): the default, and
  /// FSDP's; a DeepSpeed config's offload_optimizer.pin_memory: false keeps
  /// it pageable.
  bool host_memory_pinned = true;
  /// Of the rows above, the bytes per trainable parameter per rank the
  /// offload takes off the device (master, optimizer state and gradient
  /// partition, and the parameter partition under the parameter offload).
  double moved_bytes = 0;
  /// The parameter offload moves the frozen weights' shards (a LoRA base,
  /// its fp32 copy, NF4 bytes) to host memory too.
  bool offloads_params = false;
  int world_size = 1;
  /// Ranks one copy of the model states is sharded over (1 for NO_SHARD / zero-0,
  /// the machine size for HYBRID_SHARD, else world_size).
  int shard_count = 1;
  std::string notes;  ///< e.g. fp16 on CPU computes in fp32; pure mode loses small updates

  /// Optimizer bytes per parameter per copy of the model (master + state): the
  /// last column of docs/precision.md's table.
  double optimizer_bytes_per_param_total() const;
  int64_t predicted_bytes(double per_param) const { return static_cast<int64_t>(per_param * num_params); }
  /// The NF4 base's bytes on one rank: its shard, or all of it where
  /// parameters are not sharded (stages 0-2, NO_SHARD).
  double frozen_nf4_bytes_per_rank() const;
  /// Bytes per trainable parameter on one rank: every row but the frozen ones.
  double trained_bytes_per_param() const;
  /// Every row together: the model states one rank holds at rest.
  double total_bytes_per_rank() const;
  /// Of those, what one rank keeps on its device at rest (all of it without offload).
  double device_bytes_per_rank() const;
  /// What one rank keeps in host memory under the offload (the copies included).
  double host_bytes_per_rank() const;
  /// The frozen weights' bytes on one rank that the parameter offload keeps in host memory.
  double frozen_host_bytes_per_rank() const;
  /// The table rank 0 prints.
  std::string to_string() const;
};

/// `on_cuda`: compute happens on a GPU (fp16 then computes in fp16; on CPU in fp32).
/// `local_world_size`: processes per machine (HYBRID_SHARD shards within one); 0 = world_size.
PrecisionPlan plan_precision(const TrainingConfig& config, int64_t num_params, int world_size, bool on_cuda,
                             const std::string& load_dtype = "fp32", int local_world_size = 0);

}  // namespace shardtrain
