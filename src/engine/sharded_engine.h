#pragma once
// The machinery both engines share: units of parameters sharded over the
// ranks, gathered around their forward/backward through the unit hooks,
// gradients reduced into per-rank partitions, an optimizer over the shards.
//
// src/backends/zero and src/backends/fsdp plan it (engine_plan.h): ZeRO partitions
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

#include "engine/checkpoint_view.h"
#include "engine/engine.h"
#include "engine/engine_plan.h"
#include "engine/unit_layout.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/config.h"
#include "shardtrain/weight_loading.h"

namespace torch::nn {
class Module;
}

namespace shardtrain::engine {

class ShardedEngine : public Engine {
 public:
  ShardedEngine(std::shared_ptr<torch::nn::Module> model, EngineGroups groups, EnginePlan plan);
  ~ShardedEngine() override;

  std::string name() const override;
  void before_unit_forward(Unit& unit) override;
  at::Tensor after_unit_forward(Unit& unit, const at::Tensor& input, at::Tensor output) override;
  bool recompute_in_backward(const Unit& unit) const override;
  at::Tensor run_recomputed(Unit& unit, std::function<at::Tensor(const at::Tensor&)> body,
                            const at::Tensor& input) override;
  void begin_forward() override;
  at::Tensor end_forward(at::Tensor output) override;
  void backward(const at::Tensor& loss, bool sync) override;
  double clip_grad_norm(double max_norm) override;
  StepInfo step(double lr) override;
  void zero_grad() override;
  void complete_parameters() override;
  double loss_scale() const override;
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict() override;
  std::vector<std::pair<std::string, std::vector<int64_t>>> parameter_shapes() const override;
  void visit_full_parameters(const std::function<void(const std::string&, const at::Tensor&)>& visit) override;
  MemoryReport memory() const override;
  void reset_memory_peaks() override;
  TrafficReport traffic() const override;
  void reset_traffic() override;

  // ---- introspection (tests, checkpoints)
  /// Parameter gathers issued and not yet waited for (after a ZeRO-1/2 step:
  /// every trainable entry, until the next forward reaches it).
  int gathers_in_flight() const;
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
  /// Trainable parameter ranges this rank owns.
  std::vector<OwnedRange> owned_ranges() const;
  const EnginePlan& plan() const;

  // ---- checkpoints (the Engine interface)
  std::vector<CheckpointSlice> checkpoint_slices() const override;
  std::optional<at::ScalarType> load_slices(const SliceSource& source) override;
  void regather_after_load() override;
  std::optional<CustomOptimizerState> custom_optimizer_state() const override;
  std::string custom_optimizer_layout() const override;
  void load_custom_optimizer_state(const std::string& archive) override;
  int64_t optimizer_steps() const override;
  void set_optimizer_steps(int64_t steps) override;
  std::vector<double> loss_scaler_state() const override;
  void load_loss_scaler_state(const std::vector<double>& state) override;

 private:
  /// The parts the engine composes (sharded_engine.cpp): the unit table, the
  /// shard storage, the gather scheduler, the gradient reducer, the loader,
  /// the sharded optimizer and the checkpoint view.
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace shardtrain::engine
