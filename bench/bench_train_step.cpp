// bench_train_step: one training step of a Llama on random tokens, under a
// plain LibTorch loop (no shardtrain engine), an all-reduce data-parallel loop
// (the plain loop plus one all-reduce of the gradients: what DDP does) and
// each engine configuration, measured side by side in one run (configurations
// interleaved round by round, so machine noise hits them alike).
//
//   build/bin/shardtrain launch --num_processes 1 build/bin/bench_train_step
//   build/bin/shardtrain launch --num_processes 2 build/bin/bench_train_step --dtype fp32 bf16
//   ... --model-config my/config.json --seq-len 512 --configs plain zero3
//
// The step time is the median over rounds of each run's mean timed step
// (each run's first --skip steps are warm-up). Ratios are to the plain loop
// at world 1 and to the all-reduce loop at larger worlds. MFU is against this
// machine's GEMM rate in the run's compute dtype, measured at start through
// shardtrain::nn (the path the model's products take). With both dtypes the
// runs interleave too, and a last line gives each configuration's bf16/fp32
// step-time ratio. With --audit-ablation every engine configuration also
// runs without the lost-update audit (precision_audit.sample_fraction 0),
// interleaved with the audited run, and a last line gives the audit's cost as
// the ratio of the two step times. Model states are the
// bytes the run holds per rank (parameters, gradients, master, optimizer
// state; for engines Accelerator::memory()), next to the precision plan's
// prediction. Peak RSS is the process's high-water mark during the run.
// The ZeRO configurations run with overlap_comm on at every stage.
// The *_lora configurations train a LoRA adapter (r --lora-r, alpha 2r, on
// q/k/v/o_proj, PEFT's semantics: shardtrain/lora.h) instead of the whole
// model; *_qlora ones also hold the frozen base in NF4
// (shardtrain/quantization.h). Their "model states peak" adds the most
// gathered bytes at once to the states at rest.

#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <CLI/CLI.hpp>

#include "bench_util.h"
#include "build_config.h"
#include "finetune/finetune.h"
#include "shardtrain/accelerator.h"
#include "shardtrain/comm/rendezvous.h"
#include "shardtrain/error.h"
#include "shardtrain/lora.h"
#include "shardtrain/models/llama.h"
#include "shardtrain/quantization.h"
#include "shardtrain/nn/linear.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace models = shardtrain::models;

struct BenchOptions {
  models::LlamaConfig model;
  bool bf16 = false;
  int64_t seq_len = 256;
  int64_t micro_batch = 4;
  int steps = 4;
  int skip = 1;
  double lr = 1e-4;
  double weight_decay = 0.01;
  /// ZeRO bucket sizes "auto" (from the hidden size, as in the shipped
  /// configs/zero*.json) rather than DeepSpeed's fixed defaults.
  bool auto_buckets = true;
  /// The lost-update audit (precision_audit.sample_fraction 1, the default) or none (0).
  bool audit = true;
  /// Rank of the *_lora and *_qlora configurations' adapters.
  int64_t lora_r = 8;
  /// FSDP also wraps the embeddings and the head ("Embedding", "Linear")
  /// beside the decoder layers, as ZeRO-3 does by itself.
  bool wrap_edges = false;
};

struct RunResult {
  double step_seconds = 0;  ///< mean of the timed steps
  double optimizer_seconds = 0;  ///< mean time of accelerator.step() in the timed steps (engines)
  double final_loss = 0;
  int64_t state_bytes = 0;
  int64_t state_peak_bytes = 0;  ///< engines: states at rest plus the gathered peak
  int64_t planned_bytes = -1;  ///< -1: no plan (plain loops)
  int64_t peak_rss = 0;
  int64_t gathered_bytes_per_step = 0;  ///< parameters all-gathered (bytes on the wire), mean over every step
  int64_t num_params = 0;  ///< the model's, adapters included, before any quantization
  double flops_per_token = 0;  ///< what MFU counts (LoRA: no weight gradient for the frozen base)
};

