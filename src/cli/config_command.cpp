// `shardtrain config check|convert`: read a config the way a run would and
// show what it resolves to, or express it for the other engine.
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "shardtrain/config.h"
#include "shardtrain/precision_plan.h"
#include "shardtrain/error.h"

namespace shardtrain::cli {
namespace {

struct CheckFlags {
  std::string file;
  int world_size = 0;
  int64_t micro_batch = 0;
  int64_t hidden_size = 0;
  int64_t steps = 0;
  int64_t warmup_steps = 0;
  int64_t num_params = 7000000000;  // a 7B model, the seeds' size, unless told
  std::string device = "cpu";
};

struct ConvertFlags {
  std::string file;
  std::string target;
  std::string output;
};

/// What `config check` leaves to the run, one "key: auto (from ...)" line
/// each: the values the file does not determine and no flag gave.
std::vector<std::string> left_to_the_run(const TrainingConfig& resolved) {
  std::vector<std::string> lines;
  auto add = [&](bool unset, const std::string& key, const std::string& source) {
    if (unset) lines.push_back(key + ": auto (" + source + ")");
  };
  const bool no_micro = !resolved.train_micro_batch_size_per_gpu;
  add(no_micro, "train_micro_batch_size_per_gpu", "from the data loader: its batch size; --micro-batch fills it");
  add(!resolved.gradient_accumulation_steps, "gradient_accumulation_steps",
      "from the run: its gradient_accumulation_steps, 1 unless set");
  add(!resolved.train_batch_size, "train_batch_size",
      "from the data loader: micro batch x gradient accumulation x world size");
  add(!resolved.gradient_clipping, "gradient_clipping", "from the run: its max_grad_norm, 1.0 unless set");
  const ZeroConfig& zero = resolved.zero;
  add(!zero.reduce_bucket_size, "zero_optimization.reduce_bucket_size",
      "from the model: hidden_size^2; --hidden-size fills it");
  add(!zero.stage3_prefetch_bucket_size, "zero_optimization.stage3_prefetch_bucket_size",
      "from the model: 0.9 x hidden_size^2; --hidden-size fills it");
  add(!zero.stage3_param_persistence_threshold, "zero_optimization.stage3_param_persistence_threshold",
      "from the model: 10 x hidden_size; --hidden-size fills it");
  const OptimizerConfig& optimizer = resolved.optimizer;
  add(!optimizer.lr, "optimizer.params.lr", "from the run: its learning rate");
  add(!optimizer.betas, "optimizer.params.betas", "from the run: its Adam betas, [0.9, 0.999] unless set");
  add(!optimizer.eps, "optimizer.params.eps", "from the run: its Adam epsilon, 1e-8 unless set");
  add(!optimizer.weight_decay, "optimizer.params.weight_decay", "from the run: its weight decay");
  const SchedulerConfig& scheduler = resolved.scheduler;
  if (scheduler.specified) {
    add(!scheduler.warmup_max_lr, "scheduler.params.warmup_max_lr", "from the run: its learning rate");
    add(!scheduler.warmup_num_steps, "scheduler.params.warmup_num_steps",
        "from the run: its warmup steps; --warmup-steps fills it");
    add(!scheduler.total_num_steps, "scheduler.params.total_num_steps",
        "from the run: its optimizer steps; --steps fills it");
  }
  return lines;
}

/// Runs a subcommand body; a ConfigError is the user's to fix, so it is
/// reported as such with exit code 2 instead of escaping as a crash.
template <typename Body>
void run_reporting_config_errors(const char* command, int& exit_code, Body body) {
  try {
    body();
    exit_code = 0;
  } catch (const ConfigError& e) {
    std::cerr << "shardtrain config " << command << ": error: " << e.what() << "\n";
    exit_code = 2;
  }
}

void register_check(CLI::App& config, int& exit_code) {
  auto* check = config.add_subcommand(
      "check", "Read FILE as a run would, print its warnings and the resolved config (YAML)");
  auto flags = std::make_shared<CheckFlags>();
  check->add_option("FILE", flags->file, "Accelerate YAML or DeepSpeed JSON")->required();
  auto* world_size = check->add_option("--world-size", flags->world_size,
                                       "Processes in the run (default: the config's num_processes)");
  auto* micro_batch = check->add_option("--micro-batch", flags->micro_batch,
                                        "The data loader's batch size per process (fills \"auto\" micro batches)");
  auto* hidden_size = check->add_option("--hidden-size", flags->hidden_size,
                                        "The model's hidden size H (\"auto\" buckets: H*H, 0.9*H*H, 10*H)");
  check->add_option("--num-params", flags->num_params, "Trainable parameters of the model (precision-plan totals)")
      ->capture_default_str();
  check->add_option("--device", flags->device,
                    "Where the run computes (precision plan: the GEMMs, fp16's compute dtype, what an offload moves)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  auto* steps = check->add_option("--steps", flags->steps, "Optimizer steps of the run (\"auto\" total_num_steps)");
  auto* warmup = check->add_option("--warmup-steps", flags->warmup_steps,
                                   "Warmup steps of the run (\"auto\" warmup_num_steps; default 0)");
  check->callback([flags, world_size, micro_batch, hidden_size, steps, warmup, &exit_code]() {
    run_reporting_config_errors("check", exit_code, [&] {
      const TrainingConfig config = load_config(flags->file);
      AutoContext context;
      // Flags fill values in; whatever else the run decides is shown as auto.
      context.leave_run_values_auto = true;
      context.world_size = world_size->count() > 0 ? flags->world_size : config.num_processes;
      if (micro_batch->count() > 0) context.micro_batch_size = flags->micro_batch;
      if (hidden_size->count() > 0) context.hidden_size = flags->hidden_size;
      if (steps->count() > 0) context.total_steps = flags->steps;
      if (warmup->count() > 0) context.warmup_steps = flags->warmup_steps;
      const TrainingConfig resolved = resolve_auto(config, context);
      // Comments keep the whole output a YAML document that load_config reads back.
      for (const auto& warning : resolved.warnings) std::cout << "# warning: " << warning << "\n";
      std::cout << "# resolved for world size " << context.world_size << " from";
      for (const auto& source : resolved.sources) std::cout << " " << source;
      std::cout << "\n";
      for (const auto& line : left_to_the_run(resolved)) std::cout << "# " << line << "\n";
      // The precision plan as comments, so the output stays loadable YAML.
      // Per-parameter rows hold for any model; totals need --num-params.
      const PrecisionPlan plan = plan_precision(resolved, flags->num_params, context.world_size,
                                                /*on_cuda=*/flags->device == "cuda");
      std::istringstream plan_lines(plan.to_string());
      for (std::string line; std::getline(plan_lines, line);) std::cout << "# " << line << "\n";
      std::cout << to_yaml(resolved);
    });
  });
}

void register_convert(CLI::App& config, int& exit_code) {
  auto* convert = config.add_subcommand(
      "convert", "Express FILE's run for the other engine: an Accelerate FSDP YAML or a DeepSpeed JSON");
  auto flags = std::make_shared<ConvertFlags>();
  convert->add_option("FILE", flags->file, "Accelerate YAML or DeepSpeed JSON")->required();
  convert->add_option("--to", flags->target, "Target engine")
      ->required()
      ->check(CLI::IsMember({"fsdp", "deepspeed"}));
  convert->add_option("-o,--output", flags->output, "Write the converted config here instead of stdout");
  convert->footer("Notes on settings without an equivalent go to stderr.");
  convert->callback([flags, &exit_code]() {
    run_reporting_config_errors("convert", exit_code, [&] {
      const TrainingConfig config = load_config(flags->file);
      std::vector<std::string> notes;
      const std::string converted = convert_config(config, flags->target, notes);
      for (const auto& warning : config.warnings) std::cerr << "warning: " << warning << "\n";
      for (const auto& note : notes) std::cerr << "note: " << note << "\n";
      if (flags->output.empty()) {
        std::cout << converted;
        return;
      }
      std::ofstream out(flags->output, std::ios::binary | std::ios::trunc);
      out << converted;
      out.close();
      if (!out) ST_THROW(ConfigError, "cannot write ", flags->output);
      std::cerr << "wrote " << flags->output << "\n";
    });
  });
}

}  // namespace

void register_config_command(CLI::App& app, int& exit_code) {
  auto* config = app.add_subcommand("config", "Check or convert a training config (Accelerate YAML, DeepSpeed JSON)");
  config->require_subcommand(1);
  register_check(*config, exit_code);
  register_convert(*config, exit_code);
}

}  // namespace shardtrain::cli
