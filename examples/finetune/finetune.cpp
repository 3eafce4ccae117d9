// The fine-tune job behind llama_finetune / mistral_finetune: model, tokenizer
// and data, the training loop with evaluation and generation, checkpoints,
// the Hugging Face export and the summary.
//
// One piece: run_finetune is the training loop this example exists to show,
// read top to bottom; every helper above it serves only it.

#include "finetune/finetune.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <set>
#include <sstream>

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include "finetune/progress.h"
#include "shardtrain/accelerator.h"
#include "shardtrain/checkpoint_location.h"
#include "shardtrain/comm/rendezvous.h"
#include "shardtrain/device.h"
#include "shardtrain/error.h"
#include "shardtrain/logging.h"
#include "shardtrain/lora.h"
#include "shardtrain/quantization.h"
#include "shardtrain/models/generation.h"
#include "shardtrain/models/hf_weights.h"
#include "shardtrain/models/instruction_data.h"
#include "shardtrain/models/llama.h"
#include "shardtrain/nn/linear.h"
#include "shardtrain/tokenizer.h"
#include "shardtrain/weight_loading.h"
#include "step_metrics.h"

namespace finetune {
namespace {

namespace fs = std::filesystem;
namespace models = shardtrain::models;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  ST_CHECK(in.good(), "cannot read '", path, "'");
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

/// The model's config.json text as the export should carry it (model type
/// and, for the bundled config as Mistral, the sliding window applied).
struct ModelSpec {
  models::LlamaConfig config;
  std::string config_json;
};

/// A run resumed from an earlier checkpoint than its last drops the metric
/// lines after that checkpoint's step before it appends its own, so each step
/// is in the file once (the Trainer restores its log_history to the
/// checkpoint's the same way). Lines that are not a step's JSON are kept.
void keep_metrics_up_to(const std::string& file, int64_t last_step) {
  std::ifstream in(file);
  if (!in.good()) return;
  std::string kept;
  for (std::string line; std::getline(in, line);) {
    const json parsed = json::parse(line, nullptr, /*allow_exceptions=*/false);
    const bool later = parsed.is_object() && parsed.contains("step") && parsed["step"].is_number_integer() &&
                       parsed["step"].get<int64_t>() > last_step;
    if (!later) kept += line + "\n";
  }
  in.close();
  std::ofstream out(file, std::ios::trunc);
  out << kept;
  ST_CHECK(out.good(), "cannot rewrite the metrics file '", file, "'");
}

/// The run's LoRA config, when it trains one: --lora-adapter's own config,
/// else --lora-config's, else PEFT's defaults, with the --lora-* flags on top.
std::optional<shardtrain::LoraConfig> lora_config_of(const FinetuneOptions& options) {
  const bool flags = options.lora_r || options.lora_alpha || options.lora_dropout || !options.lora_target_modules.empty();
  if (!flags && options.lora_config.empty() && options.lora_adapter.empty()) return std::nullopt;
  ST_CHECK_T(shardtrain::ConfigError, options.lora_adapter.empty() || (!flags && options.lora_config.empty()),
             "--lora-adapter brings its own adapter_config.json; leave out --lora-config and the --lora-* flags");
  if (!options.lora_adapter.empty()) {
    return shardtrain::LoraConfig::from_peft_json_file(options.lora_adapter + "/adapter_config.json");
  }
  shardtrain::LoraConfig config;
  if (!options.lora_config.empty()) config = shardtrain::LoraConfig::from_peft_json_file(options.lora_config);
  if (options.lora_r) config.r = *options.lora_r;
  if (options.lora_alpha) config.lora_alpha = *options.lora_alpha;
  if (options.lora_dropout) config.lora_dropout = *options.lora_dropout;
  if (!options.lora_target_modules.empty()) {
    config.target_modules = options.lora_target_modules;
    config.target_modules_regex.clear();
  }
  config.base_model_name_or_path = options.model_dir;
  config.validate();
  return config;
}

ModelSpec model_spec(const FinetuneOptions& options) {
  const std::string path = options.model_dir.empty() ? options.model_config : options.model_dir + "/config.json";
  ST_CHECK(!path.empty(), "no model: pass --model-dir DIR (a Hugging Face directory) or --model-config config.json");
  const std::string text = read_text(path);
  // The library's reader first: it refuses a file without the model's sizes
  // or one nested beyond its depth limit, naming the problem.
  (void)models::LlamaConfig::from_json_string(text, path);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    ST_THROW(shardtrain::ConfigError, path, ": invalid JSON: ", e.what());
  }
  if (options.model_dir.empty()) {
    // A random-init model takes the family the program asks for; the bundled
    // config is a Llama, so as Mistral it gets a window shorter than a row so
    // that sliding-window attention is exercised.
    if (j.value("model_type", std::string("llama")) != options.model_type) {
      j["model_type"] = options.model_type;
      j["architectures"] = {options.model_type == "mistral" ? "MistralForCausalLM" : "LlamaForCausalLM"};
      if (options.model_type == "mistral" && !j.contains("sliding_window")) {
        j["sliding_window"] = std::max<int64_t>(8, options.seq_len / 2);
      }
    }
  } else if (j.value("model_type", std::string("llama")) != options.model_type) {
    ST_LOG_WARN("{} is a '{}' model; running it as such (--model-type {} ignored)", path,
                j.value("model_type", std::string("llama")), options.model_type);
  }
  ModelSpec spec;
  spec.config_json = j.dump(2);
  spec.config = models::LlamaConfig::from_json_string(spec.config_json, path);
  return spec;
}

std::string resolve_load_dtype(const FinetuneOptions& options, const shardtrain::TrainingConfig& config) {
  if (options.load_dtype != "auto") return options.load_dtype;
  // FSDP pure low precision means a model loaded in bf16 (Accelerate's definition).
  if (config.distributed_type == shardtrain::DistributedType::kFsdp && config.fsdp.pure_low_precision.value_or(false)) {
    return "bf16";
  }
  return "fp32";
}

at::ScalarType dtype_of(const std::string& name) {
  return name == "bf16" ? at::kBFloat16 : name == "fp16" ? at::kHalf : at::kFloat;
}

// ---- data ---------------------------------------------------------------------------

struct Dataset {
  models::PackedRows rows;
  std::vector<models::InstructionRecord> examples;  ///< prompt/response records (exact match)
};

// ---- evaluation ---------------------------------------------------------------------

template <typename Prepared>
EvalResult evaluate(shardtrain::Accelerator& accelerator, Prepared& model, const Dataset& eval,
                    const shardtrain::Tokenizer& tokenizer, models::ChatFormat chat,
                    const FinetuneOptions& options) {
  torch::NoGradGuard no_grad;
  // Evaluation mode, as Trainer's evaluation loop: no LoRA dropout (which
  // would change the loss and draw from the random streams the training's
  // masks come from), back to training mode when it returns or throws.
  struct EvalMode {
    Prepared& model;
    const bool was_training = model->is_training();
    explicit EvalMode(Prepared& m) : model(m) { model->eval(); }
    ~EvalMode() {
      // Reaching the module waits for gathers in flight, which may fail again
      // while an evaluation's failure unwinds: that one is the error to report.
      try {
        model->train(was_training);
      } catch (const std::exception& e) {
        ST_LOG_WARN("evaluation: restoring training mode failed: {}", e.what());
      }
    }
  } eval_mode(model);
  EvalResult result;
  const int world = accelerator.num_processes(), rank = accelerator.process_index();
  // Every rank runs the same number of forwards (ZeRO-3 and FSDP gather
  // parameters collectively): ranks short of rows repeat row 0, unlabelled.
  const int64_t rows = eval.rows.num_rows();
  if (rows > 0) {
    const int64_t per_rank = (rows + world - 1) / world;
    double loss_sum = 0, token_sum = 0;
    for (int64_t k = 0; k < per_rank; k += options.micro_batch) {
      std::vector<int64_t> indices, repeats;
      for (int64_t i = k; i < std::min(per_rank, k + options.micro_batch); ++i) {
        const int64_t row = i * world + rank;
        if (row >= rows) repeats.push_back(static_cast<int64_t>(indices.size()));
        indices.push_back(row < rows ? row : 0);
      }
      models::InstructionBatch host = models::make_batch(eval.rows, indices);
      for (int64_t b : repeats) host.labels[b].fill_(models::kIgnoreIndex);  // not counted
      const models::InstructionBatch batch = host.to(accelerator.device());
      // Every rank runs every forward, tokens or not: its gathers are collective.
      at::Tensor logits = model(batch.input_ids, at::Tensor(), batch.document_ids);
      // Counted on the host: no wait for the GPU.
      const double tokens = static_cast<double>(models::count_loss_tokens(host.labels));
      if (tokens == 0) continue;
      // The mean over the batch's target tokens, weighted back into a sum.
      loss_sum += models::causal_lm_loss(logits, batch.labels).item<double>() * tokens;
      token_sum += tokens;
    }
    at::Tensor totals = accelerator.reduce(at::tensor({loss_sum, token_sum}, at::kDouble), "sum");
    result.loss = totals[0].item<double>() / std::max(1.0, totals[1].item<double>());
  }

  int64_t prompts = options.eval_generate ? static_cast<int64_t>(eval.examples.size()) : 0;
  if (options.eval_samples > 0) prompts = std::min(prompts, options.eval_samples);
  if (prompts > 0) {
    const int64_t per_rank = (prompts + world - 1) / world;
    double correct = 0;
    std::vector<std::string> shown;
    models::GenerationOptions generation;
    generation.max_new_tokens = options.max_new_tokens;
    generation.stop_ids = {tokenizer.eos_id()};
    generation.vocab_limit = tokenizer.vocab_size();
    generation.fixed_steps = true;  // every rank runs max_new_tokens forwards: they are collective
    for (int64_t i = 0; i < per_rank; ++i) {
      const int64_t index = i * world + rank;
      const bool real = index < prompts;
      const auto& example = eval.examples[real ? index : 0];
      const std::vector<int64_t> prompt_ids = models::format_prompt(tokenizer, chat, example.prompt);
      const models::GenerationResult generated =
          models::generate(models::prepared_cached_step(model), prompt_ids, generation);
      const std::string answer = models::strip(tokenizer.decode(generated.tokens));
      const bool ok = answer == models::strip(example.response);
      if (real && ok) correct += 1;
      if (real && rank == 0 && static_cast<int64_t>(shown.size()) < options.show_examples) {
        shown.push_back(example.prompt + "  =>  " + answer + (ok ? "  (correct)" : "  (expected " + example.response + ")"));
      }
    }
    result.exact_match = accelerator.reduce(at::tensor({correct}, at::kDouble), "sum").item<double>() / prompts;
    result.prompts = prompts;
    result.examples = shown;
  }
  return result;
}

std::string percent(double fraction) {
  if (std::isnan(fraction)) return "n/a";
  char text[32];
  std::snprintf(text, sizeof text, "%.1f%%", 100.0 * fraction);
  return text;
}

std::string number(double value, const char* format = "%.4f") {
  if (std::isnan(value)) return "n/a";
  char text[64];
  std::snprintf(text, sizeof text, format, value);
  return text;
}


}  // namespace

