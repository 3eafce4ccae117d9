// KV-cached generation of a model prepared by the Accelerator: ZeRO-3 and
// FSDP FULL_SHARD gather each decoder layer's parameters inside run_unit()
// and the root's around PreparedModel::run(), so generation with the cache
// must give the plain model's tokens, the same on every rank, and leave the
// layers resharded after no-grad forwards.

#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "build_config.h"
#include "shardtrain/accelerator.h"
#include "shardtrain/models/generation.h"
#include "shardtrain/models/llama.h"
#include "support/llama_golden.h"
#include "support/multirank.h"
#include "support/tiny_compare.h"

namespace {

namespace sm = shardtrain::models;
using shardtrain::MixedPrecision;
using shardtrain::testing::load_golden_case;
using shardtrain::testing::RankContext;
using shardtrain::testing::run_on_ranks;

shardtrain::TrainingConfig zero3(bool activation_checkpointing) {
  // No persistence threshold or reuse distance: every layer is really freed after its forward.
  auto config = shardtrain::testing::zero_test_config(3, MixedPrecision::kNo);
  config.gradient_checkpointing = activation_checkpointing;
  return config;
}

shardtrain::TrainingConfig fsdp_full_shard(const std::string& layer_class) {
  shardtrain::TrainingConfig config;
  config.distributed_type = shardtrain::DistributedType::kFsdp;
  config.fsdp.sharding_strategy = shardtrain::ShardingStrategy::kFullShard;
  config.fsdp.auto_wrap_policy = shardtrain::AutoWrapPolicy::kTransformerBased;
  config.fsdp.transformer_layer_cls_to_wrap = {layer_class};
  config.optimizer.lr = 1e-3;
  config.steps_per_print = 1000;
  return config;
}

/// Every rank's tokens, gathered (rank-major) so each rank can compare them.
std::vector<std::vector<int64_t>> tokens_of_all_ranks(shardtrain::Accelerator& accelerator,
                                                      const std::vector<int64_t>& tokens, int64_t length) {
  at::Tensor mine = at::full({length}, -1, at::TensorOptions().dtype(at::kLong));
  for (std::size_t i = 0; i < tokens.size() && static_cast<int64_t>(i) < length; ++i) mine[i] = tokens[i];
  at::Tensor all = accelerator.gather_for_metrics(mine).view({accelerator.num_processes(), length});
  std::vector<std::vector<int64_t>> out;
  for (int r = 0; r < accelerator.num_processes(); ++r) {
    std::vector<int64_t> row;
    for (int64_t i = 0; i < length && all[r][i].item<int64_t>() >= 0; ++i) row.push_back(all[r][i].item<int64_t>());
    out.push_back(row);
  }
  return out;
}

struct DistCase {
  std::string name;   // test-name suffix
  std::string model;  // golden case
  /// 0: zero-3, 1: zero-3 + activation checkpointing, 2: fsdp FULL_SHARD,
  /// 3: configs/zero3_fp32.json (DeepSpeed's stage3_max_reuse_distance 1e9)
  int kind;
};

shardtrain::TrainingConfig config_for(const DistCase& c, const sm::LlamaConfig& model) {
  switch (c.kind) {
    case 0: return zero3(false);
    case 1: return zero3(true);
    case 2: return fsdp_full_shard(model.decoder_layer_class_name());
    default: return shardtrain::load_config(std::string(SHARDTRAIN_SOURCE_DIR) + "/configs/zero3_fp32.json");
  }
}

class DistGeneration : public ::testing::TestWithParam<DistCase> {};

TEST_P(DistGeneration, ShardedModelGeneratesThePlainModelsTokensOnEveryRank) {
  const DistCase c = GetParam();
  run_on_ranks(2, [c](RankContext& ctx) {
    auto plain = load_golden_case(c.model);
    auto sharded = load_golden_case(c.model);
    auto accelerator = shardtrain::testing::accelerator_for(config_for(c, plain->config), ctx);
    shardtrain::RunInfo run = shardtrain::testing::micro_batch(1);
    run.hidden_size = plain->config.hidden_size;  // the file config's "auto" bucket sizes
    auto prepared = accelerator->prepare(sharded, {}, run);

    torch::NoGradGuard no_grad;
    const std::vector<int64_t> prompt = {1, 7, 19, 3, 30, 11};
    sm::GenerationOptions greedy;
    greedy.max_new_tokens = 10;  // 16 positions: past mistral_swa's window of 4
    const auto expected = sm::generate(sm::cached_step(plain), prompt, greedy);
    ASSERT_EQ(expected.tokens.size(), 10u);

    // The decoder layers are sharded: their parameters hold no storage outside a forward.
    auto layer_storage = [&] {
      int64_t bytes = 0;
      for (auto& layer : *sharded->model->layers) {
        for (auto& p : layer->parameters()) bytes += static_cast<int64_t>(p.storage().nbytes());
      }
      return bytes;
    };
    ASSERT_EQ(layer_storage(), 0) << "prepared layers should start resharded";

    const auto got = sm::generate(sm::prepared_cached_step(prepared), prompt, greedy);
    EXPECT_EQ(got.tokens, expected.tokens) << "rank " << ctx.rank();
    EXPECT_EQ(got.forward_calls, expected.forward_calls);
    EXPECT_EQ(layer_storage(), 0) << "no-grad forwards must release every layer after its forward";
    const auto all = tokens_of_all_ranks(*accelerator, got.tokens, 10);
    EXPECT_EQ(all[0], all[1]) << "ranks generated different tokens";

    // Sampling with the same seed agrees across ranks without any communication
    // (fixed_steps keeps the collective forwards in lockstep), and matches the plain model.
    sm::GenerationOptions sample;
    sample.max_new_tokens = 8;
    sample.temperature = 0.8;
    sample.top_p = 0.9;
    sample.seed = 42;
    sample.fixed_steps = true;
    sample.stop_ids = {plain->config.eos_token_id};
    const auto sampled = sm::generate(sm::prepared_cached_step(prepared), prompt, sample);
    EXPECT_EQ(sampled.forward_calls, 8);
    const auto sampled_all = tokens_of_all_ranks(*accelerator, sampled.tokens, 8);
    EXPECT_EQ(sampled_all[0], sampled_all[1]);
    EXPECT_EQ(sampled.tokens, sm::generate(sm::cached_step(plain), prompt, sample).tokens);

    // agree_on_token: every rank continues with rank 0's token; here rank 1
    // samples with another seed, and still ends with rank 0's sequence.
    sm::GenerationOptions agreed = sample;
    agreed.fixed_steps = false;
    agreed.seed = 42 + static_cast<uint64_t>(ctx.rank());
    agreed.agree_on_token = [&](int64_t token) {
      at::Tensor t = at::full({1}, token, at::TensorOptions().dtype(at::kLong));
      accelerator->communicator().broadcast(t, 0);
      return t.item<int64_t>();
    };
    const auto agreed_result = sm::generate(sm::prepared_cached_step(prepared), prompt, agreed);
    EXPECT_EQ(agreed_result.tokens, sampled.tokens) << "rank " << ctx.rank() << " should follow rank 0";

    // The model still trains after generating: a training forward/backward/step runs.
    torch::AutoGradMode grad(true);
    at::Tensor ids = at::tensor(prompt, at::TensorOptions().dtype(at::kLong)).view({1, -1});
    at::Tensor loss = sm::causal_lm_loss(prepared(ids), ids);
    accelerator->backward(loss);
    accelerator->step();
    EXPECT_TRUE(std::isfinite(loss.item<double>()));
  });
}

INSTANTIATE_TEST_SUITE_P(DistGeneration, DistGeneration,
                         ::testing::Values(DistCase{"zero3_llama", "llama", 0},
                                           DistCase{"zero3_checkpointing_mistral", "mistral_swa", 1},
                                           DistCase{"fsdp_full_shard_llama", "llama", 2},
                                           DistCase{"fsdp_full_shard_mistral", "mistral_swa", 2},
                                           DistCase{"zero3_config_file_llama", "llama", 3}),
                         [](const ::testing::TestParamInfo<DistCase>& info) { return info.param.name; });

// Generating (no-grad forwards) between a backward and the optimizer step
// must not leave parameters gathered with their pre-step values: the next
// training forward has to see the updated weights.
TEST(DistGenerationTraining, NoGradForwardBeforeStepDoesNotLeaveStaleParameters) {
  run_on_ranks(2, [](RankContext& ctx) {
    auto shard_grad_op = fsdp_full_shard("LlamaDecoderLayer");
    shard_grad_op.fsdp.sharding_strategy = shardtrain::ShardingStrategy::kShardGradOp;
    const std::vector<std::pair<std::string, shardtrain::TrainingConfig>> configs = {
        {"zero-3", zero3(false)}, {"fsdp FULL_SHARD", fsdp_full_shard("LlamaDecoderLayer")},
        {"fsdp SHARD_GRAD_OP", shard_grad_op}};
    const std::vector<int64_t> prompt = {1, 7, 19, 3, 30, 11};
    at::Tensor ids = at::tensor(prompt, at::TensorOptions().dtype(at::kLong)).view({1, -1});
    for (const auto& [name, config] : configs) {
      // One training step, optionally generating between backward and step;
      // returns the logits of the next forward.
      auto train_once = [&, config = config](bool generate_before_step) {
        auto accelerator = shardtrain::testing::accelerator_for(config, ctx);
        shardtrain::OptimizerOptions optimizer;
        optimizer.lr = 1e-2;  // a step that moves the logits well above the tolerance
        auto prepared = accelerator->prepare(load_golden_case("llama"), optimizer, shardtrain::testing::micro_batch(1));
        accelerator->backward(sm::causal_lm_loss(prepared(ids), ids));
        if (generate_before_step) {
          torch::NoGradGuard no_grad;
          sm::GenerationOptions greedy;
          greedy.max_new_tokens = 3;
          sm::generate(sm::prepared_cached_step(prepared), prompt, greedy);
        }
        accelerator->step();
        torch::NoGradGuard no_grad;
        return prepared(ids);
      };
      const at::Tensor straight = train_once(false);
      const at::Tensor with_generation = train_once(true);
      // Both runs do the same arithmetic on the same inputs (generation
      // draws no random numbers and changes no parameter): equal bit for bit.
      EXPECT_TRUE(at::equal(straight, with_generation))
          << name << ": the forward after step() used parameters gathered before it (max difference "
          << (straight - with_generation).abs().max().item<double>() << ")";
    }
  });
}

}  // namespace
