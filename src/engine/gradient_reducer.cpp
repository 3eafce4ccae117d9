// Reducing gradients: autograd's post-accumulate hooks hand each
// parameter's gradient over; they are reduce-scattered (or all-reduced) in
// buckets, straight from where autograd left them, into the gradient shard.

#include "engine/gradient_reducer.h"

#include <algorithm>

#include <ATen/ATen.h>

#include "shardtrain/error.h"
#include "shardtrain/logging.h"

namespace shardtrain::engine {

using comm::ReduceOp;

namespace {

/// Adds a reduced gradient into its place in the shard's gradient, in that
/// gradient's dtype and where it lives: under offload in host memory, so the
/// value comes down first (the copy waits for the reduction on the stream).
void add_reduced(const at::Tensor& place, const at::Tensor& reduced, bool land_pinned) {
  if (reduced.device() == place.device()) {
    place.add_(reduced.to(place.scalar_type()));
    return;
  }
  // Into pinned memory where the offload pins (the host allocator caches a
  // bucket's worth): one direct copy instead of one staged through a
  // pageable buffer.
  at::Tensor landed =
      at::empty(reduced.sizes(), place.options().dtype(reduced.scalar_type()).pinned_memory(land_pinned));
  landed.copy_(reduced);
  place.add_(landed.to(place.scalar_type()));
}

}  // namespace

GradientReducer::GradientReducer(const EnginePlan& plan, const ShardGroups& groups, const UnitTable& units,
                                 ShardStorage& storage, GatherScheduler& gather)
    : plan_(plan), groups_(groups), units_(units), storage_(storage), gather_(gather),
      pending_(static_cast<std::size_t>(units.size())) {
  for (int i = 0; i < units.size(); ++i) {
    pending_[static_cast<std::size_t>(i)].grads.resize(units[i].params.size());
    pending_[static_cast<std::size_t>(i)].issued.resize(units[i].params.size(), false);
  }
}

bool GradientReducer::adds_grads_directly() const { return plan_.adds_grads_directly(groups_.single_rank()); }

void GradientReducer::attach(int i) {
  const UnitEntry& u = units_[i];
  if (!u.trainable) return;
  for (int k = 0; k < static_cast<int>(u.params.size()); ++k) {
    ST_CHECK(u.params[k].requires_grad() && u.params[k].is_leaf(), plan_.name, ": trainable parameter '",
             u.names[k], "' must be a leaf that requires grad");
    hooks_.push_back(std::make_unique<GradReadyHook>(u.params[k], [this, i, k]() { on_grad_accumulated(i, k); }));
  }
}

void GradientReducer::on_grad_accumulated(int i, int param_index) {
  Pending& p = pending_[static_cast<std::size_t>(i)];
  at::Tensor& slot = units_[i].params[param_index].mutable_grad();
  if (!slot.defined()) return;
  at::Tensor grad = std::move(slot);
  slot = at::Tensor();
  at::Tensor& waiting = p.grads[param_index];
  if (p.issued[param_index]) {
    // A second accumulation (a reentrant recompute) after this gradient's
    // reduction went out: reduced too, and added to the same place.
    waiting = std::move(grad);
    enqueue_gradient(i, param_index);
    flush_if_due();
    return;
  }
  if (waiting.defined()) {
    // A second accumulation in the same backward (a reentrant recompute): sum them.
    waiting = waiting + grad;
    return;
  }
  waiting = std::move(grad);
  if (++p.seen == static_cast<int>(p.grads.size())) {
    unit_grads_ready(i);
  } else if (units_[i].unit == nullptr && reduces_during_backward()) {
    // The root entry's parameters are used at both ends of the forward (the
    // embeddings first, the final norm and an untied head last), so their
    // gradients come at both ends of backward. Waiting for the last one would
    // hold the head's reduction to the end of backward, exposed; each goes
    // out as it arrives instead, as DDP's buckets do.
    enqueue_gradient(i, param_index);
    flush_if_due();
  }
}

bool GradientReducer::reduces_during_backward() const {
  return !adds_grads_directly() && !(plan_.reduce_at_boundary_only && (accumulated_in_window_ || !boundary_backward_));
}

void GradientReducer::flush_if_due() {
  if (filling_.numel >= plan_.reduce_bucket_size) flush_bucket();
  if (!plan_.overlap_comm) finish_reductions();
}

void GradientReducer::enqueue_gradient(int i, int k) {
  const UnitEntry& u = units_[i];
  Pending& p = pending_[static_cast<std::size_t>(i)];
  if (!plan_.shard_params) {
    // Unsharded: all-reduced whole, from autograd's tensor.
    const int64_t n = u.layout->param_numel(k);
    if (n > 0) enqueue(i, reduce_input(i, k), u.layout->param_offset_in_full(k), n);
  } else if (u.layout->param_numel(k) > 0) {
    // Reduce-scattered where autograd left it, cut where the ranks' shards
    // cut it: ZeRO's in even chunks unless its size does not divide by the
    // world, FSDP's wherever the flat shards' boundaries fall.
    const int me = groups_.layout_rank();
    std::vector<int64_t> splits = u.layout->param_splits(k);
    const bool even = std::all_of(splits.begin(), splits.end(), [&](int64_t c) { return c == splits[0]; });
    const int64_t length = splits[me];
    enqueue(i, reduce_input(i, k), u.layout->param_shard_offset(k, me), length,
            even ? std::vector<int64_t>{} : std::move(splits));
  }
  p.grads[k] = at::Tensor();
  p.issued[k] = true;
  storage_.note_grads_written();
}

at::Tensor GradientReducer::reduce_input(int i, int k) const {
  const at::Tensor& g = pending_[static_cast<std::size_t>(i)].grads[k];
  if (!g.defined()) {
    return at::zeros({units_[i].layout->param_numel(k)}, gather_.full(i).options().dtype(plan_.reduce_dtype));
  }
  return g.to(plan_.reduce_dtype).reshape({-1});
}

void GradientReducer::enqueue(int i, at::Tensor input, int64_t grad_offset, int64_t length,
                              std::vector<int64_t> splits) {
  if (plan_.predivide != 1.0) input.div_(plan_.predivide);
  filling_.numel += input.numel();
  filling_.entries.push_back({i, std::move(input), grad_offset, length, std::move(splits)});
}

void GradientReducer::enqueue_full_layout(int i, const at::Tensor& full_input) {
  const UnitLayout& layout = *units_[i].layout;
  if (!plan_.shard_params) {
    enqueue(i, full_input, 0, layout.shard_numel());
    return;
  }
  const int W = groups_.shard().world_size();
  for (const auto& piece : layout.pieces()) {
    enqueue(i, full_input.narrow(0, piece.full_offset, W * piece.chunk), piece.shard_offset, piece.chunk);
  }
}

void GradientReducer::unit_grads_ready(int i) {
  const UnitEntry& u = units_[i];
  Pending& p = pending_[static_cast<std::size_t>(i)];
  const at::Tensor& shard_grad = storage_.unit(i).grad;
  storage_.note_grads_written();
  if (adds_grads_directly()) {
    // The reduction over one rank is the identity: each gradient is added
    // straight into its place in the shard's gradient, rounded to the
    // reduce dtype as the collective would have carried it. The same sums
    // as the bucketed path (0 + g, then each later micro-batch), so ZeRO-1's
    // boundary accumulation gives the same bits too.
    for (int k = 0; k < static_cast<int>(p.grads.size()); ++k) {
      const at::Tensor& g = p.grads[k];
      if (!g.defined()) continue;
      at::Tensor place = shard_grad.narrow(0, u.layout->param_offset_in_full(k), g.numel()).view(g.sizes());
      // Through the reduce dtype into the gradient's, as the collective path does.
      add_reduced(place, g.to(plan_.reduce_dtype), storage_.host_pinned());
    }
  } else if (plan_.reduce_at_boundary_only && (accumulated_in_window_ || !boundary_backward_)) {
    // Accumulated unreduced, each gradient into its slice of the full layout;
    // in the window's last backward the sum goes out at once. The
    // accumulator is made on the first backward without sync: a run whose
    // every window is one micro-batch never holds it.
    if (!p.boundary_accumulator.defined()) {
      p.boundary_accumulator = at::zeros({u.layout->full_numel()}, storage_.fp32_options());
    }
    for (int k = 0; k < static_cast<int>(p.grads.size()); ++k) {
      const at::Tensor& g = p.grads[k];
      if (!g.defined()) continue;
      p.boundary_accumulator.narrow(0, u.layout->param_offset_in_full(k), g.numel()).add_(g.reshape({-1}));
    }
    if (boundary_backward_) reduce_accumulator(i);
  } else {
    // Each gradient not yet sent (the root entry's go as they arrive) is
    // reduced from autograd's tensor, zeros where it got none.
    if (plan_.reduce_at_boundary_only) p.boundary_reduced = true;  // zero 1, a one-micro-batch window
    for (int k = 0; k < static_cast<int>(p.grads.size()); ++k) {
      if (!p.issued[k]) enqueue_gradient(i, k);
    }
  }
  for (auto& g : p.grads) g = at::Tensor();
  std::fill(p.issued.begin(), p.issued.end(), false);
  p.seen = 0;
  if (!adds_grads_directly() && (!plan_.reduce_at_boundary_only || boundary_backward_)) flush_if_due();
  // Every autograd node that read the unit's trainable weights has run (each
  // produced its weight's gradient). Frozen weights give no such signal: a
  // unit holding some also waits for its input's gradient
  // (unit_input_grad_ready), or else for the end of backward.
  if (u.unit != nullptr) {
    if (units_.holds_frozen(*u.unit)) {
      frozen_unit_backward_[u.unit].grads_in = true;
      release_frozen_unit_if_done(*u.unit);
    } else {
      gather_.release_unit(*u.unit, /*after_forward=*/false);
    }
    if (plan_.backward_prefetch == BackwardPrefetchMode::kPost) gather_.prefetch_for_backward(u.unit);
  }
}

void GradientReducer::expect_input_grad(const Unit& unit) { ++frozen_unit_backward_[&unit].inputs_hooked; }

void GradientReducer::unit_input_grad_ready(const Unit& unit) {
  ++frozen_unit_backward_[&unit].input_grads_in;
  release_frozen_unit_if_done(unit);
}

void GradientReducer::release_frozen_unit_if_done(const Unit& unit) {
  const UnitBackward& state = frozen_unit_backward_[&unit];
  // Without a hooked input (one that needs no gradient, or a leaf) nothing
  // says when the frozen weights are last read: the end of backward frees the
  // unit. AccumulateGrad can run after the input's gradient is out: the
  // trainable gradients must be in as well before the views they came from go.
  const bool inputs_done = state.inputs_hooked > 0 && state.input_grads_in == state.inputs_hooked;
  if (inputs_done && (state.grads_in || !units_.trains(unit))) gather_.release_unit(unit, /*after_forward=*/false);
}

void GradientReducer::flush_bucket() {
  if (filling_.entries.empty()) return;
  // The oldest finishes before this one goes out: never more than
  // kMaxBucketsInFlight issued at once.
  if (in_flight_.size() == kMaxBucketsInFlight) finish_oldest_bucket();
  // In in_flight_ before anything is issued: a failure part way leaves what
  // went out to settle_in_flight.
  in_flight_.push_back(std::move(filling_));
  filling_ = Bucket();
  Bucket& bucket = in_flight_.back();
  if (plan_.shard_params) {
    int64_t total = 0;
    for (const auto& e : bucket.entries) total += e.length;
    bucket.output = at::empty({total}, bucket.entries[0].input.options());
  }
  live_bytes_ += bucket.bytes();
  peak_bytes_ = std::max(peak_bytes_, live_bytes_);
  comm::Communicator& comm = groups_.shard();
  const std::size_t more = bucket.entries.size() - 1;
  comm::CollectiveScope scope("reduce gradients of " + units_[bucket.entries[0].unit].label() +
                              (more > 0 ? " and " + std::to_string(more) + " more tensors" : ""));
  const ReduceOp op = plan_.average ? ReduceOp::kAvg : ReduceOp::kSum;
  if (!plan_.shard_params) {
    std::vector<at::Tensor> inputs;
    for (const auto& e : bucket.entries) inputs.push_back(e.input);
    bucket.works.push_back(comm.all_reduce_coalesced_async(inputs, op));
    return;
  }
  // Consecutive even pieces go out as one coalesced call; uneven ones on their own.
  std::vector<at::Tensor> inputs, outputs;
  auto issue_even = [&] {
    if (!inputs.empty()) bucket.works.push_back(comm.reduce_scatter_coalesced_async(outputs, inputs, op));
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
    bucket.works.push_back(comm.reduce_scatter_v_async(out, e.input, e.splits, op));
  }
  issue_even();
}

int64_t GradientReducer::Bucket::bytes() const {
  int64_t total = bytes_of(output);
  for (const auto& e : entries) total += bytes_of(e.input);
  return total;
}

void GradientReducer::finish_reductions() {
  flush_bucket();
  while (!in_flight_.empty()) finish_oldest_bucket();
}

void GradientReducer::finish_oldest_bucket() {
  comm::Communicator* replicate = groups_.replicate();
  // Stays in in_flight_ until done: a failed wait leaves it to settle_in_flight.
  Bucket& bucket = in_flight_.front();
  for (auto& work : bucket.works) work->wait();
  // The reduced values: the bucket's output, or (unsharded) the inputs in place.
  std::vector<at::Tensor> reduced;
  int64_t offset = 0;
  for (const auto& e : bucket.entries) {
    reduced.push_back(plan_.shard_params ? bucket.output.narrow(0, offset, e.length) : e.input);
    offset += e.length;
  }
  if (replicate != nullptr) {
    const ReduceOp op = plan_.average ? ReduceOp::kAvg : ReduceOp::kSum;
    if (plan_.shard_params) {
      replicate->all_reduce(bucket.output, op);
    } else {
      replicate->all_reduce_coalesced_async(reduced, op)->wait();
    }
  }
  for (std::size_t k = 0; k < bucket.entries.size(); ++k) {
    const auto& e = bucket.entries[k];
    if (plan_.postdivide != 1.0) reduced[k].div_(plan_.postdivide);
    const at::Tensor& shard_grad = storage_.unit(e.unit).grad;
    add_reduced(shard_grad.narrow(0, e.grad_offset, e.length), reduced[k].reshape({-1}), storage_.host_pinned());
  }
  live_bytes_ -= bucket.bytes();
  in_flight_.pop_front();
}

void GradientReducer::reduce_accumulator(int i) {
  Pending& p = pending_[static_cast<std::size_t>(i)];
  const bool accumulated = p.boundary_accumulator.defined();
  // A copy: the accumulator is zeroed below, before the bucket is sent. A
  // unit no backward of this run accumulated into still takes part, with
  // zeros: every rank must issue the same collectives.
  at::Tensor input =
      accumulated ? p.boundary_accumulator.to(plan_.reduce_dtype, /*non_blocking=*/false, /*copy=*/true)
                  : at::zeros({units_[i].layout->full_numel()}, storage_.fp32_options().dtype(plan_.reduce_dtype));
  enqueue_full_layout(i, input);
  if (accumulated) p.boundary_accumulator.zero_();
  p.boundary_reduced = true;
}

void GradientReducer::reduce_boundary_accumulators() {
  if (adds_grads_directly()) return;  // unit_grads_ready added them
  for (int i = 0; i < units_.size(); ++i) {
    if (!units_[i].trainable) continue;
    Pending& p = pending_[static_cast<std::size_t>(i)];
    if (!p.boundary_reduced) {
      reduce_accumulator(i);
      if (filling_.numel >= plan_.reduce_bucket_size) flush_bucket();
    }
    p.boundary_reduced = false;
  }
  finish_reductions();
}

void GradientReducer::backward(const at::Tensor& scaled_loss, bool sync) {
  boundary_backward_ = plan_.reduce_at_boundary_only && sync;
  scaled_loss.backward();
  // A forward whose graph got no backward leaves its inputs pending: that
  // only kept its units gathered to the end of this backward.
  frozen_unit_backward_.clear();
  // Units some of whose parameters got no gradient (unused in this forward)
  // still take part in the reductions with zeros: every rank must issue the
  // same collectives.
  for (int i = 0; i < units_.size(); ++i) {
    if (units_[i].trainable && pending_[static_cast<std::size_t>(i)].seen > 0) unit_grads_ready(i);
  }
  finish_reductions();
  for (const auto& u : units_.entries()) {
    for (const auto& param : u.params) {
      if (param.grad().defined()) param.mutable_grad() = at::Tensor();
    }
  }
  if (boundary_backward_) reduce_boundary_accumulators();
  boundary_backward_ = false;
  if (plan_.reduce_at_boundary_only) accumulated_in_window_ = !sync;
}

void GradientReducer::clear_window() {
  // zero 1's accumulators hold anything only inside a window (a backward
  // without sync added to them); the boundary's reductions leave them zeroed.
  if (!accumulated_in_window_) return;
  for (auto& p : pending_) {
    if (p.boundary_accumulator.defined()) p.boundary_accumulator.zero_();
  }
  accumulated_in_window_ = false;
}

int64_t GradientReducer::accumulator_bytes() const {
  int64_t bytes = 0;
  for (const auto& p : pending_) bytes += bytes_of(p.boundary_accumulator);
  return bytes;
}

void GradientReducer::settle_in_flight(const std::string& engine_name) noexcept {
  for (auto& bucket : in_flight_) {
    for (auto& work : bucket.works) {
      if (!work) continue;
      try {
        work->wait();
      } catch (const std::exception& e) {
        ST_LOG_WARN("{}: a gradient reduction still in flight at shutdown failed: {}", engine_name, e.what());
      }
    }
  }
}

}  // namespace shardtrain::engine
