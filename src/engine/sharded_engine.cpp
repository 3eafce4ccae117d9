#include "engine/sharded_engine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/optim/optimizer.h>

#include "comm/work_util.h"
#include "compat/autograd_hooks.h"
#include "compat/storage.h"
#include "engine/loss_scaler.h"
#include "kernels/kernels.h"
#include "shardtrain/error.h"
#include "shardtrain/logging.h"

namespace shardtrain::engine {

using comm::ReduceOp;

namespace {

int64_t bytes_of(const at::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; }

/// A 1-D tensor of `numel` elements whose storage claims their bytes but owns
/// no memory (a null data pointer). ATen bounds-checks views against the
/// storage's byte size, so the module's parameters can become views into a
/// unit's buffer before anything is allocated; resize_storage_bytes() gives
/// it memory when the unit is gathered. Loading parameters built without
/// storage must not allocate (and touch) a full unit per unit: glibc keeps
/// freed heap memory resident, so that churn alone grew a rank's resident set
/// by most of the model (measured: 52 MB over 8 layers of a 60 MB model).
at::Tensor unallocated_buffer(int64_t numel, const at::TensorOptions& options) {
  const std::size_t bytes = static_cast<std::size_t>(numel) * c10::elementSize(options.dtype().toScalarType());
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, at::DataPtr(nullptr, options.device()),
                       c10::GetAllocator(options.device().type()), /*resizable=*/true);
  return at::empty({0}, options).set_(storage, 0, {numel}, {1});
}

std::string join_path(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

/// Keeps a unit's forward body alive inside the autograd context until backward.
struct RecomputeBody : torch::CustomClassHolder {
  explicit RecomputeBody(std::function<at::Tensor(const at::Tensor&)> f) : fn(std::move(f)) {}
  std::function<at::Tensor(const at::Tensor&)> fn;
};

/// Activation checkpointing as an autograd function: forward runs the body
/// without recording a graph; backward runs it again with grad mode on (the
/// engine's pre-backward hook on the output has gathered the parameters by
/// then) and differentiates that. The parameters are inputs, so their
/// gradients reach their AccumulateGrad nodes and the engine's hooks as usual.
struct RecomputeFunction : torch::autograd::Function<RecomputeFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            at::TensorList params, c10::IValue body) {
    std::vector<at::Tensor> saved{input};
    saved.insert(saved.end(), params.begin(), params.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["body"] = body;
    at::NoGradGuard no_grad;
    return c10::static_intrusive_pointer_cast<RecomputeBody>(body.toCapsule())->fn(input);
  }

  static std::vector<at::Tensor> backward(torch::autograd::AutogradContext* ctx, std::vector<at::Tensor> grads) {
    auto saved = ctx->get_saved_variables();
    auto body = c10::static_intrusive_pointer_cast<RecomputeBody>(ctx->saved_data["body"].toCapsule());
    at::Tensor input = saved[0].detach().requires_grad_(saved[0].requires_grad());
    std::vector<at::Tensor> wrt;
    if (input.requires_grad()) wrt.push_back(input);
    std::vector<at::Tensor> params(saved.begin() + 1, saved.end());
    for (const auto& p : params) wrt.push_back(p);
    at::Tensor output;
    {
      at::AutoGradMode enable(true);
      output = body->fn(input);
    }
    auto computed = torch::autograd::grad({output}, wrt, {grads[0]}, /*retain_graph=*/false,
                                          /*create_graph=*/false, /*allow_unused=*/true);
    std::vector<at::Tensor> result;
    std::size_t k = 0;
    result.push_back(input.requires_grad() ? computed[k++] : at::Tensor());
    for (std::size_t i = 0; i < params.size(); ++i) result.push_back(computed[k++]);
    result.emplace_back();  // the body
    return result;
  }
};

}  // namespace

/// How a parameter's shard gets its initial values (settled identically on every rank).
enum class LoadMode {
  kLocal,     ///< this rank's own values (sync_module_states off)
  kFromRoot,  ///< rank 0's values, sent one rank's chunk at a time
  kSource,    ///< the weight source, each rank reading its own slices
};

/// One unit's parameters of one kind (trainable or frozen: they are flattened
/// separately, so frozen weights never enter the optimizer).
struct UnitState {
  std::string path;               // module path ("" = root)
  Unit* unit = nullptr;           // nullptr for the root
  bool trainable = true;
  std::vector<std::string> names; // fully-qualified parameter names
  std::vector<at::Tensor> params; // the module's parameters (identity kept)
  std::vector<std::vector<int64_t>> shapes;
  std::unique_ptr<UnitLayout> layout;
  int64_t shard_offset = 0;       // offset in the flat partitions (trainable states)
  at::Tensor full;                // compute dtype; the parameters are views into it
  at::Tensor lp_shard;            // param dtype shard (all-gather input)
  at::Tensor master, grad, exp_avg, exp_avg_sq;  // views into the flat partitions / own (frozen master)
  at::Tensor boundary_grad_accumulator;          // zero 1: fp32, in the full layout
  bool gathered = false;
  bool persistent = false;
  /// One rank or no sharding (the shard is the whole unit), and the shard
  /// holds the compute dtype: the parameters view the shard itself, so
  /// gathering and releasing are nothing to do.
  bool views_shard = false;
  comm::WorkPtr gather_work;
  at::Tensor gather_buffer;       // param-dtype staging when the compute dtype differs (fp16 on a CPU)
  std::vector<at::Tensor> pending_grads;  // autograd's gradients, moved out of .grad()
  int grads_seen = 0;
  bool loads_released = false;        // some rank built a parameter of it without storage
  int64_t original_storage_bytes = 0; // the module's own storage behind its parameters, before set-up
};

/// A module buffer and, when buffer_dtype cast it, what it was.
struct BufferState {
  std::string name;
  at::Tensor buffer;     // the module's buffer (identity kept)
  bool cast = false;
  at::Tensor original;   // its value before the cast (full precision)
};

/// Gradient reductions issued together. Each entry reduces `input` (a
/// parameter's gradient, or a piece of a full-layout gradient buffer) and
/// adds the result to unit `unit`'s gradient at [grad_offset, +length).
struct ReduceBucket {
  struct Entry {
    int unit = 0;
    at::Tensor input;
    int64_t grad_offset = 0;
    int64_t length = 0;
    std::vector<int64_t> splits;  ///< uneven reduce-scatter counts per rank; empty: even chunks
  };
  std::vector<Entry> entries;
  int64_t numel = 0;  ///< input elements queued
  std::vector<comm::WorkPtr> works;  ///< in issue order
  at::Tensor output;  ///< sharded: the reduced chunks, entry after entry
};

