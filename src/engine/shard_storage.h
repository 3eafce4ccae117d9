#pragma once
// The shard storage: where this rank's part of the model states lives. The
// flat partitions (fp32 master, low-precision copy, gradient, optimizer
// moments), every unit entry's views into them, the frozen entries' own
// shards, what the offloads keep in host memory, and the model's device.

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "engine/engine.h"
#include "engine/engine_plan.h"
#include "engine/shard_groups.h"
#include "engine/unit_table.h"

namespace shardtrain::engine {

inline int64_t bytes_of(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

/// A unit entry's pieces of the model states: views into the flat partitions
/// (trainable entries) or its own tensors (frozen ones: a shard to gather
/// from and, where the plan keeps one, an fp32 copy for state dicts; no
/// optimizer state).
struct UnitShard {
  at::Tensor master;                 ///< fp32; undefined in pure low precision
  at::Tensor lp;                     ///< param_dtype: what the all-gather sends (under the parameter offload, what its upload copies)
  at::Tensor grad;                   ///< the reduced gradient (trainable)
  at::Tensor exp_avg, exp_avg_sq;    ///< Adam's moments (trainable, Adam only)
  /// What a checkpoint and the state dict read as the value: the master, or
  /// the low-precision shard where there is none.
  const at::Tensor& value() const { return master.defined() ? master : lp; }
};

class ShardStorage {
 public:
  /// Binds the model's device (checked against the communicators') and
  /// allocates every partition for `units`.
  ShardStorage(const EnginePlan& plan, const UnitTable& units, const ShardGroups& groups);

  /// fp32 on the model's device (where every buffer the engine creates lives,
  /// what the offloads keep in host memory excepted): masters, moments, fp32 gradients.
  at::TensorOptions fp32_options() const { return at::TensorOptions().dtype(at::kFloat).device(device_); }

  UnitShard& unit(int i) { return shards_[static_cast<std::size_t>(i)]; }
  const UnitShard& unit(int i) const { return shards_[static_cast<std::size_t>(i)]; }

  // ---- the flat partitions (trainable entries' shards, one after another)
  const at::Tensor& master() const { return master_; }
  /// The low-precision partition (aliases the master when param_dtype is fp32).
  const at::Tensor& low_precision() const { return lp_; }
  /// What the optimizer steps: the master, or in pure low precision the
  /// low-precision partition (under offload its host copy, download_for_step()).
  const at::Tensor& stepped() const {
    return !plan_.pure_low_precision ? master_ : host_lp_.defined() ? host_lp_ : lp_;
  }
  const at::Tensor& grad() const { return grad_; }
  const at::Tensor& exp_avg() const { return exp_avg_; }
  const at::Tensor& exp_avg_sq() const { return exp_avg_sq_; }
  const at::Tensor& momentum() const { return momentum_; }
  /// Whether the optimizer steps in host memory, on the master, the moments
  /// and the gradient partition there (offload asked for and the model on a
  /// GPU; nothing moves otherwise).
  bool offloaded() const { return offloaded_; }
  /// Whether the parameter shards (the low-precision partition, the frozen
  /// entries' shards) live in host memory: a gather uploads its shard first.
  bool params_offloaded() const { return params_offloaded_; }
  /// Before an offloaded step in pure low precision without the parameter
  /// offload: the model's partition down to the host copy the step updates
  /// (a checkpoint load or a state dict may have written it since the last step).
  void download_for_step();
  /// Where the optimizer's kernel writes the stepped values rounded to
  /// param_dtype: the low-precision partition, its host copy under offload, or
  /// nothing where the stepped tensor is itself what the model reads, or is
  /// fp32 and copied to the model's device after the step (upload_low_precision).
  at::Tensor low_precision_out() const;
  /// After a step, brings the model's partition up to date where the kernel
  /// could not write it: from the host copy (the rounded one, or pure low
  /// precision's stepped one), or, for fp32 parameters whose master was
  /// offloaded off the GPU, from the master itself.
  void upload_low_precision();

  /// Something wrote into the gradient partition.
  void note_grads_written() { grads_zero_ = false; }
  /// zero_grad: zeroes the gradients unless they are known to be zero.
  void zero_grads();
  /// Zeroes the gradients whatever they hold (after a step, applied or skipped).
  void clear_grads();

  /// Whether the offloaded states are in page-locked host memory.
  bool host_pinned() const { return host_pinned_; }

  /// Bytes held at rest, by kind (MemoryReport' params, master, grads, optimizer).
  void add_memory(MemoryReport& stats) const;

  /// A 1-D tensor of `numel` elements whose storage claims their bytes but owns
  /// no memory (a null data pointer). ATen bounds-checks views against the
  /// storage's byte size, so the module's parameters can become views into a
  /// unit's buffer before anything is allocated; resize_storage_bytes() gives
  /// it memory when the unit is gathered. Loading parameters built without
  /// storage must not allocate (and touch) a full unit per unit: glibc keeps
  /// freed heap memory resident, so that churn alone grew a rank's resident set
  /// by most of the model (measured: 52 MB over 8 layers of a 60 MB model).
  static at::Tensor unallocated_buffer(int64_t numel, const at::TensorOptions& options);

 private:
  /// `numel` zeros with `options`; in host memory pinned to its exact size
  /// where the offload pins (host_pinned_).
  at::Tensor zeros(int64_t numel, const at::TensorOptions& options) const;

  const EnginePlan& plan_;
  at::Device device_{at::kCPU};
  at::Tensor master_, lp_, grad_, exp_avg_, exp_avg_sq_, momentum_;
  at::Tensor host_lp_;
  bool offloaded_ = false;
  bool params_offloaded_ = false;
  bool host_pinned_ = false;
  std::vector<UnitShard> shards_;
  bool grads_zero_ = true;
};

}  // namespace shardtrain::engine
