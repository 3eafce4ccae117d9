#pragma once
// The interface the Accelerator drives; implemented by backends/zero and
// backends/fsdp. Engines see the outside world only through the
// Communicator, the unit hooks and the kernel functions.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "shardtrain/unit.h"

namespace torch::optim {
class Optimizer;
}

namespace shardtrain::engine {

/// Bytes of model state held by this rank, by kind (the precision plan's rows).
struct MemoryStats {
  int64_t params = 0;     ///< low-precision shards / replicated params at rest
  int64_t grads = 0;      ///< gradient partitions / buffers at rest
  int64_t master = 0;     ///< fp32 master copies that are not the params themselves
  int64_t optimizer = 0;  ///< optimizer state (m, v, momentum)
  int64_t gathered = 0;   ///< currently gathered (unsharded) parameter buffers
  int64_t gathered_peak = 0;  ///< maximum of `gathered` since the last reset
  /// The most bytes of unsharded parameter values this rank held at once
  /// while the engine sharded the model: the module's own parameter storage
  /// not yet replaced by shards, plus the engine's gathered and loading
  /// buffers. With weights loaded on rank 0 only (cpu_ram_efficient_loading)
  /// the other ranks stay near one unit; a normal load holds the whole model.
  int64_t load_peak = 0;
};

struct StepResult {
  bool skipped = false;    ///< fp16 overflow: the update was not applied
  double grad_norm = -1;   ///< global (unscaled) gradient norm, -1 if not computed
  double loss_scale = 1;   ///< loss scale in effect for this step
};

/// Optimizer the engine runs over its fp32 master shards.
struct OptimizerSpec {
  std::string type = "AdamW";  ///< AdamW | Adam | SGD
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  double momentum = 0.0;
  bool nesterov = false;
  /// Escape hatch: build any torch::optim optimizer over the master shard
  /// tensors (their .grad() holds the reduced, unscaled gradient at step time).
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)> custom_factory;
};

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
  /// Applies the optimizer with learning rate `lr` (skips on fp16 overflow).
  virtual StepResult step(double lr) = 0;
  virtual void zero_grad() = 0;
  /// Multiplies the loss before backward (fp16 loss scaling; 1 otherwise).
  virtual double loss_scale() const = 0;

  /// Every parameter's full fp32 value by fully-qualified name, then every
  /// buffer in its original dtype (as a state dict holds them). Collective.
  virtual std::vector<std::pair<std::string, at::Tensor>> full_state_dict() = 0;
  virtual MemoryStats memory() const = 0;
  virtual void reset_gathered_peak() = 0;
};

}  // namespace shardtrain::engine