struct ShardedEngine::State {
  std::shared_ptr<torch::nn::Module> model;
  comm::CommunicatorPtr comm;
  ShardingOptions options;
  std::vector<UnitState> units;  // root states first
  std::unordered_map<const Unit*, std::vector<int>> unit_states;
  at::Tensor master_flat, lp_flat, grad_flat, exp_avg_flat, exp_avg_sq_flat, momentum_flat;
  at::Tensor host_grad_flat, host_lp_flat;  // optimizer offload staging
  DynamicLossScaler scaler;
  double clip_coefficient = 1.0;
  double last_grad_norm = -1.0;
  int64_t optimizer_steps = 0;
  /// grad_flat is known to hold zeros (zero_grad need not write it again).
  bool grads_zero = true;
  int64_t forward_count = 0;
  std::vector<const Unit*> trace;          // unit order recorded on the first forward
  std::vector<const Unit*> current_order;
  bool trace_valid = false;
  int64_t gathered_bytes = 0;
  int64_t gathered_peak = 0;
  ReduceBucket filling;
  std::vector<ReduceBucket> in_flight;
  std::unique_ptr<torch::optim::Optimizer> custom_optimizer;
  std::vector<at::Tensor> custom_leaves;
  std::vector<BufferState> buffers;
  /// on_grad_accumulated's hooks on the trainable parameters; removed with the engine.
  std::vector<std::unique_ptr<compat::PostAccumulateGradHook>> grad_hooks;
  // Set-up accounting (MemoryStats::load_peak).
  int64_t load_held = 0;       // the module's parameter storage not yet replaced by shards
  int64_t load_transient = 0;  // value copies and loading chunks of the unit being set up
  int64_t load_peak = 0;
  // Loading units with released parameters reuses one shard buffer and one
  // chunk buffer, sized for the largest unit (no per-unit heap churn).
  at::Tensor load_shard_buffer, load_chunk_buffer;

  /// The model's device: every buffer, flag and scalar the engine creates lives
  /// there (the optimizer offload's host copies excepted).
  at::Device device{at::kCPU};

  /// All-reduces a small host tensor of control values (flags, hashes)
  /// through `group`, which needs its tensors on its own device; the result
  /// comes back into `values`.
  static void all_reduce_control(comm::Communicator& group, at::Tensor& values, ReduceOp op) {
    if (group.world_size() == 1) return;
    if (values.device() == group.device()) {
      group.all_reduce(values, op);
      return;
    }
    at::Tensor moved = values.to(group.device());
    group.all_reduce(moved, op);
    values.copy_(moved);  // from a GPU: waits for the collective's stream
  }

  at::Tensor load_buffer(at::Tensor& buffer, int64_t numel, const at::TensorOptions& options) {
    if (!buffer.defined() || buffer.numel() < numel) buffer = at::empty({numel}, options);
    return buffer.narrow(0, 0, numel);
  }

  State(std::shared_ptr<torch::nn::Module> m, comm::CommunicatorPtr c, ShardingOptions o)
      : model(std::move(m)), comm(std::move(c)), options(std::move(o)), scaler(options.loss_scale) {}

  int layout_world() const { return options.shard_params ? comm->world_size() : 1; }
  /// One rank with no replicas: an all-gather or reduce-scatter would be a
  /// copy of the shard onto itself, so the engine skips them (no copy).
  bool single_rank() const { return comm->world_size() == 1 && !options.replicate_group; }
  /// Gradients go straight into the shard's gradient (single_rank). Not with
  /// ZeRO-1's boundary accumulation in a 16-bit reduce dtype: that rounds the
  /// accumulated sum once, not each micro-batch's gradient.
  bool adds_grads_directly() const {
    return single_rank() && options.predivide == 1.0 && options.postdivide == 1.0 &&
           (!options.reduce_at_boundary_only || options.reduce_dtype == at::kFloat);
  }
  int layout_rank() const { return options.shard_params ? comm->rank() : 0; }
  bool pure() const { return options.pure_low_precision; }
  int64_t full_bytes(const UnitState& u) const {
    return u.layout->full_numel() * static_cast<int64_t>(c10::elementSize(options.compute_dtype));
  }
  bool frees_after_forward(const UnitState& u) const {
    return options.reshard == Reshard::kAfterForward && !u.persistent;
  }
  bool frees_after_backward(const UnitState& u) const {
    return options.reshard != Reshard::kNever && !u.persistent;
  }

  void add_gathered(int64_t delta) {
    gathered_bytes += delta;
    gathered_peak = std::max(gathered_peak, gathered_bytes);
  }

  void note_load() { load_peak = std::max(load_peak, load_held + gathered_bytes + load_transient); }

