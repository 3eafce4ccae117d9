#pragma once
// The state the sharded engine's parts share (not installed): a unit's
// parameters, buffers and gradient buckets, and ShardedEngine::State, whose
// methods live in one file per job:
//   unit_registry.cpp     which modules are units, which parameters are whose
//   shard_storage.cpp     the device, the flat partitions, releasing unit buffers
//   initial_load.cpp      filling the shards at set-up (rank 0, a weight source), buffers
//   gather_scheduler.cpp  gathering units around their forward and backward, prefetch
//   gradient_reducer.cpp  reducing gradients from autograd's hooks into the shards
//   sharded_optimizer.cpp clipping and the optimizer step over the shards
//   checkpoint_view.cpp   the state dict, checkpoint slices, memory accounting
// sharded_engine.cpp holds the constructor that runs the set-up in order.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "comm/work_util.h"
#include "engine/grad_ready_hook.h"
#include "engine/loss_scaler.h"
#include "engine/sharded_engine.h"
#include "engine/unit_layout.h"

namespace shardtrain::engine {

using comm::ReduceOp;

inline int64_t bytes_of(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

inline std::string join_path(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

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
  /// How hang reports name this unit's collectives: "layers.3 (LlamaDecoderLayer)".
  std::string label() const;
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
  bool boundary_reduced = false;  // zero 1: its accumulator went out during this boundary backward
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
  comm::CommunicatorPtr comm;  ///< the shard group
  comm::CommunicatorPtr replicate_group;  ///< HYBRID_SHARD's replica group, else null
  comm::CommunicatorPtr sync_comm;  ///< where initial values are broadcast (null: comm)
  EnginePlan plan;
  std::vector<UnitState> units;  // root states first
  std::unordered_map<const Unit*, std::vector<int>> unit_states;
  at::Tensor master_flat, lp_flat, grad_flat, exp_avg_flat, exp_avg_sq_flat, momentum_flat;
  at::Tensor host_grad_flat, host_lp_flat;  // optimizer offload staging
  DynamicLossScaler scaler;
  double clip_coefficient = 1.0;
  double last_grad_norm = -1.0;
  /// Set by clip_grad_norm for the step it precedes: whether the global norm
  /// was finite (it is iff every gradient element is). Unset: step() checks.
  std::optional<bool> grads_finite;
  int64_t optimizer_steps = 0;
  /// grad_flat is known to hold zeros (zero_grad need not write it again).
  bool grads_zero = true;
  /// zero 1: the running backward ends an accumulation window, so each unit's
  /// accumulator is reduced as soon as its gradients are in (overlapping the
  /// rest of backward, as ZeRO-2's reductions do) instead of after backward.
  bool boundary_backward = false;
  /// zero 1: a backward without sync has added to the accumulators since the
  /// last boundary. When none has (an accumulation window of one micro-batch,
  /// every step with gradient_accumulation_steps 1), the accumulator would hold
  /// 0 + g: the boundary backward reduces each gradient straight from autograd
  /// instead, as zero 2 does, with the same sums and the same bits, and no
  /// full-size fp32 add, copy and zeroing per step.
  bool accumulated_in_window = false;
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
  std::vector<std::unique_ptr<GradReadyHook>> grad_hooks;
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

  State(std::shared_ptr<torch::nn::Module> m, EngineGroups groups, EnginePlan p)
      : model(std::move(m)),
        comm(std::move(groups.shard)),
        replicate_group(std::move(groups.replicate)),
        sync_comm(std::move(groups.sync)),
        plan(std::move(p)),
        scaler(plan.loss_scale, plan.loss_scale.raise_error_at_min_scale) {}

  int layout_world() const { return plan.shard_params ? comm->world_size() : 1; }
  /// One rank with no replicas: an all-gather or reduce-scatter would be a
  /// copy of the shard onto itself, so the engine skips them (no copy).
  bool single_rank() const { return comm->world_size() == 1 && !replicate_group; }
  /// Gradients go straight into the shard's gradient (single_rank). Not with
  /// ZeRO-1's boundary accumulation in a 16-bit reduce dtype: that rounds the
  /// accumulated sum once, not each micro-batch's gradient.
  bool adds_grads_directly() const {
    return single_rank() && plan.predivide == 1.0 && plan.postdivide == 1.0 &&
           (!plan.reduce_at_boundary_only || plan.reduce_dtype == at::kFloat);
  }
  int layout_rank() const { return plan.shard_params ? comm->rank() : 0; }
  bool pure() const { return plan.pure_low_precision; }
  int64_t full_bytes(const UnitState& u) const {
    return u.layout->full_numel() * static_cast<int64_t>(c10::elementSize(plan.compute_dtype));
  }
  bool frees_after_forward(const UnitState& u) const {
    return plan.reshard == Reshard::kAfterForward && !u.persistent;
  }
  bool frees_after_backward(const UnitState& u) const {
    return plan.reshard != Reshard::kNever && !u.persistent;
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
                          comm::Communicator& sync);

  // ---- buffers ------------------------------------------------------------------
  /// A buffer's compute value under buffer_dtype. As for parameters, fp16 on a
  /// CPU computes in fp32 on fp16-rounded values (LibTorch has no fp16 matmul there).
  at::Tensor cast_buffer(const at::Tensor& value) const;

  /// Buffers are replicated, not sharded: rank 0's are broadcast
  /// (sync_module_states, as FSDP's _sync_module_params_and_buffers), then
  /// floating-point ones are cast to buffer_dtype in place for compute, as
  /// FSDP1's root does in _lazy_init (integer buffers are never cast).
  void setup_buffers(comm::Communicator& sync);

  // ---- gathering ------------------------------------------------------------
  /// All-gathers `shard`'s pieces into `target`, a full-layout buffer of the
  /// shard's dtype: each piece lands where the parameters view it.
  comm::WorkPtr gather_pieces(const UnitLayout& layout, const at::Tensor& shard, const at::Tensor& target);

  void start_gather(UnitState& u);

  void finish_gather(UnitState& u);

  void release(UnitState& u);

  void gather_unit(const Unit* unit);

  void release_unit(const Unit* unit, bool after_forward);

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
  void prefetch_after(const std::vector<const Unit*>& order, std::size_t pos, int64_t window_elements);

  void prefetch_for_backward(const Unit* current);

  // ---- gradients --------------------------------------------------------------
  /// After autograd accumulated into a parameter's .grad(): the engine takes
  /// that tensor (autograd's own output, not a copy) and leaves .grad() empty.
  void on_grad_accumulated(int state_index, int param_index);

  /// A pending gradient in the reduce dtype, flattened (zeros where the
  /// parameter got none: every rank reduces the same pieces).
  at::Tensor reduce_input(const UnitState& u, int k) const;

  /// `splits` (one count per rank) makes it an uneven reduce-scatter; empty: even chunks of `length`.
  void enqueue_reduction(int state_index, at::Tensor input, int64_t grad_offset, int64_t length,
                         std::vector<int64_t> splits = {});

  /// Queues the reduction of a unit's gradients held in the full layout (the
  /// flat gradient, ZeRO-1's accumulator), one piece at a time.
  void enqueue_full_layout(int state_index, const at::Tensor& full_input);

  void unit_grads_ready(int state_index);

  /// Issues the queued reductions as one coalesced collective: reduce-scatters
  /// of the pieces into one output buffer, or (unsharded) all-reduces in place.
  void flush_bucket();

  void finish_reductions();

  /// zero 1: queues the reduction of one unit's accumulator (a copy in the
  /// reduce dtype) and zeroes it for the next window.
  void reduce_accumulator(int state_index);

  /// zero 1, at the boundary: reduces the accumulators not yet reduced during
  /// backward (units that got no gradient) and waits for all of them.
  void reduce_boundary_accumulators();

  void regather_after_step();

  /// The units' gathers in flight together, then waited for in order.
  void gather_bucket(const std::vector<int>& bucket);

  /// Elements gathered between this unit's forward and its backward, by the recorded order.
  int64_t reuse_distance(const Unit* unit) const {
    auto where = std::find(trace.begin(), trace.end(), unit);
    if (where == trace.end()) return std::numeric_limits<int64_t>::max();
    int64_t between = 0;
    for (auto it = where + 1; it != trace.end(); ++it) between += unit_numel(*it);
    return 2 * between;  // the later units' forward, then their backward
  }

  // ---- set-up, in the order the constructor runs it ---------------------------
  /// unit_registry.cpp: picks the units (the outermost marked modules the wrap
  /// policy selects) and splits each into trainable and frozen states.
  void register_units();
  /// shard_storage.cpp: the model's device, checked against the communicators'.
  void bind_device();
  /// shard_storage.cpp: layouts, the flat partitions and the offload copies.
  void allocate_partitions();
  /// initial_load.cpp: one collective that settles how each parameter's shard
  /// is filled and checks that the ranks built the same model.
  std::vector<std::vector<LoadMode>> agree_on_load_modes();
  /// initial_load.cpp: fills every shard, makes the parameters views into
  /// their unit's buffer, installs the gradient and unit hooks on `engine`.
  void shard_initial_values(ShardedEngine* engine, const std::vector<std::vector<LoadMode>>& modes);
  /// sharded_optimizer.cpp: the custom-optimizer escape hatch over the master.
  void create_custom_optimizer();

  /// A 1-D tensor of `numel` elements whose storage claims their bytes but owns
  /// no memory (a null data pointer). ATen bounds-checks views against the
  /// storage's byte size, so the module's parameters can become views into a
  /// unit's buffer before anything is allocated; resize_storage_bytes() gives
  /// it memory when the unit is gathered. Loading parameters built without
  /// storage must not allocate (and touch) a full unit per unit: glibc keeps
  /// freed heap memory resident, so that churn alone grew a rank's resident set
  /// by most of the model (measured: 52 MB over 8 layers of a 60 MB model).
  static at::Tensor unallocated_buffer(int64_t numel, const at::TensorOptions& options);

  /// fp32 on the model's device: masters, moments, fp32 gradients.
  at::TensorOptions fp32_options() const { return at::TensorOptions().dtype(at::kFloat).device(device); }
  /// The group the set-up collectives run over (the whole job under HYBRID_SHARD).
  comm::Communicator& sync_group() const { return sync_comm ? *sync_comm : *comm; }
};

}  // namespace shardtrain::engine
