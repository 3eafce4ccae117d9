// The Accelerator: connects the ranks, resolves the config, builds the chosen
// engine around the model, and runs the training step, the metric collectives
// and the checkpoints through it.
#include "shardtrain/accelerator.h"

#include <filesystem>
#include <fstream>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>
#include <iostream>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "checkpoint/checkpoint.h"
#include "checkpoint/export.h"
#include "engine/engine.h"
#include "engine/sharded_engine.h"
#include "engine/lost_update_watch.h"
#include "run_agreement.h"
#include "shardtrain/lr_scheduler.h"
#include "shardtrain/error.h"
#include "shardtrain/logging.h"
#include "shardtrain/nn/linear.h"
#include "engine_factory.h"
#include "precision_plan_of.h"

namespace shardtrain {
namespace {

/// What differs between the batch a checkpoint was trained with (its training
/// state) and this run's: the world, the global batch and its split into
/// micro-batch x accumulation x world. Empty when nothing did, or when the
/// checkpoint predates these fields.
std::string describe_batch_change(const nlohmann::json& saved, const TrainingConfig& config, int64_t accumulation,
                                  int world) {
  if (!saved.contains("train_batch_size") || !saved.contains("world_size")) return "";
  const int64_t saved_world = saved.at("world_size").get<int64_t>();
  const int64_t saved_global = saved.at("train_batch_size").get<int64_t>();
  const int64_t saved_micro = saved.value("micro_batch_size", int64_t{0});
  const int64_t saved_accumulation = saved.value("gradient_accumulation_steps", int64_t{1});
  const int64_t micro = config.train_micro_batch_size_per_gpu.value_or(0);
  const int64_t global = config.train_batch_size.value_or(0);
  if (saved_world == world && saved_global == global && saved_micro == micro && saved_accumulation == accumulation) {
    return "";
  }
  auto split = [](int64_t g, int64_t m, int64_t a, int64_t w) {
    return std::to_string(g) + " (micro-batch " + std::to_string(m) + " x accumulation " + std::to_string(a) +
           " x world " + std::to_string(w) + ")";
  };
  std::string text = "the checkpoint was saved at world " + std::to_string(saved_world) + " with global batch " +
                     split(saved_global, saved_micro, saved_accumulation, saved_world) + ", this run has world " +
                     std::to_string(world) + " and global batch " + split(global, micro, accumulation, world);
  if (saved_global != global) {
    text += "; each step now averages " + std::to_string(global) + " samples instead of " +
            std::to_string(saved_global) + " (pin train_batch_size in the config to keep it across world sizes)";
  }
  return text;
}

MixedPrecision parse_mixed_precision(const std::string& text) {
  if (text == "no") return MixedPrecision::kNo;
  if (text == "fp16") return MixedPrecision::kFp16;
  if (text == "bf16") return MixedPrecision::kBf16;
  ST_THROW(ConfigError, "mixed_precision '", text, "' is not one of no, fp16, bf16");
}

}  // namespace

int64_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return 0;
}

struct Accelerator::State {
  AcceleratorOptions options;
  TrainingConfig config;
  DistEnv env;
  comm::CommunicatorPtr comm;
  std::shared_ptr<torch::nn::Module> module;
  std::unique_ptr<engine::Engine> engine;
  std::unique_ptr<LRScheduler> scheduler;
  PrecisionPlan plan;
  double base_lr = 1e-3;
  int64_t accumulation = 1;
  int64_t micro_in_window = 0;  // backward() calls since the last boundary
  bool window_closed = false;    // the last backward() was the window's last: step() applies the update
  bool close_window_early = false;  // end_accumulation_early(): the next backward() closes the window
  bool clipped_this_window = false;
  StepInfo last;
  bool prepared = false;
  std::map<std::string, int64_t> extras;
  std::unique_ptr<DistributedSampler> sampler;
  std::unique_ptr<engine::LostUpdateWatch> lost_update_watch;
};

