#pragma once
// The engine plan: what a run's sharded engine does, resolved once from the
// config by the sharding backend that config names (src/backends/zero,
// src/backends/fsdp; src/engine_factory.h picks one), then only read. The
// engine core runs it, and the precision plan the user sees is printed from
// it (precision_plan.cpp), so no decision is derived twice. A plan holds no
// communicator: `shardtrain config check` plans a run without starting one.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include "engine/engine.h"
#include "engine/unit_layout.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/config.h"
#include "shardtrain/weight_loading.h"

namespace shardtrain::engine {

/// When a unit's gathered parameters are freed.
enum class Reshard {
  kNever,          ///< kept gathered (zero 0-2, NO_SHARD): re-gathered after each optimizer step
  kAfterBackward,  ///< gathered for forward, freed once the unit's gradients are reduced (SHARD_GRAD_OP)
  kAfterForward,   ///< freed after forward, gathered again for backward (zero 3, FULL_SHARD)
};

/// Which unit to gather ahead during backward.
enum class BackwardPrefetchMode { kNone, kPre, kPost };

/// Everything the engine core runs by. Each sharding backend sets every field
/// it cares about from its own config section (src/backends/*/: ZeRO's
/// defaults are ZeroConfig's, FSDP's are its config's); the values here are
/// the neutral ones a backend gets for a feature it does not have, and the
/// size limits are DeepSpeed's, taken from ZeroConfig.
struct EnginePlan {
  /// The one name of this engine, in logs, errors and the precision plan:
  /// "zero-3", "ddp (zero-0)", "fsdp FULL_SHARD standard", ...
  std::string name = "sharded";
  /// What rank 0 warns about when the engine starts (a key with no effect
  /// here, a mode that loses updates), decided with the plan.
  std::vector<std::string> notices;
  UnitLayout::Kind layout = UnitLayout::Kind::kPerParam;
  /// false: every rank holds everything and gradients are all-reduced (zero 0, NO_SHARD).
  bool shard_params = true;
  Reshard reshard = Reshard::kAfterForward;
  /// zero 1: gradients accumulate unreduced (full size, fp32) until the accumulation boundary.
  bool reduce_at_boundary_only = false;
  /// gradient_accumulation_steps > 1: backwards without sync come between the
  /// boundaries. Only then does zero 1 need its full-size accumulator at rest
  /// (allocated on the first such backward): in a one-micro-batch window it
  /// reduces straight from autograd, as zero 2 does.
  bool accumulates_between_boundaries = false;
  /// fsdp pure low precision: shard, gradients and optimizer state in param_dtype; no fp32 master.
  bool pure_low_precision = false;
  /// Frozen entries keep an fp32 copy of their shard beside the param_dtype
  /// one they are gathered from: what state dicts, exports and checkpoints
  /// read, so a frozen fp32-loaded weight is saved as it was loaded. Each
  /// backend keeps one where its peer holds frozen weights in fp32 (fsdp
  /// standard, Accelerate's DDP or a single process, with frozen weights that
  /// arrive in fp32); elsewhere (DeepSpeed's ZeRO, fsdp pure) the frozen
  /// weights are held in param_dtype alone, rounded once at prepare().
  bool frozen_fp32_copy = true;
  /// fsdp keep_low_precision_grads: the sharded gradient the optimizer reads
  /// stays in param_dtype (the kernels widen it to fp32 as they read it)
  /// instead of an fp32 gradient partition. Half the gradient memory with a
  /// 16-bit param_dtype; gradients accumulate rounded to that dtype.
  bool keep_low_precision_grads = false;
  /// fsdp buffer_dtype: floating-point buffers are cast to it for compute
  /// (FSDP1's MixedPrecision.buffer_dtype); full_state_dict returns them in
  /// their original dtype. Unset: buffers are left as the model made them.
  std::optional<at::ScalarType> buffer_dtype;
  /// Fills the shards of parameters built without storage
  /// (release_parameter_storage); without one they come from rank 0.
  WeightSource weight_source;
  /// fsdp_cpu_ram_efficient_loading / zero3_init_flag is on: rank 0 warns when
  /// no other rank built the model without its weights (nothing was saved).
  bool rank0_loads_weights = false;
  at::ScalarType compute_dtype = at::kFloat;  ///< dtype the module computes in
  at::ScalarType param_dtype = at::kFloat;    ///< shard at rest / all-gather dtype
  at::ScalarType reduce_dtype = at::kFloat;   ///< gradient reduction dtype
  /// Gradient scaling around the reduction, as FSDP computes it: divide by
  /// `predivide` before, by `postdivide` after a SUM. {1, 1} with average=true
  /// is ZeRO's mean (sum, then one division in fp32).
  bool average = true;
  double predivide = 1.0;
  double postdivide = 1.0;
  /// HYBRID_SHARD: ranks per shard group (one machine); gradients are then
  /// all-reduced over the replica groups across machines. 0: the shard group
  /// is the whole world.
  int hybrid_shard_size = 0;
  /// Communication runs under computation: gradient buckets are reduced
  /// while backward goes on, and the gathers of kept units after a step run
  /// under the next forward. false: each bucket is waited for as it is
  /// issued, and step() waits for its gathers.
  bool overlap_comm = true;
  int64_t reduce_bucket_size = ZeroConfig::kDefaultReduceBucketSize;  ///< gradient elements per reduction
  int64_t sub_group_size = ZeroConfig::kDefaultSubGroupSize;  ///< optimizer step slices (0: one per parameter)
  int64_t prefetch_bucket_size = ZeroConfig::kDefaultPrefetchBucketSize;  ///< forward prefetch window, elements (0 = none)
  int max_prefetch_units = 1 << 30;         ///< FSDP gathers one unit ahead
  /// Before allocating a gather's buffer the host waits until the compute
  /// stream has passed the free of all but the last two units released
  /// (FSDP1's limit_all_gathers). A gathered buffer is in use by the
  /// communicator's stream as well, so the caching allocator reuses it only
  /// once the device has caught up with its free: a host far ahead of the
  /// device would allocate fresh memory for every gather, up to the whole
  /// model. Paced, the buffers held stay within a few units (the
  /// communicator's stream lags the compute stream by about one).
  /// false lets the host run ahead.
  bool limit_all_gathers = true;
  BackwardPrefetchMode backward_prefetch = BackwardPrefetchMode::kPre;
  /// The model output's gradient gathers the unit backward runs first, so it
  /// overlaps the root's backward (the head): FSDP's root pre-backward
  /// prefetch under BACKWARD_PRE. DeepSpeed has none.
  bool prefetch_first_backward_unit = false;
  int64_t param_persistence_threshold = 0;  ///< units smaller than this stay gathered
  /// kAfterForward: a unit whose backward use comes within this many gathered
  /// elements of its forward (per the recorded order) is not freed in between
  /// (DeepSpeed's stage3_max_reuse_distance). 0 = always free: FSDP's
  /// behaviour; ZeRO-3 sets ZeroConfig's default.
  int64_t max_reuse_distance = 0;
  int64_t max_live_parameters = ZeroConfig::kDefaultMaxLiveParameters;
  bool offload_optimizer = false;
  /// The parameter shards (the low-precision partition and the frozen
  /// entries' shards) live in host memory as well, and each gather uploads
  /// its shard first: ZeRO-3's offload_param, FSDP's offload_params. Needs
  /// shard_params and offload_optimizer (the host step writes the partition
  /// where it lives); ShardStorage checks both.
  bool offload_params = false;
  /// The offloaded states in page-locked host memory, each buffer its exact
  /// size (torch_cuda::pinned_host_zeros): copies to and from the GPU run at
  /// full bus speed and can overlap. false keeps them in pageable memory, where
  /// page-locked memory is scarce: DeepSpeed's offload_optimizer.pin_memory.
  bool offload_pin_memory = true;
  /// Unit selection among the model's shardtrain::Unit modules (outermost wins):
  /// no wrapping at all, by class name, by size, or (all empty/zero) every marked unit.
  bool wrap_units = true;
  std::vector<std::string> unit_classes;
  /// With no class names, take only Unit::Kind::kBlock units: FSDP's
  /// transformer-based policy falls back, as Accelerate's does, to the
  /// model's _no_split_modules (its blocks). ZeRO and the size-based policy
  /// consider every marked unit, the embeddings and the head included.
  bool unnamed_takes_blocks_only = false;
  int64_t min_unit_params = 0;
  /// Recompute every block unit's forward during its backward (activation
  /// checkpointing; Unit::Kind::kBlock, not the embeddings or the head).
  bool activation_checkpointing = false;
  /// Rank 0's initial values are broadcast (fsdp_sync_module_states; zero
  /// always) over the shard group, or over the whole world with HYBRID_SHARD.
  bool sync_module_states = true;
  LossScaleConfig loss_scale;
  bool fp16 = false;
  OptimizerSpec optimizer;

