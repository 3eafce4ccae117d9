// Filling the shards at set-up: from each rank's own values, from rank 0
// (sync_module_states, rank-0-only loading), or from a weight source reading
// only this rank's slices; one collective first settles which, identically
// everywhere. Also the module buffers (broadcast, buffer_dtype).

#include "engine/shard_loader.h"

#include <algorithm>
#include <unordered_set>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "engine/storage_resize.h"
#include "shardtrain/error.h"
#include "shardtrain/logging.h"
#include "shardtrain/weight_loading.h"

namespace shardtrain::engine {
namespace {

using comm::ReduceOp;

/// All-reduces a small host tensor of control values (flags, hashes)
/// through `group`, which needs its tensors on its own device; the result
/// comes back into `values`.
void all_reduce_control(comm::Communicator& group, at::Tensor& values, ReduceOp op) {
  if (group.world_size() == 1) return;
  if (values.device() == group.device()) {
    group.all_reduce(values, op);
    return;
  }
  at::Tensor moved = values.to(group.device());
  group.all_reduce(moved, op);
  values.copy_(moved);  // from a GPU: waits for the collective's stream
}

}  // namespace

ShardLoader::ShardLoader(torch::nn::Module& model, const EnginePlan& plan, const ShardGroups& groups,
                         const UnitTable& units, ShardStorage& storage, GatherScheduler& gather)
    : model_(model), plan_(plan), groups_(groups), units_(units), storage_(storage), gather_(gather),
      loads_released_(static_cast<std::size_t>(units.size()), false),
      original_storage_bytes_(static_cast<std::size_t>(units.size()), 0) {}

at::Tensor ShardLoader::reuse(at::Tensor& buffer, int64_t numel, const at::TensorOptions& options) {
  // Entries differ in load dtype (fp32 where there is a master, else the shard's).
  if (!buffer.defined() || buffer.numel() < numel || buffer.scalar_type() != options.dtype().toScalarType()) {
    buffer = at::empty({numel}, options);
  }
  return buffer.narrow(0, 0, numel);
}

void ShardLoader::note_peak() { peak_ = std::max(peak_, held_ + gather_.live_bytes() + transient_); }

std::vector<std::vector<ShardLoader::Source>> ShardLoader::agree_on_sources() {
  // ---- which parameters some rank built without storage ------------------------
  // One collective settles, identically on every rank, how each parameter's
  // shard is filled: parameters some rank released (release_parameter_storage:
  // cpu_ram_efficient_loading / zero3_init_flag, or a weight source) take the
  // loading path below; the others keep the plain one. The same all-reduce
  // checks that the ranks built the same model and agree on the weight source,
  // so a mismatch fails here with a message instead of hanging in a collective.
  comm::Communicator& sync = groups_.sync();
  std::vector<std::vector<Source>> modes(static_cast<std::size_t>(units_.size()));
  {
    int64_t count = 0;
    for (const auto& u : units_.entries()) count += static_cast<int64_t>(u.params.size());
    at::Tensor flags = at::zeros({2 * count + 4}, at::TensorOptions().dtype(at::kDouble));
    double* f = flags.data_ptr<double>();
    uint64_t hash = 1469598103934665603ull;  // FNV-1a over names, shapes, dtypes, requires_grad
    auto mix = [&](const void* data, std::size_t n) {
      const auto* bytes = static_cast<const unsigned char*>(data);
      for (std::size_t b = 0; b < n; ++b) hash = (hash ^ bytes[b]) * 1099511628211ull;
    };
    int64_t idx = 0;
    std::unordered_set<const c10::StorageImpl*> seen;
    for (int i = 0; i < units_.size(); ++i) {
      const UnitEntry& u = units_[i];
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
          original_storage_bytes_[static_cast<std::size_t>(i)] += bytes;
          held_ += bytes;
        }
      }
    }
    const bool has_source = static_cast<bool>(plan_.weight_source);
    const double h = static_cast<double>(hash >> 12);  // 52 bits: exact in a double
    f[2 * count] = has_source ? 1.0 : 0.0;
    f[2 * count + 1] = has_source ? 0.0 : 1.0;
    f[2 * count + 2] = h;
    f[2 * count + 3] = -h;
    note_peak();
    all_reduce_control(sync, flags, ReduceOp::kMax);
    ST_CHECK(f[2 * count + 2] == -f[2 * count + 3], plan_.name,
             ": the ranks built different models (parameter names, shapes, dtypes or requires_grad differ between "
             "ranks); every rank must construct the same architecture, with or without its weights");
    ST_CHECK_T(ConfigError, !(f[2 * count] > 0 && f[2 * count + 1] > 0), plan_.name,
               ": a weight source (RunInfo::weight_source) was given on some ranks but not on others; give it on "
               "every rank or on none");
    idx = 0;
    int64_t released_params = 0, released_elements = 0;
    for (int i = 0; i < units_.size(); ++i) {
      const UnitEntry& u = units_[i];
      for (std::size_t k = 0; k < u.params.size(); ++k, ++idx) {
        Source mode = plan_.sync_module_states ? Source::kFromRoot : Source::kLocal;
        if (f[idx] > 0) {
          ++released_params;
          released_elements += u.params[k].numel();
          if (has_source) {
            // Every rank decides this alike (the flags were all-reduced), so
            // every rank throws, and none waits in a collective.
            ST_CHECK_T(ConfigError, !u.packed, plan_.name, ": the quantized weight '", u.names[k],
                       "' has no values on some rank, and a weight source reads the original values, not NF4 "
                       "bytes. Under QLoRA, give the weights to quantize_frozen_base instead, where accelerator."
                       "materialize_full_weights() is true (quantize_frozen_base(model, models::hf_weight_source("
                       "checkpoint))); the other ranks quantize the model built without weights and receive "
                       "their shards from rank 0. Pass prepare() no weight source");
            mode = Source::kWeights;
          } else {
            ST_CHECK(f[count + idx] == 0 || !u.packed, plan_.name, ": the quantized weight '", u.names[k],
                     "' has no values on rank 0. Build the model with its weights where accelerator."
                     "materialize_full_weights() is true, or build it without and give quantize_frozen_base the "
                     "weights to read (quantize_frozen_base(model, models::hf_weight_source(checkpoint)))");
            ST_CHECK(f[count + idx] == 0, plan_.name, ": parameter '", u.names[k],
                     "' has no storage on rank 0 and no weight source was given. Rank 0 must build the model with "
                     "its weights (accelerator.materialize_full_weights() is true there), or pass "
                     "RunInfo::weight_source to read every rank's slices");
            mode = Source::kFromRoot;
          }
          loads_released_[static_cast<std::size_t>(i)] = true;
        }
        modes[static_cast<std::size_t>(i)].push_back(mode);
      }
    }
    if (sync.rank() == 0 && released_params == 0 && plan_.rank0_loads_weights && sync.world_size() > 1) {
      ST_LOG_WARN("{}: rank-0-only loading (fsdp_cpu_ram_efficient_loading / zero3_init_flag) is on, but every "
                  "rank built the model with its weights, so every rank held the full model. Build it without "
                  "them where accelerator.materialize_full_weights() is false (shardtrain::release_parameter_"
                  "storage, models::make_llama_without_weights)", plan_.name);
    }
    if (sync.rank() == 0 && released_params > 0) {
      ST_LOG_INFO("{}: {} parameters ({} elements) were built without storage on some rank; their shards are "
                  "filled {}, one unit at a time", plan_.name, released_params, released_elements,
                  has_source ? "from the weight source (each rank reads its own slices)" : "from rank 0");
    }
  }
  return modes;
}

