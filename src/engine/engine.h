#pragma once
// The interface the Accelerator drives; implemented by src/backends/zero and
// src/backends/fsdp. Engines see the outside world only through the
// Communicator, the unit hooks and the kernel functions.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "shardtrain/step_report.h"
#include "shardtrain/unit.h"

namespace torch::optim {
class Optimizer;
}

namespace shardtrain::engine {

/// Optimizer the engine runs over its fp32 master shards.
struct OptimizerSpec {
  std::string type = "AdamW";  ///< AdamW | Adam | SGD
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  double momentum = 0.0;
  bool nesterov = false;
  /// Lost-update audit sampling: every k-th granule of kernels' audit
  /// granules is counted (1: every element, 0: no audit).
  int64_t audit_sample_period = 1;
  /// Escape hatch: build any torch::optim optimizer over the master shard
  /// tensors (their .grad() holds the reduced, unscaled gradient at step time).
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)> custom_factory;
};

/// One contiguous run of a parameter this rank holds the state of.
struct CheckpointSlice {
  std::string name;             ///< fully-qualified parameter name
  std::vector<int64_t> shape;   ///< the whole parameter's shape
  bool trainable = true;
  int64_t begin = 0;            ///< element offset in the flattened parameter
  int64_t length = 0;
  /// State by kind, views into the engine's buffers (on the model's device):
  /// "master" (fp32; in pure mode and for frozen parameters the
  /// low-precision value), "exp_avg", "exp_avg_sq", "momentum" — only the
  /// kinds this run has.
  std::vector<std::pair<std::string, at::Tensor>> state;
};

/// A custom optimizer's own state (OptimizerSpec::custom_factory), which
/// lives over this rank's partition as a whole and cannot be resharded: its
/// torch::optim archive, and the layout it was laid over (the partition's
/// size and which elements of which parameters sit where in it, as text). It
/// loads only under the same layout.
struct CustomOptimizerState {
  std::string archive;  ///< torch::serialize's bytes
  std::string layout;
};

/// Gives the value of elements [begin, begin + length) of parameter `name`'s
/// state `kind`, or throws when it cannot.
using SliceSource =
    std::function<at::Tensor(const std::string& name, const std::string& kind, int64_t begin, int64_t length)>;

class Engine : public UnitHooks {
 public:
  ~Engine() override = default;
  virtual std::string name() const = 0;

  /// Around the whole model forward (the root unit: parameters outside all units).
  virtual void begin_forward() = 0;
  virtual at::Tensor end_forward(at::Tensor output) = 0;

  /// Runs loss.backward() with the engine's hooks; `sync` is true on the last
  /// micro-batch of a gradient-accumulation window.
  virtual void backward(const at::Tensor& loss, bool sync) = 0;
  /// Global gradient norm (fp64 over shards), unscaled; remembers the clip
  /// coefficient min(1, max_norm / (norm + 1e-6)) for the next step().
  virtual double clip_grad_norm(double max_norm) = 0;
  /// Applies the optimizer with learning rate `lr` (skips on fp16 overflow
  /// or non-finite gradients). Fills what the engine knows of the step:
  /// skipped, non_finite, grad_norm, loss_scale and the lost-update audit.
  virtual StepInfo step(double lr) = 0;
  virtual void zero_grad() = 0;
  /// With overlap_comm, step() leaves the gathers of the parameters kept
  /// gathered between steps (ZeRO-1/2) in flight, to run under the next
  /// forward, which waits for each unit's as it reaches it. This waits for
  /// all of them: before the module's parameters are read other than by a
  /// forward. Not collective (every rank issued the gathers in step()).
  virtual void complete_parameters() = 0;
  /// Multiplies the loss before backward (fp16 loss scaling; 1 otherwise).
  virtual double loss_scale() const = 0;

  /// Every parameter's full fp32 value (a quantized weight: its NF4 bytes) by fully-qualified name, then every
  /// buffer in its original dtype (as a state dict holds them). Collective.
  virtual std::vector<std::pair<std::string, at::Tensor>> full_state_dict() = 0;
  /// Every parameter's name and shape, in the order visit_full_parameters
  /// visits them; the same on every rank.
  virtual std::vector<std::pair<std::string, std::vector<int64_t>>> parameter_shapes() const = 0;
  /// Calls `visit(name, value)` with every parameter's full fp32 value, in
  /// parameter_shapes() order, gathering one unit at a time: no rank holds
  /// more than one unit's values. `value` lives only during the call.
  /// Collective: every rank visits every parameter.
  virtual void visit_full_parameters(const std::function<void(const std::string&, const at::Tensor&)>& visit) = 0;
  /// Every field but peak_rss (the process's, which the Accelerator adds).
  virtual MemoryReport memory() const = 0;
  /// Starts MemoryReport::gathered_peak and reducing_peak over from what is held now.
  virtual void reset_memory_peaks() = 0;
  virtual TrafficReport traffic() const = 0;
  virtual void reset_traffic() = 0;

  // ---- checkpoints: what the checkpoint format reads and writes, the same
  // for every engine (a checkpoint of one resumes under the other).
  /// This rank's slices to save. Replicas (NO_SHARD / zero 0 ranks other than
  /// 0, HYBRID_SHARD machines other than the first) return none: the first
  /// copy is the checkpoint.
  virtual std::vector<CheckpointSlice> checkpoint_slices() const = 0;
  /// Overwrites every owned slice with `source(name, kind, begin, length)`
  /// and refreshes the low-precision shards, with the gathered parameters
  /// released first; no collective, so that the ranks can agree on a failure
  /// before any of them gathers again. Returns the 16-bit dtype that values
  /// were rounded to on this rank, where the run holds them in that dtype
  /// alone (pure low precision's parameters and optimizer state, a frozen
  /// weight without an fp32 copy) and the checkpoint's were not
  /// representable in it; nullopt where every value was kept.
  virtual std::optional<at::ScalarType> load_slices(const SliceSource& source) = 0;
  /// Collective, after load_slices on every rank (whether it succeeded or
  /// not): gathers again what stays gathered, from the shards as they are.
  virtual void regather_after_load() = 0;
  /// The custom optimizer's state; nullopt without a custom optimizer.
  virtual std::optional<CustomOptimizerState> custom_optimizer_state() const = 0;
  /// This rank's layout now, as custom_optimizer_state() gives it; empty
  /// without a custom optimizer.
  virtual std::string custom_optimizer_layout() const = 0;
  /// Loads a custom optimizer's archive saved under custom_optimizer_layout().
  virtual void load_custom_optimizer_state(const std::string& archive) = 0;
  virtual int64_t optimizer_steps() const = 0;
  virtual void set_optimizer_steps(int64_t steps) = 0;
  /// Dynamic loss scaler state as {scale, cur_hysteresis, cur_iter, last_overflow_iter, skipped_steps}.
  virtual std::vector<double> loss_scaler_state() const = 0;
  virtual void load_loss_scaler_state(const std::vector<double>& state) = 0;
};

}  // namespace shardtrain::engine
