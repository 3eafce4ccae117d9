// The tiny training run the tests and examples share: its synthetic batches,
// its model, one training run under any engine, and the plain-LibTorch
// data-parallel reference the engines are held to bit for bit (tiny_train.h).
#include "tiny/tiny_train.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iostream>

#include <nlohmann/json.hpp>

#include "shardtrain/lr_scheduler.h"
#include "shardtrain/comm/rendezvous.h"
#include "shardtrain/device.h"
#include "shardtrain/error.h"
#include "step_metrics.h"
#include "tiny/reference_adam.h"

namespace tiny {
namespace {

uint64_t mix(uint64_t x) {
  // splitmix64: a fixed, platform-independent hash for the synthetic data.
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// Samples of one micro-batch: global step `step`, micro-batch `micro` of the
/// accumulation window, data-parallel rank `rank` of `world`.
at::Tensor batch_of(uint64_t seed, const TinyConfig& config, int64_t step, int64_t micro, int rank, int world,
                    int64_t micro_batch, int64_t accumulation) {
  const int64_t global = static_cast<int64_t>(world) * micro_batch * accumulation;
  const int64_t first = step * global + (micro * world + rank) * micro_batch;
  std::vector<at::Tensor> rows;
  for (int64_t i = 0; i < micro_batch; ++i) rows.push_back(synthetic_sample(seed, first + i, config));
  return at::stack(rows);
}

shardtrain::TrainingConfig load(const TinyRunOptions& options) {
  if (options.config) return *options.config;
  if (options.config_path) return shardtrain::load_config(*options.config_path);
  if (auto env = shardtrain::config_from_environment()) return *env;
  return {};
}

}  // namespace

at::Tensor next_token_loss(const at::Tensor& logits, const at::Tensor& tokens) {
  const int64_t V = logits.size(-1);
  at::Tensor inputs = logits.narrow(1, 0, logits.size(1) - 1).reshape({-1, V});
  at::Tensor targets = tokens.narrow(1, 1, tokens.size(1) - 1).reshape({-1});
  return at::cross_entropy_loss(inputs, targets);
}

at::Tensor synthetic_sample(uint64_t seed, int64_t index, const TinyConfig& config) {
  const uint64_t h = mix(seed * 1000003ull + static_cast<uint64_t>(index));
  const int64_t start = static_cast<int64_t>(h % static_cast<uint64_t>(config.vocab));
  const int64_t stride = 1 + static_cast<int64_t>((h >> 20) % 7);
  return (at::arange(config.seq_len, at::kLong) * stride + start).remainder(config.vocab);
}

namespace {

std::ofstream open_metrics(const std::string& path) {
  std::ofstream metrics(path);
  ST_CHECK(metrics.good(), "cannot write the metrics file '", path, "'");
  return metrics;
}

/// One line of the metrics file. The engine run and the plain reference write
/// the same fields (the reference's StepInfo holds only lr and grad_norm), so
/// one tool (shardtrain plot, a diff) reads both.
void write_metrics(std::ofstream& out, int64_t step, double loss, const shardtrain::StepInfo& info, int64_t tokens,
                   double seconds, const shardtrain::MemoryReport& memory) {
  nlohmann::json line = examples::step_metrics(step, loss, info);
  line["tokens"] = tokens;
  line["tokens_per_s"] = tokens / seconds;
  line["step_time_s"] = seconds;
  line["mem"] = {{"params", memory.params},       {"grads", memory.grads},
                 {"master", memory.master},       {"optimizer", memory.optimizer},
                 {"gathered", memory.gathered_peak}, {"peak_rss", memory.peak_rss}};
  out << line.dump() << "\n" << std::flush;
}

}  // namespace

TinyRunResult run_tiny(const TinyRunOptions& options) {
  shardtrain::AcceleratorOptions accelerator_options;
  accelerator_options.config = load(options);
  accelerator_options.communicator = options.communicator;
  accelerator_options.checkpoint_total_limit = options.keep_last;
  const at::Device device = options.communicator
                                ? options.communicator->device()
                                : shardtrain::resolve_device(options.device, shardtrain::detect_dist_env().local_rank);
  if (!options.communicator) accelerator_options.init.backend = shardtrain::backend_for(device);
  shardtrain::Accelerator accelerator(accelerator_options);

  // Initialised on the CPU, then moved: a seed gives the same weights on every device.
  torch::manual_seed(options.seed);
  TinyModel model(options.model);
  model->to(device, options.load_dtype == "bf16" ? at::kBFloat16 : at::kFloat);
  shardtrain::OptimizerOptions optimizer;
  optimizer.lr = options.lr;
  shardtrain::RunInfo run;
  run.hidden_size = options.model.hidden;
  run.micro_batch_size = options.micro_batch;
  run.total_steps = options.steps;
  run.load_dtype = options.load_dtype;
  auto prepared = accelerator.prepare(model, optimizer, run);
  accelerator.prepare_scheduler(options.steps);

  const int64_t accumulation = accelerator.gradient_accumulation_steps();
  const int rank = accelerator.process_index();
  const int world = accelerator.num_processes();
  std::ofstream metrics;
  if (!options.metrics_out.empty() && accelerator.is_main_process()) metrics = open_metrics(options.metrics_out);
  TinyRunResult result;
  result.plan = accelerator.precision_plan();
  int first_step = 0;
  if (!options.resume_dir.empty()) {
    accelerator.load_state(options.resume_dir);
    first_step = static_cast<int>(accelerator.last_step().step);
  }
  const int last_step = options.stop_after > 0 ? std::min(options.steps, first_step + options.stop_after) : options.steps;
  for (int step = first_step; step < last_step; ++step) {
    const auto start = std::chrono::steady_clock::now();
    double loss_sum = 0;
    for (int64_t micro = 0; micro < accumulation; ++micro) {
      at::Tensor tokens = batch_of(options.seed, options.model, step, micro, rank, world, options.micro_batch,
                                   accumulation)
                              .to(device);
      at::Tensor loss = next_token_loss(prepared(tokens), tokens);
      accelerator.backward(loss);
      loss_sum += loss.item<double>();
    }
    accelerator.step();
    accelerator.zero_grad();
    at::Tensor mean_loss = accelerator.reduce(at::full({1}, loss_sum / accumulation, at::kDouble), "mean");
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const auto& info = accelerator.last_step();
    result.losses.push_back(mean_loss.item<double>());
    result.grad_norms.push_back(info.grad_norm);
    result.lost_update_fracs.push_back(info.lost_update_frac);
    result.lost_update_fracs_if_bf16.push_back(info.lost_update_frac_if_bf16);
    if (metrics.is_open()) {
      const int64_t tokens = static_cast<int64_t>(world) * options.micro_batch * accumulation * options.model.seq_len;
      write_metrics(metrics, step + 1, result.losses.back(), info, tokens, seconds, accelerator.memory());
    }
    if (!options.save_dir.empty() && options.save_every > 0 && (step + 1) % options.save_every == 0) {
      accelerator.save_state(options.save_dir);
    }
    if (!options.quiet && accelerator.is_main_process() &&
        (step == 0 || (step + 1) % std::max(1, accelerator.config().steps_per_print) == 0 || step + 1 == options.steps)) {
      std::cout << "step " << step + 1 << "/" << options.steps << "  loss " << result.losses.back() << "  lr "
                << info.lr << "  grad_norm " << info.grad_norm << (info.skipped ? "  (skipped: fp16 overflow)" : "")
                << std::endl;
    }
  }
  result.skipped_steps = accelerator.last_step().skipped_total;
  result.memory = accelerator.memory();
  result.final_params = accelerator.full_state_dict();
  return result;
}

namespace {

/// What both references build before their loops: the model at the engine
/// run's starting values, the optimizer (torch's SGD, the engines' Adam
/// arithmetic) and the schedule.
struct ReferenceSetup {
  shardtrain::TrainingConfig config;
  int64_t accumulation = 1;
  TinyModel model{nullptr};
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<shardtrain::LRScheduler> scheduler;
  double clip = 0;
};

ReferenceSetup make_reference(const TinyRunOptions& options, int world_size) {
  shardtrain::AutoContext context;
  context.world_size = world_size;
  context.micro_batch_size = options.micro_batch;
  context.hidden_size = options.model.hidden;
  context.total_steps = options.steps;
  shardtrain::TrainingConfig raw = load(options);
  if (options.lr) raw.optimizer.lr = *options.lr;  // as the Accelerator applies it: before "auto" resolution
  ReferenceSetup setup;
  setup.config = shardtrain::resolve_auto(raw, context);
  setup.accumulation = setup.config.gradient_accumulation_steps.value_or(1);

  torch::manual_seed(options.seed);
  setup.model = TinyModel(options.model);
  if (options.load_dtype == "bf16") {
    // Same starting values as the engine run, which loads bf16 and upcasts its master.
    setup.model->to(at::kBFloat16);
    setup.model->to(at::kFloat);
  }
  const auto& oc = setup.config.optimizer;
  const double lr = options.lr.value_or(oc.lr.value_or(1e-3));
  const auto betas = oc.betas.value_or(std::array<double, 2>{0.9, 0.999});
  std::string type = oc.type;
  if (type == "Adam" && oc.adam_w_mode.value_or(false)) type = "AdamW";
  auto params = setup.model->parameters();
  if (type == "AdamW" || type == "Adam") {
    // The engines' per-element Adam arithmetic (reference_adam.h says why).
    const bool decoupled = type == "AdamW";
    setup.optimizer = std::make_unique<ReferenceAdam>(
        params, torch::optim::AdamWOptions(lr).betas({betas[0], betas[1]}).eps(oc.eps.value_or(1e-8))
                    .weight_decay(oc.weight_decay.value_or(0.0)), decoupled);  // resolve_auto set it
  } else {
    setup.optimizer = std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(lr).momentum(oc.momentum).weight_decay(oc.weight_decay.value_or(0.0))
                    .nesterov(oc.nesterov));
  }
  shardtrain::SchedulerConfig schedule = setup.config.scheduler;
  if (!schedule.total_num_steps) schedule.total_num_steps = options.steps;
  if (!schedule.warmup_max_lr) schedule.warmup_max_lr = lr;
  if (!schedule.warmup_min_lr) schedule.warmup_min_lr = 0.0;
  setup.scheduler = std::make_unique<shardtrain::LRScheduler>(schedule, lr);
  setup.clip = setup.config.gradient_clipping.value_or(0.0);
  return setup;
}

/// The plain loop's model state in the engine's terms: fp32 parameters and
/// gradients, no separate master, torch's optimizer state, nothing gathered.
shardtrain::MemoryReport reference_memory(ReferenceSetup& setup) {
  shardtrain::MemoryReport memory;
  for (const auto& p : setup.model->parameters()) {
    memory.params += p.numel() * static_cast<int64_t>(p.element_size());
    if (p.grad().defined()) memory.grads += p.grad().numel() * static_cast<int64_t>(p.grad().element_size());
  }
  auto bytes = [](const at::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; };
  for (const auto& entry : setup.optimizer->state()) {
    const torch::optim::OptimizerParamState* state = entry.second.get();
    if (const auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(state)) {
      memory.optimizer += bytes(adam->exp_avg()) + bytes(adam->exp_avg_sq());
    } else if (const auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(state)) {
      memory.optimizer += bytes(adamw->exp_avg()) + bytes(adamw->exp_avg_sq());
    } else if (const auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(state)) {
      memory.optimizer += bytes(sgd->momentum_buffer());
    }
  }
  memory.peak_rss = shardtrain::peak_rss_bytes();
  return memory;
}

void finish_reference(ReferenceSetup& setup, TinyRunResult& result) {
  for (const auto& item : setup.model->named_parameters()) {
    result.final_params.emplace_back(item.key(), item.value().detach().to(at::kCPU, at::kFloat, false, true));
  }
}

}  // namespace

TinyRunResult run_tiny_reference(const TinyRunOptions& options, int world_size) {
  ReferenceSetup setup = make_reference(options, world_size);
  TinyRunResult result;
  std::ofstream metrics;
  if (!options.metrics_out.empty()) metrics = open_metrics(options.metrics_out);
  for (int step = 0; step < options.steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<at::Tensor> rows;
    for (int64_t micro = 0; micro < setup.accumulation; ++micro) {
      for (int r = 0; r < world_size; ++r) {
        rows.push_back(batch_of(options.seed, options.model, step, micro, r, world_size, options.micro_batch,
                                setup.accumulation));
      }
    }
    at::Tensor tokens = at::cat(rows);
    setup.optimizer->zero_grad();
    at::Tensor loss = next_token_loss(setup.model->forward(tokens), tokens);
    loss.backward();
    double norm = -1;
    if (setup.clip > 0) norm = torch::nn::utils::clip_grad_norm_(setup.model->parameters(), setup.clip);
    for (auto& group : setup.optimizer->param_groups()) group.options().set_lr(setup.scheduler->lr_at(step));
    setup.optimizer->step();
    result.losses.push_back(loss.item<double>());
    result.grad_norms.push_back(norm);
    if (metrics.is_open()) {
      shardtrain::StepInfo info;
      info.lr = setup.scheduler->lr_at(step);
      info.grad_norm = norm;
      write_metrics(metrics, step + 1, result.losses.back(), info, tokens.numel(),
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                    reference_memory(setup));
    }
  }
  finish_reference(setup, result);
  return result;
}

TinyRunResult run_tiny_data_parallel_reference(const TinyRunOptions& options, int world_size,
                                               DataParallelArithmetic arithmetic) {
  ReferenceSetup setup = make_reference(options, world_size);
  const int local = arithmetic.local_world_size > 0 ? arithmetic.local_world_size : world_size;
  ST_CHECK(world_size % local == 0, "local_world_size ", local, " does not divide world size ", world_size);
  const bool low_precision = arithmetic.compute_dtype != at::kFloat;
  const at::ScalarType reduce_dtype = arithmetic.reduce_dtype.value_or(arithmetic.compute_dtype);
  ST_CHECK(!low_precision || local == world_size, "the low-precision reference covers one machine only");
  auto params = setup.model->parameters();
  // The model forward and backward run on: the fp32 master itself, or a
  // low-precision copy refreshed from it before every step.
  TinyModel compute_model = setup.model;
  if (low_precision) {
    torch::manual_seed(options.seed);
    compute_model = TinyModel(options.model);
    compute_model->to(arithmetic.compute_dtype);
  }
  auto compute_params = compute_model->parameters();
  // Sum over ranks as the engines' collectives add: in rank order within a
  // machine, then the machines in order.
  auto reduce_over_ranks = [&](const std::vector<std::vector<at::Tensor>>& per_rank, std::size_t p) {
    at::Tensor total;
    for (int machine = 0; machine < world_size / local; ++machine) {
      // A low-precision reduction carries each rank's contribution in its
      // dtype (a ZeRO-1 fp32 accumulator is rounded to it first).
      auto carried = [&](int r) {
        const at::Tensor& g = per_rank[r][p];
        return low_precision ? g.to(reduce_dtype).to(at::kFloat) : g.to(at::kFloat);
      };
      at::Tensor partial = carried(machine * local).clone();
      for (int r = machine * local + 1; r < (machine + 1) * local; ++r) partial.add_(carried(r));
      total = total.defined() ? total.add_(partial) : partial;
    }
    total.div_(world_size);
    // A low-precision reduction hands back its dtype: the fp32 mean, rounded once.
    return low_precision ? total.to(reduce_dtype).to(at::kFloat) : total;
  };
  TinyRunResult result;
  for (int step = 0; step < options.steps; ++step) {
    std::vector<at::Tensor> summed(params.size());
    std::vector<std::vector<at::Tensor>> rank_accumulated(world_size);  // accumulate_before_reduce
    std::vector<double> rank_losses(world_size, 0.0);
    if (low_precision) {
      torch::NoGradGuard no_grad;
      for (std::size_t i = 0; i < params.size(); ++i) compute_params[i].copy_(params[i]);
    }
    for (int64_t micro = 0; micro < setup.accumulation; ++micro) {
      std::vector<std::vector<at::Tensor>> micro_grads(world_size);
      for (int r = 0; r < world_size; ++r) {
        at::Tensor tokens = batch_of(options.seed, options.model, step, micro, r, world_size, options.micro_batch,
                                     setup.accumulation);
        for (auto& p : compute_params) p.mutable_grad() = at::Tensor();
        at::Tensor loss = next_token_loss(compute_model->forward(tokens), tokens);
        rank_losses[r] += loss.item<double>();
        // Accelerator::backward divides by the accumulation steps (a power of two in the tests: exact).
        (loss / static_cast<double>(setup.accumulation)).backward();
        for (auto& p : compute_params) micro_grads[r].push_back(p.grad().detach().clone());
        if (arithmetic.accumulate_before_reduce) {
          if (rank_accumulated[r].empty()) {  // the engine's fp32 accumulator: 0 + g
            for (const auto& g : micro_grads[r]) rank_accumulated[r].push_back(g.to(at::kFloat, false, /*copy=*/true));
          } else {
            for (std::size_t i = 0; i < params.size(); ++i) rank_accumulated[r][i].add_(micro_grads[r][i]);
          }
        }
      }
      if (!arithmetic.accumulate_before_reduce) {
        for (std::size_t i = 0; i < params.size(); ++i) {
          // Each reduced gradient lands in the shard's gradient dtype, where the sum is kept.
          at::Tensor reduced = reduce_over_ranks(micro_grads, i).to(arithmetic.grad_dtype);
          summed[i] = summed[i].defined() ? summed[i].add_(reduced) : reduced;
        }
      }
    }
    if (arithmetic.accumulate_before_reduce) {
      for (std::size_t i = 0; i < params.size(); ++i) summed[i] = reduce_over_ranks(rank_accumulated, i);
    }
    for (auto& g : summed) g = g.to(at::kFloat);
    double norm = -1;
    if (setup.clip > 0) {
      double squares = 0;
      for (const auto& g : summed) squares += g.to(at::kDouble).pow(2).sum().item<double>();
      norm = std::sqrt(squares);
      const double coefficient = std::min(1.0, setup.clip / (norm + 1e-6));
      for (auto& g : summed) g.mul_(coefficient);  // g * float(coefficient), as the fused kernels scale
    }
    setup.optimizer->zero_grad();
    for (std::size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = summed[i];
    for (auto& group : setup.optimizer->param_groups()) group.options().set_lr(setup.scheduler->lr_at(step));
    setup.optimizer->step();
    // The engine run's loss: each rank's mean over its micro-batches, averaged over ranks in rank order.
    double loss_total = 0;
    for (int r = 0; r < world_size; ++r) loss_total += rank_losses[r] / static_cast<double>(setup.accumulation);
    result.losses.push_back(loss_total / world_size);
    result.grad_norms.push_back(norm);
  }
  finish_reference(setup, result);
  return result;
}

}  // namespace tiny
