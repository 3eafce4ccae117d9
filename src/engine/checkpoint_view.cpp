// The checkpoint slices of this rank's shards (save and load) and the owned
// ranges, by parameter name and element range. A quantized base (packed
// entries) is not part of a checkpoint: it is made again, bit for bit, from
// the base weights (quantize_frozen_base is deterministic), and is not trained.

#include "engine/checkpoint_view.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "shardtrain/error.h"

namespace shardtrain::engine {

std::vector<CheckpointSlice> CheckpointView::slices() const {
  std::vector<CheckpointSlice> slices;
  if (groups_.holds_a_copy()) return slices;
  const at::Tensor& momentum = storage_.momentum();
  for (int i = 0; i < units_.size(); ++i) {
    const UnitEntry& u = units_[i];
    const UnitShard& shard = storage_.unit(i);
    if (u.packed) continue;
    for (const auto& seg : u.layout->segments_of_rank(groups_.layout_rank())) {
      CheckpointSlice slice;
      slice.name = u.names[seg.param_index];
      slice.shape = u.shapes[seg.param_index];
      slice.trainable = u.trainable;
      slice.begin = seg.param_offset;
      slice.length = seg.length;
      auto view = [&](const at::Tensor& t) { return t.narrow(0, seg.shard_offset, seg.length); };
      slice.state.emplace_back("master", view(shard.value()));
      if (u.trainable && shard.exp_avg.defined()) {
        slice.state.emplace_back("exp_avg", view(shard.exp_avg));
        slice.state.emplace_back("exp_avg_sq", view(shard.exp_avg_sq));
      }
      if (u.trainable && momentum.defined()) {
        slice.state.emplace_back("momentum", momentum.narrow(0, u.shard_offset + seg.shard_offset, seg.length));
      }
      slices.push_back(std::move(slice));
    }
  }
  return slices;
}

std::optional<at::ScalarType> CheckpointView::load(const SliceSource& source) {
  // A custom optimizer makes the master a leaf that requires grad, and
  // autograd refuses in-place writes into a view of one: loading is not a
  // differentiable operation.
  at::NoGradGuard no_grad;
  const at::Tensor& momentum = storage_.momentum();
  std::optional<at::ScalarType> rounded_to;
  for (int i = 0; i < units_.size(); ++i) {
    const UnitEntry& u = units_[i];
    const UnitShard& shard = storage_.unit(i);
    if (u.packed) continue;
    for (const auto& seg : u.layout->segments_of_rank(groups_.layout_rank())) {
      const std::string& name = u.names[seg.param_index];
      auto fill = [&](const at::Tensor& target, const std::string& kind) {
        at::Tensor dst = target.narrow(0, seg.shard_offset, seg.length);
        at::Tensor value = source(name, kind, seg.param_offset, seg.length);
        ST_CHECK(value.numel() == seg.length, "checkpoint: '", name, "' ", kind, " [", seg.param_offset, ", +",
                 seg.length, ") came back with ", value.numel(), " elements");
        const at::Tensor flat = value.reshape({-1});
        // A value held in a 16-bit dtype alone (no fp32 master or copy) rounds
        // what a wider (or another 16-bit) checkpoint gives it, where it is not
        // already representable there (an fp32 save of bf16 values is).
        if (flat.scalar_type() != dst.scalar_type() &&
            c10::elementSize(dst.scalar_type()) <= c10::elementSize(flat.scalar_type())) {
          const at::Tensor held = flat.to(dst.scalar_type());
          if (!rounded_to && !at::equal(held.to(flat.scalar_type()), flat)) rounded_to = dst.scalar_type();
          dst.copy_(held);
        } else {
          dst.copy_(flat);
        }
      };
      fill(shard.value(), "master");
      if (u.trainable && shard.exp_avg.defined()) {
        fill(shard.exp_avg, "exp_avg");
        fill(shard.exp_avg_sq, "exp_avg_sq");
      }
      if (u.trainable && momentum.defined()) {
        fill(momentum.narrow(0, u.shard_offset, u.layout->shard_numel()), "momentum");
      }
    }
    if (shard.master.defined() && !shard.lp.is_same(shard.master)) shard.lp.copy_(shard.master);
  }
  return rounded_to;
}

std::vector<OwnedRange> CheckpointView::owned_ranges() const {
  std::vector<OwnedRange> ranges;
  for (const auto& u : units_.entries()) {
    if (!u.trainable) continue;
    for (const auto& seg : u.layout->segments_of_rank(groups_.layout_rank())) {
      ranges.push_back({u.names[seg.param_index], seg.param_offset, seg.length, u.shard_offset + seg.shard_offset});
    }
  }
  return ranges;
}

}  // namespace shardtrain::engine
