// Loading weights so that no rank holds the whole model: parameters built
// without storage (release_parameter_storage, make_llama_without_weights),
// shards filled from rank 0 (fsdp_cpu_ram_efficient_loading, zero3_init_flag)
// or from a weight source reading each rank's slices of a Hugging Face
// directory (hf_weight_source); the failures every rank must see.

#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "shardtrain/accelerator.h"
#include "shardtrain/error.h"
#include "shardtrain/models/hf_weights.h"
#include "shardtrain/models/llama.h"
#include "shardtrain/safetensors.h"
#include "shardtrain/weight_loading.h"
#include "support/llama_golden.h"
#include "support/multirank.h"
#include "support/test_scratch.h"
#include "support/tiny_compare.h"
#include "tiny/tiny_model.h"
#include "tiny/tiny_train.h"

namespace {

namespace fs = std::filesystem;
using shardtrain::MixedPrecision;
using shardtrain::ShardingStrategy;
using shardtrain::models::LlamaConfig;
using shardtrain::models::LlamaForCausalLM;
using shardtrain::testing::accelerator_for;
using shardtrain::testing::MultiRankOptions;
using shardtrain::testing::RankContext;
using shardtrain::testing::run_on_ranks;

/// About 15M parameters (60 MB in fp32) in 8 layers of 7 MB: big enough for
/// the resident-set size to show who holds the model, and a layer small next to it.
LlamaConfig big_config() {
  LlamaConfig c;
  c.vocab_size = 1024;
  c.hidden_size = 384;
  c.intermediate_size = 1024;
  c.num_hidden_layers = 8;
  c.num_attention_heads = 6;
  c.num_key_value_heads = 6;
  c.max_position_embeddings = 64;
  return c;
}

LlamaConfig small_config() { return shardtrain::testing::small_gqa_llama_config(256); }

int64_t parameter_bytes(LlamaForCausalLM& model) {
  int64_t total = 0;
  for (const auto& p : model->parameters()) total += p.numel() * static_cast<int64_t>(p.element_size());
  return total;
}

int64_t layer_bytes(LlamaForCausalLM& model) {
  int64_t total = 0;
  for (const auto& p : model->model->layers[0]->parameters()) total += p.numel() * static_cast<int64_t>(p.element_size());
  return total;
}

/// FSDP FULL_SHARD or ZeRO-3, bf16 mixed precision; `rank0_loads` turns on
/// fsdp_cpu_ram_efficient_loading / zero3_init_flag.
shardtrain::TrainingConfig loading_engine_config(bool fsdp, bool rank0_loads) {
  if (!fsdp) {
    auto config = shardtrain::testing::zero_test_config(3, MixedPrecision::kBf16);
    config.zero3_init_flag = rank0_loads;
    return config;
  }
  shardtrain::TrainingConfig config;
  config.distributed_type = shardtrain::DistributedType::kFsdp;
  config.mixed_precision = MixedPrecision::kBf16;
  config.bf16 = true;
  config.fsdp.sharding_strategy = ShardingStrategy::kFullShard;
  config.fsdp.auto_wrap_policy = shardtrain::AutoWrapPolicy::kTransformerBased;
  config.fsdp.transformer_layer_cls_to_wrap = {"LlamaDecoderLayer"};
  config.fsdp.cpu_ram_efficient_loading = rank0_loads;
  config.optimizer.type = "AdamW";
  config.optimizer.lr = 1e-3;
  config.steps_per_print = 1000;
  return config;
}

/// Deterministic token ids [2, 16] for a rank and step.
at::Tensor batch(int rank, int step, int64_t vocab) {
  return (at::arange(32, at::kLong) * (3 + rank + 2 * step) + 5 * step + 7 * rank).remainder(vocab).view({2, 16});
}

struct TrainResult {
  at::Tensor logits;  // of the first batch, before any step
  std::vector<double> losses;
  shardtrain::MemoryReport after_prepare;
  shardtrain::MemoryReport after_training;
};

TrainResult prepare_and_train(shardtrain::Accelerator& accelerator, LlamaForCausalLM model,
                              const shardtrain::RunInfo& run, int rank, int steps) {
  auto prepared = accelerator.prepare(model, {}, run);
  TrainResult result;
  result.after_prepare = accelerator.memory();
  accelerator.reset_memory_peaks();
  const int64_t vocab = model->config.vocab_size;
  {
    torch::NoGradGuard no_grad;
    result.logits = prepared(batch(rank, 0, vocab)).clone();
  }
  for (int step = 0; step < steps; ++step) {
    at::Tensor ids = batch(rank, step, vocab);
    at::Tensor loss = shardtrain::models::causal_lm_loss(prepared(ids), ids);
    accelerator.backward(loss);
    accelerator.step();
    accelerator.zero_grad();
    result.losses.push_back(accelerator.reduce(loss.detach().reshape({1}), "mean").item<double>());
  }
  result.after_training = accelerator.memory();
  return result;
}

std::string engine_name(bool fsdp) { return fsdp ? "fsdp FULL_SHARD" : "zero-3"; }

}  // namespace

