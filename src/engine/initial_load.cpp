// Filling the shards at set-up: from each rank's own values, from rank 0
// (sync_module_states, rank-0-only loading), or from a weight source reading
// only this rank's slices; one collective first settles which, identically
// everywhere. Also the module buffers (broadcast, buffer_dtype).

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
#include "shardtrain/weight_loading.h"

namespace shardtrain::engine {

std::vector<std::vector<LoadMode>> ShardedEngine::State::agree_on_load_modes() {
  // ---- which parameters some rank built without storage ------------------------
  // One collective settles, identically on every rank, how each parameter's
  // shard is filled: parameters some rank released (release_parameter_storage:
  // cpu_ram_efficient_loading / zero3_init_flag, or a weight source) take the
  // loading path below; the others keep the plain one. The same all-reduce
  // checks that the ranks built the same model and agree on the weight source,
  // so a mismatch fails here with a message instead of hanging in a collective.
  comm::Communicator& sync = sync_group();
  std::vector<std::vector<LoadMode>> modes(units.size());
  {
    int64_t count = 0;
    for (const auto& u : units) count += static_cast<int64_t>(u.params.size());
    at::Tensor flags = at::zeros({2 * count + 4}, at::TensorOptions().dtype(at::kDouble));
    double* f = flags.data_ptr<double>();
    uint64_t hash = 1469598103934665603ull;  // FNV-1a over names, shapes, dtypes, requires_grad
    auto mix = [&](const void* data, std::size_t n) {
      const auto* bytes = static_cast<const unsigned char*>(data);
      for (std::size_t b = 0; b < n; ++b) hash = (hash ^ bytes[b]) * 1099511628211ull;
    };
    int64_t idx = 0;
    std::unordered_set<const c10::StorageImpl*> seen;
    for (auto& u : units) {
      for (std::size_t k = 0; k < u.params.size(); ++k, ++idx) {
        const at::Tensor& p = u.params[k];
        const bool released = is_storage_released(p);
        f[idx] = released ? 1.0 : 0.0;
        if (sync.rank() == 0) f[count + idx] = released ? 1.0 : 0.0;
        mix(u.names[k].data(), u.names[k].size());
        mix(u.shapes[k].data(), u.shapes[k].size() * sizeof(int64_t));
        const int dtype = static_cast<int>(p.scalar_type());
        mix(&dtype, sizeof dtype);
        const bool grad = p.requires_grad();
        mix(&grad, sizeof grad);
        if (p.has_storage() && seen.insert(p.storage().unsafeGetStorageImpl()).second) {
          const int64_t bytes = static_cast<int64_t>(p.storage().nbytes());
          u.original_storage_bytes += bytes;
          load_held += bytes;
        }
      }
    }
    const bool has_source = static_cast<bool>(plan.weight_source);
    const double h = static_cast<double>(hash >> 12);  // 52 bits: exact in a double
    f[2 * count] = has_source ? 1.0 : 0.0;
    f[2 * count + 1] = has_source ? 0.0 : 1.0;
    f[2 * count + 2] = h;
    f[2 * count + 3] = -h;
    note_load();
    all_reduce_control(sync, flags, ReduceOp::kMax);
    ST_CHECK(f[2 * count + 2] == -f[2 * count + 3], plan.name,
             ": the ranks built different models (parameter names, shapes, dtypes or requires_grad differ between "
             "ranks); every rank must construct the same architecture, with or without its weights");
    ST_CHECK_T(ConfigError, !(f[2 * count] > 0 && f[2 * count + 1] > 0), plan.name,
               ": a weight source (RunInfo::weight_source) was given on some ranks but not on others; give it on "
               "every rank or on none");
    idx = 0;
    int64_t released_params = 0, released_elements = 0;
    for (std::size_t i = 0; i < units.size(); ++i) {
      UnitState& u = units[i];
      for (std::size_t k = 0; k < u.params.size(); ++k, ++idx) {
        LoadMode mode = plan.sync_module_states ? LoadMode::kFromRoot : LoadMode::kLocal;
        if (f[idx] > 0) {
          ++released_params;
          released_elements += u.params[k].numel();
          if (has_source) {
            mode = LoadMode::kSource;
          } else {
            ST_CHECK(f[count + idx] == 0, plan.name, ": parameter '", u.names[k],
                     "' has no storage on rank 0 and no weight source was given. Rank 0 must build the model with "
                     "its weights (accelerator.materialize_full_weights() is true there), or pass "
                     "RunInfo::weight_source to read every rank's slices");
            mode = LoadMode::kFromRoot;
          }
          u.loads_released = true;
        }
        modes[i].push_back(mode);
      }
    }
    if (sync.rank() == 0 && released_params == 0 && plan.rank0_loads_weights && sync.world_size() > 1) {
      ST_LOG_WARN("{}: rank-0-only loading (fsdp_cpu_ram_efficient_loading / zero3_init_flag) is on, but every "
                  "rank built the model with its weights, so every rank held the full model. Build it without "
                  "them where accelerator.materialize_full_weights() is false (shardtrain::release_parameter_"
                  "storage, models::make_llama_without_weights)", plan.name);
    }
    if (sync.rank() == 0 && released_params > 0) {
      ST_LOG_INFO("{}: {} parameters ({} elements) were built without storage on some rank; their shards are "
                  "filled {}, one unit at a time", plan.name, released_params, released_elements,
                  has_source ? "from the weight source (each rank reads its own slices)" : "from rank 0");
    }
  }
  return modes;
}

void ShardedEngine::State::shard_initial_values(ShardedEngine* engine,
                                                const std::vector<std::vector<LoadMode>>& modes) {
  comm::Communicator& sync = sync_group();
  const at::TensorOptions fp32 = fp32_options();
  const at::TensorOptions low = fp32.dtype(plan.param_dtype);
  // ---- shard the initial values ----------------------------------------------
  // A failure part-way (a weight source that throws) leaves no unit pointing
  // at this half-built engine.
  try {
  for (std::size_t i = 0; i < units.size(); ++i) {
    UnitState& u = units[i];
    const int64_t S = u.layout->shard_numel();
    if (u.trainable) {
      if (!pure()) u.master = master_flat.narrow(0, u.shard_offset, S);
      u.grad = grad_flat.narrow(0, u.shard_offset, S);
      u.lp_shard = lp_flat.narrow(0, u.shard_offset, S);
      if (exp_avg_flat.defined()) {
        u.exp_avg = exp_avg_flat.narrow(0, u.shard_offset, S);
        u.exp_avg_sq = exp_avg_sq_flat.narrow(0, u.shard_offset, S);
      }
    } else {
      // Frozen weights: a shard to gather from and an fp32 copy for state dicts; no optimizer.
      u.lp_shard = at::zeros({S}, low);
      if (!pure()) u.master = at::zeros({S}, fp32);
    }
    const at::TensorOptions init_options = (pure() ? low : fp32).device(device);
    at::Tensor shard_init = u.loads_released ? load_buffer(load_shard_buffer, S, init_options)
                                             : at::empty({S}, init_options);
    std::vector<at::Tensor> values;
    if (!u.loads_released) {
      int64_t value_bytes = 0;
      for (auto& p : u.params) {
        // Pure mode keeps the load dtype's values exactly; otherwise the fp32 master starts from them.
        at::Tensor v = p.detach().to(pure() ? plan.param_dtype : at::kFloat).contiguous();
        if (plan.sync_module_states) sync.broadcast(v, 0);
        if (!v.is_alias_of(p)) value_bytes += bytes_of(v);
        values.push_back(v);
      }
      load_transient = value_bytes;
      u.layout->pack_shard(values, layout_rank(), shard_init);
    } else {
      fill_released_unit(u, modes[i], shard_init, sync);
    }
    if (u.master.defined()) u.master.copy_(shard_init);
    if (!u.lp_shard.is_same(u.master)) u.lp_shard.copy_(shard_init);
    shard_init = at::Tensor();
    // The module's parameters become views into one compute-dtype buffer:
    // when the shard is the whole unit (one rank, or no sharding) and holds
    // that dtype, the shard itself, so the optimizer's writes are the next
    // forward's values and nothing is ever gathered or copied.
    u.views_shard = layout_world() == 1 && !u.loads_released && plan.param_dtype == plan.compute_dtype &&
                    u.lp_shard.numel() == u.layout->full_numel();
    if (u.views_shard) {
      u.full = u.lp_shard;
    } else {
      u.full = u.loads_released ? unallocated_buffer(u.layout->full_numel(), fp32.dtype(plan.compute_dtype))
                                : at::empty({u.layout->full_numel()}, fp32.dtype(plan.compute_dtype));
    }
    if (!u.loads_released && !u.views_shard) {
      load_transient += full_bytes(u);
      note_load();
    }
    for (int k = 0; k < static_cast<int>(u.params.size()); ++k) {
      at::Tensor view = u.full.narrow(0, u.layout->param_offset_in_full(k), u.params[k].numel()).view(u.shapes[k]);
      // Compute on the values the shard holds (fp16-on-CPU computes in fp32 on fp16-rounded values).
      if (!u.loads_released) view.copy_(values[k].to(plan.param_dtype));
      u.params[k].set_data(view);
    }
    // A unit with released parameters: its buffer owns no memory; make its
    // byte size say so too (this rank holds only its shard until it is gathered).
    if (u.loads_released) engine::resize_storage_bytes(u.full, 0);
    values.clear();
    load_transient = 0;
    load_held -= u.original_storage_bytes;  // the module's own storage is replaced (as far as the engine holds it)
    if (!u.loads_released) {
      u.gathered = true;
      if (!u.views_shard) add_gathered(full_bytes(u));
      note_load();
    }
    if (plan.reduce_at_boundary_only && u.trainable && !adds_grads_directly()) {
      u.boundary_grad_accumulator = at::zeros({u.layout->full_numel()}, fp32);
    }
    if (u.trainable) {
      State* state = this;
      const int state_index = static_cast<int>(i);
      for (int k = 0; k < static_cast<int>(u.params.size()); ++k) {
        ST_CHECK(u.params[k].requires_grad() && u.params[k].is_leaf(), plan.name, ": trainable parameter '",
                 u.names[k], "' must be a leaf that requires grad");
        grad_hooks.push_back(std::make_unique<GradReadyHook>(
            u.params[k], [state, state_index, k]() { state->on_grad_accumulated(state_index, k); }));
      }
    }
    if (u.unit) u.unit->attach_unit_hooks(engine, static_cast<int>(i));
    const bool stays_gathered = plan.reshard == Reshard::kNever || u.persistent;
    if (!u.loads_released) {
      if (!stays_gathered) release(u);
    } else if (stays_gathered) {
      // Its values exist only as shards: gather them like any later regather.
      start_gather(u);
      finish_gather(u);
      note_load();
    }
  }
  } catch (...) {
    for (auto& u : units) {
      if (u.unit) u.unit->attach_unit_hooks(nullptr, -1);
    }
    throw;
  }
  // Set-up held every unit at once; the working-set peak counts from here.
  gathered_peak = gathered_bytes;
  load_shard_buffer = at::Tensor();
  load_chunk_buffer = at::Tensor();
  setup_buffers(sync);
}

void ShardedEngine::State::fill_released_unit(UnitState& u, const std::vector<LoadMode>& modes, const at::Tensor& shard,
                        comm::Communicator& sync) {
  const int64_t S = u.layout->shard_numel();
  const auto segments = u.layout->segments_of_rank(layout_rank());
  shard.zero_();  // the padding
  bool from_root = false, from_source = false;
  for (LoadMode m : modes) {
    from_root = from_root || m == LoadMode::kFromRoot;
    from_source = from_source || m == LoadMode::kSource;
  }
  if (from_root) {
    std::vector<at::Tensor> root_values(u.params.size());
    if (sync.rank() == 0) {
      for (std::size_t k = 0; k < u.params.size(); ++k) {
        if (modes[k] == LoadMode::kFromRoot) root_values[k] = u.params[k].detach();
      }
    }
    at::Tensor chunk = load_buffer(load_chunk_buffer, S, shard.options());
    load_transient = bytes_of(chunk);
    note_load();
    for (int r = 0; r < layout_world(); ++r) {
      if (sync.rank() == 0) u.layout->pack_shard(root_values, r, chunk);
      if (sync.world_size() > 1) sync.broadcast(chunk, 0);
      if (r != layout_rank()) continue;
      for (const auto& seg : segments) {
        if (modes[seg.param_index] != LoadMode::kFromRoot) continue;
        shard.narrow(0, seg.shard_offset, seg.length).copy_(chunk.narrow(0, seg.shard_offset, seg.length));
      }
    }
    load_transient = 0;
  }
  for (const auto& seg : segments) {
    if (modes[seg.param_index] != LoadMode::kLocal) continue;
    shard.narrow(0, seg.shard_offset, seg.length)
        .copy_(u.params[seg.param_index].detach().reshape({-1}).narrow(0, seg.param_offset, seg.length));
  }
  if (!from_source) return;
  std::string failure;
  try {
    for (const auto& seg : segments) {
      if (modes[seg.param_index] != LoadMode::kSource) continue;
      at::Tensor out = shard.narrow(0, seg.shard_offset, seg.length);
      // NaN first: a source that returns without writing (or rebinds `out`) is caught below.
      out.fill_(std::numeric_limits<double>::quiet_NaN());
      plan.weight_source(u.names[seg.param_index], seg.param_offset, seg.length, out);
      ST_CHECK(!out.isnan().any().item<bool>(), "the weight source left elements of '", u.names[seg.param_index],
               "' [", seg.param_offset, ", +", seg.length, ") unwritten (or wrote NaN); it must copy into `out`");
    }
  } catch (const std::exception& e) {
    failure = e.what();
  }
  // Every rank learns whether any failed, so none waits in the next collective.
  at::Tensor failed = at::full({1}, failure.empty() ? 0.0 : 1.0, at::TensorOptions().dtype(at::kDouble));
  all_reduce_control(sync, failed, ReduceOp::kMax);
  if (!failure.empty()) {
    ST_THROW(Error, plan.name, ": loading unit '", u.path.empty() ? "<root>" : u.path,
             "' from the weight source failed: ", failure);
  }
  ST_CHECK(failed.item<double>() == 0, plan.name, ": another rank failed to read its slices of unit '",
           u.path.empty() ? "<root>" : u.path, "' from the weight source (its log names the cause)");
}

at::Tensor ShardedEngine::State::cast_buffer(const at::Tensor& value) const {
  at::Tensor cast = value.detach().to(*plan.buffer_dtype);
  if (cast.scalar_type() == at::kHalf && cast.is_cpu()) cast = cast.to(at::kFloat);
  return cast;
}

void ShardedEngine::State::setup_buffers(comm::Communicator& sync) {
  at::NoGradGuard no_grad;
  for (const auto& item : model->named_buffers(/*recurse=*/true)) {
    at::Tensor b = item.value();
    if (!b.defined()) continue;
    if (plan.sync_module_states && sync.world_size() > 1 && b.numel() > 0) {
      at::Tensor wire = b.detach().contiguous();
      if (!comm::is_supported_dtype(wire.scalar_type()) && !at::isComplexType(wire.scalar_type())) {
        // Exact widenings for the wire (bool, int8..int32, uint8; float64 has its own support).
        wire = wire.to(at::isFloatingType(wire.scalar_type()) ? at::kDouble : at::kLong);
      }
      sync.broadcast(wire, 0);
      if (!wire.is_same(b)) b.detach().copy_(wire);
    }
    BufferState state;
    state.name = item.key();
    state.buffer = b;
    if (plan.buffer_dtype && at::isFloatingType(b.scalar_type())) {
      at::Tensor cast = cast_buffer(b);
      if (cast.scalar_type() != b.scalar_type() || !at::equal(cast, b)) {
        state.original = b.detach();  // keeps the full-precision storage; b gets a new one
        b.set_data(cast);
        state.cast = true;
      }
    }
    buffers.push_back(std::move(state));
  }
}

}  // namespace shardtrain::engine
