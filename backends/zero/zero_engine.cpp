#include "zero/zero_engine.h"

#include <algorithm>
#include <numeric>
#include <cmath>
#include <sstream>
#include <unordered_set>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "comm/work_util.h"
#include "compat/torch_compat.h"
#include "kernels/cpu/cpu_kernels.h"
#include "shardtrain/error.h"
#include "shardtrain/logging.h"

namespace shardtrain::zero {

using comm::ReduceOp;
using engine::UnitLayout;

namespace {

int64_t bytes_of(const at::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; }

}  // namespace

struct ZeroUnitState {
  std::string path;               // module path ("" = root)
  Unit* unit = nullptr;           // nullptr for the root
  std::vector<std::string> names; // fully-qualified parameter names
  std::vector<at::Tensor> params; // the module's parameters (identity kept)
  std::vector<std::vector<int64_t>> shapes;
  std::unique_ptr<UnitLayout> layout;
  int64_t shard_offset = 0;       // offset of this unit's shard in the flat partitions
  at::Tensor full;                // compute dtype; parameters are views into it
  at::Tensor lp_shard, master, grad, exp_avg, exp_avg_sq;  // views into the flat partitions
  at::Tensor stage1_grad_accumulator;  // stage 1: rank-major fp32 W*S
  bool gathered = false;
  bool persistent = false;
  comm::WorkPtr gather_work;
  at::Tensor gather_buffer;
  std::vector<at::Tensor> pending_grads;
  int grads_seen = 0;
};

/// Gradients of several units reduced by one collective (reduce_bucket_size):
/// the units' rank-major inputs side by side, so row r of the bucket is every
/// unit's chunk for rank r and the output is every unit's shard, in order.
struct ReduceBucket {
  std::vector<int> units;
  std::vector<at::Tensor> inputs;
  int64_t numel = 0;
  comm::WorkPtr work;
  at::Tensor output;
};

struct ZeroEngine::State {
  std::shared_ptr<torch::nn::Module> model;
  comm::CommunicatorPtr comm;
  ZeroOptions options;
  std::vector<ZeroUnitState> units;  // units[0] is the root
  std::unordered_map<const Unit*, int> unit_index;
  at::Tensor master_flat, lp_flat, grad_flat, exp_avg_flat, exp_avg_sq_flat, momentum_flat;
  // offload staging: host copies the step runs on (same device on CPU runs)
  at::Tensor host_grad_flat, host_lp_flat;
  engine::DynamicLossScaler scaler;
  double clip_coefficient = 1.0;
  double last_grad_norm = -1.0;
  int64_t optimizer_steps = 0;
  int64_t forward_count = 0;
  std::vector<int> trace;          // unit order recorded on the first forward
  std::vector<int> current_order;  // order in the running forward
  bool trace_valid = false;
  int64_t gathered_bytes = 0;
  int64_t gathered_peak = 0;
  ReduceBucket filling;                 // units whose gradients wait for a bucket to fill
  std::vector<ReduceBucket> in_flight;  // issued reductions, completed at the end of backward
  std::unique_ptr<torch::optim::Optimizer> custom_optimizer;
  std::vector<at::Tensor> custom_master_views;

  State(std::shared_ptr<torch::nn::Module> m, comm::CommunicatorPtr c, ZeroOptions o)
      : model(std::move(m)), comm(std::move(c)), options(std::move(o)), scaler(options.loss_scale) {}

  int world() const { return comm->world_size(); }
  int rank() const { return comm->rank(); }
  // Stage 0 (plain data parallel) keeps everything on every rank: its layout
  // has one shard holding all of a unit.
  int layout_world() const { return options.stage == 0 ? 1 : world(); }
  int layout_rank() const { return options.stage == 0 ? 0 : rank(); }
  bool release_after_use(const ZeroUnitState& u) const { return options.stage == 3 && !u.persistent; }

  void add_gathered(int64_t delta) {
    gathered_bytes += delta;
    gathered_peak = std::max(gathered_peak, gathered_bytes);
  }

