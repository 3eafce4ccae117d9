// Gathering units where they are needed: around each unit's forward and
// backward, with prefetch along the recorded unit order, activation
// recomputation, and regathering after the optimizer step.

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
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

namespace shardtrain::engine {

namespace {

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

comm::WorkPtr ShardedEngine::State::gather_pieces(const UnitLayout& layout, const at::Tensor& shard, const at::Tensor& target) {
  const int W = comm->world_size();
  std::vector<at::Tensor> outputs, inputs;
  for (const auto& piece : layout.pieces()) {
    outputs.push_back(target.narrow(0, piece.full_offset, W * piece.chunk));
    inputs.push_back(shard.narrow(0, piece.shard_offset, piece.chunk));
  }
  return comm->all_gather_coalesced_async(outputs, inputs);
}

std::string UnitState::label() const {
  const std::string name = path.empty() ? "root parameters" : path;
  return unit != nullptr ? name + " (" + unit->unit_class_name() + ")" : name;
}

void ShardedEngine::State::start_gather(UnitState& u) {
  if (u.gathered || u.gather_work || u.views_shard) return;
  comm::CollectiveScope scope("gather " + u.label());
  engine::resize_storage_bytes(u.full, static_cast<std::size_t>(full_bytes(u)));
  add_gathered(full_bytes(u));
  if (!plan.shard_params) {
    u.gather_buffer = u.lp_shard;  // complete on every rank already; only its dtype differs
    u.gather_work = comm::completed_work();
    return;
  }
  at::Tensor target = u.full;
  if (plan.param_dtype != plan.compute_dtype) {
    // fp16 on a CPU computes in fp32: gathered in fp16, then widened.
    u.gather_buffer = at::empty({u.layout->full_numel()}, u.lp_shard.options());
    add_gathered(bytes_of(u.gather_buffer));
    target = u.gather_buffer;
  }
  u.gather_work = gather_pieces(*u.layout, u.lp_shard, target);
}

void ShardedEngine::State::finish_gather(UnitState& u) {
  if (u.gathered) return;
  if (!u.gather_work) start_gather(u);
  u.gather_work->wait();
  u.gather_work.reset();
  if (u.gather_buffer.defined()) {
    u.full.copy_(u.gather_buffer);  // the same layout, the compute dtype
    if (plan.shard_params) add_gathered(-bytes_of(u.gather_buffer));
    u.gather_buffer = at::Tensor();
  }
  u.gathered = true;
}

void ShardedEngine::State::gather_unit(const Unit* unit) {
  for (int idx : unit_states.at(unit)) start_gather(units[idx]);
  for (int idx : unit_states.at(unit)) finish_gather(units[idx]);
}

void ShardedEngine::State::release_unit(const Unit* unit, bool after_forward) {
  for (int idx : unit_states.at(unit)) {
    UnitState& u = units[idx];
    if (after_forward ? frees_after_forward(u) : frees_after_backward(u)) release(u);
  }
}

void ShardedEngine::State::prefetch_after(const std::vector<const Unit*>& order, std::size_t pos, int64_t window_elements) {
  if (plan.reshard != Reshard::kAfterForward && plan.reshard != Reshard::kAfterBackward) return;
  if (window_elements <= 0 || !trace_valid) return;
  int64_t live = 0;
  for (const auto& u : units) {
    if (u.gathered || u.gather_work) live += u.layout->total_param_numel();
  }
  int64_t window = 0;
  int units_ahead = 0;
  for (std::size_t k = pos + 1; k < order.size() && units_ahead < plan.max_prefetch_units; ++k) {
    const int64_t n = unit_numel(order[k]);
    if (window + n > window_elements || live + n > plan.max_live_parameters) break;
    window += n;
    ++units_ahead;
    if (unit_gathered_or_pending(order[k])) continue;
    for (int idx : unit_states.at(order[k])) start_gather(units[idx]);
    live += n;
  }
}

void ShardedEngine::State::prefetch_for_backward(const Unit* current) {
  const auto& order = trace_valid ? trace : current_order;
  std::vector<const Unit*> reversed(order.rbegin(), order.rend());
  auto where = std::find(reversed.begin(), reversed.end(), current);
  if (where == reversed.end()) return;
  // Backward prefetch gathers exactly the next unit, as FSDP does.
  const int64_t next_numel = where + 1 < reversed.end() ? unit_numel(*(where + 1)) : 0;
  prefetch_after(reversed, static_cast<std::size_t>(where - reversed.begin()), next_numel);
}

void ShardedEngine::State::regather_after_step() {
  std::vector<int> bucket;
  int64_t bucket_numel = 0;
  for (std::size_t i = 0; i < units.size(); ++i) {
    UnitState& u = units[i];
    if (!u.trainable || u.views_shard) continue;  // a shard view already holds the stepped values
    const bool kept = plan.reshard == Reshard::kNever || u.persistent;
    // Gathered on demand by the next forward. Released here too: a no-grad
    // forward after the last backward left it gathered with pre-step values.
    if (!kept) { release(u); continue; }
    release(u);
    bucket.push_back(static_cast<int>(i));
    bucket_numel += u.layout->full_numel();
    if (bucket_numel >= plan.allgather_bucket_size) {
      gather_bucket(bucket);
      bucket.clear();
      bucket_numel = 0;
    }
  }
  gather_bucket(bucket);
}

void ShardedEngine::State::gather_bucket(const std::vector<int>& bucket) {
  for (int idx : bucket) start_gather(units[idx]);
  for (int idx : bucket) finish_gather(units[idx]);
}

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
                s.plan.name, s.forward_count + 1, s.units[s.unit_states.at(&unit)[0]].path, pos);
    s.trace_valid = false;
  }
  s.gather_unit(&unit);
  s.prefetch_after(s.trace, pos, s.plan.prefetch_bucket_size);
}

at::Tensor ShardedEngine::after_unit_forward(Unit& unit, at::Tensor output) {
  State& s = *state_;
  // The reuse is the unit's backward: a no-grad forward has none, so it reshards.
  const bool reused_soon = at::GradMode::is_enabled() && s.plan.max_reuse_distance > 0 && s.trace_valid &&
                           s.reuse_distance(&unit) <= s.plan.max_reuse_distance;
  if (!reused_soon) s.release_unit(&unit, /*after_forward=*/true);
  bool frees = false;
  for (int idx : s.unit_states.at(&unit)) frees = frees || s.frees_after_forward(s.units[idx]);
  if (output.requires_grad() && (frees || s.plan.backward_prefetch == BackwardPrefetchMode::kPre)) {
    State* state = &s;
    const Unit* key = &unit;
    // The gradient of the unit's output arrives just before the unit's own
    // backward runs: gather its parameters then (FSDP's pre-backward hook).
    output.register_hook([state, key](const at::Tensor&) {
      state->gather_unit(key);
      if (state->plan.backward_prefetch == BackwardPrefetchMode::kPre) state->prefetch_for_backward(key);
    });
  }
  return output;
}

bool ShardedEngine::recompute_in_backward(const Unit& unit) const {
  return state_->plan.activation_checkpointing && state_->unit_states.count(&unit) != 0;
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

}  // namespace shardtrain::engine
