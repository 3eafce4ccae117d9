// What the engine shows of its state: the full state dict, the checkpoint
// slices (save and load), the loss scaler and step counters, the owned
// ranges and partitions tests inspect, and memory accounting.

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

std::vector<std::pair<std::string, at::Tensor>> ShardedEngine::full_state_dict() {
  State& s = *state_;
  std::vector<std::pair<std::string, at::Tensor>> result;
  for (auto& u : s.units) {
    const at::Tensor source = (u.master.defined() ? u.master : u.lp_shard.to(at::kFloat)).contiguous();
    at::Tensor full = source;  // without sharding the shard is the full buffer
    if (s.plan.shard_params) {
      full = at::empty({u.layout->full_numel()}, source.options());
      s.gather_pieces(*u.layout, source, full)->wait();
    }
    for (std::size_t k = 0; k < u.params.size(); ++k) {
      result.emplace_back(u.names[k], full.narrow(0, u.layout->param_offset_in_full(static_cast<int>(k)),
                                                  u.params[k].numel()).view(u.shapes[k]).clone());
    }
  }
  for (const auto& b : s.buffers) {
    if (!b.cast) {
      result.emplace_back(b.name, b.buffer.detach().clone());
    } else if (at::equal(b.buffer, s.cast_buffer(b.original))) {
      // Unchanged since the cast (constants such as rotary tables): the original full-precision values.
      result.emplace_back(b.name, b.original.clone());
    } else {
      // Changed in forward (running statistics): the current values widened, as FSDP1's state_dict does.
      result.emplace_back(b.name, b.buffer.detach().to(b.original.scalar_type()));
    }
  }
  return result;
}

MemoryStats ShardedEngine::memory() const {
  const State& s = *state_;
  MemoryStats m;
  const bool master_is_lp = s.lp_flat.is_same(s.master_flat);
  m.params = bytes_of(s.lp_flat);
  m.master = master_is_lp ? 0 : bytes_of(s.master_flat);
  m.grads = bytes_of(s.grad_flat) + bytes_of(s.host_grad_flat);
  m.optimizer = bytes_of(s.exp_avg_flat) + bytes_of(s.exp_avg_sq_flat) + bytes_of(s.momentum_flat);
  for (const auto& u : s.units) {
    m.grads += bytes_of(u.boundary_grad_accumulator);
    if (!u.trainable) m.params += bytes_of(u.lp_shard);
  }
  m.gathered = s.gathered_bytes;
  m.gathered_peak = s.gathered_peak;
  m.load_peak = s.load_peak;
  return m;
}

void ShardedEngine::reset_gathered_peak() { state_->gathered_peak = state_->gathered_bytes; }

const at::Tensor& ShardedEngine::parameter_partition() const {
  return state_->pure() ? state_->lp_flat : state_->master_flat;
}

const at::Tensor& ShardedEngine::master_partition() const { return state_->master_flat; }

const at::Tensor& ShardedEngine::low_precision_partition() const { return state_->lp_flat; }

const at::Tensor& ShardedEngine::gradient_partition() const {
  state_->grads_zero = false;  // the caller may write into it
  return state_->grad_flat;
}

const at::Tensor& ShardedEngine::exp_avg_partition() const { return state_->exp_avg_flat; }

const at::Tensor& ShardedEngine::exp_avg_sq_partition() const { return state_->exp_avg_sq_flat; }

std::vector<CheckpointSlice> ShardedEngine::checkpoint_slices() const {
  const State& s = *state_;
  std::vector<CheckpointSlice> slices;
  const bool is_copy = s.replicate_group ? s.replicate_group->rank() != 0
                                                  : (!s.plan.shard_params && s.comm->rank() != 0);
  if (is_copy) return slices;
  for (const auto& u : s.units) {
    for (const auto& seg : u.layout->segments_of_rank(s.layout_rank())) {
      CheckpointSlice slice;
      slice.name = u.names[seg.param_index];
      slice.shape = u.shapes[seg.param_index];
      slice.trainable = u.trainable;
      slice.begin = seg.param_offset;
      slice.length = seg.length;
      auto view = [&](const at::Tensor& t) { return t.narrow(0, seg.shard_offset, seg.length); };
      slice.state.emplace_back("master", view(u.master.defined() ? u.master : u.lp_shard));
      if (u.trainable && u.exp_avg.defined()) {
        slice.state.emplace_back("exp_avg", view(u.exp_avg));
        slice.state.emplace_back("exp_avg_sq", view(u.exp_avg_sq));
      }
      if (u.trainable && s.momentum_flat.defined()) {
        slice.state.emplace_back("momentum", s.momentum_flat.narrow(0, u.shard_offset + seg.shard_offset, seg.length));
      }
      slices.push_back(std::move(slice));
    }
  }
  return slices;
}