Accelerator::Accelerator(AcceleratorOptions options) : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.options = std::move(options);
  if (s.options.config) {
    s.config = *s.options.config;
  } else if (s.options.config_path) {
    s.config = load_config(*s.options.config_path);
  } else if (auto from_env = config_from_environment()) {
    s.config = *from_env;
  }
  if (s.options.mixed_precision) {
    s.config.mixed_precision = parse_mixed_precision(*s.options.mixed_precision);
  }
  if (s.options.gradient_accumulation_steps) s.config.gradient_accumulation_steps = s.options.gradient_accumulation_steps;
  if (s.options.communicator) {
    s.comm = s.options.communicator;
    // The machine layout (HYBRID_SHARD) still comes from the environment when it describes this job.
    try {
      s.env = detect_dist_env();
    } catch (const ConfigError&) {
      s.env = DistEnv();
    }
    if (s.env.world_size != s.comm->world_size() || s.env.rank != s.comm->rank()) {
      s.env.rank = s.comm->rank();
      s.env.world_size = s.comm->world_size();
      s.env.local_world_size = s.comm->world_size();
      s.env.local_rank = s.comm->rank();
    }
  } else {
    s.env = detect_dist_env();
    s.comm = init_distributed(s.env, s.options.init);
  }
  set_log_rank(s.comm->rank());
  if (s.comm->rank() == 0) {
    for (const auto& warning : s.config.warnings) ST_LOG_WARN("config: {}", warning);
  }
}

Accelerator::~Accelerator() = default;

int Accelerator::process_index() const { return state_->comm->rank(); }
int Accelerator::local_process_index() const { return state_->env.local_rank; }
int Accelerator::num_processes() const { return state_->comm->world_size(); }
comm::Communicator& Accelerator::communicator() { return *state_->comm; }
const TrainingConfig& Accelerator::config() const { return state_->config; }
const PrecisionPlan& Accelerator::precision_plan() const { return state_->plan; }

bool Accelerator::materialize_full_weights() const {
  // The backend decides (EnginePlan::rank0_loads_weights), from the config
  // and the world alone: the model's load dtype, its device and its adapters,
  // not known before it is built, do not enter that decision.
  engine::PlanContext context;
  context.world_size = num_processes();
  context.local_world_size = state_->env.local_world_size;
  return !plan_engine(state_->config, context).rank0_loads_weights || process_index() == 0;
}

engine::Engine& Accelerator::engine() {
  ST_CHECK(state_->engine != nullptr, "no engine yet: call accelerator.prepare(model) first");
  return *state_->engine;
}