  // ---- loading parameters built without storage ------------------------------
  /// Fills this rank's shard of a unit some rank built (partly) without
  /// storage. Rank 0's values travel one rank's chunk (S elements) at a time,
  /// so a receiving rank never holds more than its shard plus one chunk, and
  /// rank 0 nothing beyond the module it already holds; the weight source is
  /// asked for this rank's slices only.
  void fill_released_unit(UnitState& u, const std::vector<LoadMode>& modes, const at::Tensor& shard,
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
        options.weight_source(u.names[seg.param_index], seg.param_offset, seg.length, out);
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
      ST_THROW(Error, options.name, ": loading unit '", u.path.empty() ? "<root>" : u.path,
               "' from the weight source failed: ", failure);
    }
    ST_CHECK(failed.item<double>() == 0, options.name, ": another rank failed to read its slices of unit '",
             u.path.empty() ? "<root>" : u.path, "' from the weight source (its log names the cause)");
  }

  // ---- buffers ------------------------------------------------------------------
  /// A buffer's compute value under buffer_dtype. As for parameters, fp16 on a
  /// CPU computes in fp32 on fp16-rounded values (LibTorch has no fp16 matmul there).
  at::Tensor cast_buffer(const at::Tensor& value) const {
    at::Tensor cast = value.detach().to(*options.buffer_dtype);
    if (cast.scalar_type() == at::kHalf && cast.is_cpu()) cast = cast.to(at::kFloat);
    return cast;
  }

  /// Buffers are replicated, not sharded: rank 0's are broadcast
  /// (sync_module_states, as FSDP's _sync_module_params_and_buffers), then
  /// floating-point ones are cast to buffer_dtype in place for compute, as
  /// FSDP1's root does in _lazy_init (integer buffers are never cast).
  void setup_buffers(comm::Communicator& sync) {
    at::NoGradGuard no_grad;
    for (const auto& item : model->named_buffers(/*recurse=*/true)) {
      at::Tensor b = item.value();
      if (!b.defined()) continue;
      if (options.sync_module_states && sync.world_size() > 1 && b.numel() > 0) {
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
      if (options.buffer_dtype && at::isFloatingType(b.scalar_type())) {
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

  // ---- gathering ------------------------------------------------------------
  /// All-gathers `shard`'s pieces into `target`, a full-layout buffer of the
  /// shard's dtype: each piece lands where the parameters view it.
  comm::WorkPtr gather_pieces(const UnitLayout& layout, const at::Tensor& shard, const at::Tensor& target) {
    const int W = comm->world_size();
    std::vector<at::Tensor> outputs, inputs;
    for (const auto& piece : layout.pieces()) {
      outputs.push_back(target.narrow(0, piece.full_offset, W * piece.chunk));
      inputs.push_back(shard.narrow(0, piece.shard_offset, piece.chunk));
    }
    return comm->all_gather_coalesced_async(outputs, inputs);
  }

  void start_gather(UnitState& u) {
    if (u.gathered || u.gather_work || u.views_shard) return;
    compat::resize_storage_bytes(u.full, static_cast<std::size_t>(full_bytes(u)));
    add_gathered(full_bytes(u));
    if (!options.shard_params) {
      u.gather_buffer = u.lp_shard;  // complete on every rank already; only its dtype differs
      u.gather_work = comm::completed_work();
      return;
    }
    at::Tensor target = u.full;
    if (options.param_dtype != options.compute_dtype) {
      // fp16 on a CPU computes in fp32: gathered in fp16, then widened.
      u.gather_buffer = at::empty({u.layout->full_numel()}, u.lp_shard.options());
      add_gathered(bytes_of(u.gather_buffer));
      target = u.gather_buffer;
    }
    u.gather_work = gather_pieces(*u.layout, u.lp_shard, target);
  }

  void finish_gather(UnitState& u) {
    if (u.gathered) return;
    if (!u.gather_work) start_gather(u);
    u.gather_work->wait();
    u.gather_work.reset();
    if (u.gather_buffer.defined()) {
      u.full.copy_(u.gather_buffer);  // the same layout, the compute dtype
      if (options.shard_params) add_gathered(-bytes_of(u.gather_buffer));
      u.gather_buffer = at::Tensor();
    }
    u.gathered = true;
  }

  void release(UnitState& u) {
    if (!u.gathered || u.views_shard) return;
    compat::resize_storage_bytes(u.full, 0);
    add_gathered(-full_bytes(u));
    u.gathered = false;
  }

  void gather_unit(const Unit* unit) {
    for (int idx : unit_states.at(unit)) start_gather(units[idx]);
    for (int idx : unit_states.at(unit)) finish_gather(units[idx]);
  }

  void release_unit(const Unit* unit, bool after_forward) {
    for (int idx : unit_states.at(unit)) {
      UnitState& u = units[idx];
      if (after_forward ? frees_after_forward(u) : frees_after_backward(u)) release(u);
    }
  }

  int64_t unit_numel(const Unit* unit) const {
    int64_t n = 0;
    for (int idx : unit_states.at(unit)) n += units[idx].layout->total_param_numel();
    return n;
  }

  bool unit_gathered_or_pending(const Unit* unit) const {
    for (int idx : unit_states.at(unit)) {
      if (!units[idx].gathered && !units[idx].gather_work) return false;
    }
    return true;
  }

  /// Issues gathers for the units after position `pos` of `order` while they
  /// fit in the prefetch window (elements, units) and the live-parameter budget.
  void prefetch_after(const std::vector<const Unit*>& order, std::size_t pos, int64_t window_elements) {
    if (options.reshard != Reshard::kAfterForward && options.reshard != Reshard::kAfterBackward) return;
    if (window_elements <= 0 || !trace_valid) return;
    int64_t live = 0;
    for (const auto& u : units) {
      if (u.gathered || u.gather_work) live += u.layout->total_param_numel();
    }
    int64_t window = 0;
    int units_ahead = 0;
    for (std::size_t k = pos + 1; k < order.size() && units_ahead < options.max_prefetch_units; ++k) {
      const int64_t n = unit_numel(order[k]);
      if (window + n > window_elements || live + n > options.max_live_parameters) break;
      window += n;
      ++units_ahead;
      if (unit_gathered_or_pending(order[k])) continue;
      for (int idx : unit_states.at(order[k])) start_gather(units[idx]);
      live += n;
    }
  }

  void prefetch_for_backward(const Unit* current) {
    const auto& order = trace_valid ? trace : current_order;
    std::vector<const Unit*> reversed(order.rbegin(), order.rend());
    auto where = std::find(reversed.begin(), reversed.end(), current);
    if (where == reversed.end()) return;
    // Backward prefetch gathers exactly the next unit, as FSDP does.
    const int64_t next_numel = where + 1 < reversed.end() ? unit_numel(*(where + 1)) : 0;
    prefetch_after(reversed, static_cast<std::size_t>(where - reversed.begin()), next_numel);
  }

  // ---- gradients --------------------------------------------------------------
  /// After autograd accumulated into a parameter's .grad(): the engine takes
  /// that tensor (autograd's own output, not a copy) and leaves .grad() empty.
  void on_grad_accumulated(int state_index, int param_index) {
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

  /// A pending gradient in the reduce dtype, flattened (zeros where the
  /// parameter got none: every rank reduces the same pieces).
  at::Tensor reduce_input(const UnitState& u, int k) const {
    const at::Tensor& g = u.pending_grads[k];
    if (!g.defined()) return at::zeros({u.layout->param_numel(k)}, u.full.options().dtype(options.reduce_dtype));
    return g.to(options.reduce_dtype).reshape({-1});
  }

  /// `splits` (one count per rank) makes it an uneven reduce-scatter; empty: even chunks of `length`.
  void enqueue_reduction(int state_index, at::Tensor input, int64_t grad_offset, int64_t length,
                         std::vector<int64_t> splits = {}) {
    if (options.predivide != 1.0) input.div_(options.predivide);
    filling.numel += input.numel();
    filling.entries.push_back({state_index, std::move(input), grad_offset, length, std::move(splits)});
  }

  /// Queues the reduction of a unit's gradients held in the full layout (the
  /// flat gradient, ZeRO-1's accumulator), one piece at a time.
  void enqueue_full_layout(int state_index, const at::Tensor& full_input) {
    const UnitLayout& layout = *units[state_index].layout;
    if (!options.shard_params) {
      enqueue_reduction(state_index, full_input, 0, layout.shard_numel());
      return;
    }
    const int W = comm->world_size();
    for (const auto& piece : layout.pieces()) {
      enqueue_reduction(state_index, full_input.narrow(0, piece.full_offset, W * piece.chunk), piece.shard_offset,
                        piece.chunk);
    }
  }

  void unit_grads_ready(int state_index) {
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
        place.add_(g.to(options.reduce_dtype).to(u.grad.scalar_type()));
      }
    } else if (options.reduce_at_boundary_only) {
      // Accumulated unreduced, each gradient into its slice of the full layout.
      for (int k = 0; k < static_cast<int>(u.pending_grads.size()); ++k) {
        const at::Tensor& g = u.pending_grads[k];
        if (!g.defined()) continue;
        u.boundary_grad_accumulator.narrow(0, u.layout->param_offset_in_full(k), g.numel()).add_(g.reshape({-1}));
      }
    } else if (!options.shard_params) {
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
    if (!adds_grads_directly() && !options.reduce_at_boundary_only) {
      if (filling.numel >= options.reduce_bucket_size) flush_bucket();
      if (!options.overlap_comm) finish_reductions();
    }
    // Every autograd node that read the unit's trainable weights has run (each
    // produced its weight's gradient). Frozen weights give no such signal, so a
    // unit holding some stays gathered until the end of backward.
    if (u.unit != nullptr) {
      const bool has_frozen = unit_states.at(u.unit).size() > 1;
      if (!has_frozen) release_unit(u.unit, /*after_forward=*/false);
      if (options.backward_prefetch == BackwardPrefetchMode::kPost) prefetch_for_backward(u.unit);
    }
  }

  /// Issues the queued reductions as one coalesced collective: reduce-scatters
  /// of the pieces into one output buffer, or (unsharded) all-reduces in place.
  void flush_bucket() {
    if (filling.entries.empty()) return;
    ReduceBucket bucket = std::move(filling);
    filling = ReduceBucket();
    const ReduceOp op = options.average ? ReduceOp::kAvg : ReduceOp::kSum;
    if (!options.shard_params) {
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

  void finish_reductions() {
    flush_bucket();
    for (auto& bucket : in_flight) {
      for (auto& work : bucket.works) work->wait();
      // The reduced values: the bucket's output, or (unsharded) the inputs in place.
      std::vector<at::Tensor> reduced;
      int64_t offset = 0;
      for (const auto& e : bucket.entries) {
        reduced.push_back(options.shard_params ? bucket.output.narrow(0, offset, e.length) : e.input);
        offset += e.length;
      }
      if (options.replicate_group) {
        const ReduceOp op = options.average ? ReduceOp::kAvg : ReduceOp::kSum;
        if (options.shard_params) {
          options.replicate_group->all_reduce(bucket.output, op);
        } else {
          options.replicate_group->all_reduce_coalesced_async(reduced, op)->wait();
        }
      }
      for (std::size_t k = 0; k < bucket.entries.size(); ++k) {
        const auto& e = bucket.entries[k];
        if (options.postdivide != 1.0) reduced[k].div_(options.postdivide);
        UnitState& u = units[e.unit];
        u.grad.narrow(0, e.grad_offset, e.length).add_(reduced[k].reshape({-1}).to(u.grad.scalar_type()));
      }
    }
    in_flight.clear();
  }

  void reduce_boundary_accumulators() {
    if (adds_grads_directly()) return;  // unit_grads_ready added them
    for (std::size_t i = 0; i < units.size(); ++i) {
      UnitState& u = units[i];
      if (!u.trainable) continue;
      // A copy: the accumulator is zeroed below, before the bucket is sent.
      at::Tensor input = u.boundary_grad_accumulator.to(options.reduce_dtype, /*non_blocking=*/false, /*copy=*/true);
      enqueue_full_layout(static_cast<int>(i), input);
      if (filling.numel >= options.reduce_bucket_size) flush_bucket();
      u.boundary_grad_accumulator.zero_();
    }
    finish_reductions();
  }

  void regather_after_step() {
    std::vector<int> bucket;
    int64_t bucket_numel = 0;
    for (std::size_t i = 0; i < units.size(); ++i) {
      UnitState& u = units[i];
      if (!u.trainable || u.views_shard) continue;  // a shard view already holds the stepped values
      const bool kept = options.reshard == Reshard::kNever || u.persistent;
      // Gathered on demand by the next forward. Released here too: a no-grad
      // forward after the last backward left it gathered with pre-step values.
      if (!kept) { release(u); continue; }
      release(u);
      bucket.push_back(static_cast<int>(i));
      bucket_numel += u.layout->full_numel();
      if (bucket_numel >= options.allgather_bucket_size) {
        gather_bucket(bucket);
        bucket.clear();
        bucket_numel = 0;
      }
    }
    gather_bucket(bucket);
  }

  /// The units' gathers in flight together, then waited for in order.
  void gather_bucket(const std::vector<int>& bucket) {
    for (int idx : bucket) start_gather(units[idx]);
    for (int idx : bucket) finish_gather(units[idx]);
  }

  /// Elements gathered between this unit's forward and its backward, by the recorded order.
  int64_t reuse_distance(const Unit* unit) const {
    auto where = std::find(trace.begin(), trace.end(), unit);
    if (where == trace.end()) return std::numeric_limits<int64_t>::max();
    int64_t between = 0;
    for (auto it = where + 1; it != trace.end(); ++it) between += unit_numel(*it);
    return 2 * between;  // the later units' forward, then their backward
  }
};

ShardedEngine::ShardedEngine(std::shared_ptr<torch::nn::Module> model, comm::CommunicatorPtr shard_group,
                             ShardingOptions options)
    : state_(std::make_unique<State>(std::move(model), std::move(shard_group), std::move(options))) {
  State& s = *state_;
  ST_CHECK(s.model != nullptr, s.options.name, ": the model is null");
  ST_CHECK(!(s.options.pure_low_precision && s.options.optimizer.type == "SGD"), s.options.name,
           ": pure low precision runs AdamW/Adam on low-precision state; SGD is not supported there");
  ST_CHECK(!(s.options.pure_low_precision && s.options.optimizer.custom_factory), s.options.name,
           ": a custom optimizer needs an fp32 master; it cannot run in pure low precision");

  // ---- units: the outermost marked modules the wrap policy selects ----------
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> unit_modules;
  std::vector<std::string> marked_classes;
  if (s.options.wrap_units) {
    for (const auto& item : s.model->named_modules("", /*include_self=*/false)) {
      auto* marked = dynamic_cast<Unit*>(item.value().get());
      if (marked == nullptr) continue;
      marked_classes.push_back(marked->unit_class_name());
      if (!s.options.unit_classes.empty() &&
          std::find(s.options.unit_classes.begin(), s.options.unit_classes.end(), marked->unit_class_name()) ==
              s.options.unit_classes.end()) {
        continue;
      }
      if (s.options.min_unit_params > 0) {
        int64_t n = 0;
        for (const auto& p : item.value()->parameters()) n += p.numel();
        if (n < s.options.min_unit_params) continue;
      }
      bool nested = false;
      for (const auto& [path, _] : unit_modules) {
        if (item.key().rfind(path + ".", 0) == 0) nested = true;
      }
      if (!nested) unit_modules.emplace_back(item.key(), item.value());
    }
  }
  if (s.comm->rank() == 0) {
    // A config may list several families' classes (LlamaDecoderLayer,MistralDecoderLayer)
    // so one file serves both: a missing name only warns when no listed class matched.
    const bool any_listed_found = std::any_of(
        s.options.unit_classes.begin(), s.options.unit_classes.end(), [&](const std::string& cls) {
          return std::find(marked_classes.begin(), marked_classes.end(), cls) != marked_classes.end();
        });
    for (const auto& cls : s.options.unit_classes) {
      if (std::find(marked_classes.begin(), marked_classes.end(), cls) != marked_classes.end()) continue;
      if (any_listed_found) {
        ST_LOG_INFO("{}: transformer_layer_cls_to_wrap also names '{}', which this model does not have",
                    s.options.name, cls);
      } else {
        ST_LOG_WARN("{}: transformer_layer_cls_to_wrap names '{}', but no shardtrain::Unit of that class is in "
                    "the model; its layers stay in the root unit", s.options.name, cls);
      }
    }
    if (unit_modules.empty() && s.options.wrap_units) {
      ST_LOG_WARN("{}: no sharding units selected (the model marks none, or the wrap policy matched none); "
                  "the whole model is one unit, gathered at once. Mark transformer blocks as shardtrain::Unit.",
                  s.options.name);
    }
  }

  std::unordered_set<const c10::TensorImpl*> claimed;
  auto collect = [&](const std::string& path, Unit* unit, torch::nn::Module& module) {
    UnitState trainable, frozen;
    for (UnitState* st : {&trainable, &frozen}) {
      st->path = path;
      st->unit = unit;
    }
    frozen.trainable = false;
    for (const auto& item : module.named_parameters(/*recurse=*/true)) {
      const at::Tensor& p = item.value();
      if (!claimed.insert(p.unsafeGetTensorImpl()).second) continue;  // shared/tied: the first owner keeps it
      UnitState& st = p.requires_grad() ? trainable : frozen;
      st.names.push_back(join_path(path, item.key()));
      st.params.push_back(p);
      st.shapes.push_back(p.sizes().vec());
    }
    for (UnitState* st : {&trainable, &frozen}) {
      if (!st->params.empty() || (st == &trainable && unit == nullptr)) s.units.push_back(std::move(*st));
    }
  };
  // Units first (so they claim their parameters), then the root takes the rest.
  for (const auto& [path, module] : unit_modules) collect(path, dynamic_cast<Unit*>(module.get()), *module);
  const std::size_t unit_state_count = s.units.size();
  collect("", nullptr, *s.model);
  // Root states go first in the list; keep their relative order.
  std::rotate(s.units.begin(), s.units.begin() + static_cast<std::ptrdiff_t>(unit_state_count), s.units.end());
  for (std::size_t i = 0; i < s.units.size(); ++i) {
    if (s.units[i].unit) s.unit_states[s.units[i].unit].push_back(static_cast<int>(i));
  }

  // ---- layouts and flat partitions (trainable states) -------------------------
  // ---- the device: the model's, and the communicators' -----------------------
  // Checked once here, so a model left on the CPU under NCCL (or moved to a
  // GPU under Gloo) fails with the fix instead of inside the first collective.
  s.device = s.comm->device();
  {
    const std::string* first_name = nullptr;
    for (const auto& u : s.units) {
      for (std::size_t k = 0; k < u.params.size(); ++k) {
        const at::Device d = u.params[k].device();
        if (first_name == nullptr) {
          first_name = &u.names[k];
          s.device = d;
        }
        ST_CHECK(d == s.device, s.options.name, ": parameter '", u.names[k], "' is on ", d, " but '", *first_name,
                 "' is on ", s.device, "; move the whole model to one device (model->to(device)) before prepare()");
      }
    }
  }
  for (comm::Communicator* group : {s.comm.get(), s.options.sync_group.get()}) {
    if (group == nullptr) continue;
    ST_CHECK_T(ConfigError, group->device() == s.device, s.options.name, ": the model is on ", s.device,
               " but the ", group->backend(), " communicator moves tensors on ", group->device(),
               "; move the model there before prepare() (model->to(accelerator.device())), or pick the backend "
               "for the model's device (gloo for cpu, nccl for cuda:LOCAL_RANK)");
  }
  const at::Device device = s.device;
  const at::TensorOptions fp32 = at::TensorOptions().dtype(at::kFloat).device(device);
  const at::TensorOptions low = fp32.dtype(s.options.param_dtype);
  const at::TensorOptions state_options = s.pure() ? low : fp32;  // dtype the optimizer steps in
  int64_t total_shard = 0;
  for (auto& u : s.units) {
    std::vector<int64_t> numels;
    for (const auto& p : u.params) numels.push_back(p.numel());
    u.layout = std::make_unique<UnitLayout>(s.options.layout, numels, s.layout_world(), /*align=*/1);
    u.persistent = u.layout->total_param_numel() < s.options.param_persistence_threshold;
    u.pending_grads.resize(u.params.size());
    if (u.trainable) {
      u.shard_offset = total_shard;
      total_shard += u.layout->shard_numel();
    }
  }
  if (!s.pure()) s.master_flat = at::zeros({total_shard}, fp32);
  // keep_low_precision_grads: the reduced gradient stays in param_dtype (the
  // optimizer kernels widen it as they read it), as FSDP1 leaves flat_param.grad.
  const bool low_grads = s.pure() || (s.options.keep_low_precision_grads && s.options.param_dtype != at::kFloat);
  const at::TensorOptions grad_options = low_grads ? low : fp32;
  s.grad_flat = at::zeros({total_shard}, grad_options);
  s.lp_flat = (!s.pure() && s.options.param_dtype == at::kFloat) ? s.master_flat : at::zeros({total_shard}, low);
  const std::string& opt = s.options.optimizer.type;
  if (!s.options.optimizer.custom_factory) {
    if (opt == "AdamW" || opt == "Adam") {
      s.exp_avg_flat = at::zeros({total_shard}, state_options);
      s.exp_avg_sq_flat = at::zeros({total_shard}, state_options);
    } else if (opt == "SGD") {
      if (s.options.optimizer.momentum != 0.0) s.momentum_flat = at::zeros({total_shard}, fp32);
    } else {
      ST_THROW(ConfigError, "optimizer type '", opt, "' is not one of AdamW, Adam, SGD");
    }
  }
  if (s.options.offload_optimizer && !s.pure()) {
    // The step runs on the host: gradients come down, the low-precision copy goes back up.
    // Pinned next to a GPU, as DeepSpeed's offload buffers are: copies between
    // pinned host memory and the device run at full bus speed and can overlap.
    const at::TensorOptions host = fp32.device(at::kCPU).pinned_memory(device.is_cuda());
    if (!s.master_flat.is_cpu()) {
      auto to_host = [&](at::Tensor& t) {
        if (t.defined()) t = at::empty({t.numel()}, host.dtype(t.scalar_type())).copy_(t);
      };
      to_host(s.master_flat);
      to_host(s.exp_avg_flat);
      to_host(s.exp_avg_sq_flat);
      to_host(s.momentum_flat);
    }
    s.host_grad_flat = at::zeros({total_shard}, host.dtype(grad_options.dtype()));
    s.host_lp_flat = at::zeros({total_shard}, host.dtype(s.options.param_dtype));
  }

  // ---- which parameters some rank built without storage ------------------------
  // One collective settles, identically on every rank, how each parameter's
  // shard is filled: parameters some rank released (release_parameter_storage:
  // cpu_ram_efficient_loading / zero3_init_flag, or a weight source) take the
  // loading path below; the others keep the plain one. The same all-reduce
  // checks that the ranks built the same model and agree on the weight source,
  // so a mismatch fails here with a message instead of hanging in a collective.
  comm::Communicator& sync = s.options.sync_group ? *s.options.sync_group : *s.comm;
  std::vector<std::vector<LoadMode>> modes(s.units.size());
  {
    int64_t count = 0;
    for (const auto& u : s.units) count += static_cast<int64_t>(u.params.size());
    at::Tensor flags = at::zeros({2 * count + 4}, at::TensorOptions().dtype(at::kDouble));
    double* f = flags.data_ptr<double>();
    uint64_t hash = 1469598103934665603ull;  // FNV-1a over names, shapes, dtypes, requires_grad
    auto mix = [&](const void* data, std::size_t n) {
      const auto* bytes = static_cast<const unsigned char*>(data);
      for (std::size_t b = 0; b < n; ++b) hash = (hash ^ bytes[b]) * 1099511628211ull;
    };
    int64_t idx = 0;
    std::unordered_set<const c10::StorageImpl*> seen;
    for (auto& u : s.units) {
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
          s.load_held += bytes;
        }
      }
    }
    const bool has_source = static_cast<bool>(s.options.weight_source);
    const double h = static_cast<double>(hash >> 12);  // 52 bits: exact in a double
    f[2 * count] = has_source ? 1.0 : 0.0;
    f[2 * count + 1] = has_source ? 0.0 : 1.0;
    f[2 * count + 2] = h;
    f[2 * count + 3] = -h;
    s.note_load();
    s.all_reduce_control(sync, flags, ReduceOp::kMax);
    ST_CHECK(f[2 * count + 2] == -f[2 * count + 3], s.options.name,
             ": the ranks built different models (parameter names, shapes, dtypes or requires_grad differ between "
             "ranks); every rank must construct the same architecture, with or without its weights");
    ST_CHECK_T(ConfigError, !(f[2 * count] > 0 && f[2 * count + 1] > 0), s.options.name,
               ": a weight source (RunInfo::weight_source) was given on some ranks but not on others; give it on "
               "every rank or on none");
    idx = 0;
    int64_t released_params = 0, released_elements = 0;
    for (std::size_t i = 0; i < s.units.size(); ++i) {
      UnitState& u = s.units[i];
      for (std::size_t k = 0; k < u.params.size(); ++k, ++idx) {
        LoadMode mode = s.options.sync_module_states ? LoadMode::kFromRoot : LoadMode::kLocal;
        if (f[idx] > 0) {
          ++released_params;
          released_elements += u.params[k].numel();
          if (has_source) {
            mode = LoadMode::kSource;
          } else {
            ST_CHECK(f[count + idx] == 0, s.options.name, ": parameter '", u.names[k],
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
    if (sync.rank() == 0 && released_params == 0 && s.options.rank0_loads_weights && sync.world_size() > 1) {
      ST_LOG_WARN("{}: rank-0-only loading (fsdp_cpu_ram_efficient_loading / zero3_init_flag) is on, but every "
                  "rank built the model with its weights, so every rank held the full model. Build it without "
                  "them where accelerator.materialize_full_weights() is false (shardtrain::release_parameter_"
                  "storage, models::make_llama_without_weights)", s.options.name);
    }
    if (sync.rank() == 0 && released_params > 0) {
      ST_LOG_INFO("{}: {} parameters ({} elements) were built without storage on some rank; their shards are "
                  "filled {}, one unit at a time", s.options.name, released_params, released_elements,
                  has_source ? "from the weight source (each rank reads its own slices)" : "from rank 0");
    }
  }

  // ---- shard the initial values ----------------------------------------------
  // A failure part-way (a weight source that throws) leaves no unit pointing
  // at this half-built engine.
  try {
  for (std::size_t i = 0; i < s.units.size(); ++i) {
    UnitState& u = s.units[i];
    const int64_t S = u.layout->shard_numel();
    if (u.trainable) {
      if (!s.pure()) u.master = s.master_flat.narrow(0, u.shard_offset, S);
      u.grad = s.grad_flat.narrow(0, u.shard_offset, S);
      u.lp_shard = s.lp_flat.narrow(0, u.shard_offset, S);
      if (s.exp_avg_flat.defined()) {
        u.exp_avg = s.exp_avg_flat.narrow(0, u.shard_offset, S);
        u.exp_avg_sq = s.exp_avg_sq_flat.narrow(0, u.shard_offset, S);
      }
    } else {
      // Frozen weights: a shard to gather from and an fp32 copy for state dicts; no optimizer.
      u.lp_shard = at::zeros({S}, low);
      if (!s.pure()) u.master = at::zeros({S}, fp32);
    }
    const at::TensorOptions init_options = (s.pure() ? low : fp32).device(device);
    at::Tensor shard_init = u.loads_released ? s.load_buffer(s.load_shard_buffer, S, init_options)
                                             : at::empty({S}, init_options);
    std::vector<at::Tensor> values;
    if (!u.loads_released) {
      int64_t value_bytes = 0;
      for (auto& p : u.params) {
        // Pure mode keeps the load dtype's values exactly; otherwise the fp32 master starts from them.
        at::Tensor v = p.detach().to(s.pure() ? s.options.param_dtype : at::kFloat).contiguous();
        if (s.options.sync_module_states) sync.broadcast(v, 0);
        if (!v.is_alias_of(p)) value_bytes += bytes_of(v);
        values.push_back(v);
      }
      s.load_transient = value_bytes;
      u.layout->pack_shard(values, s.layout_rank(), shard_init);
    } else {
      s.fill_released_unit(u, modes[i], shard_init, sync);
    }
    if (u.master.defined()) u.master.copy_(shard_init);
    if (!u.lp_shard.is_same(u.master)) u.lp_shard.copy_(shard_init);
    shard_init = at::Tensor();
    // The module's parameters become views into one compute-dtype buffer:
    // when the shard is the whole unit (one rank, or no sharding) and holds
    // that dtype, the shard itself, so the optimizer's writes are the next
    // forward's values and nothing is ever gathered or copied.
    u.views_shard = s.layout_world() == 1 && !u.loads_released && s.options.param_dtype == s.options.compute_dtype &&
                    u.lp_shard.numel() == u.layout->full_numel();
    if (u.views_shard) {
      u.full = u.lp_shard;
    } else {
      u.full = u.loads_released ? unallocated_buffer(u.layout->full_numel(), fp32.dtype(s.options.compute_dtype))
                                : at::empty({u.layout->full_numel()}, fp32.dtype(s.options.compute_dtype));
    }
    if (!u.loads_released && !u.views_shard) {
      s.load_transient += s.full_bytes(u);
      s.note_load();
    }
    for (int k = 0; k < static_cast<int>(u.params.size()); ++k) {
      at::Tensor view = u.full.narrow(0, u.layout->param_offset_in_full(k), u.params[k].numel()).view(u.shapes[k]);
      // Compute on the values the shard holds (fp16-on-CPU computes in fp32 on fp16-rounded values).
      if (!u.loads_released) view.copy_(values[k].to(s.options.param_dtype));
      u.params[k].set_data(view);
    }
    // A unit with released parameters: its buffer owns no memory; make its
    // byte size say so too (this rank holds only its shard until it is gathered).
    if (u.loads_released) compat::resize_storage_bytes(u.full, 0);
    values.clear();
    s.load_transient = 0;
    s.load_held -= u.original_storage_bytes;  // the module's own storage is replaced (as far as the engine holds it)
    if (!u.loads_released) {
      u.gathered = true;
      if (!u.views_shard) s.add_gathered(s.full_bytes(u));
      s.note_load();
    }
    if (s.options.reduce_at_boundary_only && u.trainable && !s.adds_grads_directly()) {
      u.boundary_grad_accumulator = at::zeros({u.layout->full_numel()}, fp32);
    }
    if (u.trainable) {
      State* state = state_.get();
      const int state_index = static_cast<int>(i);
      for (int k = 0; k < static_cast<int>(u.params.size()); ++k) {
        ST_CHECK(u.params[k].requires_grad() && u.params[k].is_leaf(), s.options.name, ": trainable parameter '",
                 u.names[k], "' must be a leaf that requires grad");
        s.grad_hooks.push_back(std::make_unique<compat::PostAccumulateGradHook>(
            u.params[k], [state, state_index, k]() { state->on_grad_accumulated(state_index, k); }));
      }
    }
    if (u.unit) u.unit->attach_unit_hooks(this, static_cast<int>(i));
    const bool stays_gathered = s.options.reshard == Reshard::kNever || u.persistent;
    if (!u.loads_released) {
      if (!stays_gathered) s.release(u);
    } else if (stays_gathered) {
      // Its values exist only as shards: gather them like any later regather.
      s.start_gather(u);
      s.finish_gather(u);
      s.note_load();
    }
  }
  } catch (...) {
    for (auto& u : s.units) {
      if (u.unit) u.unit->attach_unit_hooks(nullptr, -1);
    }
    throw;
  }
  // Set-up held every unit at once; the working-set peak counts from here.
  s.gathered_peak = s.gathered_bytes;
  s.load_shard_buffer = at::Tensor();
  s.load_chunk_buffer = at::Tensor();
  s.setup_buffers(sync);

  if (s.options.optimizer.custom_factory) {
    // The escape hatch steps the master shard directly; its .grad() is the
    // reduced gradient partition, unscaled and clipped by step().
    at::Tensor leaf = s.master_flat;
    leaf.set_requires_grad(true);
    s.custom_leaves = {leaf};
    s.custom_optimizer = s.options.optimizer.custom_factory(s.custom_leaves);
    ST_CHECK(s.custom_optimizer != nullptr, "the custom optimizer factory returned null");
  }
  const int64_t trainable = std::accumulate(s.units.begin(), s.units.end(), int64_t{0}, [](int64_t a, const UnitState& u) {
    return a + (u.trainable ? u.layout->total_param_numel() : 0);
  });
  ST_LOG_INFO("{}: {} unit states, {} trainable elements over {} ranks; compute {}, shard {}, reduce {}{}{}",
              s.options.name, s.units.size(), trainable, s.layout_world(), c10::toString(s.options.compute_dtype),
              c10::toString(s.options.param_dtype), c10::toString(s.options.reduce_dtype),
              s.pure() ? ", pure low precision (no fp32 master)" : "",
              s.options.offload_optimizer ? ", optimizer offloaded to CPU" : "");
}

ShardedEngine::~ShardedEngine() {
  for (auto& u : state_->units) {
    if (u.unit) u.unit->attach_unit_hooks(nullptr, -1);
  }
}

std::string ShardedEngine::name() const { return state_->options.name; }
const ShardingOptions& ShardedEngine::options() const { return state_->options; }

void ShardedEngine::begin_forward() {
  State& s = *state_;
  s.current_order.clear();
  for (auto& u : s.units) {
    if (u.unit == nullptr) s.start_gather(u);
  }
  for (auto& u : s.units) {
    if (u.unit == nullptr) s.finish_gather(u);
  }
}

void ShardedEngine::before_unit_forward(Unit& unit) {
  State& s = *state_;
  ST_CHECK(s.unit_states.count(&unit), "unit '", unit.unit_class_name(), "' is not managed by this engine");
  const std::size_t pos = s.current_order.size();
  s.current_order.push_back(&unit);
  if (s.trace_valid && (pos >= s.trace.size() || s.trace[pos] != &unit)) {
    ST_LOG_WARN("{}: the unit order changed at forward {} (unit '{}' at position {}): prefetch trace rebuilt",
                s.options.name, s.forward_count + 1, s.units[s.unit_states.at(&unit)[0]].path, pos);
    s.trace_valid = false;
  }
  s.gather_unit(&unit);
  s.prefetch_after(s.trace, pos, s.options.prefetch_bucket_size);
}

at::Tensor ShardedEngine::after_unit_forward(Unit& unit, at::Tensor output) {
  State& s = *state_;
  // The reuse is the unit's backward: a no-grad forward has none, so it reshards.
  const bool reused_soon = at::GradMode::is_enabled() && s.options.max_reuse_distance > 0 && s.trace_valid &&
                           s.reuse_distance(&unit) <= s.options.max_reuse_distance;
  if (!reused_soon) s.release_unit(&unit, /*after_forward=*/true);
  bool frees = false;
  for (int idx : s.unit_states.at(&unit)) frees = frees || s.frees_after_forward(s.units[idx]);
  if (output.requires_grad() && (frees || s.options.backward_prefetch == BackwardPrefetchMode::kPre)) {
    State* state = &s;
    const Unit* key = &unit;
    // The gradient of the unit's output arrives just before the unit's own
    // backward runs: gather its parameters then (FSDP's pre-backward hook).
    output.register_hook([state, key](const at::Tensor&) {
      state->gather_unit(key);
      if (state->options.backward_prefetch == BackwardPrefetchMode::kPre) state->prefetch_for_backward(key);
    });
  }
  return output;
}

bool ShardedEngine::recompute_in_backward(const Unit& unit) const {
  return state_->options.activation_checkpointing && state_->unit_states.count(&unit) != 0;
}

at::Tensor ShardedEngine::run_recomputed(Unit& unit, std::function<at::Tensor(const at::Tensor&)> body,
                                         const at::Tensor& input) {
  State& s = *state_;
  std::vector<at::Tensor> trainable;
  for (int idx : s.unit_states.at(&unit)) {
    if (s.units[idx].trainable) trainable = s.units[idx].params;
  }
  if (!at::GradMode::is_enabled()) return body(input);  // nothing to recompute for
  auto holder = c10::make_intrusive<RecomputeBody>(std::move(body));
  // TensorList (not std::vector): autograd treats each parameter as an input only in that form.
  return RecomputeFunction::apply(input, at::TensorList(trainable), c10::IValue::make_capsule(holder));
}

at::Tensor ShardedEngine::end_forward(at::Tensor output) {
  State& s = *state_;
  ++s.forward_count;
  if (!s.trace_valid) {
    s.trace = s.current_order;
    s.trace_valid = true;
  }
  return output;
}

void ShardedEngine::backward(const at::Tensor& loss, bool sync) {
  State& s = *state_;
  ST_CHECK(loss.numel() == 1, "backward: the loss must be a scalar, got shape ", loss.sizes());
  at::Tensor scaled = s.scaler.scale() == 1.0 ? loss : loss * s.scaler.scale();
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
  if (s.options.reduce_at_boundary_only && sync) s.reduce_boundary_accumulators();
  for (auto& u : s.units) {
    if (s.frees_after_backward(u)) s.release(u);
  }
}

double ShardedEngine::clip_grad_norm(double max_norm) {
  State& s = *state_;
  // The local sum stays on the gradients' device through the all-reduce;
  // item() is the step's one wait for it.
  at::Tensor total = kernels::sum_of_squares(s.grad_flat).reshape({1});
  s.comm->all_reduce(total, ReduceOp::kSum);
  if (!s.options.shard_params) {
    // Every rank holds all gradients: the sum over ranks counted each W times.
    total.div_(s.comm->world_size());
  }
  const double norm = std::sqrt(total.item<double>()) / s.scaler.scale();
  s.last_grad_norm = std::isfinite(norm) ? norm : -1.0;
  s.clip_coefficient = 1.0;
  if (max_norm > 0 && std::isfinite(norm)) s.clip_coefficient = std::min(1.0, max_norm / (norm + 1e-6));
  return norm;
}

StepResult ShardedEngine::step(double lr) {
  State& s = *state_;
  StepResult result;
  result.loss_scale = s.scaler.scale();
  result.grad_norm = s.last_grad_norm;
  if (s.options.fp16) {
    at::Tensor overflow = kernels::non_finite_flag(s.grad_flat).reshape({1});
    s.comm->all_reduce(overflow, ReduceOp::kMax);
    if (overflow.item<float>() > 0) {
      s.scaler.update(true);
      s.grad_flat.zero_();
      s.grads_zero = true;
      s.clip_coefficient = 1.0;
      s.last_grad_norm = -1.0;
      result.skipped = true;
      return result;
    }
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

  const auto& o = s.options.optimizer;
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
    const int64_t group = std::max<int64_t>(1, s.options.sub_group_size);
    for (int64_t begin = 0; begin < total; begin += group) {
      const int64_t len = std::min(group, total - begin);
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
        kernels::sgd_step(param, s.momentum_flat.defined() ? &momentum : nullptr, g, separate_lp ? &lp : nullptr, p);
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
        kernels::adam_step_low_precision(param, m, v, g, p);
      } else {
        kernels::adam_step(param, m, v, g, separate_lp ? &lp : nullptr, p);
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
  for (auto& u : s.units) {
    if (u.boundary_grad_accumulator.defined()) u.boundary_grad_accumulator.zero_();
  }
}

double ShardedEngine::loss_scale() const { return state_->scaler.scale(); }

std::vector<std::pair<std::string, at::Tensor>> ShardedEngine::full_state_dict() {
  State& s = *state_;
  std::vector<std::pair<std::string, at::Tensor>> result;
  for (auto& u : s.units) {
    const at::Tensor source = (u.master.defined() ? u.master : u.lp_shard.to(at::kFloat)).contiguous();
    at::Tensor full = source;  // without sharding the shard is the full buffer
    if (s.options.shard_params) {
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
  const bool is_copy = s.options.replicate_group ? s.options.replicate_group->rank() != 0
                                                  : (!s.options.shard_params && s.comm->rank() != 0);
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
    if (s.options.reshard == Reshard::kNever || u.persistent) s.start_gather(u);
  }
  for (auto& u : s.units) {
    if (u.gather_work) s.finish_gather(u);
  }
}

int64_t ShardedEngine::optimizer_steps() const { return state_->optimizer_steps; }

std::optional<at::ScalarType> ShardedEngine::pure_low_precision_dtype() const {
  if (!state_->pure()) return std::nullopt;
  return state_->options.param_dtype;
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
