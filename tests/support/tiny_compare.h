#pragma once
// Comparing a train_tiny engine run with its reference (shared by the engine tests).

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "shardtrain/accelerator.h"
#include "shardtrain/lora.h"
#include "support/multirank.h"
#include "tiny/tiny_train.h"

namespace shardtrain::testing {

/// A DeepSpeed config for the engine tests. Blocks are freed between their
/// forward and backward (no persistence threshold, no reuse distance) so
/// stage 3 really gathers: every block is below DeepSpeed's defaults.
inline TrainingConfig zero_test_config(int stage, MixedPrecision precision, int64_t accumulation = 1,
                                       double clip = 0.0) {
  TrainingConfig config;
  config.distributed_type = DistributedType::kDeepSpeed;
  config.zero.stage = stage;
  config.mixed_precision = precision;
  config.bf16 = precision == MixedPrecision::kBf16;
  config.fp16.enabled = precision == MixedPrecision::kFp16;
  config.gradient_accumulation_steps = accumulation;
  config.gradient_clipping = clip;
  config.optimizer.specified = true;
  config.optimizer.type = "AdamW";
  config.optimizer.lr = 1e-3;
  config.steps_per_print = 1000;
  config.zero.stage3_param_persistence_threshold = 0;
  config.zero.stage3_max_reuse_distance = 0;
  return config;
}

/// fp32 ZeRO-3 (zero_test_config) or FSDP FULL_SHARD wrapping each Llama
/// decoder layer: the two engines the peer tests hold against PyTorch and PEFT.
inline TrainingConfig fp32_llama_engine_config(bool fsdp) {
  TrainingConfig config;
  if (fsdp) {
    config.distributed_type = DistributedType::kFsdp;
    config.fsdp.sharding_strategy = ShardingStrategy::kFullShard;
    config.fsdp.auto_wrap_policy = AutoWrapPolicy::kTransformerBased;
    config.fsdp.transformer_layer_cls_to_wrap = {"LlamaDecoderLayer"};
  } else {
    config = zero_test_config(3, MixedPrecision::kNo);
  }
  config.mixed_precision = MixedPrecision::kNo;
  config.optimizer.specified = true;
  config.steps_per_print = 1000;
  return config;
}

/// LoRA r 8, alpha 16 on the attention projections (q/k/v/o_proj): the
/// adapters the LoRA and QLoRA engine tests train.
inline LoraConfig attention_lora_r8() {
  LoraConfig lora;
  lora.r = 8;
  lora.lora_alpha = 16;
  lora.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj"};
  return lora;
}

/// SGD without momentum or decay, at a rate that moves the adapters visibly
/// in a few steps: an update is then a plain function of the gradient.
inline void use_plain_sgd(TrainingConfig& config) {
  config.optimizer.type = "SGD";
  config.optimizer.lr = 0.5;
  config.optimizer.weight_decay = 0.0;
}

/// An Accelerator on the harness's communicator.
inline std::unique_ptr<Accelerator> accelerator_for(const TrainingConfig& config, RankContext& ctx) {
  AcceleratorOptions options;
  options.config = config;
  options.communicator = ctx.comm;
  return std::make_unique<Accelerator>(options);
}

/// RunInfo with the data loader's micro batch size.
inline RunInfo micro_batch(int64_t size) {
  RunInfo run;
  run.micro_batch_size = size;
  return run;
}

/// train_tiny options for a run inside the multi-rank harness.
inline tiny::TinyRunOptions tiny_run_options(const TrainingConfig& config, RankContext& ctx, int steps,
                                             uint64_t seed) {
  tiny::TinyRunOptions options;
  options.config = config;
  options.steps = steps;
  options.seed = seed;
  options.micro_batch = 4;
  options.communicator = ctx.comm;
  options.quiet = true;
  return options;
}

/// One optimizer step of a plain module doing an engine's per-rank
/// arithmetic: rank r's loss (`loss_of_rank(r)`) backpropagated on its own,
/// the ranks' gradients summed in rank order and divided by `world` (a power
/// of two: exact), then `optimizer` steps. An fp32 engine run on `world`
/// ranks must then match the module bit for bit.
template <typename LossOfRank>
void data_parallel_reference_step(torch::nn::Module& module, torch::optim::Optimizer& optimizer, int world,
                                  LossOfRank&& loss_of_rank) {
  std::vector<at::Tensor> params;
  for (const auto& p : module.parameters()) {
    if (p.requires_grad()) params.push_back(p);
  }
  std::vector<at::Tensor> summed(params.size());
  for (int r = 0; r < world; ++r) {
    for (auto& p : params) p.mutable_grad() = at::Tensor();
    loss_of_rank(r).backward();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& g = params[i].grad();
      summed[i] = summed[i].defined() ? summed[i].add_(g) : g.clone();
    }
  }
  for (std::size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = summed[i].div_(world);
  optimizer.step();
}

/// Bit-for-bit equality with a reference that does the same per-rank
/// arithmetic (run_tiny_data_parallel_reference): every loss and every final
/// parameter element. The expected difference is zero, so no tolerance.
inline void expect_same_bits(const tiny::TinyRunResult& actual, const tiny::TinyRunResult& reference) {
  ASSERT_EQ(actual.losses.size(), reference.losses.size());
  for (std::size_t i = 0; i < actual.losses.size(); ++i) {
    EXPECT_EQ(actual.losses[i], reference.losses[i]) << "loss of step " << i + 1;
  }
  ASSERT_EQ(actual.final_params.size(), reference.final_params.size());
  std::map<std::string, at::Tensor> by_name(reference.final_params.begin(), reference.final_params.end());
  for (const auto& [name, value] : actual.final_params) {
    ASSERT_TRUE(by_name.count(name)) << "parameter " << name << " missing from the reference";
    EXPECT_TRUE(at::equal(value, by_name[name]))
        << name << ": max |difference| " << (value - by_name[name]).abs().max().item<double>();
  }
}

}  // namespace shardtrain::testing