void Accelerator::prepare_module(std::shared_ptr<torch::nn::Module> module, const OptimizerOptions& optimizer,
                                 const RunInfo& run) {
  comm::CollectiveScope scope("prepare()");
  State& s = *state_;
  ST_CHECK(!s.prepared, "prepare() was already called: one Accelerator drives one model");
  ST_CHECK(module != nullptr, "prepare(): the model is null");
  s.module = std::move(module);

  // Options given in code win over the config's optimizer block, before
  // "auto" resolution (the scheduler's warmup_max_lr "auto" follows the lr).
  if (optimizer.type) s.config.optimizer.type = *optimizer.type;
  if (optimizer.lr) s.config.optimizer.lr = *optimizer.lr;
  if (optimizer.betas) s.config.optimizer.betas = *optimizer.betas;
  if (optimizer.eps) s.config.optimizer.eps = *optimizer.eps;
  if (optimizer.weight_decay) s.config.optimizer.weight_decay = *optimizer.weight_decay;
  if (optimizer.momentum) s.config.optimizer.momentum = *optimizer.momentum;

  AutoContext context;
  context.world_size = num_processes();
  context.micro_batch_size = run.micro_batch_size;
  context.hidden_size = run.hidden_size;
  context.total_steps = run.total_steps;
  context.warmup_steps = run.warmup_steps;
  context.max_grad_norm = run.max_grad_norm;
  s.config = resolve_auto(s.config, context);
  s.accumulation = s.config.gradient_accumulation_steps.value_or(1);

  int64_t num_params = 0, frozen_params = 0, frozen_nf4_bytes = 0;
  bool on_cuda = false;
  std::string load_dtype = run.load_dtype;
  bool load_dtype_seen = false;
  bool frozen_weights_in_fp32 = false;
  for (const auto& p : s.module->parameters()) {
    // uint8 parameters are the NF4 bytes of a quantized base (quantization.h).
    (p.requires_grad() ? num_params : p.scalar_type() == at::kByte ? frozen_nf4_bytes : frozen_params) += p.numel();
    on_cuda = on_cuda || p.is_cuda();
    // The model tells its load dtype (the pure-low-precision rule depends on
    // it): its first floating parameter's.
    if (!load_dtype_seen && at::isFloatingType(p.scalar_type())) {
      load_dtype = p.scalar_type() == at::kBFloat16 ? "bf16" : p.scalar_type() == at::kHalf ? "fp16" : "fp32";
      load_dtype_seen = true;
    }
    frozen_weights_in_fp32 = frozen_weights_in_fp32 || (!p.requires_grad() && p.scalar_type() == at::kFloat);
  }

  // ---- every rank must train the same thing: checked before the engine's
  // first collective, which would otherwise hang or mix different models.
  check_ranks_agree(*s.comm, "resolved config", describe_run(s.config, num_processes(), load_dtype, run.seed));
  check_ranks_agree(*s.comm, "model", describe_model(*s.module));

  // ---- the engine: its plan comes from the backend the config names
  // (engine_factory.h); the precision plan is printed from the same plan.
  s.base_lr = s.config.optimizer.lr.value_or(1e-3);
  engine::PlanContext plan_context;
  plan_context.world_size = num_processes();
  plan_context.local_world_size = s.env.local_world_size;
  plan_context.on_cuda = on_cuda;
  plan_context.load_dtype = load_dtype;
  plan_context.frozen_weights_in_fp32 = frozen_weights_in_fp32;
  plan_context.trains_lora_adapters = !lora_layers(*s.module).empty();
  engine::EnginePlan plan = plan_engine(s.config, plan_context);
  plan.optimizer.custom_factory = optimizer.custom_factory;
  plan.weight_source = run.weight_source;
  s.config.optimizer.type = plan.optimizer.type;
  s.config.optimizer.momentum = plan.optimizer.momentum;
  s.plan = precision_plan_of(plan, num_params, plan_context);
  s.plan.frozen_params = frozen_params;
  s.plan.frozen_nf4_bytes = frozen_nf4_bytes;
  s.engine = make_engine(s.module, s.comm, s.config.distributed_type, std::move(plan));
  s.lost_update_watch = std::make_unique<engine::LostUpdateWatch>(
      s.config.precision_audit,
      s.plan.engine + ": " + s.plan.shard_dtype + " parameters, " +
          (s.plan.no_master() ? std::string("no fp32 master") : s.plan.master_dtype + " master"),
      !s.plan.no_master());
  if (is_main_process() && s.options.print_plan) {
    std::cout << s.plan.to_string() << std::flush;
  }
  s.prepared = true;
}

void Accelerator::prepare_scheduler(int64_t total_steps, std::optional<SchedulerConfig> override_config) {
  State& s = *state_;
  SchedulerConfig config = override_config ? *override_config : s.config.scheduler;
  if (!config.total_num_steps) config.total_num_steps = total_steps;
  if (!config.warmup_max_lr) config.warmup_max_lr = s.base_lr;
  if (!config.warmup_min_lr) config.warmup_min_lr = 0.0;
  s.scheduler = std::make_unique<LRScheduler>(config, s.base_lr);
}

DistributedSampler& Accelerator::prepare_sampler(int64_t dataset_size, uint64_t seed, bool shuffle, bool drop_last) {
  state_->sampler = std::make_unique<DistributedSampler>(dataset_size, num_processes(), process_index(), seed, shuffle,
                                                         drop_last);
  return *state_->sampler;
}

void Accelerator::begin_forward() { engine().begin_forward(); }
void Accelerator::complete_parameters() {
  if (state_->engine) state_->engine->complete_parameters();
}
at::Tensor Accelerator::end_forward(at::Tensor output) { return engine().end_forward(std::move(output)); }