  // ---- gathering ----------------------------------------------------------
  void start_gather(ZeroUnitState& u) {
    if (u.gathered || u.gather_work) return;
    const int64_t full_bytes = u.layout->full_numel() * static_cast<int64_t>(c10::elementSize(options.compute_dtype));
    compat::resize_storage_bytes(u.full, static_cast<std::size_t>(full_bytes));
    add_gathered(full_bytes);
    if (options.stage == 0) {
      u.gather_buffer = u.lp_shard;  // already complete on every rank
      u.gather_work = comm::completed_work();
      return;
    }
    u.gather_buffer = at::empty({u.layout->gathered_numel()}, u.lp_shard.options());
    add_gathered(bytes_of(u.gather_buffer));
    u.gather_work = comm->all_gather_async(u.gather_buffer, u.lp_shard);
  }

  void finish_gather(ZeroUnitState& u) {
    if (u.gathered) return;
    if (!u.gather_work) start_gather(u);
    u.gather_work->wait();
    u.gather_work.reset();
    u.layout->unpack(u.gather_buffer, u.full);
    if (options.stage != 0) add_gathered(-bytes_of(u.gather_buffer));
    u.gather_buffer = at::Tensor();
    u.gathered = true;
  }

  void release(ZeroUnitState& u) {
    if (!u.gathered) return;
    compat::resize_storage_bytes(u.full, 0);
    add_gathered(-u.layout->full_numel() * static_cast<int64_t>(c10::elementSize(options.compute_dtype)));
    u.gathered = false;
  }

  /// Issues gathers for the units after position `pos` of `order` while they
  /// fit in the prefetch window (elements) and the live-parameter budget.
  void prefetch_after(const std::vector<int>& order, std::size_t pos) {
    if (options.stage != 3 || !trace_valid) return;
    int64_t window = 0;
    int64_t live = 0;
    for (const auto& u : units) {
      if (u.gathered || u.gather_work) live += u.layout->total_param_numel();
    }
    for (std::size_t k = pos + 1; k < order.size(); ++k) {
      ZeroUnitState& next = units[order[k]];
      const int64_t n = next.layout->total_param_numel();
      if (window + n > options.prefetch_bucket_size || live + n > options.max_live_parameters) break;
      window += n;
      if (next.gathered || next.gather_work) continue;
      start_gather(next);
      live += n;
    }
  }

  // ---- gradients ----------------------------------------------------------
  void on_param_grad(int unit_idx, int param_idx, const at::Tensor& grad) {
    ZeroUnitState& u = units[unit_idx];
    if (!u.pending_grads[param_idx].defined()) ++u.grads_seen;
    u.pending_grads[param_idx] = grad;
    if (u.grads_seen == static_cast<int>(u.params.size())) unit_grads_ready(u);
  }

  void unit_grads_ready(ZeroUnitState& u) {
    if (options.stage == 1) {
      at::Tensor packed = at::empty({u.layout->gathered_numel()}, u.stage1_grad_accumulator.options());
      u.layout->pack(u.pending_grads, packed);
      u.stage1_grad_accumulator.add_(packed);
    } else {
      at::Tensor input = at::empty({u.layout->gathered_numel()}, u.full.options().dtype(options.reduce_dtype));
      u.layout->pack(u.pending_grads, input);
      filling.units.push_back(static_cast<int>(&u - units.data()));
      filling.inputs.push_back(std::move(input));
      filling.numel += u.layout->gathered_numel();
      if (filling.numel >= options.reduce_bucket_size) flush_bucket();
      if (!options.overlap_comm) finish_reductions();
    }
    for (auto& g : u.pending_grads) g = at::Tensor();
    u.grads_seen = 0;
    // The unit's backward is over (every node that read its weights produced their grads).
    if (release_after_use(u) && u.unit != nullptr) release(u);
  }

  void flush_bucket() {
    if (filling.units.empty()) return;
    ReduceBucket bucket = std::move(filling);
    filling = ReduceBucket();
    const int rows = layout_world();
    at::Tensor input;
    if (bucket.units.size() == 1) {
      input = bucket.inputs[0];
    } else {
      int64_t shard_total = 0;
      for (int idx : bucket.units) shard_total += units[idx].layout->shard_numel();
      input = at::empty({rows * shard_total}, bucket.inputs[0].options());
      at::Tensor grid = input.view({rows, shard_total});
      int64_t offset = 0;
      for (std::size_t k = 0; k < bucket.units.size(); ++k) {
        const int64_t S = units[bucket.units[k]].layout->shard_numel();
        grid.narrow(1, offset, S).copy_(bucket.inputs[k].view({rows, S}));
        offset += S;
      }
    }
    bucket.inputs.clear();
    if (options.stage == 0) {
      bucket.output = input;
      bucket.work = comm->all_reduce_async(bucket.output, ReduceOp::kAvg);
    } else {
      bucket.output = at::empty({input.numel() / rows}, input.options());
      bucket.work = comm->reduce_scatter_async(bucket.output, input, ReduceOp::kAvg);
    }
    in_flight.push_back(std::move(bucket));
  }

