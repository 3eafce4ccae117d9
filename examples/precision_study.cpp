// precision_study: the seeds' precision study on the bundled tiny Llama (see
// study/precision_study.h). Writes one metrics file per run, study.md (table
// and the seeds' relations), study.json and study.png; exits 1 when a
// relation does not hold.
//
//   build/bin/precision_study --output-dir precision-study

#include <iostream>

#include <CLI/CLI.hpp>

#include "data_dir.h"
#include "study/precision_study.h"

int main(int argc, char** argv) {
  study::StudyOptions options;
  options.configs_dir = shardtrain_data_dir() + "/configs/llama";
  options.model_dir = shardtrain_data_dir() + "/examples/tiny_llama";
  CLI::App app{"precision_study: zero-3, fsdp standard and fsdp pure bf16 at small and large learning rates"};
  app.add_option("--base-steps", options.base_steps, "Steps that train the base model from the random init")
      ->capture_default_str();
  app.add_option("--base-lr", options.base_lr, "Learning rate of the base model's training")->capture_default_str();
  app.add_option("--steps", options.steps, "Optimizer steps per fine-tune run")->capture_default_str();
  app.add_option("--seq-len", options.seq_len, "Tokens per row")->capture_default_str();
  app.add_option("--micro-batch", options.micro_batch, "Rows per step")->capture_default_str();
  app.add_option("--warmup", options.warmup, "Linear warm-up steps before the cosine decay")->capture_default_str();
  app.add_option("--seed", options.seed, "Data order and initialisation")->capture_default_str();
  app.add_option("--small-lr", options.small_lr, "The learning rate pure bf16 cannot train at")->capture_default_str();
  app.add_option("--scaled-lr", options.scaled_lr, "The seeds' 'scaled by 4 GPUs' rate for pure bf16")
      ->capture_default_str();
  app.add_option("--large-lr", options.large_lr, "A rate every mode trains at")->capture_default_str();
  app.add_option("--output-dir", options.output_dir, "Where the metrics files, table and picture go")
      ->capture_default_str();
  app.add_option("--configs-dir", options.configs_dir,
                 "Directory with zero3_bf16.json, fsdp_standard_bf16.yaml, fsdp_pure_bf16.yaml")
      ->capture_default_str();
  app.add_option("--model-dir", options.model_dir, "The tiny Llama: config.json, tokenizer.model, data/train.jsonl")
      ->capture_default_str();
  bool no_plot = false;
  app.add_flag("--no-plot", no_plot, "Do not draw study.png (no gnuplot)");
  CLI11_PARSE(app, argc, argv);
  options.plot = !no_plot;
  try {
    const study::StudyResult result = study::run_precision_study(options);
    std::cout << "\n" << study::study_markdown(result, options) << "\nwritten to " << options.output_dir
              << " (study.md, study.json" << (options.plot ? ", study.png" : "") << ", one .jsonl per run)"
              << std::endl;
    return result.all_hold() ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "precision_study: " << e.what() << std::endl;
    return 1;
  }
}