void ShardLoader::load() {
  const std::vector<std::vector<Source>> sources = agree_on_sources();
  comm::Communicator& sync = groups_.sync();
  const at::TensorOptions fp32 = storage_.fp32_options();
  const at::TensorOptions low = fp32.dtype(plan_.param_dtype);
  for (int i = 0; i < units_.size(); ++i) {
    const UnitEntry& u = units_[i];
    const UnitShard& unit_shard = storage_.unit(i);
    const bool released = loads_released_[static_cast<std::size_t>(i)];
    const int64_t S = u.layout->shard_numel();
    // An entry with an fp32 master (or frozen fp32 copy) starts it from the
    // values; one without keeps the load dtype's values exactly (pure mode);
    // NF4 bytes stay bytes.
    const at::TensorOptions init_options = u.packed                      ? fp32.dtype(at::kByte)
                                           : unit_shard.master.defined() ? fp32
                                                                         : low;
    at::Tensor shard_init = released ? reuse(shard_buffer_, S, init_options) : at::empty({S}, init_options);
    std::vector<at::Tensor> values;
    if (!released) {
      int64_t value_bytes = 0;
      for (const auto& p : u.params) {
        at::Tensor v = p.detach().to(init_options.dtype().toScalarType()).contiguous();
        if (plan_.sync_module_states) sync.broadcast(v, 0);
        if (!v.is_alias_of(p)) value_bytes += bytes_of(v);
        values.push_back(v);
      }
      transient_ = value_bytes;
      u.layout->pack_shard(values, groups_.layout_rank(), shard_init);
    } else {
      fill_released(i, sources[static_cast<std::size_t>(i)], shard_init);
    }
    if (unit_shard.master.defined()) unit_shard.master.copy_(shard_init);
    if (!unit_shard.lp.is_same(unit_shard.master)) unit_shard.lp.copy_(shard_init);
    shard_init = at::Tensor();
    // The module's parameters become views into one compute-dtype buffer:
    // when the shard is the whole unit (one rank, or no sharding) and holds
    // that dtype, the shard itself, so the optimizer's writes are the next
    // forward's values and nothing is ever gathered or copied. Not a shard in
    // host memory (the parameter offload): the model computes on its device.
    const bool views_shard = groups_.layout_world() == 1 && !released && !storage_.params_offloaded() &&
                             unit_shard.lp.scalar_type() == gather_.full_dtype(i) &&
                             unit_shard.lp.numel() == u.layout->full_numel();
    if (views_shard) {
      gather_.bind(i, unit_shard.lp, true);
    } else {
      const at::TensorOptions compute = fp32.dtype(gather_.full_dtype(i));
      gather_.bind(i,
                   released ? ShardStorage::unallocated_buffer(u.layout->full_numel(), compute)
                            : at::empty({u.layout->full_numel()}, compute),
                   false);
    }
    const at::Tensor& full = gather_.full(i);
    if (!released && !views_shard) {
      transient_ += gather_.full_bytes(i);
      note_peak();
    }
    for (int k = 0; k < static_cast<int>(u.params.size()); ++k) {
      at::Tensor view = full.narrow(0, u.layout->param_offset_in_full(k), u.params[k].numel()).view(u.shapes[k]);
      // Compute on the values the shard holds (fp16-on-CPU computes in fp32 on fp16-rounded values).
      if (!released) view.copy_(values[k].to(unit_shard.lp.scalar_type()));
      // set_data replaces the parameter's TensorImpl contents; the handle is shared with the module.
      at::Tensor param = u.params[k];
      param.set_data(view);
    }
    // An entry with released parameters: its buffer owns no memory; make its
    // byte size say so too (this rank holds only its shard until it is gathered).
    if (released) engine::resize_storage_bytes(full, 0);
    values.clear();
    transient_ = 0;
    held_ -= original_storage_bytes_[static_cast<std::size_t>(i)];  // the module's own storage is replaced
    if (!released) {
      gather_.mark_gathered(i);
      note_peak();
    }
    if (!released) {
      if (!gather_.stays_gathered(i)) gather_.release(i);
    } else if (gather_.stays_gathered(i)) {
      // Its values exist only as shards: gather them like any later regather.
      gather_.start(i);
      gather_.finish(i);
      note_peak();
    }
  }
  // Set-up held every unit at once; the working-set peak counts from here.
  gather_.reset_peak();
  shard_buffer_ = at::Tensor();
  chunk_buffer_ = at::Tensor();
  setup_buffers();
}