void Accelerator::backward(const at::Tensor& loss) { backward(loss, LossNormalization::kPerRankMean); }

void Accelerator::backward(const at::Tensor& loss, LossNormalization normalization) {
  comm::CollectiveScope scope("backward()");
  State& s = *state_;
  if (s.window_closed) {  // step() was not called: start a new window anyway
    s.micro_in_window = 0;
    s.window_closed = false;
  }
  const bool sync = s.micro_in_window + 1 == s.accumulation || s.close_window_early;
  // The engine divides the summed gradients by the world size (gradient
  // predivide x postdivide); a global-token loss is already a share of the
  // global mean, so it is multiplied back here (exact for powers of two).
  const double factor = normalization == LossNormalization::kGlobalTokens
                            ? static_cast<double>(num_processes())
                            : 1.0 / static_cast<double>(s.accumulation);
  engine().backward(factor == 1.0 ? loss : loss * factor, sync);
  ++s.micro_in_window;
  if (sync) {
    s.window_closed = true;
    s.close_window_early = false;
  }
}

void Accelerator::end_accumulation_early() { state_->close_window_early = true; }

int64_t Accelerator::sum_over_processes(int64_t local_count) {
  comm::CollectiveScope scope("sum_over_processes()");
  // fp64 carries every count below 2^53 exactly; Gloo reduces it on every backend.
  const at::Tensor total = reduce(at::full({1}, static_cast<double>(local_count), at::kDouble), "sum");
  return static_cast<int64_t>(total.item<double>());
}

bool Accelerator::sync_gradients() const { return state_->window_closed; }
int64_t Accelerator::gradient_accumulation_steps() const { return state_->accumulation; }

double Accelerator::clip_grad_norm(double max_norm) {
  comm::CollectiveScope scope("clip_grad_norm()");
  State& s = *state_;
  if (!sync_gradients()) return -1.0;  // gradients are incomplete until the window ends
  s.clipped_this_window = true;
  return engine().clip_grad_norm(max_norm);
}

double Accelerator::current_lr() const {
  const State& s = *state_;
  return s.scheduler ? s.scheduler->lr_at(s.last.step) : s.base_lr;
}

void Accelerator::step() {
  comm::CollectiveScope scope("step()");
  State& s = *state_;
  if (!sync_gradients()) return;
  const double clip = s.config.gradient_clipping.value_or(0.0);
  double norm = -1;
  if (!s.clipped_this_window && clip > 0) norm = engine().clip_grad_norm(clip);
  const double lr = current_lr();
  // The engine fills what it knows of the step; the counts and the lr are the Accelerator's.
  StepInfo result = engine().step(lr);
  result.lr = lr;
  if (result.grad_norm < 0) result.grad_norm = norm;
  result.step = s.last.step + (result.skipped ? 0 : 1);
  result.skipped_total = s.last.skipped_total + (result.skipped ? 1 : 0);
  result.non_finite_total = s.last.non_finite_total + (result.non_finite ? 1 : 0);
  s.last = result;
  s.micro_in_window = 0;
  s.window_closed = false;
  s.close_window_early = false;  // asked for after the window's last backward: it ended this window anyway
  s.clipped_this_window = false;
  if (result.non_finite) {
    // The update was not applied and the gradients are zeroed: stopping here
    // leaves the weights and optimizer state as they were after the last good step.
    ST_CHECK(s.config.non_finite_policy != NonFinitePolicy::kStop, "after step ", s.last.step,
             ": the gradients hold inf or NaN (a non-finite loss, or an overflow in bf16/fp32); the update was not "
             "applied and non_finite_policy: stop ends the run here. Look at the loss and the learning rate, or "
             "set non_finite_policy: skip to skip such steps");
    if (is_main_process()) {
      ST_LOG_WARN("skipped the optimizer step after step {}: the gradients hold inf or NaN ({} such step(s) so "
                  "far); the weights are unchanged. non_finite_policy: stop makes this an error",
                  s.last.step, s.last.non_finite_total);
    }
  }
  if (s.lost_update_watch) {
    // Every rank sees the same reduced fraction; one of them speaks.
    auto warning = s.lost_update_watch->observe(s.last.step, result.lost_update_frac, lr);
    if (warning && is_main_process()) ST_LOG_WARN("{}", *warning);
  }
}