/// Random tokens of step `step` on `rank`: [micro_batch, seq_len + 1].
at::Tensor random_tokens(const BenchOptions& o, int step, int rank) {
  at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * step + rank + 1));
  return at::randint(o.model.vocab_size, {o.micro_batch, o.seq_len + 1}, gen, at::TensorOptions().dtype(at::kLong));
}

at::Tensor next_token_loss(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

int64_t tensor_bytes(const at::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; }

/// The plain loop, optionally data-parallel: one flat all-reduce (mean) of
/// every gradient before the optimizer step, as DDP's buckets amount to.
/// bf16: forward and backward on a bf16 copy refreshed from the fp32 master
/// each step; the master and AdamW stay fp32 (what a hand-written mixed
/// precision loop does).
RunResult run_plain(const BenchOptions& o, shardtrain::comm::Communicator* all_reduce) {
  torch::manual_seed(0);
  models::LlamaForCausalLM master(o.model);
  models::LlamaForCausalLM compute = master;
  if (o.bf16) {
    torch::manual_seed(0);
    compute = models::LlamaForCausalLM(o.model);
    compute->to(at::kBFloat16);
  }
  auto master_params = master->parameters();
  auto compute_params = compute->parameters();
  torch::optim::AdamW optimizer(master_params, torch::optim::AdamWOptions(o.lr).weight_decay(o.weight_decay));
  const int rank = all_reduce != nullptr ? all_reduce->rank() : 0;
  RunResult result;
  double timed = 0;
  for (int step = 0; step < o.skip + o.steps; ++step) {
    at::Tensor tokens = random_tokens(o, step, rank);
    const auto start = Clock::now();
    if (o.bf16) {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < master_params.size(); ++i) compute_params[i].copy_(master_params[i]);
    }
    at::Tensor loss = next_token_loss(compute(tokens.narrow(1, 0, o.seq_len)), tokens.narrow(1, 1, o.seq_len));
    loss.backward();
    std::vector<at::Tensor> grads;
    for (auto& p : compute_params) grads.push_back(p.grad().reshape({-1}));
    if (all_reduce != nullptr) {
      at::Tensor flat = at::cat(grads);
      all_reduce->all_reduce(flat, shardtrain::comm::ReduceOp::kAvg);
      int64_t offset = 0;
      for (auto& g : grads) {
        g.copy_(flat.narrow(0, offset, g.numel()));
        offset += g.numel();
      }
    }
    if (o.bf16) {
      for (size_t i = 0; i < master_params.size(); ++i) master_params[i].mutable_grad() = compute_params[i].grad().to(at::kFloat);
    }
    optimizer.step();
    for (auto& p : compute_params) p.mutable_grad() = at::Tensor();
    for (auto& p : master_params) p.mutable_grad() = at::Tensor();
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (step >= o.skip) timed += seconds;
    result.final_loss = loss.item<double>();
  }
  result.step_seconds = timed / o.steps;
  for (auto& p : master_params) {
    result.num_params += p.numel();
    result.flops_per_token = models::training_flops_per_token(o.model, result.num_params, o.seq_len);
    result.state_bytes += 4 * tensor_bytes(p);  // parameter, gradient, exp_avg, exp_avg_sq
  }
  if (o.bf16) {
    for (auto& p : compute_params) result.state_bytes += 2 * tensor_bytes(p);  // the bf16 copy and its gradient
  }
  return result;
}

