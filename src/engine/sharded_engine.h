#pragma once
// The machinery both engines share: units of parameters sharded over the
// ranks, gathered around their forward/backward through the unit hooks,
// gradients reduced into per-rank partitions, an optimizer over the shards.
//
// backends/zero and backends/fsdp are configurations of it: ZeRO partitions
// every parameter separately (UnitLayout::kPerParam) and keeps an FP32 master
// always; FSDP flattens each unit (kFlat), chooses when to reshard from its
// sharding strategy, and in pure-low-precision mode keeps no FP32 copy at all.
// With the same layout-independent arithmetic (every gradient element summed
// over ranks in rank order in fp32, the same fused optimizer kernel) the two
// engines compute identical numbers from identical inputs.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/unit_layout.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/config.h"
#include "shardtrain/weight_loading.h"

namespace torch::nn {
class Module;
}

namespace shardtrain::engine {

/// When a unit's gathered parameters are freed.
enum class Reshard {
  kNever,          ///< kept gathered (zero 0-2, NO_SHARD): re-gathered after each optimizer step
  kAfterBackward,  ///< gathered for forward, freed once the unit's gradients are reduced (SHARD_GRAD_OP)
  kAfterForward,   ///< freed after forward, gathered again for backward (zero 3, FULL_SHARD)
};

/// Which unit to gather ahead during backward.
enum class BackwardPrefetchMode { kNone, kPre, kPost };

/// Every engine sets each field it cares about from its own options (ZeRO's
/// defaults are ZeroConfig's, FSDP's are its config's); the values here are
/// the neutral ones an engine gets for a feature it does not have, and the
/// size limits are DeepSpeed's, taken from ZeroConfig.
struct ShardingOptions {
  std::string name = "sharded";
  UnitLayout::Kind layout = UnitLayout::Kind::kPerParam;
  /// false: every rank holds everything and gradients are all-reduced (zero 0, NO_SHARD).
  bool shard_params = true;
  Reshard reshard = Reshard::kAfterForward;
  /// zero 1: gradients accumulate unreduced (full size, fp32) until the accumulation boundary.
  bool reduce_at_boundary_only = false;
  /// fsdp pure low precision: shard, gradients and optimizer state in param_dtype; no fp32 master.
  bool pure_low_precision = false;
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
  /// HYBRID_SHARD: after the reduce-scatter inside the shard group, gradients
  /// are all-reduced (SUM) over this replica group. Null otherwise.
  comm::CommunicatorPtr replicate_group;
  bool overlap_comm = true;
  int64_t reduce_bucket_size = ZeroConfig::kDefaultReduceBucketSize;  ///< gradient elements per reduction
  int64_t sub_group_size = ZeroConfig::kDefaultSubGroupSize;  ///< optimizer step slices (0: one per parameter)
  int64_t prefetch_bucket_size = ZeroConfig::kDefaultPrefetchBucketSize;  ///< forward prefetch window, elements (0 = none)
  int max_prefetch_units = 1 << 30;         ///< FSDP gathers one unit ahead
  BackwardPrefetchMode backward_prefetch = BackwardPrefetchMode::kPre;
  int64_t param_persistence_threshold = 0;  ///< units smaller than this stay gathered
  /// kAfterForward: a unit whose backward use comes within this many gathered
  /// elements of its forward (per the recorded order) is not freed in between
  /// (DeepSpeed's stage3_max_reuse_distance). 0 = always free: FSDP's
  /// behaviour; ZeRO-3 sets ZeroConfig's default.
  int64_t max_reuse_distance = 0;
  /// Parameter all-gathers after an optimizer step (units kept gathered) are
  /// combined into collectives of up to this many elements (allgather_bucket_size).
  int64_t allgather_bucket_size = 1;
  int64_t max_live_parameters = ZeroConfig::kDefaultMaxLiveParameters;
  bool offload_optimizer = false;
  /// Unit selection among the model's shardtrain::Unit modules (outermost wins):
  /// no wrapping at all, by class name, by size, or (all empty/zero) every marked unit.
  bool wrap_units = true;
  std::vector<std::string> unit_classes;
  int64_t min_unit_params = 0;
  /// Recompute every unit's forward during its backward (activation checkpointing).
  bool activation_checkpointing = false;
  /// Rank 0's initial values are broadcast (fsdp_sync_module_states; zero always)
  /// over this group (null: the shard group; HYBRID_SHARD passes the world).
  bool sync_module_states = true;
  comm::CommunicatorPtr sync_group;
  LossScaleConfig loss_scale;
  bool fp16 = false;
  OptimizerSpec optimizer;
};

class ShardedEngine : public Engine {
 public:
  ShardedEngine(std::shared_ptr<torch::nn::Module> model, comm::CommunicatorPtr shard_group,
                ShardingOptions options);
  ~ShardedEngine() override;

  std::string name() const override;
  void before_unit_forward(Unit& unit) override;
  at::Tensor after_unit_forward(Unit& unit, at::Tensor output) override;
  bool recompute_in_backward(const Unit& unit) const override;
  at::Tensor run_recomputed(Unit& unit, std::function<at::Tensor(const at::Tensor&)> body,
                            const at::Tensor& input) override;
  void begin_forward() override;
  at::Tensor end_forward(at::Tensor output) override;
  void backward(const at::Tensor& loss, bool sync) override;
  double clip_grad_norm(double max_norm) override;
  StepResult step(double lr) override;
  void zero_grad() override;
  double loss_scale() const override;
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict() override;
  MemoryStats memory() const override;
  void reset_gathered_peak() override;

  // ---- introspection (tests, checkpoints)
  /// What the optimizer steps: the fp32 master partition, or in pure mode the low-precision one.
  const at::Tensor& parameter_partition() const;
  /// The fp32 master partition (undefined in pure low precision).
  const at::Tensor& master_partition() const;
  /// The low-precision partition (aliases the master when param_dtype is fp32).
  const at::Tensor& low_precision_partition() const;
  /// The sharded gradient the optimizer reads (fp32; param_dtype in pure
  /// mode or with keep_low_precision_grads).
  const at::Tensor& gradient_partition() const;
  /// exp_avg / exp_avg_sq (Adam) partitions; undefined for SGD.
  const at::Tensor& exp_avg_partition() const;
  const at::Tensor& exp_avg_sq_partition() const;
  /// Module paths of the units ("" is the root), in setup order.
  std::vector<std::string> unit_paths() const;
  struct OwnedRange {
    std::string name;
    int64_t begin;          ///< element offset in the flattened parameter
    int64_t length;
    int64_t master_offset;  ///< offset in parameter_partition()
  };
  /// Trainable parameter ranges this rank owns.
  std::vector<OwnedRange> owned_ranges() const;
  const ShardingOptions& options() const;

  // ---- checkpoints (the Engine interface)
  std::vector<CheckpointSlice> checkpoint_slices() const override;
  void load_slices(const SliceSource& source) override;
  int64_t optimizer_steps() const override;
  void set_optimizer_steps(int64_t steps) override;
  std::vector<double> loss_scaler_state() const override;
  void load_loss_scaler_state(const std::vector<double>& state) override;
  std::optional<at::ScalarType> pure_low_precision_dtype() const override;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace shardtrain::engine
