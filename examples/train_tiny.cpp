// train_tiny: the smallest end-to-end shardtrain program, and the reference
// the tests compare the engines with.
//
//   build/bin/shardtrain launch --num_processes 2 build/bin/train_tiny --config configs/zero3_bf16.json
//   build/bin/train_tiny --reference --config configs/zero3_bf16.json --world-size 2
#include <iostream>

#include <CLI/CLI.hpp>

#include "shardtrain/error.h"
#include "tiny/tiny_train.h"

int main(int argc, char** argv) {
  CLI::App app{"train_tiny: a small decoder on synthetic token data, trained with shardtrain"};
  tiny::TinyRunOptions options;
  std::string config_path;
  bool reference = false;
  int reference_world = 1;
  double lr = 0;
  app.add_option("--config", config_path, "Accelerate YAML or DeepSpeed JSON (default: the launcher's)");
  app.add_option("--steps", options.steps, "Optimizer steps")->capture_default_str();
  app.add_option("--seed", options.seed, "Seed of the init and the data")->capture_default_str();
  app.add_option("--lr", lr, "Learning rate (overrides the config's optimizer lr)");
  app.add_option("--micro-batch", options.micro_batch, "Samples per rank per micro-batch")->capture_default_str();
  app.add_option("--metrics-out", options.metrics_out, "Write one JSON object per step here (rank 0)");
  app.add_option("--load-dtype", options.load_dtype, "Model load dtype: fp32 or bf16")->capture_default_str()
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--device", options.device,
                 "cpu, cuda (cuda:LOCAL_RANK), cuda:N or auto (a GPU when visible); the backend follows the device")
      ->capture_default_str();
  app.add_option("--save-dir", options.save_dir, "Save checkpoints here (with --save-every)");
  app.add_option("--save-every", options.save_every, "Save every N steps")->capture_default_str();
  app.add_option("--resume", options.resume_dir, "Resume from this checkpoint directory's latest checkpoint");
  app.add_option("--stop-after", options.stop_after, "Stop after N steps of this run (0: run to --steps)");
  app.add_option("--keep-last", options.keep_last, "Keep at most N checkpoints (0: all)")->capture_default_str();
  app.add_flag("--reference", reference, "Plain LibTorch loop in one process (no engine), same init and global batch");
  app.add_option("--world-size", reference_world, "With --reference: the world size whose global batch to use")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    if (!config_path.empty()) options.config_path = config_path;
    if (lr > 0) options.lr = lr;
    tiny::TinyRunResult result =
        reference ? tiny::run_tiny_reference(options, reference_world) : tiny::run_tiny(options);
    if (reference) {
      for (std::size_t i = 0; i < result.losses.size(); ++i) {
        std::cout << "step " << i + 1 << "  loss " << result.losses[i] << std::endl;
      }
    }
    std::cout << "loss " << result.losses.front() << " -> " << result.losses.back() << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "train_tiny: " << e.what() << std::endl;
    return 1;
  }
}