// ---- unit: the building blocks ---------------------------------------------

TEST(UnitWeightLoading, ReleasedParametersKeepShapeDtypeAndIdentity) {
  torch::nn::Linear linear(16, 8);
  at::Tensor weight = linear->weight;
  const auto* impl = weight.unsafeGetTensorImpl();
  EXPECT_EQ(shardtrain::parameter_storage_bytes(*linear), (16 * 8 + 8) * 4);
  EXPECT_EQ(shardtrain::release_parameter_storage(*linear), (16 * 8 + 8) * 4);
  EXPECT_EQ(shardtrain::parameter_storage_bytes(*linear), 0);
  EXPECT_TRUE(shardtrain::is_storage_released(linear->weight));
  EXPECT_EQ(linear->weight.unsafeGetTensorImpl(), impl) << "the module's parameter is the same tensor";
  EXPECT_EQ(linear->named_parameters()["weight"].unsafeGetTensorImpl(), impl);
  EXPECT_EQ(linear->weight.sizes().vec(), (std::vector<int64_t>{8, 16}));
  EXPECT_EQ(linear->weight.scalar_type(), at::kFloat);
  EXPECT_TRUE(linear->weight.requires_grad());
  EXPECT_EQ(shardtrain::release_parameter_storage(*linear), 0) << "releasing twice is a no-op";

  // A view into a larger storage (a prepared model's parameters) is refused.
  at::Tensor big = at::zeros({64});
  at::Tensor view = big.narrow(0, 8, 16);
  try {
    shardtrain::release_storage(view);
    FAIL() << "releasing a view must throw";
  } catch (const shardtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("shared with other tensors"), std::string::npos) << e.what();
  }
  EXPECT_EQ(big.storage().nbytes(), 64u * 4);
}

TEST(UnitWeightLoading, LlamaWithoutWeightsHasTheNormalModelsParametersAndNoStorage) {
  for (bool tied : {false, true}) {
    LlamaConfig config = small_config();
    config.tie_word_embeddings = tied;
    LlamaForCausalLM normal(config);
    LlamaForCausalLM empty = shardtrain::models::make_llama_without_weights(config, at::kBFloat16);
    auto expected = normal->named_parameters();
    auto actual = empty->named_parameters();
    ASSERT_EQ(actual.size(), expected.size());
    for (std::size_t i = 0; i < actual.size(); ++i) {
      // Same names in the same order: the engines' layouts (and all-reduced load flags) line up across ranks.
      EXPECT_EQ(actual[i].key(), expected[i].key());
      EXPECT_EQ(actual[i].value().sizes(), expected[i].value().sizes()) << actual[i].key();
      EXPECT_EQ(actual[i].value().scalar_type(), at::kBFloat16) << actual[i].key();
      EXPECT_TRUE(shardtrain::is_storage_released(actual[i].value())) << actual[i].key();
    }
    EXPECT_EQ(shardtrain::parameter_storage_bytes(*empty), 0);
    EXPECT_EQ(empty->config.vocab_size, config.vocab_size);
    EXPECT_EQ(empty->model->config.num_hidden_layers, config.num_hidden_layers);
    EXPECT_EQ(static_cast<bool>(empty->lm_head), !tied);
  }
}

