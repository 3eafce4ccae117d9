#pragma once
// The fine-tune loop behind llama_finetune / mistral_finetune, as a library so
// the tests run it in-process on several ranks.

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/precision_plan.h"

namespace finetune {

struct FinetuneOptions {
  std::string model_type = "llama";  ///< llama | mistral
  std::string config_path;           ///< empty: the launcher's config, else a plain run
  std::string model_dir;             ///< Hugging Face directory; empty: random init from model_config
  std::string model_config;          ///< config.json when model_dir is empty
  std::string tokenizer;             ///< empty: model_dir/tokenizer.model
  std::string data, eval_data;
  std::string chat_format = "auto";
  int64_t seq_len = 128;
  /// drop | truncate: what happens to a record longer than seq_len.
  std::string truncation = "drop";
  /// none | selective (core attention recomputed in backward) | full (whole decoder layers)
  std::string activation_checkpointing = "none";
  bool no_packing = false;
  int64_t micro_batch = 8;
  /// 0: the config's gradient_accumulation_steps (Accelerate's --gradient_accumulation_steps otherwise).
  int64_t gradient_accumulation_steps = 0;
  /// global_tokens: each step's loss is the mean over every loss token of the
  /// global batch (all ranks, all micro-batches), as the Transformers Trainer
  /// computes it since its gradient-accumulation fix, so a step does not
  /// depend on the world size or the accumulation split. per_rank_mean: each
  /// rank's micro-batch mean, averaged (Accelerate's plain loop; DeepSpeed).
  std::string loss_normalization = "global_tokens";
  int64_t max_steps = 600;
  double lr = 1e-3;
  double weight_decay = 0.0;
  int64_t warmup = 30;
  double max_grad_norm = 1.0;
  uint64_t seed = 0;
  std::string load_dtype = "auto";
  std::string output_dir = "finetune-out";
  int64_t save_every = 0;
  int keep_last = 2;
  std::string resume;
  std::string metrics_out;
  std::string report_to = "none";  ///< see resolve_metrics_file
  int64_t eval_every = 0;
  int64_t eval_samples = 200;
  int64_t max_new_tokens = 16;
  /// false: the evaluation measures the eval loss only, without generating
  /// answers for exact match (studies that compare losses).
  bool eval_generate = true;
  int64_t show_examples = 4;
  double peak_tflops = 0;  ///< 0: the GPU's known peak (device.h), else a measured GEMM rate
  std::string device = "auto";        ///< cpu | cuda | cuda:N | auto (cuda:LOCAL_RANK when a GPU is visible)
  int64_t throughput_skip_steps = 0;  ///< warm-up steps left out of tokens/s and MFU
  bool no_export = false;
  /// LoRA (shardtrain/lora.h): on when lora_r is given, or lora_config or
  /// lora_adapter. The flags override lora_config's fields; unset ones take
  /// PEFT's defaults (r 8, alpha 8, dropout 0, q_proj and v_proj).
  std::optional<int64_t> lora_r;
  std::optional<double> lora_alpha;
  std::optional<double> lora_dropout;
  std::vector<std::string> lora_target_modules;
  std::string lora_config;   ///< a PEFT adapter_config.json
  std::string lora_adapter;  ///< a PEFT adapter directory to train further (its config and values)
  /// With LoRA: also export OUTPUT/hf, a full model with the adapters folded
  /// in (the adapter itself always goes to OUTPUT/adapter).
  bool merge_lora = false;
  /// QLoRA (shardtrain/quantization.h): the frozen base in NF4, compute in bf16.
  bool load_in_4bit = false;
  bool no_save = false;  ///< no checkpoint at the end (benchmarks)
  bool no_progress = false;
  bool quiet = false;  ///< tests, benchmarks: no progress bar, no plan, no summary
  /// Tests: run on this communicator instead of the launcher's environment.
  shardtrain::comm::CommunicatorPtr communicator;
};

struct EvalResult {
  double loss = NAN;
  double exact_match = NAN;  ///< fraction of eval prompts answered exactly (NaN: no prompt/response data)
  int64_t prompts = 0;
  std::vector<std::string> examples;  ///< "prompt => answer (expected ...)" for the first few
};

struct FinetuneSummary {
  bool ok = true;
  std::vector<double> losses;  ///< mean train loss per step of this run
  std::vector<double> step_seconds;  ///< wall time of each step on this rank
  /// StepInfo::lost_update_frac / _if_bf16 of each audited step (empty: audit off).
  std::vector<double> lost_update_fracs, lost_update_fracs_if_bf16;
  int64_t tokens_per_step = 0;       ///< token positions one step computes on one rank
  int64_t first_step = 0;      ///< step the run started at (non-zero after --resume)
  EvalResult eval_before, eval_after;
  double tokens_per_s_per_rank = 0;
  double mfu = NAN;
  double flops_per_token = 0;  ///< model FLOPs of one trained token (forward + backward)
  int64_t peak_rss_max = 0;
  int64_t peak_device_memory_max = 0;  ///< caching allocator's peak over ranks (0 on cpu)
  std::string device;                  ///< where rank 0 trained ("cpu", "cuda:0")
  std::string device_name;             ///< "cpu" or the GPU's product name
  int world_size = 1;
  bool main_process = true;
  double peak_flops = 0;               ///< per rank, what MFU is measured against
  std::string peak_source;             ///< where peak_flops came from
  std::string checkpoint_dir, export_dir;
  std::string adapter_dir;              ///< the PEFT adapter saved at the end ("" without LoRA)
  int64_t trainable_parameters = 0, total_parameters = 0;
  /// Parameter bytes this rank all-gathered per step (all, and the frozen base's).
  double gathered_bytes_per_step = 0, frozen_gathered_bytes_per_step = 0;
  std::string metrics_file;  ///< the per-step JSONL rank 0 wrote ("" when none)
  shardtrain::PrecisionPlan plan;
};

/// Where the per-step metrics go, from the Trainer's --report_to list
/// ("jsonl,tensorboard", "none", "all") and --metrics-out. jsonl (and "all")
/// writes OUTPUT_DIR/metrics.jsonl unless --metrics-out names a file; an
/// explicit --metrics-out is always written. The Trainer's other
/// integrations (tensorboard, wandb, ...) are not built in: each adds a
/// warning to `warnings` saying why and falls back to the JSONL file, so no
/// run loses its metrics. Anything else is a ConfigError. Returns the file ("" for none).
std::string resolve_metrics_file(const std::string& report_to, const std::string& metrics_out,
                                 const std::string& output_dir, std::vector<std::string>& warnings);

/// Mean of `values`; NaN when empty.
double mean_of(const std::vector<double>& values);

/// Measured GEMM throughput of this rank in dtype "fp32", "bf16" or "fp16"
/// (FLOP/s): the denominator of MFU where nobody gives the peak (CPUs).
/// The summary as one JSON object (what llama_finetune --summary-json writes).
nlohmann::json summary_to_json(const FinetuneSummary& summary);

double measure_gemm_flops(const std::string& dtype, const at::Device& device = at::Device(at::kCPU));

/// Runs the whole job: load, (resume), train, evaluate, save, export, summary.
FinetuneSummary run_finetune(const FinetuneOptions& options);

}  // namespace finetune