double mean_of(const std::vector<double>& values) {
  if (values.empty()) return NAN;
  double sum = 0;
  for (const double v : values) sum += v;
  return sum / static_cast<double>(values.size());
}

double measure_gemm_flops(const std::string& dtype_name, const at::Device& device) {
  const at::ScalarType dtype = dtype_of(dtype_name);
  torch::NoGradGuard no_grad;
  // A GPU needs large products to reach its rate; a CPU gets there at 512.
  const int64_t n = device.is_cuda() ? 8192 : 512;
  // From a generator of its own: a measurement after a resume must not move
  // the random streams the checkpoint restored (LoRA dropout draws from them).
  at::Generator own = at::make_generator<at::CPUGeneratorImpl>(/*seed_in=*/0);
  at::Tensor a = at::randn({n, n}, own).to(device, dtype), b = at::randn({n, n}, own).to(device, dtype);
  // Through shardtrain::nn, as the model's products run: on a CPU without
  // fast bf16 that is the widened fp32 GEMM, not LibTorch's scalar fallback.
  at::Tensor warm = shardtrain::nn::matmul(a, b);
  if (device.is_cuda()) warm.sum().item<double>();  // done before the clock starts
  int64_t runs = 0;
  const auto start = Clock::now();
  while (seconds_since(start) < 0.4) {
    at::Tensor c = shardtrain::nn::matmul(a, b);
    ++runs;
    // A GPU queues products asynchronously: wait for each before the clock reads.
    if (device.is_cuda()) c.sum().item<double>();
  }
  return 2.0 * n * n * n * runs / seconds_since(start);
}

