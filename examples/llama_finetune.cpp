// llama_finetune / mistral_finetune: instruction fine-tuning of a Llama or
// Mistral model with shardtrain (any config in configs/: ZeRO-1/2/3, FSDP
// standard or pure low precision).
//
// With no --model-dir it fine-tunes the bundled tiny Llama (examples/tiny_llama:
// random initial weights, the project's sentencepiece model, a generated
// arithmetic/string instruction set) — the README's main job:
//
//   build/bin/shardtrain launch --num_processes 2 build/bin/llama_finetune --config configs/llama/zero3_bf16.json
//
// A real model: --model-dir (config.json + safetensors, tokenizer.model
// inside unless --tokenizer), --data/--eval-data JSONL.
//
// The binary's name picks the model family default (mistral_finetune ->
// mistral); --model-type overrides it.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "data_dir.h"
#include "finetune/finetune.h"
#include "shardtrain/metrics_plot.h"

int main(int argc, char** argv) {
  finetune::FinetuneOptions options;
  const std::string program = std::filesystem::path(argv[0]).filename().string();
  options.model_type = program.find("mistral") != std::string::npos ? "mistral" : "llama";
  const std::string bundled = shardtrain_data_dir() + "/examples/tiny_llama";

  CLI::App app{program + ": instruction fine-tuning of a Llama/Mistral model with shardtrain"};
  app.add_option("--config", options.config_path,
                 "Accelerate YAML or DeepSpeed JSON (e.g. configs/llama/zero3_bf16.json; default: the launcher's)");
  app.add_option("--model-type", options.model_type, "llama or mistral (default from the program name)")
      ->check(CLI::IsMember({"llama", "mistral"}))
      ->capture_default_str();
  app.add_option("--model-dir", options.model_dir,
                 "Hugging Face model directory (config.json, model.safetensors[.index.json]); "
                 "default: the bundled tiny model from random weights");
  app.add_option("--model-config", options.model_config, "config.json for a randomly initialised model (no --model-dir)");
  app.add_option("--tokenizer", options.tokenizer, "sentencepiece tokenizer.model (default: MODEL_DIR/tokenizer.model)");
  app.add_option("--data", options.data, "Training JSONL: {prompt,response}, {text} or {input_ids,labels}");
  app.add_option("--eval-data", options.eval_data, "Evaluation JSONL (eval loss; exact match for prompt/response)");
  app.add_option("--chat-format", options.chat_format, "auto (by model type), llama2, mistral or none")
      ->check(CLI::IsMember({"auto", "llama2", "mistral", "none"}))
      ->capture_default_str();
  app.add_option("--seq-len", options.seq_len, "Tokens per packed row")->capture_default_str();
  app.add_option("--truncation", options.truncation,
                 "A record longer than --seq-len: drop it, or truncate it (its end and EOS are then not trained)")
      ->check(CLI::IsMember({"drop", "truncate"}))
      ->capture_default_str();
  app.add_option("--activation-checkpointing", options.activation_checkpointing,
                 "none; selective (recompute the core attention in backward); full (recompute each decoder layer)")
      ->check(CLI::IsMember({"none", "selective", "full"}))
      ->capture_default_str();
  app.add_flag("--no-packing", options.no_packing, "One example per row (padded) instead of packing");
  app.add_option("--micro-batch", options.micro_batch, "Rows per rank per micro-batch")->capture_default_str();
  app.add_option("--gradient-accumulation-steps", options.gradient_accumulation_steps,
                 "Micro-batches per optimizer step (0: the config's, else 1)")
      ->capture_default_str();
  app.add_option("--loss-normalization", options.loss_normalization,
                 "global_tokens: mean over the global batch's loss tokens, the same at any world size and "
                 "accumulation split (the Trainer's); per_rank_mean: mean of each rank's micro-batch means")
      ->check(CLI::IsMember({"global_tokens", "per_rank_mean"}))
      ->capture_default_str();
  app.add_option("--max-steps", options.max_steps, "Optimizer steps")->capture_default_str();
  app.add_option("--lr", options.lr, "Peak learning rate")->capture_default_str();
  app.add_option("--weight-decay", options.weight_decay, "AdamW weight decay")->capture_default_str();
  app.add_option("--warmup", options.warmup,
                 "Warmup steps: linear (DeepSpeed's WarmupCosineLR: the first two updates run at lr 0 whatever "
                 "the warmup), then cosine decay to 0.1 x lr; a config with a scheduler block runs its own "
                 "schedule, with this as its \"auto\" warmup_num_steps")
      ->capture_default_str();
  app.add_option("--max-grad-norm", options.max_grad_norm, "Gradient clipping (config \"auto\")")->capture_default_str();
  app.add_option("--seed", options.seed, "Seed of the init, the data order and sampling")->capture_default_str();
  app.add_option("--load-dtype", options.load_dtype,
                 "Dtype the model is loaded in: auto (bf16 for FSDP pure low precision, else fp32), fp32, bf16")
      ->check(CLI::IsMember({"auto", "fp32", "bf16", "fp16"}))
      ->capture_default_str();
  app.add_option("--output-dir", options.output_dir, "Checkpoints (checkpoints/), the exported model (hf/)")
      ->capture_default_str();
  app.add_option("--save-every", options.save_every, "Save a checkpoint every N steps (0: only at the end)")
      ->capture_default_str();
  app.add_option("--keep-last", options.keep_last, "Keep at most N checkpoints (0: all)")->capture_default_str();
  app.add_option("--resume", options.resume, "Resume from a run's output directory, a checkpoint directory (their latest), a step_N checkpoint, or `latest` (this run's --output-dir)");
  app.add_option("--metrics-out", options.metrics_out, "One JSON object per step (rank 0)");
  app.add_option("--report_to,--report-to", options.report_to,
                 "Where metrics go, as the Trainer's: jsonl (OUTPUT_DIR/metrics.jsonl unless --metrics-out), none, "
                 "all; tensorboard, wandb, ... are not built in and fall back to jsonl with a warning")
      ->capture_default_str();
  app.add_option("--eval-every", options.eval_every, "Evaluate every N steps (0: at start and end only)")
      ->capture_default_str();
  app.add_option("--eval-samples", options.eval_samples, "Eval prompts for exact match (0: all)")
      ->capture_default_str();
  app.add_option("--max-new-tokens", options.max_new_tokens, "Generation length for exact match")
      ->capture_default_str();
  app.add_option("--show-examples", options.show_examples, "Print this many eval answers at the end")
      ->capture_default_str();
  app.add_option("--peak-tflops", options.peak_tflops,
                 "Per-rank peak TFLOP/s for MFU; 0: the GPU's datasheet peak where known (H100/H200 SXM bf16 "
                 "989, A100 312), else a GEMM measured here")
      ->capture_default_str();
  app.add_option("--device", options.device,
                 "cpu, cuda (cuda:LOCAL_RANK), cuda:N, or auto (cuda:LOCAL_RANK when a GPU is visible, else cpu); "
                 "the backend follows: gloo for cpu, nccl for cuda")
      ->capture_default_str();
  app.add_flag("--no-export", options.no_export, "Skip the Hugging Face export at the end");
  app.add_option("--lora-r", options.lora_r, "Train a LoRA adapter of this rank instead of the whole model "
                 "(PEFT's defaults for the rest: alpha 8, dropout 0, q_proj and v_proj)");
  app.add_option("--lora-alpha", options.lora_alpha, "LoRA alpha: the update is scaled by alpha / r");
  app.add_option("--lora-dropout", options.lora_dropout, "Dropout on the adapters' input while training");
  app.add_option("--lora-target-modules", options.lora_target_modules,
                 "Layers that get adapters: names (q_proj,k_proj,...) or all-linear")
      ->delimiter(',');
  app.add_option("--lora-config", options.lora_config,
                 "A PEFT adapter_config.json (the --lora-* flags override its fields)");
  app.add_option("--lora-adapter", options.lora_adapter,
                 "A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) to train further");
  app.add_flag("--merge-lora", options.merge_lora,
               "With LoRA: also export OUTPUT/hf, the model with the adapters folded in (the adapter always goes "
               "to OUTPUT/adapter)");
  app.add_flag("--load-in-4bit", options.load_in_4bit,
               "QLoRA: hold the frozen base in 4-bit NF4 (blocksize 64, double quant, as bitsandbytes), compute in "
               "bf16; needs LoRA (--lora-r, ...)");
  app.add_flag("--no-save", options.no_save, "No checkpoint at the end (benchmarks)");
  app.add_flag("--no-progress", options.no_progress, "No progress bar");
  app.add_option("--throughput-skip-steps", options.throughput_skip_steps,
                 "Leave the first N steps (warm-up) out of tokens/s and MFU")
      ->capture_default_str();
  bool no_eval = false;
  app.add_flag("--no-eval", no_eval, "No evaluation before and after training (benchmarks)");
  std::string plot;
  app.add_option("--plot", plot, "At the end, draw this run's curves from --metrics-out into this .png or .svg (rank 0)");
  std::string summary_json;
  app.add_option("--summary-json", summary_json,
                 "Write the run's summary (throughput, MFU and its peak, memory, per-step losses) here as JSON (rank 0)");
  CLI11_PARSE(app, argc, argv);

  if (options.model_dir.empty()) {
    if (options.model_config.empty()) options.model_config = bundled + "/config.json";
    if (options.tokenizer.empty()) options.tokenizer = bundled + "/tokenizer.model";
    if (options.data.empty()) options.data = bundled + "/data/train.jsonl";
    if (options.eval_data.empty() && !no_eval) options.eval_data = bundled + "/data/eval.jsonl";
  }
  if (no_eval) options.eval_data.clear();
  try {
    std::vector<std::string> unused_warnings;  // run_finetune says them on rank 0
    if (!plot.empty() &&
        finetune::resolve_metrics_file(options.report_to, options.metrics_out, options.output_dir, unused_warnings)
            .empty()) {
      std::cerr << program << ": --plot draws the metrics file: give --metrics-out FILE or --report_to jsonl too"
                << std::endl;
      return 2;
    }
    finetune::FinetuneSummary summary = finetune::run_finetune(options);
    if (!plot.empty() && summary.main_process && !summary.metrics_file.empty()) {
      shardtrain::plot_metrics({{summary.metrics_file, program}}, plot);
      std::cout << "curves: " << plot << std::endl;
    }
    if (!summary_json.empty() && summary.main_process) {
      std::ofstream out(summary_json);
      out << finetune::summary_to_json(summary).dump(2) << "\n";
      if (!out.good()) throw std::runtime_error("cannot write --summary-json " + summary_json);
    }
    return summary.ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << program << ": " << e.what() << std::endl;
    return 1;
  }
}