void Accelerator::zero_grad() {
  if (sync_gradients() || state_->micro_in_window == 0) engine().zero_grad();
}

const StepInfo& Accelerator::last_step() const { return state_->last; }

at::Device Accelerator::device() const { return state_->comm->device(); }

at::Tensor Accelerator::gather_for_metrics(const at::Tensor& tensor) {
  comm::CollectiveScope scope("gather_for_metrics()");
  at::Tensor input = tensor.to(device()).contiguous();
  const bool widen = !comm::is_supported_dtype(input.scalar_type());
  if (widen) input = input.to(at::isFloatingType(input.scalar_type()) ? at::kFloat : at::kLong);
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  if (shape.empty()) shape.push_back(1);
  shape[0] *= num_processes();
  at::Tensor output = at::empty(shape, input.options());
  communicator().all_gather(output, input);
  return output.to(tensor.device(), tensor.scalar_type());
}

at::Tensor Accelerator::reduce(const at::Tensor& tensor, const std::string& op) {
  comm::CollectiveScope scope("reduce()");
  // A copy on the communicator's device (to() alone would alias a tensor already there).
  at::Tensor copy = tensor.to(device(), /*non_blocking=*/false, /*copy=*/true).contiguous();
  if (op == "sum") communicator().all_reduce(copy, comm::ReduceOp::kSum);
  else if (op == "mean") communicator().all_reduce(copy, comm::ReduceOp::kAvg);
  else if (op == "max") communicator().all_reduce(copy, comm::ReduceOp::kMax);
  else ST_THROW(ConfigError, "reduce: op '", op, "' is not one of sum, mean, max");
  return copy.to(tensor.device());
}

void Accelerator::wait_for_everyone() {
  comm::CollectiveScope scope("wait_for_everyone()");
  communicator().barrier();
}

void Accelerator::print(const std::string& text) const {
  if (is_main_process()) std::cout << text << std::endl;
}

std::vector<std::pair<std::string, at::Tensor>> Accelerator::full_state_dict() {
  comm::CollectiveScope scope("full_state_dict()");
  return engine().full_state_dict();
}

std::map<std::string, int64_t>& Accelerator::checkpoint_extras() { return state_->extras; }

std::string Accelerator::save_state(const std::string& dir, const std::string& tag) {
  comm::CollectiveScope scope("save_state()");
  State& s = *state_;
  engine::Engine& running = engine();
  ST_CHECK(s.micro_in_window == 0 || s.window_closed,
           "save_state in the middle of a gradient-accumulation window (", s.micro_in_window, " of ", s.accumulation,
           " micro-batches done): the accumulated gradients are not saved; call it after accelerator.step()");
  // The scheduler is a pure function of the step, so the step is its state.
  const int64_t global_batch = s.config.train_batch_size.value_or(0);
  nlohmann::json training = {{"step", s.last.step},
                             {"scheduler_step", s.last.step},
                             {"samples_seen", (s.last.step + s.last.skipped_total) * global_batch},
                             {"skipped_total", s.last.skipped_total},
                             {"non_finite_total", s.last.non_finite_total},
                             {"world_size", num_processes()},
                             {"train_batch_size", global_batch},
                             {"micro_batch_size", s.config.train_micro_batch_size_per_gpu.value_or(0)},
                             {"gradient_accumulation_steps", s.accumulation},
                             {"optimizer_steps", running.optimizer_steps()},
                             {"loss_scaler", running.loss_scaler_state()},
                             {"extras", s.extras}};
  if (s.sampler) {
    const SamplerState sampler = s.sampler->state();
    training["sampler"] = {{"seed", sampler.seed},
                           {"epoch", sampler.epoch},
                           {"position", sampler.position},
                           {"dataset_size", sampler.dataset_size}};
  }
  try {
    // Named by the steps taken, skipped ones too (DeepSpeed's global_step{N},
    // the Trainer's checkpoint-{global_step}): two saves apart never share a name.
    const std::string default_tag = "step_" + std::to_string(s.last.step + s.last.skipped_total);
    return checkpoint::save(running, *s.comm, dir, tag.empty() ? default_tag : tag,
                            training, to_yaml(s.config), s.plan.to_string(), s.options.checkpoint_total_limit);
  } catch (const CheckpointSaveError& failure) {
    if (s.config.checkpoint_on_error == CheckpointErrorPolicy::kStop) throw;
    if (is_main_process()) {
      ST_LOG_WARN("{}. Training goes on (checkpoint_on_error: continue); the next save_state tries again. "
                  "checkpoint_on_error: stop ends the run instead",
                  failure.what());
    }
    return "";
  }
}

