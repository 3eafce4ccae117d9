// The optimizer over the shards: the global gradient norm and clipping, the
// fp16 overflow check, the fused step through the kernel layer (or a custom
// torch optimizer), and zeroing the gradients.

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "engine/storage_resize.h"
#include "engine/engine_state.h"
#include "shardtrain/error.h"
#include "shardtrain/logging.h"
#include "shardtrain/kernels.h"

namespace shardtrain::engine {
namespace {

/// Where each parameter run of this rank (`rank` in the layouts: the shard
/// group's, 0 when unsharded) begins in its flat partition: the sub-groups
/// of sub_group_size 0.
std::vector<int64_t> parameter_run_starts(const std::vector<UnitState>& units, int rank) {
  std::vector<int64_t> starts;
  for (const UnitState& u : units) {
    if (!u.trainable || !u.layout) continue;
    for (const OwnedSegment& segment : u.layout->segments_of_rank(rank)) {
      if (segment.length > 0) starts.push_back(u.shard_offset + segment.shard_offset);
    }
  }
  return starts;
}

}  // namespace

void ShardedEngine::State::create_custom_optimizer() {
  if (plan.optimizer.custom_factory) {
    // The escape hatch steps the master shard directly; its .grad() is the
    // reduced gradient partition, unscaled and clipped by step().
    at::Tensor leaf = master_flat;
    leaf.set_requires_grad(true);
    custom_leaves = {leaf};
    custom_optimizer = plan.optimizer.custom_factory(custom_leaves);
    ST_CHECK(custom_optimizer != nullptr, "the custom optimizer factory returned null");
  }
}

double ShardedEngine::clip_grad_norm(double max_norm) {
  State& s = *state_;
  // The local sum stays on the gradients' device through the all-reduce;
  // item() is the step's one wait for it.
  at::Tensor total = kernels::sum_of_squares(s.grad_flat).reshape({1});
  s.comm->all_reduce(total, ReduceOp::kSum);
  if (!s.plan.shard_params) {
    // Every rank holds all gradients: the sum over ranks counted each W times.
    total.div_(s.comm->world_size());
  }
  const double norm = std::sqrt(total.item<double>()) / s.scaler.scale();
  s.last_grad_norm = std::isfinite(norm) ? norm : -1.0;
  s.grads_finite = std::isfinite(norm);
  s.clip_coefficient = 1.0;
  if (max_norm > 0 && std::isfinite(norm)) s.clip_coefficient = std::min(1.0, max_norm / (norm + 1e-6));
  return norm;
}

StepResult ShardedEngine::step(double lr) {
  State& s = *state_;
  // A collective that failed after its wait() returned (NCCL's watchdog)
  // left garbage in the gradients: never apply it.
  s.comm->check_health();
  StepResult result;
  result.loss_scale = s.scaler.scale();
  result.grad_norm = s.last_grad_norm;
  // Whether every gradient element is finite. fp16: the loss scaler's
  // overflow check. bf16/fp32: no scaler absorbs an inf or NaN, and an update
  // with one would poison the weights, so the step is skipped the same way and
  // the Accelerator applies non_finite_policy. There the norm, when clipping
  // computed it for this step, already answers (finite iff every element is);
  // else one pass and a MAX.
  const std::optional<bool> norm_finite = std::exchange(s.grads_finite, std::nullopt);
  bool finite = true;
  if (norm_finite.has_value() && !s.plan.fp16) {
    finite = *norm_finite;
  } else {
    at::Tensor flag = kernels::non_finite_flag(s.grad_flat).reshape({1});
    s.comm->all_reduce(flag, ReduceOp::kMax);
    finite = flag.item<float>() == 0;
  }
  if (!finite) {
    s.scaler.update(true);  // fp16 lowers the scale; otherwise it counts the skipped step
    s.grad_flat.zero_();
    s.grads_zero = true;
    s.clip_coefficient = 1.0;
    s.last_grad_norm = -1.0;
    result.skipped = true;
    result.non_finite = !s.plan.fp16;
    return result;
  }
  const double grad_scale = s.clip_coefficient / s.scaler.scale();
  at::Tensor grad = s.grad_flat;
  if (s.host_grad_flat.defined()) {
    s.host_grad_flat.copy_(s.grad_flat);
    grad = s.host_grad_flat;
  }
  const bool separate_lp = !s.pure() && !s.lp_flat.is_same(s.master_flat);
  at::Tensor lp_out;
  if (separate_lp) lp_out = s.host_lp_flat.defined() ? s.host_lp_flat : s.lp_flat;
  ++s.optimizer_steps;

  const auto& o = s.plan.optimizer;
  if (s.custom_optimizer) {
    at::Tensor& leaf = s.custom_leaves[0];
    // torch optimizers need the leaf's dtype (keep_low_precision_grads keeps a 16-bit partition).
    leaf.mutable_grad() = grad.to(leaf.scalar_type()) * grad_scale;
    {
      at::NoGradGuard no_grad;
      s.custom_optimizer->step();
    }
    leaf.mutable_grad() = at::Tensor();
    if (separate_lp) lp_out.copy_(s.master_flat);
  } else {
    at::Tensor& stepped = s.pure() ? s.lp_flat : s.master_flat;
    const int64_t total = stepped.numel();
    kernels::UpdateAudit audit;
    kernels::UpdateAudit* audit_ptr = nullptr;
    if (o.audit_sample_period > 0) {
      audit.counts = at::zeros({3}, stepped.options().dtype(at::kLong));
      audit.sample_period = o.audit_sample_period;
      audit_ptr = &audit;
    }
    // The step is elementwise, so the slicing changes temporary memory and
    // kernel launches, never the result; aligned to the audit's sampling
    // pattern it does not change the audit either.
    const int64_t alignment = audit_ptr != nullptr ? kernels::audit_pattern_elements(o.audit_sample_period) : 1;
    const auto slices = optimizer_step_slices(
        s.plan.sub_group_size == 0 ? parameter_run_starts(s.units, s.layout_rank()) : std::vector<int64_t>{},
        s.plan.sub_group_size, total, alignment);
    for (const auto& [begin, end] : slices) {
      const int64_t len = end - begin;
      at::Tensor param = stepped.narrow(0, begin, len);
      at::Tensor g = grad.narrow(0, begin, len);
      at::Tensor lp = separate_lp ? lp_out.narrow(0, begin, len) : at::Tensor();
      if (o.type == "SGD") {
        at::Tensor momentum = s.momentum_flat.defined() ? s.momentum_flat.narrow(0, begin, len) : at::Tensor();
        kernels::SgdParams p;
        p.lr = lr;
        p.momentum = o.momentum;
        p.weight_decay = o.weight_decay;
        p.nesterov = o.nesterov;
        p.grad_scale = grad_scale;
        p.first_step = s.optimizer_steps == 1;
        kernels::sgd_step(param, s.momentum_flat.defined() ? &momentum : nullptr, g, separate_lp ? &lp : nullptr, p,
                          audit_ptr);
        continue;
      }
      at::Tensor m = s.exp_avg_flat.narrow(0, begin, len);
      at::Tensor v = s.exp_avg_sq_flat.narrow(0, begin, len);
      kernels::AdamParams p;
      p.lr = lr;
      p.beta1 = o.beta1;
      p.beta2 = o.beta2;
      p.eps = o.eps;
      p.weight_decay = o.weight_decay;
      p.step = s.optimizer_steps;
      p.adam_w_mode = o.type == "AdamW";
      p.grad_scale = grad_scale;
      if (s.pure()) {
        kernels::adam_step_low_precision(param, m, v, g, p, audit_ptr);
      } else {
        kernels::adam_step(param, m, v, g, separate_lp ? &lp : nullptr, p, audit_ptr);
      }
    }
    if (audit_ptr != nullptr) {
      // Offloaded steps count on the host; the sum runs on the communicator's device.
      at::Tensor counts = audit.counts.to(s.comm->device());
      s.comm->all_reduce(counts, ReduceOp::kSum);
      const at::Tensor host = counts.cpu();
      const int64_t* c = host.data_ptr<int64_t>();
      if (c[0] > 0) {
        result.lost_update_frac = static_cast<double>(c[1]) / static_cast<double>(c[0]);
        result.lost_update_frac_if_bf16 = static_cast<double>(c[2]) / static_cast<double>(c[0]);
      }
    }
  }
  if (separate_lp && s.host_lp_flat.defined()) s.lp_flat.copy_(s.host_lp_flat);
  s.scaler.update(false);
  s.grad_flat.zero_();
  s.grads_zero = true;
  s.clip_coefficient = 1.0;
  s.last_grad_norm = -1.0;
  s.regather_after_step();
  return result;
}

void ShardedEngine::zero_grad() {
  State& s = *state_;
  // step() leaves the gradients zeroed; a second pass over them would be the
  // only work of this call.
  if (!s.grads_zero) s.grad_flat.zero_();
  s.grads_zero = true;
  // zero 1's accumulators hold anything only inside a window (a backward
  // without sync added to them); the boundary's reductions leave them zeroed.
  if (s.accumulated_in_window) {
    for (auto& u : s.units) {
      if (u.boundary_grad_accumulator.defined()) u.boundary_grad_accumulator.zero_();
    }
    s.accumulated_in_window = false;
  }
}

double ShardedEngine::loss_scale() const { return state_->scaler.scale(); }

}  // namespace shardtrain::engine
