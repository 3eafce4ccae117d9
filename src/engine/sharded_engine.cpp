// ShardedEngine: the composition of its parts, each owning its own state, and
// the Engine interface over them. The constructor runs the set-up in order:
// the unit table picks the units and lays them out, the shard storage binds
// the device and allocates the partitions, the loader fills them and points
// the parameters at the gather scheduler's buffers, the gradient reducer
// hooks the trainable parameters; the sharded optimizer and the checkpoint
// view read the storage. A part reaches another only through its interface.

#include "engine/sharded_engine.h"

#include <memory>
#include <numeric>
#include <sstream>
#include <string>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "engine/activation_recompute.h"
#include "engine/gather_scheduler.h"
#include "engine/gradient_reducer.h"
#include "engine/shard_groups.h"
#include "engine/shard_loader.h"
#include "engine/shard_storage.h"
#include "engine/sharded_optimizer.h"
#include "engine/unit_table.h"
#include "shardtrain/error.h"
#include "shardtrain/logging.h"

namespace shardtrain::engine {
namespace {

/// What no part can check for itself: a model to shard, and a plan the
/// engine core runs. Rank 0 reports the plan's notices before anything else.
std::shared_ptr<torch::nn::Module> checked_model(std::shared_ptr<torch::nn::Module> model, const EnginePlan& plan,
                                                 const ShardGroups& groups) {
  ST_CHECK(model != nullptr, plan.name, ": the model is null");
  if (groups.sync().rank() == 0) {
    for (const std::string& notice : plan.notices) ST_LOG_WARN("{}", notice);
  }
  ST_CHECK(!(plan.pure_low_precision && plan.optimizer.type == "SGD"), plan.name,
           ": pure low precision runs AdamW/Adam on low-precision state; SGD is not supported there");
  ST_CHECK(!(plan.pure_low_precision && plan.optimizer.custom_factory), plan.name,
           ": a custom optimizer needs an fp32 master; it cannot run in pure low precision");
  return model;
}

}  // namespace

struct ShardedEngine::State {
  State(std::shared_ptr<torch::nn::Module> m, EngineGroups g, EnginePlan p)
      : plan(std::move(p)),
        groups(std::move(g), plan.shard_params),
        model(checked_model(std::move(m), plan, groups)),
        units(*model, plan, groups.layout_world(), /*logs=*/groups.shard().rank() == 0),
        storage(plan, units, groups),
        gather(plan, groups, units, storage),
        reducer(plan, groups, units, storage, gather),
        loader(*model, plan, groups, units, storage, gather),
        optimizer(plan, groups, units, storage),
        checkpoint(groups, units, storage) {}