void Accelerator::save_model(const std::string& out_dir, const std::string& dtype, uint64_t max_shard_bytes,
                             const std::string& config_json) {
  comm::CollectiveScope scope("save_model()");
  State& s = *state_;
  engine::Engine& running = engine();  // refuses a call before prepare(), where the plan is not made yet
  std::string resolved = dtype;
  if (resolved == "auto") {
    // What Accelerate's save_model writes from each peer's state dict.
    // DeepSpeed holds the module in the training dtype: its 16-bit state dict
    // at stages 0-2, and at stage 3 with stage3_gather_16bit_weights_on_model_save
    // (without it Accelerate refuses and points at zero_to_fp32, the fp32
    // master written here). FSDP's full state dict holds the flat
    // parameters' dtype: the low one in pure mode (no fp32 master exists),
    // fp32 otherwise; so do DDP and a single process.
    const bool deepspeed_16bit = s.config.distributed_type == DistributedType::kDeepSpeed &&
                                 (s.config.zero_stage() < 3 || s.config.zero.stage3_gather_16bit_weights_on_model_save);
    resolved = deepspeed_16bit || s.plan.no_master() ? s.plan.shard_dtype : "fp32";
  }
  ST_CHECK_T(ConfigError, resolved == "fp32" || resolved == "bf16" || resolved == "fp16", "save_model: dtype '",
             dtype, "' is not one of auto, fp32, bf16, fp16");
  checkpoint::ExportOptions options;
  options.dtype = resolved;
  options.max_shard_bytes = max_shard_bytes;
  options.config_json_path = config_json;
  for (const auto& item : s.module->named_parameters()) {
    // Every rank has the same parameters, so every rank refuses alike.
    ST_CHECK_T(ConfigError, item.value().scalar_type() != at::kByte, "save_model: ", item.key(),
               " is a quantized NF4 base weight (quantize_frozen_base); a Hugging Face export needs the original "
               "weights. Save the adapter (save_lora_adapter) and merge it onto the unquantized base (the fine-tune "
               "examples: --lora-adapter DIR --merge-lora on the original model)");
  }
  checkpoint::ExportSelection selection;
  for (const auto& [path, linear] : lora_layers(*s.module)) selection.merge_lora[path] = linear->lora_scaling;
  checkpoint::save_model(running, *s.comm, out_dir, options, selection);
}

