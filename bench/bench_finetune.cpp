// bench_finetune: the seeds' throughput table on this machine — the bundled
// Llama fine-tune step under each engine configuration, measured side by side
// in one run (configurations interleaved round by round, so machine noise hits
// them alike), with ratios to ZeRO-3.
//
//   build/bin/shardtrain launch --num_processes 2 build/bin/bench_finetune
//   build/bin/shardtrain launch --num_processes 2 build/bin/bench_finetune --model-config my/config.json --seq-len 512
//
// tokens/s per rank counts token positions (rows x seq_len) of the timed steps
// (each run's first --skip steps are warm-up and not timed); the median over
// rounds is reported. MFU is against one bf16 GEMM rate measured at start
// (or --peak-tflops). Peak RSS is this process's high-water mark
// during the run (reset before each run through /proc/self/clear_refs).

#include <unistd.h>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "build_config.h"
#include "finetune/finetune.h"
#include "shardtrain/accelerator.h"
#include "shardtrain/comm/rendezvous.h"
#include "shardtrain/error.h"
#include "shardtrain/nn/linear.h"

using bench::median;
using bench::reset_peak_rss;

int main(int argc, char** argv) {
  const std::string source = SHARDTRAIN_SOURCE_DIR;
  CLI::App app{"bench_finetune: fine-tune step throughput of each engine configuration, side by side"};
  finetune::FinetuneOptions base;
  base.model_config = source + "/examples/tiny_llama/config.json";
  base.tokenizer = source + "/examples/tiny_llama/tokenizer.model";
  base.data = source + "/examples/tiny_llama/data/train.jsonl";
  base.max_steps = 12;
  int rounds = 3;
  int64_t skip = 2;
  std::vector<std::string> configs = {"zero3", "fsdp_full_shard", "fsdp_pure", "zero2", "fsdp_shard_grad_op"};
  app.add_option("--model-config", base.model_config, "config.json of the (randomly initialised) model")
      ->capture_default_str();
  app.add_option("--seq-len", base.seq_len, "Tokens per row")->capture_default_str();
  app.add_option("--micro-batch", base.micro_batch, "Rows per rank per step")->capture_default_str();
  app.add_option("--steps", base.max_steps, "Steps per run (including --skip warm-up steps)")->capture_default_str();
  app.add_option("--skip", skip, "Warm-up steps per run, not timed")->capture_default_str();
  app.add_option("--rounds", rounds, "Runs of every configuration (interleaved); the median is reported")
      ->capture_default_str();
  app.add_option("--configs", configs,
                 "Which of: zero3 zero3_fp32 fsdp_full_shard fsdp_pure zero2 fsdp_shard_grad_op")
      ->capture_default_str();
  app.add_option("--peak-tflops", base.peak_tflops, "Per-rank peak for MFU (0: measured GEMM rate)")
      ->capture_default_str();
  app.add_option("--activation-checkpointing", base.activation_checkpointing, "none, selective or full")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  const std::map<std::string, std::pair<std::string, std::string>> known = {
      {"zero3", {"configs/zero3_bf16.json", "ZeRO-3 bf16 (fp32 master)"}},
      {"zero3_fp32", {"configs/zero3_fp32.json", "ZeRO-3 fp32"}},
      {"fsdp_full_shard", {"configs/llama/fsdp_standard_bf16.yaml", "FSDP FULL_SHARD standard bf16"}},
      {"fsdp_pure", {"configs/llama/fsdp_pure_bf16.yaml", "FSDP FULL_SHARD pure bf16"}},
      {"zero2", {"configs/zero2_bf16.json", "ZeRO-2 bf16"}},
      {"fsdp_shard_grad_op", {"configs/llama/fsdp_shard_grad_op_bf16.yaml", "FSDP SHARD_GRAD_OP standard bf16"}},
  };
  try {
    for (const auto& name : configs) {
      if (!known.count(name)) throw std::runtime_error("unknown configuration '" + name + "'");
    }
    ST_CHECK(base.max_steps > skip, "--steps must exceed --skip");
    const shardtrain::DistEnv env = shardtrain::detect_dist_env();
    shardtrain::comm::CommunicatorPtr comm = shardtrain::init_distributed(env);
    const bool main_process = comm->rank() == 0;
    const std::string scratch =
        (std::filesystem::temp_directory_path() / ("bench_finetune_" + std::to_string(::getpid()))).string();
    base.communicator = comm;
    base.quiet = true;
    base.no_export = true;
    base.no_save = true;
    base.warmup = 1;
    // One peak per compute dtype, measured here through the path the model's
    // products take (shardtrain::nn), so the MFU column compares like with like.
    const bool measured_peaks = base.peak_tflops <= 0;
    const double bf16_peak = measured_peaks ? finetune::measure_gemm_flops("bf16") / 1e12 : base.peak_tflops;
    const double fp32_peak = measured_peaks ? finetune::measure_gemm_flops("fp32") / 1e12 : base.peak_tflops;
    base.peak_tflops = bf16_peak;
    if (main_process) {
      std::printf("GEMM peak per rank (512^3, shardtrain::nn): bf16 %.1f GFLOP/s, fp32 %.1f GFLOP/s; bf16 path: %s\n",
                  bf16_peak * 1e3, fp32_peak * 1e3, shardtrain::nn::cpu_low_precision_gemm().describe().c_str());
    }

    std::map<std::string, std::vector<double>> tokens_per_s;
    std::map<std::string, finetune::FinetuneSummary> last;
    for (int round = 0; round < rounds; ++round) {
      for (const auto& name : configs) {
        finetune::FinetuneOptions options = base;
        options.config_path = source + "/" + known.at(name).first;
        options.output_dir = scratch + "/" + name;
        reset_peak_rss();
        finetune::FinetuneSummary summary = finetune::run_finetune(options);
        double seconds = 0;
        for (size_t i = skip; i < summary.step_seconds.size(); ++i) seconds += summary.step_seconds[i];
        const double local = summary.tokens_per_step * (summary.step_seconds.size() - skip) / seconds;
        at::Tensor mean = at::full({1}, local, at::kDouble);
        comm->all_reduce(mean, shardtrain::comm::ReduceOp::kAvg);
        tokens_per_s[name].push_back(mean.item<double>());
        last[name] = summary;
        if (main_process) {
          std::printf("round %d  %-20s %8.0f tokens/s per rank\n", round + 1, name.c_str(), mean.item<double>());
          std::fflush(stdout);
        }
      }
    }
    std::filesystem::remove_all(scratch);
    if (main_process) {
      const finetune::FinetuneSummary& any = last.begin()->second;
      std::printf("\nbundled-Llama fine-tune step, %d ranks, %lld parameters, seq %lld x micro-batch %lld, "
                  "median of %d rounds (%lld timed steps each)\n",
                  comm->world_size(), static_cast<long long>(any.plan.num_params), static_cast<long long>(base.seq_len),
                  static_cast<long long>(base.micro_batch), rounds, static_cast<long long>(base.max_steps - skip));
      std::printf("%-34s %14s %10s %8s %16s %14s\n", "configuration", "tokens/s/rank", "vs ZeRO-3", "MFU",
                  "model states/rank", "peak RSS/rank");
      const double reference = tokens_per_s.count("zero3") ? median(tokens_per_s["zero3"]) : 0.0;
      for (const auto& name : configs) {
        const double tps = median(tokens_per_s[name]);
        const finetune::FinetuneSummary& s = last[name];
        const double states = s.plan.trained_bytes_per_param() * static_cast<double>(s.plan.num_params);
        char ratio[32] = "-";
        if (reference > 0) std::snprintf(ratio, sizeof ratio, "%.3f", tps / reference);
        std::printf("%-34s %14.0f %10s %7.1f%% %13.1f MB %11.1f MiB\n", known.at(name).second.c_str(), tps, ratio,
                    100.0 * tps * s.flops_per_token /
                        ((s.plan.compute_dtype.rfind("fp32", 0) == 0 ? fp32_peak : bf16_peak) * 1e12),
                    states / 1e6, s.peak_rss_max / 1048576.0);
      }
      if (tokens_per_s.count("zero3") && tokens_per_s.count("zero3_fp32")) {
        // Step time scales as 1 / tokens per second: the "bf16 step <= 1.25x fp32 step".
        std::printf("\nbf16 step time / fp32 step time (ZeRO-3, same job): %.3f\n",
                    median(tokens_per_s["zero3_fp32"]) / median(tokens_per_s["zero3"]));
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "bench_finetune: " << e.what() << std::endl;
    return 1;
  }
}