void ShardLoader::fill_released(int i, const std::vector<Source>& modes, const at::Tensor& shard) {
  const UnitEntry& u = units_[i];
  comm::Communicator& sync = groups_.sync();
  const int layout_rank = groups_.layout_rank();
  const int64_t S = u.layout->shard_numel();
  const auto segments = u.layout->segments_of_rank(layout_rank);
  shard.zero_();  // the padding
  bool from_root = false, from_source = false;
  for (Source m : modes) {
    from_root = from_root || m == Source::kFromRoot;
    from_source = from_source || m == Source::kWeights;
  }
  if (from_root) {
    std::vector<at::Tensor> root_values(u.params.size());
    if (sync.rank() == 0) {
      for (std::size_t k = 0; k < u.params.size(); ++k) {
        if (modes[k] == Source::kFromRoot) root_values[k] = u.params[k].detach();
      }
    }
    at::Tensor chunk = reuse(chunk_buffer_, S, shard.options());
    transient_ = bytes_of(chunk);
    note_peak();
    for (int r = 0; r < groups_.layout_world(); ++r) {
      if (sync.rank() == 0) u.layout->pack_shard(root_values, r, chunk);
      if (sync.world_size() > 1) sync.broadcast(chunk, 0);
      if (r != layout_rank) continue;
      for (const auto& seg : segments) {
        if (modes[seg.param_index] != Source::kFromRoot) continue;
        shard.narrow(0, seg.shard_offset, seg.length).copy_(chunk.narrow(0, seg.shard_offset, seg.length));
      }
    }
    transient_ = 0;
  }
  for (const auto& seg : segments) {
    if (modes[seg.param_index] != Source::kLocal) continue;
    shard.narrow(0, seg.shard_offset, seg.length)
        .copy_(u.params[seg.param_index].detach().reshape({-1}).narrow(0, seg.param_offset, seg.length));
  }
  if (!from_source) return;
  std::string failure;
  try {
    for (const auto& seg : segments) {
      if (modes[seg.param_index] != Source::kWeights) continue;
      read_weights(plan_.weight_source, u.names[seg.param_index], seg.param_offset, seg.length,
                   shard.narrow(0, seg.shard_offset, seg.length));
    }
  } catch (const std::exception& e) {
    failure = e.what();
  }
  // Every rank learns whether any failed, so none waits in the next collective.
  at::Tensor failed = at::full({1}, failure.empty() ? 0.0 : 1.0, at::TensorOptions().dtype(at::kDouble));
  all_reduce_control(sync, failed, ReduceOp::kMax);
  if (!failure.empty()) {
    ST_THROW(Error, plan_.name, ": loading unit '", u.path.empty() ? "<root>" : u.path,
             "' from the weight source failed: ", failure);
  }
  ST_CHECK(failed.item<double>() == 0, plan_.name, ": another rank failed to read its slices of unit '",
           u.path.empty() ? "<root>" : u.path, "' from the weight source (its log names the cause)");
}