// ---- rank 0 loads, the others receive their shards ----------------------------

class DistRankZeroLoading : public ::testing::TestWithParam<bool> {};

TEST_P(DistRankZeroLoading, OnlyRankZeroHoldsTheWeightsAndTrainingMatchesANormalLoad) {
  const bool fsdp = GetParam();
  MultiRankOptions harness;
  harness.timeout = std::chrono::seconds(300);
  run_on_ranks(2, [fsdp](RankContext& ctx) {
    const LlamaConfig config = big_config();
    TrainResult efficient, normal;
    int64_t model_bytes = 0, unit_bytes = 0;
    {
      auto accelerator = accelerator_for(loading_engine_config(fsdp, /*rank0_loads=*/true), ctx);
      EXPECT_EQ(accelerator->materialize_full_weights(), ctx.rank() == 0);
      const int64_t rss_before = shardtrain::peak_rss_bytes();
      LlamaForCausalLM model{nullptr};
      if (accelerator->materialize_full_weights()) {
        torch::manual_seed(3);
        model = LlamaForCausalLM(config);
      } else {
        model = shardtrain::models::make_llama_without_weights(config);
      }
      const int64_t rss_growth = shardtrain::peak_rss_bytes() - rss_before;
      const int64_t held = shardtrain::parameter_storage_bytes(*model);
      model_bytes = parameter_bytes(model);
      unit_bytes = layer_bytes(model);
      std::cout << engine_name(fsdp) << " rank " << ctx.rank() << ": model " << model_bytes / 1e6
                << " MB; after building, parameter storage " << held / 1e6 << " MB, peak RSS grew "
                << rss_growth / 1e6 << " MB" << std::endl;
      if (ctx.rank() == 0) {
        EXPECT_EQ(held, model_bytes);
        EXPECT_GE(rss_growth, model_bytes * 9 / 10) << "rank 0 materialises the whole model";
      } else {
        EXPECT_EQ(held, 0);
        // One decoder layer (7 MB of 60 MB) is the most it ever holds while building.
        EXPECT_LT(rss_growth, model_bytes * 4 / 10) << "rank 1 must never hold the full weights";
      }
      efficient = prepare_and_train(*accelerator, model, shardtrain::testing::micro_batch(2), ctx.rank(), 3);
      const int64_t load_peak = efficient.after_prepare.load_peak;
      std::cout << engine_name(fsdp) << " rank " << ctx.rank() << ": load peak " << load_peak / 1e6
                << " MB (one layer in fp32: " << unit_bytes / 1e6 << " MB), training gathered peak "
                << efficient.after_training.gathered_peak / 1e6 << " MB, peak RSS after prepare "
                << efficient.after_prepare.peak_rss / 1e6 << " MB, after training "
                << efficient.after_training.peak_rss / 1e6 << " MB" << std::endl;
      // Peak resident set after prepare() (building + sharding), side by side:
      // rank 0 held the model once, rank 1 never did.
      at::Tensor rss = accelerator->gather_for_metrics(
          at::full({1}, static_cast<double>(efficient.after_prepare.peak_rss), at::TensorOptions().dtype(at::kDouble)));
      const double rss_gap = rss[0].item<double>() - rss[1].item<double>();
      if (ctx.rank() == 0) {
        std::cout << engine_name(fsdp) << ": peak RSS after prepare, rank 0 minus rank 1: " << rss_gap / 1e6
                  << " MB" << std::endl;
      }
      EXPECT_GE(rss_gap, 0.6 * model_bytes) << "rank 1's peak must stay clear of rank 0's by most of the model";
      if (ctx.rank() == 0) {
        EXPECT_GE(load_peak, model_bytes);
      } else {
        EXPECT_GT(load_peak, 0);
        EXPECT_LE(load_peak, unit_bytes) << "rank 1 receives one chunk of one unit at a time";
        if (fsdp) {
          // (zero_test_config's stage3_prefetch_bucket_size prefetches every layer, so only FSDP is bounded here.)
          EXPECT_LT(efficient.after_training.gathered_peak, model_bytes / 2)
              << "FULL_SHARD gathers a unit or two (bf16), never the model";
        }
      }
    }
    {
      auto accelerator = accelerator_for(loading_engine_config(fsdp, /*rank0_loads=*/false), ctx);
      EXPECT_TRUE(accelerator->materialize_full_weights());
      torch::manual_seed(3);
      LlamaForCausalLM model(config);
      normal = prepare_and_train(*accelerator, model, shardtrain::testing::micro_batch(2), ctx.rank(), 3);
      EXPECT_GE(normal.after_prepare.load_peak, model_bytes) << "a normal load holds the model on every rank";
    }
    EXPECT_TRUE(at::equal(efficient.logits, normal.logits));
    EXPECT_EQ(efficient.losses, normal.losses);
    EXPECT_LT(efficient.losses.back(), efficient.losses.front());
  }, harness);
}

