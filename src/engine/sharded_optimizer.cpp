// The optimizer over the shards: the global gradient norm and clipping, the
// fp16 overflow check, the fused step through the kernel layer (or a custom
// torch optimizer), and zeroing the gradients after it.

#include "engine/sharded_optimizer.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "shardtrain/error.h"
#include "shardtrain/kernels.h"

namespace shardtrain::engine {
namespace {

using comm::ReduceOp;

/// Where each parameter run of this rank (`rank` in the layouts: the shard
/// group's, 0 when unsharded) begins in its flat partition: the sub-groups
/// of sub_group_size 0.
std::vector<int64_t> parameter_run_starts(const UnitTable& units, int rank) {
  std::vector<int64_t> starts;
  for (const UnitEntry& u : units.entries()) {
    if (!u.trainable || !u.layout) continue;
    for (const OwnedSegment& segment : u.layout->segments_of_rank(rank)) {
      if (segment.length > 0) starts.push_back(u.shard_offset + segment.shard_offset);
    }
  }
  return starts;
}

}  // namespace

ShardedOptimizer::ShardedOptimizer(const EnginePlan& plan, const ShardGroups& groups, const UnitTable& units,
                                   ShardStorage& storage)
    : plan_(plan), groups_(groups), units_(units), storage_(storage),
      scaler_(plan.loss_scale, plan.loss_scale.raise_error_at_min_scale) {}

void ShardedOptimizer::create_custom_optimizer() {
  if (!plan_.optimizer.custom_factory) return;
  // The escape hatch steps the master shard directly; its .grad() is the
  // reduced gradient partition, unscaled and clipped by step().
  at::Tensor leaf = storage_.master();
  leaf.set_requires_grad(true);
  custom_leaves_ = {leaf};
  custom_ = plan_.optimizer.custom_factory(custom_leaves_);
  ST_CHECK(custom_ != nullptr, "the custom optimizer factory returned null");
}

std::string ShardedOptimizer::custom_state() const {
  ST_CHECK(custom_ != nullptr, plan_.name, ": no custom optimizer to save");
  torch::serialize::OutputArchive archive;
  custom_->save(archive);
  std::ostringstream bytes;
  archive.save_to(bytes);
  return bytes.str();
}

void ShardedOptimizer::load_custom_state(const std::string& bytes) {
  ST_CHECK(custom_ != nullptr, plan_.name, ": no custom optimizer to load into");
  torch::serialize::InputArchive archive;
  archive.load_from(bytes.data(), bytes.size(), storage_.master().device());
  custom_->load(archive);
}

double ShardedOptimizer::clip_grad_norm(double max_norm) {
  comm::Communicator& comm = groups_.shard();
  // The local sum stays on the gradients' device (under offload the host's,
  // then the communicator's) through the all-reduce; item() is the step's one
  // wait for it.
  at::Tensor total = kernels::sum_of_squares(storage_.grad()).reshape({1}).to(comm.device());
  comm.all_reduce(total, ReduceOp::kSum);
  if (!plan_.shard_params) {
    // Every rank holds all gradients: the sum over ranks counted each W times.
    total.div_(comm.world_size());
  }
  const double norm = std::sqrt(total.item<double>()) / scaler_.scale();
  last_grad_norm_ = std::isfinite(norm) ? norm : -1.0;
  grads_finite_ = std::isfinite(norm);
  clip_coefficient_ = 1.0;
  if (max_norm > 0 && std::isfinite(norm)) clip_coefficient_ = std::min(1.0, max_norm / (norm + 1e-6));
  return norm;
}

StepInfo ShardedOptimizer::step(double lr) {
  comm::Communicator& comm = groups_.shard();
  StepInfo result;
  result.loss_scale = scaler_.scale();
  result.grad_norm = last_grad_norm_;
  // Whether every gradient element is finite. fp16: the loss scaler's
  // overflow check. bf16/fp32: no scaler absorbs an inf or NaN, and an update
  // with one would poison the weights, so the step is skipped the same way and
  // the Accelerator applies non_finite_policy. There the norm, when clipping
  // computed it for this step, already answers (finite iff every element is);
  // else one pass and a MAX.
  const std::optional<bool> norm_finite = std::exchange(grads_finite_, std::nullopt);
  bool finite = true;
  if (norm_finite.has_value() && !plan_.fp16) {
    finite = *norm_finite;
  } else {
    at::Tensor flag = kernels::non_finite_flag(storage_.grad()).reshape({1}).to(comm.device());
    comm.all_reduce(flag, ReduceOp::kMax);
    finite = flag.item<float>() == 0;
  }
  // A collective that failed after its wait() returned (NCCL's watchdog)
  // left garbage in the gradients: never apply it. Checked after the host
  // waited on the last reduction (the flag or the norm), when the reductions
  // before it have ended or timed out; an asynchronous NCCL error the
  // watchdog has not polled yet can still be missed.
  groups_.check_health();
  if (!finite) {
    scaler_.update(true);  // fp16 lowers the scale; otherwise it counts the skipped step
    storage_.clear_grads();
    clip_coefficient_ = 1.0;
    last_grad_norm_ = -1.0;
    result.skipped = true;
    result.non_finite = !plan_.fp16;
    return result;
  }
  const double grad_scale = clip_coefficient_ / scaler_.scale();
  storage_.download_for_step();
  const at::Tensor& grad = storage_.grad();
  const at::Tensor lp_out = storage_.low_precision_out();
  ++steps_;

  if (custom_) {
    at::Tensor& leaf = custom_leaves_[0];
    // torch optimizers need the leaf's dtype (keep_low_precision_grads keeps a 16-bit partition).
    leaf.mutable_grad() = grad.to(leaf.scalar_type()) * grad_scale;
    {
      at::NoGradGuard no_grad;
      custom_->step();
    }
    leaf.mutable_grad() = at::Tensor();
    if (lp_out.defined()) lp_out.copy_(storage_.master());
  } else {
    fused_step(lr, grad_scale, grad, lp_out, result);
  }
  storage_.upload_low_precision();
  scaler_.update(false);
  storage_.clear_grads();
  clip_coefficient_ = 1.0;
  last_grad_norm_ = -1.0;
  return result;
}

void ShardedOptimizer::fused_step(double lr, double grad_scale, const at::Tensor& grad, const at::Tensor& lp_out,
                                  StepInfo& result) {
  const auto& o = plan_.optimizer;
  const bool pure = plan_.pure_low_precision;
  const bool write_lp = lp_out.defined();
  at::Tensor stepped = storage_.stepped();
  const at::Tensor& momentum_flat = storage_.momentum();
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
      plan_.sub_group_size == 0 ? parameter_run_starts(units_, groups_.layout_rank()) : std::vector<int64_t>{},
      plan_.sub_group_size, total, alignment);
  for (const auto& [begin, end] : slices) {
    const int64_t len = end - begin;
    at::Tensor param = stepped.narrow(0, begin, len);
    at::Tensor g = grad.narrow(0, begin, len);
    at::Tensor lp = write_lp ? lp_out.narrow(0, begin, len) : at::Tensor();
    if (o.type == "SGD") {
      at::Tensor momentum = momentum_flat.defined() ? momentum_flat.narrow(0, begin, len) : at::Tensor();
      kernels::SgdParams p;
      p.lr = lr;
      p.momentum = o.momentum;
      p.weight_decay = o.weight_decay;
      p.nesterov = o.nesterov;
      p.grad_scale = grad_scale;
      p.first_step = steps_ == 1;
      kernels::sgd_step(param, momentum_flat.defined() ? &momentum : nullptr, g, write_lp ? &lp : nullptr, p,
                        audit_ptr);
      continue;
    }
    at::Tensor m = storage_.exp_avg().narrow(0, begin, len);
    at::Tensor v = storage_.exp_avg_sq().narrow(0, begin, len);
    kernels::AdamParams p;
    p.lr = lr;
    p.beta1 = o.beta1;
    p.beta2 = o.beta2;
    p.eps = o.eps;
    p.weight_decay = o.weight_decay;
    p.step = steps_;
    p.adam_w_mode = o.type == "AdamW";
    p.grad_scale = grad_scale;
    if (pure) {
      kernels::adam_step_low_precision(param, m, v, g, p, audit_ptr);
    } else {
      kernels::adam_step(param, m, v, g, write_lp ? &lp : nullptr, p, audit_ptr);
    }
  }
  if (audit_ptr != nullptr) {
    // Offloaded steps count on the host; the sum runs on the communicator's device.
    comm::Communicator& comm = groups_.shard();
    at::Tensor counts = audit.counts.to(comm.device());
    comm.all_reduce(counts, ReduceOp::kSum);
    const at::Tensor host = counts.cpu();
    const int64_t* c = host.data_ptr<int64_t>();
    if (c[0] > 0) {
      result.lost_update_frac = static_cast<double>(c[1]) / static_cast<double>(c[0]);
      result.lost_update_frac_if_bf16 = static_cast<double>(c[2]) / static_cast<double>(c[0]);
    }
  }
}

}  // namespace shardtrain::engine