  /// Gradients go straight into the shard's gradient: one rank with no
  /// replicas (`single_rank`) and nothing to scale. Not with ZeRO-1's boundary
  /// accumulation in a 16-bit reduce dtype: that rounds the accumulated sum
  /// once, not each micro-batch's gradient. The gradient reducer acts on this
  /// and the precision plan counts memory by it, so it is decided here once.
  bool adds_grads_directly(bool single_rank) const {
    return single_rank && predivide == 1.0 && postdivide == 1.0 &&
           (!reduce_at_boundary_only || reduce_dtype == at::kFloat);
  }
};

/// What a backend plans from besides the config: the run's shape and the
/// model's load dtype (the pure-low-precision rule depends on it).
struct PlanContext {
  int world_size = 1;
  /// Processes per machine (HYBRID_SHARD shards within one); 0: world_size.
  int local_world_size = 0;
  /// Compute happens on a GPU (fp16 then computes in fp16; on a CPU in fp32).
  bool on_cuda = false;
  std::string load_dtype = "fp32";
  /// Some frozen floating parameter (a LoRA base) arrives in fp32: a frozen
  /// fp32 copy would hold more than its low-precision shard.
  bool frozen_weights_in_fp32 = true;
  /// The model trains LoRA adapters (lora.h), which keep fp32 masters under
  /// every backend: fsdp pure low precision then holds only the frozen base
  /// in the low dtype.
  bool trains_lora_adapters = false;
};

/// The communicators a plan runs over, made from the world by its backend.
struct EngineGroups {
  comm::CommunicatorPtr shard;      ///< the ranks one copy of the model states is sharded over
  comm::CommunicatorPtr replicate;  ///< HYBRID_SHARD: the same shard on every machine; else null
  comm::CommunicatorPtr sync;       ///< where rank 0's initial values are broadcast (null: `shard`)
};

/// The ScalarType of a config dtype, and back: the one mapping between the
/// config's dtypes and the tensors'.
at::ScalarType scalar_type(DType dtype);
DType dtype_of(at::ScalarType type);

/// Whether an offload moves anything for a model on this device: on a GPU;
/// on the CPU every state is in host memory already, unless
/// SHARDTRAIN_OFFLOAD_ON_CPU=1 makes the host copies anyway (so that tests
/// run the offload's copies and host step on a machine without a GPU).
bool offload_moves_states(bool on_cuda);

/// The dtype a module computes in when its parameters are held in `low`:
/// `low` itself, except fp16 off a GPU, which computes in fp32 on fp16-rounded
/// values (LibTorch has no fp16 matmul on a CPU).
at::ScalarType compute_dtype(DType low, const PlanContext& context);

/// The optimizer the config's optimizer block asks for, with the defaults of
/// torch.optim / DeepSpeed where it leaves a value out (lr excepted: the
/// scheduler's base lr; weight decay 0.01 for AdamW, else 0). Adam with
/// adam_w_mode is AdamW.
OptimizerSpec optimizer_spec(const TrainingConfig& config);

}  // namespace shardtrain::engine
