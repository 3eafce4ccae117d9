// Reducing gradients: autograd's post-accumulate hooks hand each
// parameter's gradient over; they are reduce-scattered (or all-reduced) in
// buckets, straight from where autograd left them, into the gradient shard.

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_set>

#include <ATen/ATen.h>

#include "engine/storage_resize.h"
#include "engine/engine_state.h"
#include "shardtrain/error.h"
#include "shardtrain/logging.h"

namespace shardtrain::engine {

void ShardedEngine::State::on_grad_accumulated(int state_index, int param_index) {
  UnitState& u = units[state_index];
  at::Tensor& slot = u.params[param_index].mutable_grad();
  if (!slot.defined()) return;
  at::Tensor grad = std::move(slot);
  slot = at::Tensor();
  at::Tensor& pending = u.pending_grads[param_index];
  if (pending.defined()) {
    // A second accumulation in the same backward (a reentrant recompute): sum them.
    pending = pending + grad;
    return;
  }
  pending = std::move(grad);
  if (++u.grads_seen == static_cast<int>(u.params.size())) unit_grads_ready(state_index);
}

at::Tensor ShardedEngine::State::reduce_input(const UnitState& u, int k) const {
  const at::Tensor& g = u.pending_grads[k];
  if (!g.defined()) return at::zeros({u.layout->param_numel(k)}, u.full.options().dtype(plan.reduce_dtype));
  return g.to(plan.reduce_dtype).reshape({-1});
}

void ShardedEngine::State::enqueue_reduction(int state_index, at::Tensor input, int64_t grad_offset,
                                             int64_t length, std::vector<int64_t> splits) {
  if (plan.predivide != 1.0) input.div_(plan.predivide);
  filling.numel += input.numel();
  filling.entries.push_back({state_index, std::move(input), grad_offset, length, std::move(splits)});
}

void ShardedEngine::State::enqueue_full_layout(int state_index, const at::Tensor& full_input) {
  const UnitLayout& layout = *units[state_index].layout;
  if (!plan.shard_params) {
    enqueue_reduction(state_index, full_input, 0, layout.shard_numel());
    return;
  }
  const int W = comm->world_size();
  for (const auto& piece : layout.pieces()) {
    enqueue_reduction(state_index, full_input.narrow(0, piece.full_offset, W * piece.chunk), piece.shard_offset,
                      piece.chunk);
  }
}

void ShardedEngine::State::unit_grads_ready(int state_index) {
  UnitState& u = units[state_index];
  grads_zero = false;
  if (adds_grads_directly()) {
    // The reduction over one rank is the identity: each gradient is added
    // straight into its place in the shard's gradient, rounded to the
    // reduce dtype as the collective would have carried it. The same sums
    // as the bucketed path (0 + g, then each later micro-batch), so ZeRO-1's
    // boundary accumulation gives the same bits too.
    for (int k = 0; k < static_cast<int>(u.pending_grads.size()); ++k) {
      const at::Tensor& g = u.pending_grads[k];
      if (!g.defined()) continue;
      at::Tensor place = u.grad.narrow(0, u.layout->param_offset_in_full(k), g.numel()).view(g.sizes());
      // Through the reduce dtype into the gradient's, as the collective path does.
      place.add_(g.to(plan.reduce_dtype).to(u.grad.scalar_type()));
    }
  } else if (plan.reduce_at_boundary_only && (accumulated_in_window || !boundary_backward)) {
    // Accumulated unreduced, each gradient into its slice of the full layout;
    // in the window's last backward the sum goes out at once.
    for (int k = 0; k < static_cast<int>(u.pending_grads.size()); ++k) {
      const at::Tensor& g = u.pending_grads[k];
      if (!g.defined()) continue;
      u.boundary_grad_accumulator.narrow(0, u.layout->param_offset_in_full(k), g.numel()).add_(g.reshape({-1}));
    }
    if (boundary_backward) reduce_accumulator(state_index);
  } else if (!plan.shard_params) {
    // Unsharded: each gradient is all-reduced whole, from autograd's tensor.
    for (int k = 0; k < static_cast<int>(u.pending_grads.size()); ++k) {
      const int64_t n = u.layout->param_numel(k);
      if (n > 0) enqueue_reduction(state_index, reduce_input(u, k), u.layout->param_offset_in_full(k), n);
    }
  } else {
    // Each gradient is reduce-scattered where autograd left it, cut where
    // the ranks' shards cut it: ZeRO's in even chunks unless its size does
    // not divide by the world, FSDP's wherever the flat shards' boundaries fall.
    const int me = layout_rank();
    if (plan.reduce_at_boundary_only) u.boundary_reduced = true;  // zero 1, a one-micro-batch window
    for (int k = 0; k < static_cast<int>(u.pending_grads.size()); ++k) {
      if (u.layout->param_numel(k) == 0) continue;
      std::vector<int64_t> splits = u.layout->param_splits(k);
      const bool even = std::all_of(splits.begin(), splits.end(), [&](int64_t c) { return c == splits[0]; });
      const int64_t length = splits[me];
      enqueue_reduction(state_index, reduce_input(u, k), u.layout->param_shard_offset(k, me), length,
                        even ? std::vector<int64_t>{} : std::move(splits));
    }
  }
  for (auto& g : u.pending_grads) g = at::Tensor();
  u.grads_seen = 0;
  if (!adds_grads_directly() && (!plan.reduce_at_boundary_only || boundary_backward)) {
    if (filling.numel >= plan.reduce_bucket_size) flush_bucket();
    if (!plan.overlap_comm) finish_reductions();
  }
  // Every autograd node that read the unit's trainable weights has run (each
  // produced its weight's gradient). Frozen weights give no such signal, so a
  // unit holding some stays gathered until the end of backward.
  if (u.unit != nullptr) {
    const bool has_frozen = unit_states.at(u.unit).size() > 1;
    if (!has_frozen) release_unit(u.unit, /*after_forward=*/false);
    if (plan.backward_prefetch == BackwardPrefetchMode::kPost) prefetch_for_backward(u.unit);
  }
}

void ShardedEngine::State::flush_bucket() {
  if (filling.entries.empty()) return;
  ReduceBucket bucket = std::move(filling);
  filling = ReduceBucket();
  const std::size_t more = bucket.entries.size() - 1;
  comm::CollectiveScope scope("reduce gradients of " + units[bucket.entries[0].unit].label() +
                              (more > 0 ? " and " + std::to_string(more) + " more tensors" : ""));
  const ReduceOp op = plan.average ? ReduceOp::kAvg : ReduceOp::kSum;
  if (!plan.shard_params) {
    std::vector<at::Tensor> inputs;
    for (const auto& e : bucket.entries) inputs.push_back(e.input);
    bucket.works.push_back(comm->all_reduce_coalesced_async(inputs, op));
  } else {
    int64_t total = 0;
    for (const auto& e : bucket.entries) total += e.length;
    bucket.output = at::empty({total}, bucket.entries[0].input.options());
    // Consecutive even pieces go out as one coalesced call; uneven ones on their own.
    std::vector<at::Tensor> inputs, outputs;
    auto issue_even = [&] {
      if (!inputs.empty()) bucket.works.push_back(comm->reduce_scatter_coalesced_async(outputs, inputs, op));
      inputs.clear();
      outputs.clear();
    };
    int64_t offset = 0;
    for (const auto& e : bucket.entries) {
      at::Tensor out = bucket.output.narrow(0, offset, e.length);
      offset += e.length;
      if (e.splits.empty()) {
        inputs.push_back(e.input);
        outputs.push_back(out);
        continue;
      }
      issue_even();
      bucket.works.push_back(comm->reduce_scatter_v_async(out, e.input, e.splits, op));
    }
    issue_even();
  }
  in_flight.push_back(std::move(bucket));
}

void ShardedEngine::State::finish_reductions() {
  flush_bucket();
  for (auto& bucket : in_flight) {
    for (auto& work : bucket.works) work->wait();
    // The reduced values: the bucket's output, or (unsharded) the inputs in place.
    std::vector<at::Tensor> reduced;
    int64_t offset = 0;
    for (const auto& e : bucket.entries) {
      reduced.push_back(plan.shard_params ? bucket.output.narrow(0, offset, e.length) : e.input);
      offset += e.length;
    }
    if (replicate_group) {
      const ReduceOp op = plan.average ? ReduceOp::kAvg : ReduceOp::kSum;
      if (plan.shard_params) {
        replicate_group->all_reduce(bucket.output, op);
      } else {
        replicate_group->all_reduce_coalesced_async(reduced, op)->wait();
      }
    }
    for (std::size_t k = 0; k < bucket.entries.size(); ++k) {
      const auto& e = bucket.entries[k];
      if (plan.postdivide != 1.0) reduced[k].div_(plan.postdivide);
      UnitState& u = units[e.unit];
      u.grad.narrow(0, e.grad_offset, e.length).add_(reduced[k].reshape({-1}).to(u.grad.scalar_type()));
    }
  }
  in_flight.clear();
}

void ShardedEngine::State::reduce_accumulator(int state_index) {
  UnitState& u = units[state_index];
  // A copy: the accumulator is zeroed below, before the bucket is sent.
  at::Tensor input = u.boundary_grad_accumulator.to(plan.reduce_dtype, /*non_blocking=*/false, /*copy=*/true);
  enqueue_full_layout(state_index, input);
  u.boundary_grad_accumulator.zero_();
  u.boundary_reduced = true;
}

void ShardedEngine::State::reduce_boundary_accumulators() {
  if (adds_grads_directly()) return;  // unit_grads_ready added them
  for (std::size_t i = 0; i < units.size(); ++i) {
    UnitState& u = units[i];
    if (!u.trainable) continue;
    if (!u.boundary_reduced) {
      reduce_accumulator(static_cast<int>(i));
      if (filling.numel >= plan.reduce_bucket_size) flush_bucket();
    }
    u.boundary_reduced = false;
  }
  finish_reductions();
}

void ShardedEngine::backward(const at::Tensor& loss, bool sync) {
  State& s = *state_;
  ST_CHECK(loss.numel() == 1, "backward: the loss must be a scalar, got shape ", loss.sizes());
  at::Tensor scaled = s.scaler.scale() == 1.0 ? loss : loss * s.scaler.scale();
  s.boundary_backward = s.plan.reduce_at_boundary_only && sync;
  scaled.backward();
  // Units some of whose parameters got no gradient (unused in this forward)
  // still take part in the reductions with zeros: every rank must issue the
  // same collectives.
  for (std::size_t i = 0; i < s.units.size(); ++i) {
    if (s.units[i].trainable && s.units[i].grads_seen > 0) s.unit_grads_ready(static_cast<int>(i));
  }
  s.finish_reductions();
  for (auto& u : s.units) {
    for (auto& p : u.params) {
      if (p.grad().defined()) p.mutable_grad() = at::Tensor();
    }
  }
  if (s.boundary_backward) s.reduce_boundary_accumulators();
  s.boundary_backward = false;
  if (s.plan.reduce_at_boundary_only) s.accumulated_in_window = !sync;
  for (auto& u : s.units) {
    if (s.frees_after_backward(u)) s.release(u);
  }
}

}  // namespace shardtrain::engine