nlohmann::json summary_to_json(const FinetuneSummary& summary) {
  auto finite_or_null = [](double x) { return std::isfinite(x) ? json(x) : json(); };
  return json{{"ok", summary.ok},
              {"engine", summary.plan.engine},
              {"compute_dtype", summary.plan.compute_dtype},
              {"device", summary.device},
              {"device_name", summary.device_name},
              {"world_size", summary.world_size},
              {"first_step", summary.first_step},
              {"steps", summary.losses.size()},
              {"tokens_per_step_per_rank", summary.tokens_per_step},
              {"tokens_per_s_per_rank", summary.tokens_per_s_per_rank},
              {"flops_per_token", summary.flops_per_token},
              {"peak_tflops_per_rank", summary.peak_flops / 1e12},
              {"peak_source", summary.peak_source},
              {"mfu", finite_or_null(summary.mfu)},
              {"peak_rss_max_bytes", summary.peak_rss_max},
              {"gathered_bytes_per_step", summary.gathered_bytes_per_step},
              {"frozen_gathered_bytes_per_step", summary.frozen_gathered_bytes_per_step},
              {"peak_device_allocated_max_bytes", summary.peak_device_memory_max},
              {"losses", summary.losses},
              {"step_seconds", summary.step_seconds},
              {"mean_lost_update_frac", finite_or_null(mean_of(summary.lost_update_fracs))},
              {"mean_lost_update_frac_if_bf16", finite_or_null(mean_of(summary.lost_update_fracs_if_bf16))},
              {"eval_loss_before", finite_or_null(summary.eval_before.loss)},
              {"eval_loss_after", finite_or_null(summary.eval_after.loss)}};
}

std::string resolve_metrics_file(const std::string& report_to, const std::string& metrics_out,
                                 const std::string& output_dir, std::vector<std::string>& warnings) {
  // The Trainer's integrations (transformers.integrations.get_available_reporting_integrations).
  static const std::set<std::string> kTrainerIntegrations = {
      "azure_ml", "clearml", "codecarbon", "comet_ml", "dagshub", "dvclive", "flyte", "mlflow",
      "neptune",  "swanlab", "tensorboard", "trackio", "wandb"};
  bool jsonl = false;
  std::stringstream list(report_to);
  for (std::string name; std::getline(list, name, ',');) {
    name.erase(0, name.find_first_not_of(" \t"));
    name.erase(name.find_last_not_of(" \t") + 1);
    if (name.empty() || name == "none") continue;
    if (name == "jsonl" || name == "all") {
      jsonl = true;
    } else if (kTrainerIntegrations.count(name) != 0) {
      jsonl = true;
      warnings.push_back("--report_to " + name + ": not built in" +
                         (name == "tensorboard"
                              ? std::string(" (no maintained C++ TensorBoard event writer is packaged for Debian)")
                              : std::string()) +
                         "; the metrics go to the JSONL file instead, which `shardtrain plot` draws");
    } else {
      ST_THROW(shardtrain::ConfigError, "--report_to '", name,
               "' is not one of jsonl, none, all, or a Transformers integration such as tensorboard");
    }
  }
  if (!metrics_out.empty()) return metrics_out;
  return jsonl ? (fs::path(output_dir) / "metrics.jsonl").string() : std::string();
}