INSTANTIATE_TEST_SUITE_P(DistEngines, DistRankZeroLoading, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? std::string("fsdp") : std::string("zero3"); });

// ---- every rank reads its own slices of a Hugging Face directory ---------------

namespace {

struct HfCase {
  bool fsdp;
  bool sharded;  ///< two bf16 files with model.safetensors.index.json, else one fp32 model.safetensors
};

/// Writes a random small Llama into the empty `dir` (parent process only).
void write_hf_dir(const fs::path& dir, bool sharded) {
  torch::manual_seed(21);
  LlamaForCausalLM model(small_config());
  auto state = shardtrain::models::hf_state_dict(model);
  if (!sharded) {
    shardtrain::safetensors::write_file((dir / "model.safetensors").string(), state);
    return;
  }
  std::vector<std::pair<std::string, at::Tensor>> parts[2];
  nlohmann::json index;
  int64_t total = 0;
  for (std::size_t i = 0; i < state.size(); ++i) {
    const int file = i < state.size() / 2 ? 0 : 1;
    at::Tensor value = state[i].second.detach().to(at::kBFloat16);
    total += value.numel() * 2;
    parts[file].emplace_back(state[i].first, value);
    index["weight_map"][state[i].first] = "model-0000" + std::to_string(file + 1) + "-of-00002.safetensors";
  }
  index["metadata"]["total_size"] = total;
  for (int file = 0; file < 2; ++file) {
    shardtrain::safetensors::write_file(
        (dir / ("model-0000" + std::to_string(file + 1) + "-of-00002.safetensors")).string(), parts[file]);
  }
  std::ofstream(dir / "model.safetensors.index.json") << index.dump(2);
}

class DistHfSource : public ::testing::TestWithParam<HfCase> {};

TEST_P(DistHfSource, EachRankReadsOnlyItsSlicesAndTrainingMatchesAFullLoad) {
  const HfCase c = GetParam();
  const fs::path dir = shardtrain::testing::test_scratch_dir();
  if (!shardtrain::testing::is_rank_process()) write_hf_dir(dir, c.sharded);
  run_on_ranks(2, [c, dir](RankContext& ctx) {
    const std::string hf_dir = dir.string();
    const LlamaConfig config = small_config();
    TrainResult sourced, full;
    auto checkpoint = std::make_shared<const shardtrain::models::HfCheckpoint>(hf_dir);
    {
      auto accelerator = accelerator_for(loading_engine_config(c.fsdp, false), ctx);
      LlamaForCausalLM model = shardtrain::models::make_llama_without_weights(config);
      checkpoint->check_against(*model);
      EXPECT_EQ(shardtrain::parameter_storage_bytes(*model), 0) << "no rank builds the weights";
      shardtrain::RunInfo run = shardtrain::testing::micro_batch(2);
      run.weight_source = shardtrain::models::hf_weight_source(checkpoint);
      sourced = prepare_and_train(*accelerator, model, run, ctx.rank(), 3);
    }
    const double read_share = static_cast<double>(checkpoint->bytes_read()) / checkpoint->total_tensor_bytes();
    std::cout << engine_name(c.fsdp) << (c.sharded ? " (sharded bf16 files)" : " (one fp32 file)") << " rank "
              << ctx.rank() << " read " << checkpoint->bytes_read() << " of " << checkpoint->total_tensor_bytes()
              << " tensor bytes (" << read_share << ")" << std::endl;
    // Each rank reads its half (its shard), give or take the odd element.
    EXPECT_GT(read_share, 0.45);
    EXPECT_LT(read_share, 0.55);
    {
      auto accelerator = accelerator_for(loading_engine_config(c.fsdp, false), ctx);
      torch::manual_seed(77);  // a different random init, overwritten by the load
      LlamaForCausalLM model(config);
      shardtrain::models::load_hf_weights(model, hf_dir);
      full = prepare_and_train(*accelerator, model, shardtrain::testing::micro_batch(2), ctx.rank(), 3);
    }
    EXPECT_TRUE(at::equal(sourced.logits, full.logits));
    EXPECT_EQ(sourced.losses, full.losses);
  });
}

INSTANTIATE_TEST_SUITE_P(DistEngines, DistHfSource,
                         ::testing::Values(HfCase{true, false}, HfCase{true, true}, HfCase{false, false},
                                           HfCase{false, true}),
                         [](const auto& info) {
                           return std::string(info.param.fsdp ? "fsdp" : "zero3") +
                                  (info.param.sharded ? "_sharded_index" : "_single_file");
                         });

// ---- failures reach every rank -----------------------------------------------

/// Runs prepare() and returns the message it threw ("" if it did not throw).
std::string prepare_error(shardtrain::Accelerator& accelerator, LlamaForCausalLM model,
                          const shardtrain::RunInfo& run) {
  try {
    accelerator.prepare(model, {}, run);
  } catch (const shardtrain::Error& e) {
    return e.what();
  }
  return "";
}

TEST(DistLoadingErrors, MissingWeightsAndFailingSourcesFailOnEveryRankWithAMessage) {
  run_on_ranks(2, [](RankContext& ctx) {
    const LlamaConfig config = small_config();
    {
      // Nobody holds the weights and no source names where they are.
      auto accelerator = accelerator_for(loading_engine_config(true, true), ctx);
      const std::string message =
          prepare_error(*accelerator, shardtrain::models::make_llama_without_weights(config),
                        shardtrain::testing::micro_batch(2));
      EXPECT_NE(message.find("has no storage on rank 0 and no weight source was given"), std::string::npos)
          << message;
    }
    {
      // The source fails on rank 1 only: rank 1 reports its cause, rank 0 learns of it (no hang).
      auto accelerator = accelerator_for(loading_engine_config(true, false), ctx);
      shardtrain::RunInfo run = shardtrain::testing::micro_batch(2);
      const int rank = ctx.rank();
      run.weight_source = [rank](const std::string& name, int64_t, int64_t, at::Tensor out) {
        if (rank == 1 && name.find("layers.1.") != std::string::npos) {
          ST_THROW(shardtrain::Error, "disk on fire while reading ", name);
        }
        out.fill_(0.01);
      };
      const std::string message =
          prepare_error(*accelerator, shardtrain::models::make_llama_without_weights(config), run);
      if (rank == 1) {
        EXPECT_NE(message.find("disk on fire"), std::string::npos) << message;
      } else {
        EXPECT_NE(message.find("another rank failed to read its slices"), std::string::npos) << message;
      }
    }
    {
      // A source that does not write its output is caught.
      auto accelerator = accelerator_for(loading_engine_config(false, false), ctx);
      shardtrain::RunInfo run = shardtrain::testing::micro_batch(2);
      run.weight_source = [](const std::string&, int64_t, int64_t, at::Tensor out) { out = at::zeros_like(out); };
      const std::string message =
          prepare_error(*accelerator, shardtrain::models::make_llama_without_weights(config), run);
      EXPECT_NE(message.find("unwritten"), std::string::npos) << message;
    }
  });
}

}  // namespace