  const EnginePlan plan;
  const ShardGroups groups;
  const std::shared_ptr<torch::nn::Module> model;
  UnitTable units;
  ShardStorage storage;
  GatherScheduler gather;
  GradientReducer reducer;
  ShardLoader loader;
  ShardedOptimizer optimizer;
  CheckpointView checkpoint;
  /// Expires with the engine: the hooks it leaves on output tensors (a graph
  /// the user may keep and run backward on later) check it before they
  /// touch the engine.
  const std::shared_ptr<const bool> alive = std::make_shared<const bool>(true);
};

ShardedEngine::ShardedEngine(std::shared_ptr<torch::nn::Module> model, EngineGroups groups, EnginePlan plan)
    : state_(std::make_unique<State>(std::move(model), std::move(groups), std::move(plan))) {
  State& s = *state_;
  s.loader.load();
  // A failure part-way (a parameter that is not a leaf) leaves no unit
  // pointing at this half-built engine.
  try {
    for (int i = 0; i < s.units.size(); ++i) {
      s.reducer.attach(i);
      if (s.units[i].unit) s.units[i].unit->attach_unit_hooks(this, i);
    }
  } catch (...) {
    for (const auto& u : s.units.entries()) {
      if (u.unit) u.unit->attach_unit_hooks(nullptr, -1);
    }
    throw;
  }
  s.optimizer.create_custom_optimizer();
  const int64_t trainable =
      std::accumulate(s.units.entries().begin(), s.units.entries().end(), int64_t{0},
                      [](int64_t a, const UnitEntry& u) { return a + (u.trainable ? u.layout->total_param_numel() : 0); });
  ST_LOG_INFO("{}: {} unit states, {} trainable elements over {} ranks; compute {}, shard {}, reduce {}{}{}",
              s.plan.name, s.units.size(), trainable, s.groups.layout_world(), c10::toString(s.plan.compute_dtype),
              c10::toString(s.plan.param_dtype), c10::toString(s.plan.reduce_dtype),
              s.plan.pure_low_precision ? ", pure low precision (no fp32 master)" : "",
              s.storage.params_offloaded() ? ", parameters and optimizer offloaded to CPU"
              : s.storage.offloaded()      ? ", optimizer offloaded to CPU"
              : s.plan.offload_optimizer ? ", offload asked for, nothing to move (the model is on the CPU)"
                                         : "");
}

ShardedEngine::~ShardedEngine() {
  State& s = *state_;
  for (const auto& u : s.units.entries()) {
    if (u.unit) u.unit->attach_unit_hooks(nullptr, -1);
  }
  // A gather or reduction still in flight (a prefetch no forward consumed, a
  // forward or backward that threw) writes into buffers the parts own: the
  // communicator's threads must be done with them before they are freed.
  // Every wait is bounded by the communicator's timeout.
  s.gather.settle_in_flight(s.plan.name);
  s.reducer.settle_in_flight(s.plan.name);
}

std::string ShardedEngine::name() const { return state_->plan.name; }

const EnginePlan& ShardedEngine::plan() const { return state_->plan; }

// ---- forward and backward -----------------------------------------------------

void ShardedEngine::begin_forward() {
  state_->units.begin_forward();
  state_->gather.gather_root();
}

void ShardedEngine::before_unit_forward(Unit& unit) {
  State& s = *state_;
  ST_CHECK(s.units.manages(unit), "unit '", unit.unit_class_name(), "' is not managed by this engine");
  const std::size_t pos = s.units.record(unit, s.plan.name);
  s.gather.gather_unit(unit);
  s.gather.prefetch_from(s.units.trace(), pos + 1, s.plan.prefetch_bucket_size);
}

at::Tensor ShardedEngine::after_unit_forward(Unit& unit, const at::Tensor& input, at::Tensor output) {
  State& s = *state_;
  // A unit holding frozen weights (a LoRA base) gets no gradient of them to
  // tell when its backward is done; the gradient of its input does (FSDP2's
  // post-backward signal). Without it the unit would stay gathered to the end
  // of backward, and with every layer adapted, so would the whole model.
  // Not on a leaf input: a tensor that outlives the step would collect a
  // hook per forward; such a unit is freed at the end of backward.
  if (at::GradMode::is_enabled() && input.requires_grad() && !input.is_leaf() && s.units.holds_frozen(unit)) {
    GradientReducer* reducer = &s.reducer;
    const Unit* key = &unit;
    reducer->expect_input_grad(unit);
    input.register_hook([reducer, key](const at::Tensor&) { reducer->unit_input_grad_ready(*key); });
  }
  // The reuse is the unit's backward: a no-grad forward has none, nor has a
  // unit whose output needs no gradient (frozen embeddings under LoRA), so
  // they reshard. A backward that reads no parameter values (an embedding
  // lookup's) is no reuse either: nothing of this step needs them again, so
  // they are freed now even where the policy keeps units to the end of
  // backward, and never gathered for it.
  const bool has_backward = at::GradMode::is_enabled() && output.requires_grad();
  const bool backward_gathers = has_backward && unit.backward_reads_parameters();
  const bool reused_soon = backward_gathers && s.plan.max_reuse_distance > 0 && s.units.trace_valid() &&
                           s.units.reuse_distance(unit) <= s.plan.max_reuse_distance;
  if (has_backward && !backward_gathers) {
    s.gather.release_unit(unit, /*after_forward=*/false);
  } else if (!reused_soon) {
    s.gather.release_unit(unit, /*after_forward=*/true);
  }
  if (!backward_gathers) return output;
  s.gather.expect_backward(unit);
  bool frees = false;
  for (int idx : s.units.entries_of(unit)) frees = frees || s.gather.frees_after_forward(idx);
  if (frees || s.plan.backward_prefetch == BackwardPrefetchMode::kPre) {
    GatherScheduler* gather = &s.gather;
    const bool prefetch = s.plan.backward_prefetch == BackwardPrefetchMode::kPre;
    const Unit* key = &unit;
    // The gradient of the unit's output arrives just before the unit's own
    // backward runs: gather its parameters then (FSDP's pre-backward hook).
    output.register_hook([gather, prefetch, key, alive = std::weak_ptr<const bool>(s.alive)](const at::Tensor&) {
      if (alive.expired()) return;
      gather->gather_unit(*key);
      if (prefetch) gather->prefetch_for_backward(key);
    });
  }
  return output;
}

bool ShardedEngine::recompute_in_backward(const Unit& unit) const {
  // A unit whose backward reads no parameter (an embedding lookup) keeps
  // nothing worth recomputing: its output is the next unit's saved input
  // anyway, and a recompute would need the parameters freed after its forward.
  return state_->plan.activation_checkpointing && state_->units.manages(unit) &&
         unit.unit_kind() == Unit::Kind::kBlock && unit.backward_reads_parameters();
}

at::Tensor ShardedEngine::run_recomputed(Unit& unit, std::function<at::Tensor(const at::Tensor&)> body,
                                         const at::Tensor& input) {
  State& s = *state_;
  std::vector<at::Tensor> trainable;
  for (int idx : s.units.entries_of(unit)) {
    if (s.units[idx].trainable) trainable = s.units[idx].params;
  }
  if (!at::GradMode::is_enabled()) return body(input);  // nothing to recompute for
  return run_with_recompute(std::move(body), input, trainable);
}

at::Tensor ShardedEngine::end_forward(at::Tensor output) {
  State& s = *state_;
  s.units.end_forward();
  if (s.plan.prefetch_first_backward_unit && output.defined() && output.requires_grad() && !output.is_leaf() &&
      at::GradMode::is_enabled()) {
    // The model output's gradient arrives before the backward of whatever
    // the root computes after the last unit (the final norm, the head): the
    // first unit's gather overlaps that instead of waiting in the unit's own
    // pre-backward hook, as FSDP's root pre-backward hook prefetches it.
    GatherScheduler* gather = &s.gather;
    output.register_hook([gather, alive = std::weak_ptr<const bool>(s.alive)](const at::Tensor&) {
      if (!alive.expired()) gather->prefetch_for_backward(nullptr);
    });
  }
  return output;
}

void ShardedEngine::backward(const at::Tensor& loss, bool sync) {
  State& s = *state_;
  ST_CHECK(loss.numel() == 1, "backward: the loss must be a scalar, got shape ", loss.sizes());
  const double scale = s.optimizer.loss_scale();
  s.reducer.backward(scale == 1.0 ? loss : loss * scale, sync);
  s.gather.release_after_backward();
}

// ---- the optimizer ----------------------------------------------------------------

double ShardedEngine::clip_grad_norm(double max_norm) { return state_->optimizer.clip_grad_norm(max_norm); }

StepInfo ShardedEngine::step(double lr) {
  State& s = *state_;
  // The step writes the partitions that gathers read: the last step's
  // regather (a unit no forward ran since) and, offloaded, the host copies.
  s.gather.finish_in_flight();
  s.gather.wait_for_uploads();
  StepInfo result = s.optimizer.step(lr);
  if (!result.skipped) {
    s.gather.regather_after_step();
    // Without overlap_comm, step() returns with the parameters complete, as
    // DeepSpeed's ZeRO-1/2 leaves them; with it the gathers run under the
    // next forward, each unit's forward waiting for its own.
    if (!s.plan.overlap_comm) s.gather.finish_in_flight();
  }
  return result;
}

void ShardedEngine::complete_parameters() { state_->gather.finish_in_flight(); }

void ShardedEngine::zero_grad() {
  state_->storage.zero_grads();
  state_->reducer.clear_window();
}

double ShardedEngine::loss_scale() const { return state_->optimizer.loss_scale(); }

std::optional<CustomOptimizerState> ShardedEngine::custom_optimizer_state() const {
  if (!state_->optimizer.has_custom_optimizer()) return std::nullopt;
  return CustomOptimizerState{state_->optimizer.custom_state(), custom_optimizer_layout()};
}

std::string ShardedEngine::custom_optimizer_layout() const {
  if (!state_->optimizer.has_custom_optimizer()) return "";
  // What each element of the stepped partition is: the same text means the
  // custom optimizer's per-element state lines up, whatever the engine.
  std::ostringstream layout;
  layout << "partition " << state_->storage.master().numel() << " elements;";
  for (const OwnedRange& r : owned_ranges()) {
    layout << " " << r.name << " [" << r.begin << ", +" << r.length << ") at " << r.master_offset << ";";
  }
  return layout.str();
}

void ShardedEngine::load_custom_optimizer_state(const std::string& archive) {
  state_->optimizer.load_custom_state(archive);
}

int64_t ShardedEngine::optimizer_steps() const { return state_->optimizer.steps(); }

void ShardedEngine::set_optimizer_steps(int64_t steps) { state_->optimizer.set_steps(steps); }

std::vector<double> ShardedEngine::loss_scaler_state() const {
  const LossScalerState st = state_->optimizer.scaler_state();
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
  state_->optimizer.load_scaler_state(st);
}

// ---- state dicts, checkpoints, memory -----------------------------------------------

std::vector<std::pair<std::string, std::vector<int64_t>>> ShardedEngine::parameter_shapes() const {
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  for (const auto& u : state_->units.entries()) {
    for (std::size_t k = 0; k < u.params.size(); ++k) shapes.emplace_back(u.names[k], u.shapes[k]);
  }
  return shapes;
}

void ShardedEngine::visit_full_parameters(const std::function<void(const std::string&, const at::Tensor&)>& visit) {
  State& s = *state_;
  for (int i = 0; i < s.units.size(); ++i) {
    const UnitEntry& u = s.units[i];
    const UnitShard& shard = s.storage.unit(i);
    // The master, or the widened shard; a quantized weight's bytes as they are.
    // On the model's device: under the offloads the master and the shards live
    // on the host, and a GPU communicator gathers device tensors only.
    const at::TensorOptions fp32 = s.storage.fp32_options();
    const at::Tensor source = u.packed ? shard.lp.to(fp32.device()) : shard.value().to(fp32).contiguous();
    at::Tensor full = source;  // without sharding the shard is the full buffer
    if (s.plan.shard_params) {
      full = at::empty({u.layout->full_numel()}, source.options());
      s.gather.gather_pieces(*u.layout, source, full)->wait();
    }
    for (std::size_t k = 0; k < u.params.size(); ++k) {
      visit(u.names[k],
            full.narrow(0, u.layout->param_offset_in_full(static_cast<int>(k)), u.params[k].numel()).view(u.shapes[k]));
    }
  }
}

std::vector<std::pair<std::string, at::Tensor>> ShardedEngine::full_state_dict() {
  std::vector<std::pair<std::string, at::Tensor>> result;
  // Each value in host memory as it is visited, as Accelerate's FSDP state
  // dict (offload_to_cpu): on a GPU only one unit's full buffer is there at a time.
  visit_full_parameters([&](const std::string& name, const at::Tensor& value) {
    result.emplace_back(name, value.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true));
  });
  state_->loader.append_buffers(result);
  return result;
}