FinetuneSummary run_finetune(const FinetuneOptions& options) {
  ST_CHECK(options.max_steps > 0, "--max-steps must be positive");
  ST_CHECK(options.seq_len >= 8, "--seq-len must be at least 8");
  ST_CHECK(options.micro_batch > 0, "--micro-batch must be positive");
  ST_CHECK(!options.data.empty(), "no training data: pass --data FILE.jsonl");
  ST_CHECK_T(shardtrain::ConfigError,
             options.loss_normalization == "global_tokens" || options.loss_normalization == "per_rank_mean",
             "--loss-normalization '", options.loss_normalization, "' is not one of global_tokens, per_rank_mean");
  std::vector<std::string> report_warnings;  // said once the logger knows the rank
  const std::string metrics_file =
      resolve_metrics_file(options.report_to, options.metrics_out, options.output_dir, report_warnings);
  ST_CHECK_T(shardtrain::ConfigError, options.gradient_accumulation_steps >= 0,
             "--gradient-accumulation-steps must be positive (0: the config's), got ",
             options.gradient_accumulation_steps);

  shardtrain::AcceleratorOptions accelerator_options;
  if (!options.config_path.empty()) accelerator_options.config_path = options.config_path;
  const std::string checkpointing = options.activation_checkpointing;
  ST_CHECK_T(shardtrain::ConfigError,
             checkpointing == "none" || checkpointing == "selective" || checkpointing == "full",
             "--activation-checkpointing '", checkpointing, "' is not one of none, selective, full");
  if (checkpointing == "full") {
    // Whole decoder layers recomputed in backward: the engine's job, switched
    // on in the config as a user would (fsdp_activation_checkpointing /
    // gradient_checkpointing).
    shardtrain::TrainingConfig config = !options.config_path.empty() ? shardtrain::load_config(options.config_path)
                                                                     : shardtrain::config_from_environment().value_or(
                                                                           shardtrain::TrainingConfig{});
    config.fsdp.activation_checkpointing = true;
    config.gradient_checkpointing = true;
    accelerator_options.config = config;
  }
  if (options.gradient_accumulation_steps > 0) {
    accelerator_options.gradient_accumulation_steps = options.gradient_accumulation_steps;
  }
  accelerator_options.communicator = options.communicator;
  accelerator_options.checkpoint_total_limit = options.keep_last;
  accelerator_options.print_plan = !options.quiet;
  // The device decides the backend (gloo for cpu, nccl for cuda), as
  // Accelerate's does; a communicator given in code brings its own device.
  const at::Device device = options.communicator
                                ? options.communicator->device()
                                : shardtrain::resolve_device(options.device, shardtrain::detect_dist_env().local_rank);
  if (!options.communicator) accelerator_options.init.backend = shardtrain::backend_for(device);
  shardtrain::Accelerator accelerator(accelerator_options);
  ST_CHECK(accelerator.device() == device, "--device ", device, " but the accelerator runs on ", accelerator.device());
  const bool main_process = accelerator.is_main_process();
  const bool verbose = main_process && !options.quiet;

  // ---- model, tokenizer, data
  // The LoRA config is read and checked before the data is tokenized (which
  // takes a while on a large set), so a mistake in it stops the run at once.
  const std::optional<shardtrain::LoraConfig> lora = lora_config_of(options);
  if (lora) lora->validate();
  ModelSpec spec = model_spec(options);
  const models::LlamaConfig& mc = spec.config;
  const std::string tokenizer_path =
      !options.tokenizer.empty() ? options.tokenizer : options.model_dir + "/tokenizer.model";
  std::unique_ptr<shardtrain::Tokenizer> tokenizer = shardtrain::load_sentencepiece(tokenizer_path);
  ST_CHECK(tokenizer->vocab_size() <= mc.vocab_size, "the tokenizer ", tokenizer_path, " has ",
           tokenizer->vocab_size(), " pieces but the model's vocab_size is ", mc.vocab_size,
           ": use the tokenizer that belongs to the model");
  if (tokenizer->vocab_size() < mc.vocab_size) {
    // Common: embeddings padded to a multiple of 64 or 128. Their extra rows
    // are never trained, so generation leaves them out.
    ST_LOG_INFO("the model's vocabulary ({}) is larger than the tokenizer's ({}): a padded embedding; generation never "
                "produces ids {} and above", mc.vocab_size, tokenizer->vocab_size(), tokenizer->vocab_size());
  }
  if (tokenizer->bos_id() != mc.bos_token_id || tokenizer->eos_id() != mc.eos_token_id) {
    // The data pipeline inserts the tokenizer's ids; generation stops at the config's EOS.
    ST_LOG_WARN("the tokenizer's BOS/EOS ids ({}/{}) differ from config.json's bos_token_id/eos_token_id ({}/{}); "
                "training uses the tokenizer's, generation stops at the tokenizer's EOS",
                tokenizer->bos_id(), tokenizer->eos_id(), mc.bos_token_id, mc.eos_token_id);
  }
  const std::string chat_name =
      options.chat_format != "auto" ? options.chat_format : (mc.model_type == "mistral" ? "mistral" : "llama2");
  const models::ChatFormat chat = models::parse_chat_format(chat_name);

  models::InstructionDataOptions data_options;
  data_options.chat_format = chat;
  data_options.seq_len = options.seq_len;
  data_options.truncation = models::parse_truncation_policy(options.truncation);
  data_options.packing = !options.no_packing;
  data_options.vocab_size = mc.vocab_size;
  Dataset train, eval;
  {
    models::InstructionDataStats stats;
    train.rows = models::build_instruction_rows(options.data, tokenizer.get(), data_options, &stats);
    if (verbose) std::cout << "train data (" << chat_name << " format): " << stats.summary() << std::endl;
  }
  if (!options.eval_data.empty()) {
    models::InstructionDataStats stats;
    eval.rows = models::build_instruction_rows(options.eval_data, tokenizer.get(), data_options, &stats);
    for (auto& record : models::read_instruction_jsonl(options.eval_data, mc.vocab_size)) {
      if (record.format == models::RecordFormat::kInstruction) eval.examples.push_back(std::move(record));
    }
    if (verbose) std::cout << "eval data: " << stats.summary() << std::endl;
  }
  ST_CHECK(train.rows.num_rows() > 0, options.data, " gave no training rows (all examples longer than --seq-len ",
           options.seq_len, "?)");

  torch::manual_seed(options.seed);
  const std::string load_dtype = resolve_load_dtype(options, accelerator.config());
  models::LlamaForCausalLM model{nullptr};
  shardtrain::WeightSource weight_source;
  shardtrain::WeightSource base_values;  // QLoRA: what quantize_frozen_base reads
  if (!options.model_dir.empty()) {
    // No rank holds the full model: each builds it without weights (layer by
    // layer, storage released). Without QLoRA the engine fills this rank's
    // shard from the safetensors files, reading only those bytes. With QLoRA,
    // quantize_frozen_base below reads each weight and quantizes it at once,
    // so a rank never holds more than one weight unquantized (transformers'
    // load_in_4bit); under rank-0-only loading (fsdp_cpu_ram_efficient_loading,
    // zero3_init_flag) only rank 0 reads, and the others quantize the shapes
    // and receive their shards of rank 0's bytes in prepare().
    auto checkpoint = std::make_shared<models::HfCheckpoint>(options.model_dir);
    model = models::make_llama_without_weights(mc, dtype_of(load_dtype), device);
    checkpoint->check_against(*model, /*warn_unexpected=*/accelerator.is_main_process());
    if (!options.load_in_4bit) {
      weight_source = models::hf_weight_source(checkpoint);
    } else if (accelerator.materialize_full_weights()) {
      base_values = models::hf_weight_source(checkpoint);
    }
  } else {
    // Initialised on the CPU whatever the device, so a seed gives the same
    // weights on a CPU and on a GPU.
    model = models::LlamaForCausalLM(mc);
    model->to(device, dtype_of(load_dtype));
  }
  // Selective: only the core attention (the O(T^2) scores and probabilities) is recomputed.
  if (checkpointing == "selective") model->set_activation_checkpointing(models::ActivationCheckpointing::kSelective);
  int64_t num_params = 0;
  for (const auto& p : model->parameters()) num_params += p.numel();
  if (lora) {
    shardtrain::LoraSummary adapters;
    if (!options.lora_adapter.empty()) {
      shardtrain::load_lora_adapter(*model, options.lora_adapter, &adapters);
    } else {
      adapters = shardtrain::apply_lora(*model, *lora);
    }
    if (main_process && !adapters.unmatched_targets.empty()) ST_LOG_WARN("{}", adapters.describe_unmatched());
    if (verbose) {
      std::cout << "LoRA r " << lora->r << ", alpha " << lora->lora_alpha << " on " << adapters.adapted_modules.size()
                << " layers: " << adapters.describe() << std::endl;
    }
  }
  int64_t trainable_params = 0, all_params = 0;  // with the adapters
  for (const auto& p : model->parameters()) {
    all_params += p.numel();
    if (p.requires_grad()) trainable_params += p.numel();
  }
  if (options.load_in_4bit) {
    ST_CHECK_T(shardtrain::ConfigError, lora.has_value(),
               "--load-in-4bit quantizes the frozen base of a LoRA run; give --lora-r (or --lora-config, --lora-adapter)");
    ST_CHECK_T(shardtrain::ConfigError, !options.merge_lora,
               "--merge-lora needs the original base weights, which --load-in-4bit replaces; merge OUTPUT/adapter in a "
               "run without --load-in-4bit (--lora-adapter OUTPUT/adapter --merge-lora)");
    const shardtrain::QuantizationSummary quantized = shardtrain::quantize_frozen_base(*model, base_values);
    if (verbose) std::cout << "QLoRA base: " << quantized.describe() << std::endl;
  }

  shardtrain::OptimizerOptions optimizer;
  optimizer.lr = options.lr;
  optimizer.weight_decay = options.weight_decay;
  shardtrain::RunInfo run;
  run.hidden_size = mc.hidden_size;
  run.micro_batch_size = options.micro_batch;
  run.total_steps = options.max_steps;
  run.warmup_steps = options.warmup;
  run.max_grad_norm = options.max_grad_norm;
  run.load_dtype = load_dtype;
  run.seed = options.seed;
  run.weight_source = weight_source;
  auto prepared = accelerator.prepare(model, optimizer, run);
  shardtrain::SchedulerConfig schedule;
  schedule.specified = true;
  schedule.type = "WarmupCosineLR";
  // DeepSpeed's WarmupCosineLR refuses 0 and warms up over at least 2 steps;
  // 0 becomes 1 as transformers fills a DeepSpeed config's "auto" warmup.
  schedule.warmup_num_steps = std::max<int64_t>(1, options.warmup);
  schedule.total_num_steps = options.max_steps;
  schedule.warmup_type = "linear";
  schedule.cos_min_ratio = 0.1;
  accelerator.prepare_scheduler(options.max_steps, accelerator.config().scheduler.specified
                                                       ? std::optional<shardtrain::SchedulerConfig>()
                                                       : std::optional<shardtrain::SchedulerConfig>(schedule));
  shardtrain::DistributedSampler& sampler = accelerator.prepare_sampler(train.rows.num_rows(), options.seed);

  FinetuneSummary summary;
  summary.total_parameters = all_params;
  summary.trainable_parameters = trainable_params;
  summary.plan = accelerator.precision_plan();
  const fs::path output(options.output_dir);
  const std::string checkpoint_dir = (output / "checkpoints").string();
  if (!options.resume.empty()) {
    const shardtrain::CheckpointLocation resume = shardtrain::find_checkpoint(options.resume, options.output_dir);
    accelerator.load_state(resume.dir, resume.tag);
    // The loop counts windows, skipped ones (an fp16 overflow, non_finite_policy:
    // skip) too, as the Trainer's global_step does; the step count is applied updates only.
    summary.first_step = accelerator.last_step().step + accelerator.last_step().skipped_total;
    if (verbose) std::cout << "resumed from " << options.resume << " at step " << summary.first_step << std::endl;
  }

  const int world = accelerator.num_processes();
  const bool config_clips = accelerator.config().gradient_clipping.value_or(0.0) > 0;
  const int64_t accumulation = accelerator.gradient_accumulation_steps();
  const bool global_tokens = options.loss_normalization == "global_tokens";
  std::ofstream metrics;
  summary.metrics_file = metrics_file;
  if (main_process) {
    for (const std::string& warning : report_warnings) ST_LOG_WARN("{}", warning);
    // Rows are drawn across epochs to fill each micro-batch (the step's shape
    // is fixed), where a Trainer would give a short batch instead.
    const int64_t step_rows = world * options.micro_batch * accumulation;
    if (train.rows.num_rows() < step_rows) {
      ST_LOG_WARN("the training data has {} rows, fewer than one step takes ({} ranks x micro-batch {} x "
                  "accumulation {} = {}): every step repeats rows, and tokens/s counts the repeats; lower "
                  "--micro-batch or the accumulation, or add data",
                  train.rows.num_rows(), world, options.micro_batch, accumulation, step_rows);
    }
  }
  if (!summary.metrics_file.empty() && main_process) {
    fs::create_directories(fs::absolute(summary.metrics_file).parent_path());
    if (summary.first_step > 0) keep_metrics_up_to(summary.metrics_file, summary.first_step);
    metrics.open(summary.metrics_file, summary.first_step > 0 ? std::ios::app : std::ios::trunc);
    ST_CHECK(metrics.good(), "cannot write the metrics file '", summary.metrics_file, "'");
  }

  // The model config as this run uses it (model type, window): the export
  // writes it as its config.json, so it loads back as the same model, and it
  // stays beside the checkpoints for `shardtrain checkpoint export
  // --config-json` later. Only rank 0, which writes exports, reads it.
  const std::string model_config = (output / "model_config.json").string();
  if (main_process && (!options.no_save || !options.no_export)) {
    fs::create_directories(output);
    std::ofstream config_out(model_config);
    config_out << spec.config_json << "\n";
    ST_CHECK(config_out.good(), "cannot write ", model_config);
  }

  if (summary.first_step == 0 && (eval.rows.num_rows() > 0 || !eval.examples.empty())) {
    summary.eval_before = evaluate(accelerator, prepared, eval, *tokenizer, chat, options);
    if (verbose) {
      std::cout << "eval before training: loss " << number(summary.eval_before.loss) << ", exact match "
                << percent(summary.eval_before.exact_match) << " of " << summary.eval_before.prompts << std::endl;
    }
  }

  // The peak MFU is measured against: --peak-tflops, else the GPU's
  // datasheet rate, else a GEMM rate measured here.
  const std::optional<double> known_peak =
      shardtrain::known_peak_tflops(shardtrain::device_name(device), summary.plan.compute_dtype);
  std::string peak_source;
  double peak_flops = 0;
  if (options.peak_tflops > 0) {
    peak_flops = options.peak_tflops * 1e12;
    peak_source = number(options.peak_tflops, "%.0f") + " TFLOP/s (--peak-tflops)";
  } else if (device.is_cuda() && known_peak) {
    peak_flops = *known_peak * 1e12;
    peak_source = number(*known_peak, "%.0f") + " TFLOP/s, the " + shardtrain::device_name(device) + " " +
                  summary.plan.compute_dtype + " dense peak";
  } else {
    peak_flops = measure_gemm_flops(summary.plan.compute_dtype, device);
    peak_source = "a measured GEMM rate, " + number(peak_flops / 1e9, "%.1f") + " GFLOP/s per rank";
  }
  summary.device = device.str();
  summary.device_name = shardtrain::device_name(device);
  summary.world_size = world;
  summary.main_process = main_process;
  summary.peak_flops = peak_flops;
  summary.peak_source = peak_source;
  shardtrain::reset_device_peak_memory(device);
  // LoRA: the frozen base gets no weight gradient (its trainable parameters
  // are the adapters, all matmul weights unless modules_to_save names the embeddings).
  const double token_flops = lora ? models::training_flops_per_token(mc, all_params, options.seq_len, trainable_params)
                                  : models::training_flops_per_token(mc, num_params, options.seq_len);

  // Rows of this rank, epoch by epoch; the sampler's position survives checkpoints.
  std::vector<int64_t> epoch_rows = sampler.indices();
  auto next_rows = [&](int64_t count) {
    std::vector<int64_t> rows;
    while (static_cast<int64_t>(rows.size()) < count) {
      if (sampler.position() >= sampler.num_samples()) {
        sampler.set_epoch(sampler.epoch() + 1);
        epoch_rows = sampler.indices();
      }
      rows.push_back(epoch_rows[sampler.position()]);
      sampler.advance(1);
    }
    return rows;
  };

  ProgressBar progress(options.max_steps, summary.first_step, verbose && !options.no_progress,
                       std::max(1, accelerator.config().steps_per_print));
  double train_seconds = 0;
  int64_t train_tokens = 0;  // token positions (rows x seq_len) this rank computed
  shardtrain::TrafficReport step_traffic;  // the training steps' all-gathers (evals and saves left out)
  for (int64_t step = summary.first_step; step < options.max_steps; ++step) {
    const auto start = Clock::now();
    accelerator.reset_traffic();
    // The window's batches come first, as the Trainer's get_batch_samples:
    // a global-token loss needs the window's loss-token count before the
    // first backward.
    std::vector<models::InstructionBatch> window;
    int64_t step_tokens = 0, window_loss_tokens = 0;
    for (int64_t micro = 0; micro < accumulation; ++micro) {
      const models::InstructionBatch host = models::make_batch(train.rows, next_rows(options.micro_batch));
      step_tokens += host.input_ids.numel();
      window_loss_tokens += models::count_loss_tokens(host.labels);  // on the host: no wait for the GPU
      window.push_back(host.to(device));
    }
    // A window without loss tokens has a zero loss, not 0/0.
    const double global_loss_tokens =
        global_tokens ? static_cast<double>(std::max<int64_t>(1, accelerator.sum_over_processes(window_loss_tokens)))
                      : 0.0;
    // Global tokens: the summed token losses of this rank's window; per-rank
    // mean: the sum of its micro-batch means. Summed in fp64 where the losses
    // are and read once a step, so the host never waits for the GPU between
    // micro-batches (the same sums as adding each loss's value on the host).
    at::Tensor window_loss;
    for (const models::InstructionBatch& batch : window) {
      at::Tensor logits = prepared(batch.input_ids, at::Tensor(), batch.document_ids);
      at::Tensor loss = global_tokens ? models::causal_lm_loss_sum(logits, batch.labels)
                                      : models::causal_lm_loss(logits, batch.labels);
      if (global_tokens) {
        accelerator.backward(loss / global_loss_tokens, shardtrain::LossNormalization::kGlobalTokens);
      } else {
        accelerator.backward(loss);
      }
      const at::Tensor value = loss.detach().to(at::kDouble);
      window_loss = window_loss.defined() ? window_loss + value : value;
    }
    window.clear();
    const double loss_sum = window_loss.defined() ? window_loss.item<double>() : 0.0;
    // As the Transformers Trainer: a DeepSpeed config's gradient_clipping is
    // applied by step(); otherwise --max-grad-norm is applied here.
    if (!config_clips && options.max_grad_norm > 0 && accelerator.sync_gradients()) {
      accelerator.clip_grad_norm(options.max_grad_norm);
    }
    accelerator.step();
    accelerator.zero_grad();
    const double step_loss =
        global_tokens
            ? accelerator.reduce(at::full({1}, loss_sum, at::kDouble), "sum").item<double>() / global_loss_tokens
            : accelerator.reduce(at::full({1}, loss_sum / accumulation, at::kDouble), "mean").item<double>();
    const double seconds = seconds_since(start);
    // The first --throughput-skip-steps steps (cuBLAS set-up, the caching
    // allocator's first allocations) stay out of tokens/s and MFU.
    if (step - summary.first_step >= options.throughput_skip_steps) {
      train_seconds += seconds;
      train_tokens += step_tokens;
    }
    summary.losses.push_back(step_loss);
    summary.step_seconds.push_back(seconds);
    const auto& audited = accelerator.last_step();
    if (audited.lost_update_frac >= 0) {
      summary.lost_update_fracs.push_back(audited.lost_update_frac);
      summary.lost_update_fracs_if_bf16.push_back(audited.lost_update_frac_if_bf16);
    }
    summary.tokens_per_step = step_tokens;
    const auto& info = accelerator.last_step();
    progress.update(step + 1, step_loss, info.lr, step_tokens / seconds);
    if (metrics.is_open()) {
      const shardtrain::MemoryReport mem = accelerator.memory();
      json line = examples::step_metrics(step + 1, step_loss, info);
      line["tokens_rank0"] = step_tokens;
      line["tokens_per_s_rank0"] = step_tokens / seconds;
      line["step_time_s"] = seconds;
      line["peak_rss"] = mem.peak_rss;
      metrics << line.dump() << "\n" << std::flush;
    }
    step_traffic.param_gather_bytes += accelerator.traffic().param_gather_bytes;
    step_traffic.frozen_gather_bytes += accelerator.traffic().frozen_gather_bytes;
    const bool last = step + 1 == options.max_steps;
    if (options.save_every > 0 && (step + 1) % options.save_every == 0 && !last) {
      progress.interrupt();
      const std::string saved = accelerator.save_state(checkpoint_dir);
      if (verbose && !saved.empty()) std::cout << "saved " << saved << std::endl;
    }
    if (options.eval_every > 0 && (step + 1) % options.eval_every == 0 && !last) {
      EvalResult mid = evaluate(accelerator, prepared, eval, *tokenizer, chat, options);
      progress.interrupt();
      if (verbose) {
        std::cout << "eval at step " << step + 1 << ": loss " << number(mid.loss) << ", exact match "
                  << percent(mid.exact_match) << std::endl;
      }
    }
  }

  if (eval.rows.num_rows() > 0 || !eval.examples.empty()) {
    summary.eval_after = evaluate(accelerator, prepared, eval, *tokenizer, chat, options);
  }
  if (!options.no_save) {
    summary.checkpoint_dir = accelerator.save_state(checkpoint_dir);
    // The last save is the run's result: losing it fails the job (after the export below).
    if (summary.checkpoint_dir.empty()) summary.ok = false;
  }
  if (lora) {
    summary.adapter_dir = (output / "adapter").string();
    accelerator.save_lora_adapter(summary.adapter_dir, *lora);
  }
  // A LoRA run exports its merged model only when asked (--merge-lora): the adapter is its result.
  if (!options.no_export && (!lora || options.merge_lora)) {
    summary.export_dir = (output / "hf").string();
    accelerator.save_model(summary.export_dir, "auto", 5000000000ULL, model_config);
    if (main_process) {
      fs::copy_file(tokenizer_path, fs::path(summary.export_dir) / "tokenizer.model",
                    fs::copy_options::overwrite_existing);
    }
    accelerator.wait_for_everyone();
  }

  // ---- summary
  summary.tokens_per_s_per_rank =
      train_seconds > 0
          ? accelerator.reduce(at::full({1}, train_tokens / train_seconds, at::kDouble), "mean").item<double>()
          : 0;
  summary.flops_per_token = token_flops;
  const double steps_run = static_cast<double>(std::max<int64_t>(1, options.max_steps - summary.first_step));
  summary.gathered_bytes_per_step = static_cast<double>(step_traffic.param_gather_bytes) / steps_run;
  summary.frozen_gathered_bytes_per_step = static_cast<double>(step_traffic.frozen_gather_bytes) / steps_run;
  summary.mfu = summary.tokens_per_s_per_rank * token_flops / peak_flops;
  const shardtrain::MemoryReport mem = accelerator.memory();
  // One gather for both peaks: [world, 2], RSS then the GPU's caching
  // allocator (which RSS does not see; 0 on a CPU).
  const at::Tensor peaks = accelerator.gather_for_metrics(
      at::tensor({static_cast<double>(mem.peak_rss),
                  static_cast<double>(shardtrain::device_memory(device).peak_allocated)},
                 at::kDouble)
          .view({1, 2}));
  const at::Tensor rss = peaks.select(1, 0), device_peak = peaks.select(1, 1);
  summary.peak_rss_max = static_cast<int64_t>(rss.max().item<double>());
  summary.peak_device_memory_max = static_cast<int64_t>(device_peak.max().item<double>());
  auto per_rank = [](const at::Tensor& bytes) {
    std::ostringstream text;
    for (int64_t r = 0; r < bytes.numel(); ++r) {
      text << (r ? ", " : "") << "rank " << r << " " << format_bytes(bytes[r].item<double>());
    }
    return text.str();
  };
  if (verbose) {
    SummaryTable table;
    const std::string first = summary.losses.empty() ? "n/a" : number(summary.losses.front());
    const std::string last = summary.losses.empty() ? "n/a" : number(summary.losses.back());
    table.add("model", mc.model_type + ", " + std::to_string(num_params) + " parameters" +
                           (options.model_dir.empty() ? " (random init)" : " from " + options.model_dir));
    if (lora) {
      table.add("trainable parameters", std::to_string(summary.trainable_parameters) + " of " +
                                           std::to_string(summary.total_parameters) + " (LoRA r " +
                                           std::to_string(lora->r) + ")");
    }
    table.add("engine", summary.plan.engine + ", " + std::to_string(world) + " ranks on " + device.str() + " (" +
                            shardtrain::device_name(device) + "), compute " + summary.plan.compute_dtype);
    table.add("steps", std::to_string(summary.first_step) + " -> " + std::to_string(options.max_steps));
    table.add("train loss (first -> last step)", first + " -> " + last);
    table.add("eval loss", number(summary.eval_before.loss) + " -> " + number(summary.eval_after.loss));
    table.add("eval exact match", percent(summary.eval_before.exact_match) + " -> " +
                                      percent(summary.eval_after.exact_match) + " of " +
                                      std::to_string(summary.eval_after.prompts) + " prompts");
    table.add("tokens/s per rank", number(summary.tokens_per_s_per_rank, "%.0f"));
    if (!summary.lost_update_fracs.empty()) {
      table.add("lost updates (mean over steps)",
                percent(mean_of(summary.lost_update_fracs)) + " (a bf16 master would lose " +
                    percent(mean_of(summary.lost_update_fracs_if_bf16)) + ")");
    }
    table.add("MFU", percent(summary.mfu) + " of " + peak_source);
    table.add("peak memory (RSS)", per_rank(rss));
    if (summary.gathered_bytes_per_step > 0) {
      table.add("parameter all-gathers per step (rank 0)",
                format_bytes(summary.gathered_bytes_per_step) + " (frozen base " +
                    format_bytes(summary.frozen_gathered_bytes_per_step) + ")");
    }
    if (device.is_cuda()) table.add("peak GPU memory (allocated)", per_rank(device_peak));
    if (!summary.checkpoint_dir.empty()) table.add("checkpoint", summary.checkpoint_dir);
    if (!summary.adapter_dir.empty()) table.add("LoRA adapter (PEFT)", summary.adapter_dir);
    if (!summary.export_dir.empty()) table.add("exported model", summary.export_dir);
    std::cout << table.render("fine-tune summary");
    if (!summary.eval_after.examples.empty()) {
      std::cout << "eval answers after training:\n";
      for (const auto& line : summary.eval_after.examples) std::cout << "  " << line << "\n";
    }
    std::cout << std::flush;
  }
  return summary;
}

}  // namespace finetune
