#pragma once
// The sharded optimizer: the step over this rank's partitions. It owns the
// loss scaler, the global gradient norm and clip coefficient, the step
// count, and the custom torch optimizer when one is given; it reads and
// writes the partitions through the shard storage.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include "engine/engine.h"
#include "engine/engine_plan.h"
#include "engine/loss_scaler.h"
#include "engine/shard_groups.h"
#include "engine/shard_storage.h"
#include "engine/unit_table.h"

namespace shardtrain::engine {

class ShardedOptimizer {
 public:
  ShardedOptimizer(const EnginePlan& plan, const ShardGroups& groups, const UnitTable& units, ShardStorage& storage);
  ShardedOptimizer(const ShardedOptimizer&) = delete;
  ShardedOptimizer& operator=(const ShardedOptimizer&) = delete;

  /// The custom-optimizer escape hatch over the master partition, built once
  /// the master holds its initial values (it makes the master a leaf that
  /// requires grad, so nothing may write it in place after this).
  void create_custom_optimizer();
  /// Global gradient norm (fp64 over shards), unscaled; remembers the clip
  /// coefficient for the next step().
  double clip_grad_norm(double max_norm);
  /// Applies the update (or skips it on non-finite gradients), then zeroes the
  /// gradients. The caller regathers the units when it was applied.
  StepInfo step(double lr);
  bool has_custom_optimizer() const { return custom_ != nullptr; }
  /// The custom optimizer's torch::optim archive, as bytes.
  std::string custom_state() const;
  /// Loads what custom_state() gave, onto the master's device.
  void load_custom_state(const std::string& archive);
  double loss_scale() const { return scaler_.scale(); }
  int64_t steps() const { return steps_; }
  void set_steps(int64_t steps) { steps_ = steps; }
  LossScalerState scaler_state() const { return scaler_.state(); }
  void load_scaler_state(const LossScalerState& state) { scaler_.load_state(state); }

 private:
  /// The fused kernels over the partitions, sliced by sub_group_size.
  void fused_step(double lr, double grad_scale, const at::Tensor& grad, const at::Tensor& lp_out,
                  StepInfo& result);

  const EnginePlan& plan_;
  const ShardGroups& groups_;
  const UnitTable& units_;
  ShardStorage& storage_;
  DynamicLossScaler scaler_;
  double clip_coefficient_ = 1.0;
  double last_grad_norm_ = -1.0;
  /// Set by clip_grad_norm for the step it precedes: whether the global norm
  /// was finite (it is iff every gradient element is). Unset: step() checks.
  std::optional<bool> grads_finite_;
  int64_t steps_ = 0;
  std::unique_ptr<torch::optim::Optimizer> custom_;
  std::vector<at::Tensor> custom_leaves_;
};

}  // namespace shardtrain::engine