at::Tensor ShardLoader::cast_buffer(const at::Tensor& value) const {
  at::Tensor cast = value.detach().to(*plan_.buffer_dtype);
  if (cast.scalar_type() == at::kHalf && cast.is_cpu()) cast = cast.to(at::kFloat);
  return cast;
}

void ShardLoader::setup_buffers() {
  comm::Communicator& sync = groups_.sync();
  at::NoGradGuard no_grad;
  for (const auto& item : model_.named_buffers(/*recurse=*/true)) {
    at::Tensor b = item.value();
    if (!b.defined()) continue;
    if (plan_.sync_module_states && sync.world_size() > 1 && b.numel() > 0) {
      at::Tensor wire = b.detach().contiguous();
      if (!comm::is_supported_dtype(wire.scalar_type()) && !at::isComplexType(wire.scalar_type())) {
        // Exact widenings for the wire (bool, int8..int32, uint8; float64 has its own support).
        wire = wire.to(at::isFloatingType(wire.scalar_type()) ? at::kDouble : at::kLong);
      }
      sync.broadcast(wire, 0);
      if (!wire.is_same(b)) b.detach().copy_(wire);
    }
    Buffer state;
    state.name = item.key();
    state.buffer = b;
    if (plan_.buffer_dtype && at::isFloatingType(b.scalar_type())) {
      at::Tensor cast = cast_buffer(b);
      if (cast.scalar_type() != b.scalar_type() || !at::equal(cast, b)) {
        state.original = b.detach();  // keeps the full-precision storage; b gets a new one
        b.set_data(cast);
        state.cast = true;
      }
    }
    buffers_.push_back(std::move(state));
  }
}

void ShardLoader::append_buffers(std::vector<std::pair<std::string, at::Tensor>>& out) const {
  // Copies in host memory, as full_state_dict's parameters.
  auto host_copy = [](const at::Tensor& t) { return t.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true); };
  for (const auto& b : buffers_) {
    if (!b.cast) {
      out.emplace_back(b.name, host_copy(b.buffer));
    } else if (at::equal(b.buffer, cast_buffer(b.original))) {
      // Unchanged since the cast (constants such as rotary tables): the original full-precision values.
      out.emplace_back(b.name, host_copy(b.original));
    } else {
      // Changed in forward (running statistics): the current values widened, as FSDP1's state_dict does.
      out.emplace_back(b.name, host_copy(b.buffer.to(b.original.scalar_type())));
    }
  }
}

}  // namespace shardtrain::engine