  void finish_reductions() {
    flush_bucket();
    for (auto& bucket : in_flight) {
      bucket.work->wait();
      int64_t offset = 0;
      for (int idx : bucket.units) {
        ZeroUnitState& u = units[idx];
        const int64_t S = u.layout->shard_numel();
        u.grad.add_(bucket.output.narrow(0, offset, S).to(at::kFloat));
        offset += S;
      }
    }
    in_flight.clear();
  }

  void stage1_reduce_all() {
    for (auto& u : units) {
      at::Tensor input = u.stage1_grad_accumulator.to(options.reduce_dtype);
      at::Tensor output = at::empty({u.layout->shard_numel()}, input.options());
      comm->reduce_scatter(output, input, ReduceOp::kAvg);
      u.grad.add_(output.to(at::kFloat));
      u.stage1_grad_accumulator.zero_();
    }
  }

  void gather_all_after_step() {
    for (auto& u : units) {
      if (options.stage == 3 && !u.persistent) continue;  // gathered on demand
      u.gathered = false;
      add_gathered(-u.layout->full_numel() * static_cast<int64_t>(c10::elementSize(options.compute_dtype)));
      start_gather(u);
    }
    for (auto& u : units) {
      if (u.gather_work) finish_gather(u);
    }
  }
};

namespace {

std::string join_path(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

}  // namespace

ZeroEngine::ZeroEngine(std::shared_ptr<torch::nn::Module> model, comm::CommunicatorPtr comm, ZeroOptions options)
    : state_(std::make_unique<State>(std::move(model), std::move(comm), std::move(options))) {
  State& s = *state_;
  ST_CHECK(s.options.stage >= 0 && s.options.stage <= 3, "ZeRO stage must be 0 (plain data parallel), 1, 2 or 3, got ",
           s.options.stage);
  const int W = s.world();

  // ---- find the units: outermost modules that are shardtrain::Unit --------
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> unit_modules;
  for (const auto& item : s.model->named_modules("", /*include_self=*/false)) {
    auto* marked = dynamic_cast<Unit*>(item.value().get());
    if (marked == nullptr) continue;
    bool nested = false;
    for (const auto& [path, _] : unit_modules) {
      if (item.key().rfind(path + ".", 0) == 0) nested = true;
    }
    if (!nested) unit_modules.emplace_back(item.key(), item.value());
  }
  if (unit_modules.empty()) {
    ST_LOG_WARN("zero: the model marks no shardtrain::Unit modules; it runs as a single unit (stage {} "
                "then gathers the whole model at once). Mark transformer blocks as units to shard them.",
                s.options.stage);
  }

  std::unordered_set<const c10::TensorImpl*> claimed;
  auto collect = [&](ZeroUnitState& u, torch::nn::Module& module, const std::string& prefix) {
    for (const auto& item : module.named_parameters(/*recurse=*/true)) {
      const at::Tensor& p = item.value();
      if (!p.requires_grad()) continue;  // frozen parameters stay replicated and untouched
      if (!claimed.insert(p.unsafeGetTensorImpl()).second) continue;  // shared/tied: first owner keeps it
      u.names.push_back(join_path(prefix, item.key()));
      u.params.push_back(p);
      u.shapes.push_back(p.sizes().vec());
    }
  };
  s.units.emplace_back();  // root, filled last (what no unit claimed)
  for (const auto& [path, module] : unit_modules) {
    ZeroUnitState u;
    u.path = path;
    u.unit = dynamic_cast<Unit*>(module.get());
    collect(u, *module, path);
    s.units.push_back(std::move(u));
  }
  collect(s.units[0], *s.model, "");
  for (std::size_t i = 0; i < s.units.size(); ++i) {
    if (s.units[i].unit) s.unit_index[s.units[i].unit] = static_cast<int>(i);
  }

  // ---- layouts and flat partitions -----------------------------------------
  int64_t total_shard = 0;
  for (auto& u : s.units) {
    std::vector<int64_t> numels;
    for (const auto& p : u.params) numels.push_back(p.numel());
    u.layout = std::make_unique<UnitLayout>(UnitLayout::Kind::kPerParam, numels, s.layout_world());
    u.shard_offset = total_shard;
    total_shard += u.layout->shard_numel();
    u.persistent = s.options.stage != 3 || u.layout->total_param_numel() < s.options.param_persistence_threshold;
    u.pending_grads.resize(u.params.size());
  }
  const at::Device device = s.units.size() > 1 || !s.units[0].params.empty()
                                ? (s.units.size() > 1 ? s.units[1].params.at(0).device() : s.units[0].params.at(0).device())
                                : at::Device(at::kCPU);
  const at::TensorOptions fp32 = at::TensorOptions().dtype(at::kFloat).device(device);
  s.master_flat = at::zeros({total_shard}, fp32);
  s.grad_flat = at::zeros({total_shard}, fp32);
  s.lp_flat = s.options.param_dtype == at::kFloat ? s.master_flat
                                                  : at::zeros({total_shard}, fp32.dtype(s.options.param_dtype));
  const std::string& opt = s.options.optimizer.type;
  if (!s.options.optimizer.custom_factory) {
    if (opt == "AdamW" || opt == "Adam") {
      s.exp_avg_flat = at::zeros({total_shard}, fp32);
      s.exp_avg_sq_flat = at::zeros({total_shard}, fp32);
    } else if (opt == "SGD") {
      if (s.options.optimizer.momentum != 0.0) s.momentum_flat = at::zeros({total_shard}, fp32);
    } else {
      ST_THROW(ConfigError, "optimizer type '", opt, "' is not one of AdamW, Adam, SGD");
    }
  }
  if (s.options.offload_optimizer) {
    // Step on the host: grads come down, the low-precision copy goes back up.
    const at::TensorOptions host = fp32.device(at::kCPU);
    if (!s.master_flat.is_cpu()) {
      s.master_flat = s.master_flat.cpu();
      if (s.exp_avg_flat.defined()) s.exp_avg_flat = s.exp_avg_flat.cpu();
      if (s.exp_avg_sq_flat.defined()) s.exp_avg_sq_flat = s.exp_avg_sq_flat.cpu();
      if (s.momentum_flat.defined()) s.momentum_flat = s.momentum_flat.cpu();
    }
    s.host_grad_flat = at::zeros({total_shard}, host);
    s.host_lp_flat = at::zeros({total_shard}, host.dtype(s.options.param_dtype));
  }

  // ---- shard the initial values: rank 0's values win (sync_module_states) ---
  for (std::size_t i = 0; i < s.units.size(); ++i) {
    ZeroUnitState& u = s.units[i];
    const int64_t S = u.layout->shard_numel();
    u.master = s.master_flat.narrow(0, u.shard_offset, S);
    u.grad = s.grad_flat.narrow(0, u.shard_offset, S);
    u.lp_shard = s.lp_flat.narrow(0, u.shard_offset, S);
    if (s.exp_avg_flat.defined()) {
      u.exp_avg = s.exp_avg_flat.narrow(0, u.shard_offset, S);
      u.exp_avg_sq = s.exp_avg_sq_flat.narrow(0, u.shard_offset, S);
    }
    std::vector<at::Tensor> values;
    for (auto& p : u.params) {
      at::Tensor v = p.detach().to(at::kFloat).contiguous();
      s.comm->broadcast(v, 0);
      values.push_back(v);
    }
    at::Tensor master_init = at::empty({S}, fp32.device(u.params.empty() ? device : u.params[0].device()));
    u.layout->pack_shard(values, s.layout_rank(), master_init);
    u.master.copy_(master_init);
    if (!u.lp_shard.is_same(u.master)) u.lp_shard.copy_(u.master);
    // The module's parameters become views into one compute-dtype buffer.
    u.full = at::empty({u.layout->full_numel()}, fp32.dtype(s.options.compute_dtype));
    for (int k = 0; k < static_cast<int>(u.params.size()); ++k) {
      at::Tensor view = u.full.narrow(0, u.layout->param_offset_in_full(k), u.params[k].numel()).view(u.shapes[k]);
      view.copy_(values[k]);
      if (s.options.compute_dtype != s.options.param_dtype) {
        // Compute on the values the low-precision copy holds (fp16-on-CPU runs in fp32 on fp16-rounded values).
        view.copy_(values[k].to(s.options.param_dtype));
      }
      u.params[k].set_data(view);
    }
    u.gathered = true;
    s.add_gathered(bytes_of(u.full));
    if (s.options.stage == 1) {
      u.stage1_grad_accumulator = at::zeros({u.layout->gathered_numel()}, fp32);
    }
    // Gradient hooks: each parameter reports its gradient once per backward.
    for (int k = 0; k < static_cast<int>(u.params.size()); ++k) {
      State* state = state_.get();
      const int unit_idx = static_cast<int>(i);
      u.params[k].register_hook([state, unit_idx, k](const at::Tensor& grad) {
        state->on_param_grad(unit_idx, k, grad);
      });
    }
    if (u.unit) u.unit->attach_unit_hooks(this, static_cast<int>(i));
    if (s.options.stage == 3 && !u.persistent) s.release(u);
  }

  // Set-up held every unit at once; the working-set peak counts from here.
  s.gathered_peak = s.gathered_bytes;

  if (s.options.optimizer.custom_factory) {
    // The escape hatch steps on the master shard directly; its .grad is the
    // reduced gradient partition, unscaled and clipped by step().
    at::Tensor master_leaf = s.master_flat;
    master_leaf.set_requires_grad(true);
    s.custom_master_views = {master_leaf};
    s.custom_optimizer = s.options.optimizer.custom_factory(s.custom_master_views);
    ST_CHECK(s.custom_optimizer != nullptr, "the custom optimizer factory returned null");
  }
  ST_LOG_INFO("zero stage {}: {} units ({} gathered at rest), {} trainable elements sharded over {} ranks; "
              "compute {}, partition {}, reduce {}{}",
              s.options.stage, s.units.size(),
              std::count_if(s.units.begin(), s.units.end(), [](const ZeroUnitState& u) { return u.gathered; }),
              std::accumulate(s.units.begin(), s.units.end(), int64_t{0},
                              [](int64_t a, const ZeroUnitState& u) { return a + u.layout->total_param_numel(); }),
              W, c10::toString(s.options.compute_dtype), c10::toString(s.options.param_dtype),
              c10::toString(s.options.reduce_dtype), s.options.offload_optimizer ? ", optimizer offloaded to CPU" : "");
}

ZeroEngine::~ZeroEngine() {
  for (auto& u : state_->units) {
    if (u.unit) u.unit->attach_unit_hooks(nullptr, -1);
  }
}

std::string ZeroEngine::name() const {
  return state_->options.stage == 0 ? "ddp (zero-0)" : "zero-" + std::to_string(state_->options.stage);
}

void ZeroEngine::begin_forward() {
  State& s = *state_;
  s.current_order.clear();
  s.finish_gather(s.units[0]);
}

void ZeroEngine::before_unit_forward(Unit& unit) {
  State& s = *state_;
  auto it = s.unit_index.find(&unit);
  ST_CHECK(it != s.unit_index.end(), "unit '", unit.unit_class_name(), "' is not managed by this engine");
  const int idx = it->second;
  const std::size_t pos = s.current_order.size();
  s.current_order.push_back(idx);
  if (s.trace_valid && (pos >= s.trace.size() || s.trace[pos] != idx)) {
    ST_LOG_WARN("zero: the unit order changed at forward {} (unit '{}' at position {}): prefetch trace rebuilt",
                s.forward_count + 1, s.units[idx].path, pos);
    s.trace_valid = false;
  }
  s.finish_gather(s.units[idx]);
  s.prefetch_after(s.trace, pos);
}

at::Tensor ZeroEngine::after_unit_forward(Unit& unit, at::Tensor output) {
  State& s = *state_;
  const int idx = s.unit_index.at(&unit);
  ZeroUnitState& u = s.units[idx];
  if (s.release_after_use(u)) s.release(u);
  if (output.requires_grad() && s.options.stage == 3 && !u.persistent) {
    State* state = &s;
    // The gradient of the unit's output arrives just before the unit's own
    // backward runs: gather its parameters then (FSDP's pre-backward hook).
    output.register_hook([state, idx](const at::Tensor&) {
      state->finish_gather(state->units[idx]);
      // Prefetch the unit that runs backward next: the one before in the forward order.
      const auto& order = state->trace_valid ? state->trace : state->current_order;
      std::vector<int> reversed(order.rbegin(), order.rend());
      auto where = std::find(reversed.begin(), reversed.end(), idx);
      if (where != reversed.end()) state->prefetch_after(reversed, static_cast<std::size_t>(where - reversed.begin()));
    });
  }
  return output;
}

at::Tensor ZeroEngine::end_forward(at::Tensor output) {
  State& s = *state_;
  ++s.forward_count;
  if (!s.trace_valid) {
    s.trace = s.current_order;
    s.trace_valid = true;
  }
  return output;
}

void ZeroEngine::backward(const at::Tensor& loss, bool sync) {
  State& s = *state_;
  ST_CHECK(loss.numel() == 1, "backward: the loss must be a scalar, got shape ", loss.sizes());
  at::Tensor scaled = s.scaler.scale() == 1.0 ? loss : loss * s.scaler.scale();
  scaled.backward();
  // Units whose parameters got no gradient this pass (unused in forward)
  // still take part in the collectives with zeros: every rank must issue the
  // same reduce-scatters.
  for (auto& u : s.units) {
    if (u.grads_seen > 0) s.unit_grads_ready(u);
  }
  s.finish_reductions();
  for (auto& u : s.units) {
    for (auto& p : u.params) {
      if (p.grad().defined()) p.mutable_grad() = at::Tensor();
    }
  }
  if (s.options.stage == 1 && sync) s.stage1_reduce_all();
  if (s.options.stage == 3) {
    for (auto& u : s.units) {
      if (!u.persistent) s.release(u);
    }
  }
}

double ZeroEngine::clip_grad_norm(double max_norm) {
  State& s = *state_;
  const double local = kernels::cpu::sum_of_squares(s.grad_flat.is_cpu() ? s.grad_flat : s.grad_flat.cpu());
  at::Tensor total = at::full({1}, local, at::TensorOptions().dtype(at::kDouble));
  s.comm->all_reduce(total, ReduceOp::kSum);
  const double scaled_norm = std::sqrt(total.item<double>());
  const double norm = scaled_norm / s.scaler.scale();
  s.last_grad_norm = std::isfinite(norm) ? norm : -1.0;
  s.clip_coefficient = 1.0;
  if (max_norm > 0 && std::isfinite(norm)) s.clip_coefficient = std::min(1.0, max_norm / (norm + 1e-6));
  return norm;
}

engine::StepResult ZeroEngine::step(double lr) {
  State& s = *state_;
  engine::StepResult result;
  result.loss_scale = s.scaler.scale();
  result.grad_norm = s.last_grad_norm;
  if (s.options.fp16) {
    at::Tensor overflow = at::full({1}, kernels::cpu::has_inf_or_nan(s.grad_flat) ? 1.0f : 0.0f);
    s.comm->all_reduce(overflow, ReduceOp::kMax);
    if (overflow.item<float>() > 0) {
      s.scaler.update(true);
      s.grad_flat.zero_();
      s.clip_coefficient = 1.0;
      s.last_grad_norm = -1.0;
      result.skipped = true;
      return result;
    }
  }
  const double grad_scale = s.clip_coefficient / s.scaler.scale();
  at::Tensor grad = s.grad_flat;
  if (s.options.offload_optimizer) {
    s.host_grad_flat.copy_(s.grad_flat);
    grad = s.host_grad_flat;
  }
  at::Tensor lp_out;
  const bool separate_lp = !s.lp_flat.is_same(s.master_flat);
  if (separate_lp) lp_out = s.options.offload_optimizer ? s.host_lp_flat : s.lp_flat;
  ++s.optimizer_steps;

  if (s.custom_optimizer) {
    at::Tensor& leaf = s.custom_master_views[0];
    leaf.mutable_grad() = grad * grad_scale;
    {
      at::NoGradGuard no_grad;
      s.custom_optimizer->step();
    }
    leaf.mutable_grad() = at::Tensor();
    if (separate_lp) lp_out.copy_(s.master_flat);
  } else {
    const auto& o = s.options.optimizer;
    const int64_t total = s.master_flat.numel();
    const int64_t group = std::max<int64_t>(1, s.options.sub_group_size);
    for (int64_t begin = 0; begin < total; begin += group) {
      const int64_t len = std::min(group, total - begin);
      at::Tensor master = s.master_flat.narrow(0, begin, len);
      at::Tensor g = grad.narrow(0, begin, len);
      at::Tensor lp = separate_lp ? lp_out.narrow(0, begin, len) : at::Tensor();
      at::Tensor* lp_ptr = separate_lp ? &lp : nullptr;
      if (o.type == "SGD") {
        at::Tensor momentum = s.momentum_flat.defined() ? s.momentum_flat.narrow(0, begin, len) : at::Tensor();
        kernels::cpu::fused_sgd(master, s.momentum_flat.defined() ? &momentum : nullptr, g, lp_ptr, lr, o.momentum,
                                o.weight_decay, o.nesterov, grad_scale, s.optimizer_steps == 1);
      } else {
        at::Tensor m = s.exp_avg_flat.narrow(0, begin, len);
        at::Tensor v = s.exp_avg_sq_flat.narrow(0, begin, len);
        kernels::cpu::AdamParams p;
        p.lr = lr;
        p.beta1 = o.beta1;
        p.beta2 = o.beta2;
        p.eps = o.eps;
        p.weight_decay = o.weight_decay;
        p.step = s.optimizer_steps;
        p.adam_w_mode = o.type == "AdamW";
        p.grad_scale = grad_scale;
        kernels::cpu::fused_adam(master, m, v, g, lp_ptr, p);
      }
    }
  }
  if (s.options.offload_optimizer && separate_lp) s.lp_flat.copy_(s.host_lp_flat);
  s.scaler.update(false);
  s.grad_flat.zero_();
  s.clip_coefficient = 1.0;
  s.last_grad_norm = -1.0;
  s.gather_all_after_step();
  return result;
}

void ZeroEngine::zero_grad() {
  State& s = *state_;
  s.grad_flat.zero_();
  for (auto& u : s.units) {
    if (u.stage1_grad_accumulator.defined()) u.stage1_grad_accumulator.zero_();
  }
}

double ZeroEngine::loss_scale() const { return state_->scaler.scale(); }

std::vector<std::pair<std::string, at::Tensor>> ZeroEngine::full_state_dict() {
  State& s = *state_;
  std::vector<std::pair<std::string, at::Tensor>> result;
  for (auto& u : s.units) {
    at::Tensor gathered = u.master.contiguous();
    if (s.options.stage != 0) {
      gathered = at::empty({u.layout->gathered_numel()}, u.master.options());
      s.comm->all_gather(gathered, u.master.contiguous());
    }
    at::Tensor full = at::empty({u.layout->full_numel()}, u.master.options());
    u.layout->unpack(gathered, full);
    for (std::size_t k = 0; k < u.params.size(); ++k) {
      result.emplace_back(u.names[k], full.narrow(0, u.layout->param_offset_in_full(static_cast<int>(k)),
                                                  u.params[k].numel()).view(u.shapes[k]).clone());
    }
  }
  return result;
}

engine::MemoryStats ZeroEngine::memory() const {
  const State& s = *state_;
  engine::MemoryStats m;
  const bool separate_lp = !s.lp_flat.is_same(s.master_flat);
  m.params = separate_lp ? bytes_of(s.lp_flat) : bytes_of(s.master_flat);
  m.master = separate_lp ? bytes_of(s.master_flat) : 0;
  m.grads = bytes_of(s.grad_flat) + bytes_of(s.host_grad_flat);
  for (const auto& u : s.units) m.grads += bytes_of(u.stage1_grad_accumulator);
  m.optimizer = bytes_of(s.exp_avg_flat) + bytes_of(s.exp_avg_sq_flat) + bytes_of(s.momentum_flat);
  m.gathered = s.gathered_bytes;
  m.gathered_peak = s.gathered_peak;
  return m;
}

void ZeroEngine::reset_gathered_peak() { state_->gathered_peak = state_->gathered_bytes; }

const at::Tensor& ZeroEngine::master_partition() const { return state_->master_flat; }
const at::Tensor& ZeroEngine::low_precision_partition() const { return state_->lp_flat; }
int ZeroEngine::num_units() const { return static_cast<int>(state_->units.size()); }

std::vector<ZeroEngine::OwnedRange> ZeroEngine::owned_ranges() const {
  std::vector<OwnedRange> ranges;
  for (const auto& u : state_->units) {
    for (const auto& seg : u.layout->segments_of_rank(state_->layout_rank())) {
      ranges.push_back({u.names[seg.param_index], seg.param_offset, seg.length, u.shard_offset + seg.shard_offset});
    }
  }
  return ranges;
}

}  // namespace shardtrain::zero