// ---- rank 0 loads: every sharding strategy, pure low precision ----------------

namespace {

struct StrategyLoadCase {
  ShardingStrategy strategy;
  int world;
  int local_world;
  bool pure;
};

class DistRankZeroLoadingStrategies : public ::testing::TestWithParam<StrategyLoadCase> {};

/// Rank 0's values reach every rank's shard whatever the layout: HYBRID_SHARD
/// (rank 0 of the world sends each machine-local rank its chunk), NO_SHARD
/// (every rank takes the whole unit), SHARD_GRAD_OP, and pure low precision
/// (bf16 chunks); losses equal a normal load's.
TEST_P(DistRankZeroLoadingStrategies, LossesMatchANormalLoad) {
  const StrategyLoadCase c = GetParam();
  MultiRankOptions harness;
  harness.local_world_size = c.local_world;
  run_on_ranks(c.world, [c](RankContext& ctx) {
    auto train = [&](bool rank0_loads) {
      shardtrain::TrainingConfig config = loading_engine_config(true, rank0_loads);
      config.fsdp.sharding_strategy = c.strategy;
      config.fsdp.transformer_layer_cls_to_wrap = {"TinyBlock"};
      if (c.pure) {
        config.mixed_precision = MixedPrecision::kNo;
        config.bf16 = false;
      }
      auto accelerator = accelerator_for(config, ctx);
      torch::manual_seed(8);
      tiny::TinyConfig model_config;
      tiny::TinyModel model(model_config);
      if (c.pure) model->to(at::kBFloat16);
      if (!accelerator->materialize_full_weights()) {
        shardtrain::release_parameter_storage(*model);
        EXPECT_EQ(shardtrain::parameter_storage_bytes(*model), 0);
      }
      auto prepared = accelerator->prepare(model, {}, shardtrain::testing::micro_batch(2));
      std::vector<double> losses;
      for (int step = 0; step < 4; ++step) {
        at::Tensor tokens = at::stack({tiny::synthetic_sample(step, 2 * ctx.rank(), model_config),
                                       tiny::synthetic_sample(step, 2 * ctx.rank() + 1, model_config)});
        at::Tensor logits = prepared(tokens);
        at::Tensor loss = at::cross_entropy_loss(logits.narrow(1, 0, 31).reshape({-1, model_config.vocab}),
                                                 tokens.narrow(1, 1, 31).reshape({-1}));
        accelerator->backward(loss);
        accelerator->step();
        accelerator->zero_grad();
        losses.push_back(accelerator->reduce(loss.detach().reshape({1}), "mean").item<double>());
      }
      return std::make_pair(losses, accelerator->full_state_dict());
    };
    const auto efficient = train(true);
    const auto normal = train(false);
    EXPECT_EQ(efficient.first, normal.first);
    ASSERT_EQ(efficient.second.size(), normal.second.size());
    for (std::size_t i = 0; i < efficient.second.size(); ++i) {
      EXPECT_TRUE(at::equal(efficient.second[i].second, normal.second[i].second)) << efficient.second[i].first;
    }
  }, harness);
}

INSTANTIATE_TEST_SUITE_P(
    DistStrategies, DistRankZeroLoadingStrategies,
    ::testing::Values(StrategyLoadCase{ShardingStrategy::kHybridShard, 4, 2, false},
                      StrategyLoadCase{ShardingStrategy::kNoShard, 2, 2, false},
                      StrategyLoadCase{ShardingStrategy::kShardGradOp, 2, 2, false},
                      StrategyLoadCase{ShardingStrategy::kFullShard, 2, 2, true}),
    [](const auto& info) {
      return std::string(shardtrain::to_string(info.param.strategy)) + "_world" + std::to_string(info.param.world) +
             (info.param.pure ? "_pure" : "");
    });

}  // namespace