void ShardedEngine::load_slices(const SliceSource& source) {
  State& s = *state_;
  for (auto& u : s.units) {
    for (const auto& seg : u.layout->segments_of_rank(s.layout_rank())) {
      const std::string& name = u.names[seg.param_index];
      auto fill = [&](const at::Tensor& target, const std::string& kind) {
        at::Tensor dst = target.narrow(0, seg.shard_offset, seg.length);
        at::Tensor value = source(name, kind, seg.param_offset, seg.length);
        ST_CHECK(value.numel() == seg.length, "checkpoint: '", name, "' ", kind, " [", seg.param_offset, ", +",
                 seg.length, ") came back with ", value.numel(), " elements");
        dst.copy_(value.reshape({-1}));
      };
      fill(u.master.defined() ? u.master : u.lp_shard, "master");
      if (u.trainable && u.exp_avg.defined()) {
        fill(u.exp_avg, "exp_avg");
        fill(u.exp_avg_sq, "exp_avg_sq");
      }
      if (u.trainable && s.momentum_flat.defined()) {
        fill(s.momentum_flat.narrow(0, u.shard_offset, u.layout->shard_numel()), "momentum");
      }
    }
    if (u.master.defined() && !u.lp_shard.is_same(u.master)) u.lp_shard.copy_(u.master);
  }
  // The gathered parameters held the old values: free them, regather what stays gathered.
  for (auto& u : s.units) s.release(u);
  for (auto& u : s.units) {
    if (s.plan.reshard == Reshard::kNever || u.persistent) s.start_gather(u);
  }
  for (auto& u : s.units) {
    if (u.gather_work) s.finish_gather(u);
  }
}

int64_t ShardedEngine::optimizer_steps() const { return state_->optimizer_steps; }

std::optional<at::ScalarType> ShardedEngine::pure_low_precision_dtype() const {
  if (!state_->pure()) return std::nullopt;
  return state_->plan.param_dtype;
}

void ShardedEngine::set_optimizer_steps(int64_t steps) { state_->optimizer_steps = steps; }

std::vector<double> ShardedEngine::loss_scaler_state() const {
  const LossScalerState st = state_->scaler.state();
  return {st.scale, static_cast<double>(st.cur_hysteresis), static_cast<double>(st.cur_iter),
          static_cast<double>(st.last_overflow_iter), static_cast<double>(st.skipped_steps)};
}

void ShardedEngine::load_loss_scaler_state(const std::vector<double>& v) {
  ST_CHECK(v.size() == 5, "loss scaler state needs 5 values, got ", v.size());
  LossScalerState st;
  st.scale = v[0];
  st.cur_hysteresis = static_cast<int>(v[1]);
  st.cur_iter = static_cast<int64_t>(v[2]);
  st.last_overflow_iter = static_cast<int64_t>(v[3]);
  st.skipped_steps = static_cast<int64_t>(v[4]);
  state_->scaler.load_state(st);
}

std::vector<std::string> ShardedEngine::unit_paths() const {
  std::vector<std::string> paths;
  for (const auto& u : state_->units) paths.push_back(u.path);
  return paths;
}

std::vector<ShardedEngine::OwnedRange> ShardedEngine::owned_ranges() const {
  std::vector<OwnedRange> ranges;
  for (const auto& u : state_->units) {
    if (!u.trainable) continue;
    for (const auto& seg : u.layout->segments_of_rank(state_->layout_rank())) {
      ranges.push_back({u.names[seg.param_index], seg.param_offset, seg.length, u.shard_offset + seg.shard_offset});
    }
  }
  return ranges;
}

}  // namespace shardtrain::engine