shardtrain::TrainingConfig engine_config(const std::string& name, const BenchOptions& o, int world) {
  shardtrain::TrainingConfig c;
  c.mixed_precision = o.bf16 ? shardtrain::MixedPrecision::kBf16 : shardtrain::MixedPrecision::kNo;
  c.bf16 = o.bf16;
  c.optimizer.specified = true;
  c.optimizer.type = "AdamW";
  c.optimizer.lr = o.lr;
  c.optimizer.weight_decay = o.weight_decay;
  c.gradient_clipping = 0.0;
  c.steps_per_print = 1 << 30;
  c.precision_audit.sample_fraction = o.audit ? 1.0 : 0.0;
  if (name == "ddp") {
    c.distributed_type = world > 1 ? shardtrain::DistributedType::kMultiCpu : shardtrain::DistributedType::kNo;
  } else if (name.rfind("zero", 0) == 0) {
    c.distributed_type = shardtrain::DistributedType::kDeepSpeed;
    c.zero.stage = name.back() - '0';
    // Communication under computation, as DDP runs its all-reduce under
    // backward: DeepSpeed's documented ZeRO-2 configurations turn it on
    // (its default is off for stages 1 and 2, on for 3).
    c.zero.overlap_comm = true;
    if (o.auto_buckets) {
      c.auto_keys = {"zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                     "zero_optimization.stage3_param_persistence_threshold"};
    }
  } else {
    c.distributed_type = shardtrain::DistributedType::kFsdp;
    // fsdp_pure: Accelerate's pure low precision, the model loaded in bf16
    // and trained without an fp32 master (its memory is the point).
    c.fsdp.pure_low_precision = name == "fsdp_pure";
    if (name == "fsdp_pure") c.mixed_precision = shardtrain::MixedPrecision::kNo;
    c.fsdp.sharding_strategy = name == "fsdp_full_shard" || name == "fsdp_pure"
                                   ? shardtrain::ShardingStrategy::kFullShard
                               : name == "fsdp_shard_grad_op" ? shardtrain::ShardingStrategy::kShardGradOp
                                                              : shardtrain::ShardingStrategy::kNoShard;
    c.fsdp.auto_wrap_policy = shardtrain::AutoWrapPolicy::kTransformerBased;
    c.fsdp.transformer_layer_cls_to_wrap = {o.model.decoder_layer_class_name()};
    if (o.wrap_edges) {
      c.fsdp.transformer_layer_cls_to_wrap.insert(c.fsdp.transformer_layer_cls_to_wrap.end(), {"Embedding", "Linear"});
    }
  }
  return c;
}

/// "zero3_qlora" -> {"zero3", LoRA, NF4 base}.
struct EngineVariant {
  std::string engine;
  bool lora = false, qlora = false;
};

EngineVariant variant_of(const std::string& name) {
  auto ends_with = [&](const std::string& suffix) {
    return name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (ends_with("_qlora")) return {name.substr(0, name.size() - 6), true, true};
  if (ends_with("_lora")) return {name.substr(0, name.size() - 5), true, false};
  return {name};
}

RunResult run_engine(const std::string& name, const BenchOptions& o, const shardtrain::comm::CommunicatorPtr& comm) {
  const EngineVariant variant = variant_of(name);
  shardtrain::AcceleratorOptions accelerator_options;
  accelerator_options.config = engine_config(variant.engine, o, comm->world_size());
  accelerator_options.communicator = comm;
  accelerator_options.print_plan = false;
  shardtrain::Accelerator accelerator(accelerator_options);
  torch::manual_seed(0);
  models::LlamaForCausalLM model(o.model);
  shardtrain::RunInfo run;
  if (variant.engine == "fsdp_pure") {
    model->to(at::kBFloat16);
    run.load_dtype = "bf16";
  }
  if (variant.lora) {
    shardtrain::LoraConfig lora;
    lora.r = o.lora_r;
    lora.lora_alpha = static_cast<double>(2 * o.lora_r);
    lora.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj"};
    shardtrain::apply_lora(*model, lora);
  }
  RunResult result;
  int64_t trainable = 0;
  for (const auto& p : model->parameters()) {
    result.num_params += p.numel();
    if (p.requires_grad()) trainable += p.numel();
  }
  result.flops_per_token = variant.lora
                               ? models::training_flops_per_token(o.model, result.num_params, o.seq_len, trainable)
                               : models::training_flops_per_token(o.model, result.num_params, o.seq_len);
  if (variant.qlora) shardtrain::quantize_frozen_base(*model);
  run.hidden_size = o.model.hidden_size;
  run.micro_batch_size = o.micro_batch;
  run.total_steps = o.skip + o.steps;
  auto prepared = accelerator.prepare(model, {}, run);
  double timed = 0, optimizer = 0;
  accelerator.reset_traffic();
  for (int step = 0; step < o.skip + o.steps; ++step) {
    at::Tensor tokens = random_tokens(o, step, comm->rank());
    const auto start = Clock::now();
    at::Tensor loss = next_token_loss(prepared(tokens.narrow(1, 0, o.seq_len)), tokens.narrow(1, 1, o.seq_len));
    accelerator.backward(loss);
    const auto step_start = Clock::now();
    accelerator.step();
    const double step_seconds = std::chrono::duration<double>(Clock::now() - step_start).count();
    accelerator.zero_grad();
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (step >= o.skip) {
      timed += seconds;
      optimizer += step_seconds;
    }
    result.final_loss = loss.item<double>();
  }
  result.step_seconds = timed / o.steps;
  result.optimizer_seconds = optimizer / o.steps;
  result.gathered_bytes_per_step = accelerator.traffic().param_gather_bytes / (o.skip + o.steps);
  const shardtrain::MemoryReport mem = accelerator.memory();
  result.state_bytes = mem.params + mem.grads + mem.master + mem.optimizer + mem.gathered;
  result.state_peak_bytes = mem.params + mem.grads + mem.master + mem.optimizer + mem.gathered_peak;
  const shardtrain::PrecisionPlan plan = accelerator.precision_plan();
  result.planned_bytes = static_cast<int64_t>(plan.total_bytes_per_rank());
  return result;
}

const std::map<std::string, std::string>& known_configs() {
  static const std::map<std::string, std::string> known = {
      {"plain", "plain LibTorch loop (no shardtrain)"},
      {"allreduce_dp", "all-reduce data-parallel loop"},
      {"ddp", "Accelerator, no sharding (zero-0/DDP)"},
      {"zero1", "ZeRO-1"},
      {"zero2", "ZeRO-2"},
      {"zero3", "ZeRO-3"},
      {"fsdp_full_shard", "FSDP FULL_SHARD standard"},
      {"fsdp_shard_grad_op", "FSDP SHARD_GRAD_OP standard"},
      {"fsdp_no_shard", "FSDP NO_SHARD"},
      {"fsdp_pure", "FSDP FULL_SHARD pure bf16 (whatever --dtype)"},
      {"ddp_lora", "zero-0/DDP, LoRA"},
      {"zero3_lora", "ZeRO-3, LoRA"},
      {"fsdp_full_shard_lora", "FSDP FULL_SHARD standard, LoRA"},
      {"zero3_qlora", "ZeRO-3, QLoRA (NF4 base)"},
      {"fsdp_full_shard_qlora", "FSDP FULL_SHARD standard, QLoRA (NF4 base)"},
      {"fsdp_pure_lora", "FSDP FULL_SHARD pure, LoRA (bf16-only base, fp32 adapters)"},
      {"fsdp_pure_qlora", "FSDP FULL_SHARD pure, QLoRA (NF4 base, bf16 embeddings, fp32 adapters)"},
  };
  return known;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string source = SHARDTRAIN_SOURCE_DIR;
  CLI::App app{"bench_train_step: a Llama training step under a plain loop, an all-reduce loop and every engine"};
  std::string model_config = source + "/bench/models/llama_58m.json";
  std::vector<std::string> dtypes = {"fp32"};
  BenchOptions o;
  int rounds = 3;
  std::vector<std::string> configs = {"plain", "allreduce_dp", "ddp", "zero2", "zero3", "fsdp_full_shard"};
  app.add_option("--model-config", model_config, "config.json of the (randomly initialised) model")->capture_default_str();
  app.add_option("--dtype", dtypes, "fp32 and/or bf16 (mixed precision, fp32 master); several are interleaved")
      ->capture_default_str();
  app.add_option("--seq-len", o.seq_len, "Tokens per row")->capture_default_str();
  app.add_option("--micro-batch", o.micro_batch, "Rows per rank per step")->capture_default_str();
  app.add_option("--steps", o.steps, "Timed steps per run")->capture_default_str();
  app.add_option("--skip", o.skip, "Warm-up steps per run, not timed")->capture_default_str();
  app.add_option("--lora-r", o.lora_r, "Adapter rank of the *_lora and *_qlora configurations")->capture_default_str();
  app.add_option("--rounds", rounds, "Runs of every configuration (interleaved); the median is reported")
      ->capture_default_str();
  std::string names;
  for (const auto& [name, label] : known_configs()) names += " " + name;
  app.add_option("--configs", configs, "Which of:" + names)->capture_default_str();
  std::string zero_buckets = "auto";
  app.add_option("--zero-buckets", zero_buckets,
                 "ZeRO bucket and prefetch sizes: auto (from the hidden size, as configs/zero*.json) or "
                 "deepspeed (DeepSpeed's fixed defaults: 5e8 reduce bucket, 5e7 prefetch)")
      ->capture_default_str();
  app.add_flag("--wrap-edges", o.wrap_edges,
               "FSDP configurations also wrap the embeddings and lm_head as units (Embedding, Linear), so they "
               "are gathered only while used");
  bool audit_ablation = false;
  app.add_flag("--audit-ablation", audit_ablation,
               "Also run every engine configuration without the lost-update audit, interleaved, and print its cost");
  CLI11_PARSE(app, argc, argv);

  try {
    for (const auto& dtype : dtypes) {
      ST_CHECK(dtype == "fp32" || dtype == "bf16", "--dtype must be fp32 or bf16, not '", dtype, "'");
    }
    ST_CHECK(o.steps > 0 && o.skip >= 0 && rounds > 0, "--steps and --rounds must be positive, --skip not negative");
    for (const auto& name : configs) {
      ST_CHECK(known_configs().count(name), "unknown configuration '", name, "' (known:", names, ")");
    }
    ST_CHECK(zero_buckets == "auto" || zero_buckets == "deepspeed", "--zero-buckets must be auto or deepspeed");
    o.auto_buckets = zero_buckets == "auto";
    o.model = models::LlamaConfig::from_json_file(model_config);
    ST_CHECK(o.seq_len <= o.model.max_position_embeddings, "--seq-len exceeds the model's max_position_embeddings");
    const shardtrain::DistEnv env = shardtrain::detect_dist_env();
    shardtrain::comm::CommunicatorPtr comm = shardtrain::init_distributed(env);
    const bool main_process = comm->rank() == 0;
    const int world = comm->world_size();
    std::map<std::string, double> peak;
    for (const auto& dtype : dtypes) peak[dtype] = finetune::measure_gemm_flops(dtype);
    if (main_process) {
      std::printf("GEMM rate per rank (512^3, shardtrain::nn, %d thread(s)):", at::get_num_threads());
      for (const auto& dtype : dtypes) std::printf(" %s %.1f GFLOP/s;", dtype.c_str(), peak[dtype] / 1e9);
      std::printf(" bf16 path: %s\n", shardtrain::nn::cpu_low_precision_gemm().describe().c_str());
      std::fflush(stdout);
    }

    // Keyed by "config dtype".
    std::map<std::string, std::vector<double>> step_seconds, optimizer_seconds;
    std::map<std::string, RunResult> last;
    for (int round = 0; round < rounds; ++round) {
      for (const auto& dtype : dtypes) {
        o.bf16 = dtype == "bf16";
        for (const auto& name : configs) {
          const bool engine = name != "plain" && name != "allreduce_dp";
          for (const bool audit : {true, false}) {
            if (!audit && !(engine && audit_ablation)) continue;
            o.audit = audit;
            comm->barrier();
            bench::reset_peak_rss();
            RunResult r = name == "plain"          ? run_plain(o, nullptr)
                          : name == "allreduce_dp" ? run_plain(o, comm.get())
                                                   : run_engine(name, o, comm);
            r.peak_rss = bench::peak_rss_bytes();
            // The slowest rank sets the step time of a synchronous job.
            at::Tensor slowest = at::full({1}, r.step_seconds, at::kDouble);
            comm->all_reduce(slowest, shardtrain::comm::ReduceOp::kMax);
            at::Tensor rss = at::full({1}, static_cast<double>(r.peak_rss), at::kDouble);
            comm->all_reduce(rss, shardtrain::comm::ReduceOp::kMax);
            r.step_seconds = slowest.item<double>();
            r.peak_rss = static_cast<int64_t>(rss.item<double>());
            const std::string key = name + " " + dtype + (audit ? "" : " noaudit");
            step_seconds[key].push_back(r.step_seconds);
            optimizer_seconds[key].push_back(r.optimizer_seconds);
            if (audit) last[key] = r;
            if (main_process) {
              std::printf("round %d  %-20s %s%s %8.3f s/step  loss %.4f  peak RSS %.0f MiB  model states %.2f MB, "
                          "peak %.2f MB, gathers %.2f MB/step\n",
                          round + 1, name.c_str(), dtype.c_str(), audit ? "" : " (no audit)", r.step_seconds,
                          r.final_loss, r.peak_rss / 1048576.0, r.state_bytes / 1e6, r.state_peak_bytes / 1e6,
                          r.gathered_bytes_per_step / 1e6);
              std::fflush(stdout);
            }
          }
        }
      }
    }
    if (main_process) {
      const RunResult& any = last.begin()->second;
      const std::string baseline = world == 1 ? "plain" : "allreduce_dp";
      std::printf("\nLlama %lld parameters (%s), world %d, seq %lld x micro-batch %lld per rank, "
                  "median of %d rounds (%d timed steps each)\n",
                  static_cast<long long>(any.num_params), model_config.c_str(), world,
                  static_cast<long long>(o.seq_len), static_cast<long long>(o.micro_batch), rounds, o.steps);
      std::printf("| configuration | dtype | step (s) | tokens/s/rank | vs %s | MFU | model states/rank | plan | "
                  "peak RSS/rank |\n|---|---|---:|---:|---:|---:|---:|---:|---:|\n",
                  baseline.c_str());
      for (const auto& dtype : dtypes) {
        const std::string base_key = baseline + " " + dtype;
        const double base = step_seconds.count(base_key) ? bench::median(step_seconds[base_key]) : 0.0;
        for (const auto& name : configs) {
          const std::string key = name + " " + dtype;
          const double seconds = bench::median(step_seconds[key]);
          const RunResult& r = last[key];
          const double tokens_per_s = static_cast<double>(o.micro_batch * o.seq_len) / seconds;
          char ratio[32] = "-";
          if (base > 0) std::snprintf(ratio, sizeof ratio, "%.3f", seconds / base);
          char plan[32] = "-";
          if (r.planned_bytes >= 0) std::snprintf(plan, sizeof plan, "%.1f MB", r.planned_bytes / 1e6);
          std::printf("| %s | %s | %.3f | %.0f | %s | %.1f%% | %.1f MB | %s | %.0f MiB |\n",
                      known_configs().at(name).c_str(), dtype.c_str(), seconds, tokens_per_s, ratio,
                      100.0 * tokens_per_s * r.flops_per_token / peak[dtype], r.state_bytes / 1e6, plan,
                      r.peak_rss / 1048576.0);
        }
      }
      if (audit_ablation) {
        // The audit runs inside accelerator.step() only, whose time varies far
        // less than a whole step's on a noisy machine; its share of the step
        // is the difference of the optimizer times over the audited step time.
        std::printf("\nlost-update audit (medians of %d interleaved rounds):\n", rounds);
        for (const auto& dtype : dtypes) {
          for (const auto& name : configs) {
            const std::string key = name + " " + dtype;
            if (!step_seconds.count(key + " noaudit")) continue;
            const double with = bench::median(optimizer_seconds[key]);
            const double without = bench::median(optimizer_seconds[key + " noaudit"]);
            const double step = bench::median(step_seconds[key]);
            std::printf("  %s %s: optimizer step %.1f ms with, %.1f ms without; cost %.2f%% of the %.3f s step "
                        "(whole-step ratio with / without %.4f)\n",
                        name.c_str(), dtype.c_str(), 1e3 * with, 1e3 * without, 100.0 * (with - without) / step, step,
                        step / bench::median(step_seconds[key + " noaudit"]));
          }
        }
      }
      if (peak.count("fp32") && peak.count("bf16")) {
        std::printf("\nbf16 step time / fp32 step time:");
        for (const auto& name : configs) {
          std::printf(" %s %.3f;", name.c_str(),
                      bench::median(step_seconds[name + " bf16"]) / bench::median(step_seconds[name + " fp32"]));
        }
        std::printf("\n");
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "bench_train_step: " << e.what() << std::endl;
    return 1;
  }
}