void Accelerator::save_lora_adapter(const std::string& out_dir, const LoraConfig& config) {
  comm::CollectiveScope scope("save_lora_adapter()");
  State& s = *state_;
  engine::Engine& running = engine();  // refuses a call before prepare()
  // The config is written as the adapter's meaning: it must be the one applied.
  const auto adapted = lora_layers(*s.module);
  ST_CHECK_T(ConfigError, !adapted.empty(), "save_lora_adapter: the model has no LoRA adapter (apply_lora it before "
             "prepare()); to save the whole model use save_model");
  for (const auto& [path, linear] : adapted) {
    ST_CHECK_T(ConfigError, linear->lora_A->weight.size(0) == config.r && linear->lora_scaling == config.scaling(),
               "save_lora_adapter: ", path, " has an adapter of rank ", linear->lora_A->weight.size(0),
               " scaled by ", linear->lora_scaling, ", but the config to save says r ", config.r, " scaled by ",
               config.scaling(), ": pass the LoraConfig that apply_lora applied");
  }
  // The adapters, and what the config trains besides (biases, modules_to_save).
  std::set<std::string> trainable;
  for (const auto& item : s.module->named_parameters()) {
    if (item.value().requires_grad()) trainable.insert(item.key());
  }
  checkpoint::ExportOptions options;
  options.dtype = "fp32";  // PEFT keeps adapters in fp32
  options.weights_stem = "adapter_model";
  options.max_shard_bytes = std::numeric_limits<uint64_t>::max();  // PEFT reads one adapter file
  options.text_files = {{"adapter_config.json", config.to_peft_json()}};
  checkpoint::ExportSelection selection;
  selection.include = [&](const std::string& name) { return trainable.count(name) != 0; };
  selection.rename = peft_adapter_key;
  checkpoint::save_model(running, *s.comm, out_dir, options, selection);
}

void Accelerator::load_state(const std::string& dir, const std::string& tag) {
  comm::CollectiveScope scope("load_state()");
  State& s = *state_;
  engine::Engine& running = engine();
  const nlohmann::json training = checkpoint::load(running, *s.comm, dir, tag);
  s.last = StepInfo();
  s.last.step = training.at("step").get<int64_t>();
  s.last.skipped_total = training.at("skipped_total").get<int64_t>();
  s.last.non_finite_total = training.value("non_finite_total", int64_t{0});  // absent before this field existed
  running.set_optimizer_steps(training.at("optimizer_steps").get<int64_t>());
  running.load_loss_scaler_state(training.at("loss_scaler").get<std::vector<double>>());
  s.extras = training.at("extras").get<std::map<std::string, int64_t>>();
  if (s.sampler && training.contains("sampler")) {
    SamplerState sampler;
    sampler.seed = training["sampler"].at("seed").get<uint64_t>();
    sampler.epoch = training["sampler"].at("epoch").get<int64_t>();
    sampler.position = training["sampler"].at("position").get<int64_t>();
    sampler.world_size = training.value("world_size", num_processes());
    sampler.dataset_size = training["sampler"].value("dataset_size", int64_t{-1});
    if (is_main_process() && sampler.dataset_size >= 0 && sampler.dataset_size != s.sampler->dataset_size()) {
      ST_LOG_WARN("resuming {} at step {}: the training data has {} rows, the checkpoint's sampler was over {}: "
                  "the data changed (the data file, or what makes its rows: sequence length, packing). The run "
                  "goes on over this run's rows in epoch {}'s order after the same number of samples; resume with "
                  "the same data to continue the same order",
                  dir, training.at("step").get<int64_t>(), s.sampler->dataset_size(), sampler.dataset_size,
                  sampler.epoch);
    }
    s.sampler->load_state(sampler);
  }
  s.micro_in_window = 0;
  s.window_closed = false;
  s.close_window_early = false;
  s.clipped_this_window = false;
  if (is_main_process()) {
    const std::string changed = describe_batch_change(training, s.config, s.accumulation, num_processes());
    if (!changed.empty()) {
      ST_LOG_WARN("resuming {} at step {}: {}. The run goes on with this run's config, as DeepSpeed and "
                  "Accelerate do; the learning-rate schedule continues at step {}, and the sampler after the "
                  "same number of samples", dir, s.last.step, changed, s.last.step);
    }
  }
}

MemoryReport Accelerator::memory() const {
  MemoryReport report;
  if (state_->engine) report = state_->engine->memory();
  report.peak_rss = peak_rss_bytes();
  return report;
}

void Accelerator::reset_memory_peaks() {
  if (state_->engine) state_->engine->reset_memory_peaks();
}

TrafficReport Accelerator::traffic() const { return state_->engine ? state_->engine->traffic() : TrafficReport(); }

void Accelerator::reset_traffic() {
  if (state_->engine) state_->engine->reset_traffic();
}

}  // namespace shardtrain