std::vector<CheckpointSlice> ShardedEngine::checkpoint_slices() const { return state_->checkpoint.slices(); }

std::optional<at::ScalarType> ShardedEngine::load_slices(const SliceSource& source) {
  // The gathered parameters hold the old values: free them all first, as a
  // gather still in flight reads the shards the load overwrites (over Gloo
  // the shard itself, under the parameter offload the host memory an upload
  // may still be copying from); then regather what stays gathered.
  state_->gather.release_all();
  state_->gather.wait_for_uploads();
  return state_->checkpoint.load(source);
}

void ShardedEngine::regather_after_load() { state_->gather.gather_kept(); }

MemoryReport ShardedEngine::memory() const {
  const State& s = *state_;
  MemoryReport m;
  s.storage.add_memory(m);
  m.grads += s.reducer.accumulator_bytes();
  m.gathered = s.gather.live_bytes();
  m.gathered_peak = s.gather.peak_bytes();
  m.reducing_peak = s.reducer.peak_bytes();
  m.load_peak = s.loader.peak_bytes();
  return m;
}

void ShardedEngine::reset_memory_peaks() {
  state_->gather.reset_peak();
  state_->reducer.reset_peak();
}

TrafficReport ShardedEngine::traffic() const { return state_->gather.traffic(); }

void ShardedEngine::reset_traffic() { state_->gather.reset_traffic(); }

// ---- introspection (tests) -------------------------------------------------------------

int ShardedEngine::gathers_in_flight() const { return state_->gather.in_flight(); }

const at::Tensor& ShardedEngine::parameter_partition() const { return state_->storage.stepped(); }

const at::Tensor& ShardedEngine::master_partition() const { return state_->storage.master(); }

const at::Tensor& ShardedEngine::low_precision_partition() const { return state_->storage.low_precision(); }

const at::Tensor& ShardedEngine::gradient_partition() const {
  state_->storage.note_grads_written();  // the caller may write into it
  return state_->storage.grad();
}

const at::Tensor& ShardedEngine::exp_avg_partition() const { return state_->storage.exp_avg(); }

const at::Tensor& ShardedEngine::exp_avg_sq_partition() const { return state_->storage.exp_avg_sq(); }

std::vector<std::string> ShardedEngine::unit_paths() const {
  std::vector<std::string> paths;
  for (const auto& u : state_->units.entries()) paths.push_back(u.path);
  return paths;
}

std::vector<OwnedRange> ShardedEngine::owned_ranges() const { return state_->checkpoint.owned_ranges(); }

}  // namespace shardtrain::engine
