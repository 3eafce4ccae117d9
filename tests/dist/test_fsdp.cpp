// The FSDP engine: FP32 parity with the plain LibTorch reference for every
// sharding strategy, exact agreement with the zero engine (the product's
// promise), pure low precision (bf16 optimizer state, the seeds' stall), the
// dtypes at the collectives, resharding behaviour, injected delays, units
// mixing frozen and trainable parameters, buffer_dtype and
// keep_low_precision_grads.

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "accelerator_internals.h"
#include "engine/sharded_engine.h"
#include "shardtrain/accelerator.h"
#include "support/multirank.h"
#include "support/test_scratch.h"
#include "support/tiny_compare.h"
#include "tiny/reference_adam.h"
#include "tiny/tiny_train.h"

namespace {

using shardtrain::MixedPrecision;
using shardtrain::ShardingStrategy;
using shardtrain::testing::MultiRankOptions;
using shardtrain::testing::RankContext;
using shardtrain::testing::run_on_ranks;

shardtrain::TrainingConfig fsdp_config(ShardingStrategy strategy, MixedPrecision precision) {
  shardtrain::TrainingConfig config;
  config.distributed_type = shardtrain::DistributedType::kFsdp;
  config.mixed_precision = precision;
  config.bf16 = precision == MixedPrecision::kBf16;
  config.fsdp.sharding_strategy = strategy;
  config.fsdp.auto_wrap_policy = shardtrain::AutoWrapPolicy::kTransformerBased;
  config.fsdp.transformer_layer_cls_to_wrap = {"TinyBlock"};
  config.optimizer.type = "AdamW";
  config.optimizer.lr = 1e-3;
  config.optimizer.weight_decay = 0.0;  // as zero3_config's DeepSpeed AdamW block (FusedAdam's default)
  config.steps_per_print = 1000;
  return config;
}

shardtrain::TrainingConfig zero3_config(MixedPrecision precision) {
  return shardtrain::testing::zero_test_config(3, precision);
}

using shardtrain::testing::accelerator_for;
using shardtrain::testing::micro_batch;

tiny::TinyRunOptions options_for(const shardtrain::TrainingConfig& config, RankContext& ctx, int steps) {
  return shardtrain::testing::tiny_run_options(config, ctx, steps, /*seed=*/11);
}


struct StrategyCase {
  ShardingStrategy strategy;
  int world;
  int local_world;
};

class DistFsdpParity : public ::testing::TestWithParam<StrategyCase> {};

TEST_P(DistFsdpParity, Fp32LossesAndFinalParametersMatchTheReference) {
  const StrategyCase c = GetParam();
  MultiRankOptions harness;
  harness.local_world_size = c.local_world;
  run_on_ranks(c.world, [c](RankContext& ctx) {
    auto options = options_for(fsdp_config(c.strategy, MixedPrecision::kNo), ctx, 30);
    tiny::TinyRunResult run = tiny::run_tiny(options);
    if (ctx.rank() != 0) return;
    tiny::DataParallelArithmetic arithmetic;
    arithmetic.local_world_size = c.local_world;
    tiny::TinyRunResult reference = tiny::run_tiny_data_parallel_reference(options, c.world, arithmetic);
    EXPECT_LT(run.losses.back(), run.losses.front() * 0.95);
    // FSDP's pre/post division by powers of two is exact, so the same
    // per-rank arithmetic gives the same bits.
    shardtrain::testing::expect_same_bits(run, reference);
  }, harness);
}

INSTANTIATE_TEST_SUITE_P(
    DistStrategies, DistFsdpParity,
    ::testing::Values(StrategyCase{ShardingStrategy::kFullShard, 2, 2}, StrategyCase{ShardingStrategy::kShardGradOp, 2, 2},
                      StrategyCase{ShardingStrategy::kNoShard, 2, 2}, StrategyCase{ShardingStrategy::kFullShard, 4, 4},
                      StrategyCase{ShardingStrategy::kShardGradOp, 4, 4}, StrategyCase{ShardingStrategy::kNoShard, 4, 4},
                      StrategyCase{ShardingStrategy::kHybridShard, 4, 2},
                      StrategyCase{ShardingStrategy::kHybridShardZero2, 4, 2}),
    [](const auto& info) {
      return std::string(shardtrain::to_string(info.param.strategy)) + "_world" + std::to_string(info.param.world) +
             (info.param.local_world != info.param.world ? "_as_2x2" : "");
    });

class DistCrossEngine : public ::testing::TestWithParam<int> {};

TEST_P(DistCrossEngine, FsdpStandardAndZero3AgreeStepByStep) {
  const int world = GetParam();
  run_on_ranks(world, [](RankContext& ctx) {
    for (MixedPrecision precision : {MixedPrecision::kBf16, MixedPrecision::kNo}) {
      const int steps = precision == MixedPrecision::kBf16 ? 50 : 20;
      auto fsdp_run = tiny::run_tiny(options_for(fsdp_config(ShardingStrategy::kFullShard, precision), ctx, steps));
      auto zero_run = tiny::run_tiny(options_for(zero3_config(precision), ctx, steps));
      ASSERT_EQ(fsdp_run.losses.size(), static_cast<std::size_t>(steps));
      // Both compute on bf16(master) and reduce in rank order with exact
      // (power-of-two) divisions: the same arithmetic, so the same bits.
      for (int step = 0; step < steps; ++step) {
        EXPECT_EQ(fsdp_run.losses[step], zero_run.losses[step])
            << (precision == MixedPrecision::kBf16 ? "bf16" : "fp32") << ", step " << step + 1;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(DistWorlds, DistCrossEngine, ::testing::Values(2, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// At one rank the collectives are the identity: every engine must do exactly
// the plain loop's arithmetic, with the module's parameters viewing the shard
// (nothing gathered, nothing copied).
TEST(DistSingleRank, EveryEngineIsThePlainLoopBitForBitAndGathersNothing) {
  run_on_ranks(1, [](RankContext& ctx) {
    for (MixedPrecision precision : {MixedPrecision::kNo, MixedPrecision::kBf16}) {
      std::vector<std::pair<std::string, shardtrain::TrainingConfig>> configs;
      for (int stage : {1, 2, 3}) {
        configs.emplace_back("zero-" + std::to_string(stage), shardtrain::testing::zero_test_config(stage, precision));
      }
      for (ShardingStrategy strategy :
           {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard}) {
        configs.emplace_back(std::string("fsdp ") + shardtrain::to_string(strategy), fsdp_config(strategy, precision));
      }
      for (auto& [name, config] : configs) {
        SCOPED_TRACE(name + (precision == MixedPrecision::kBf16 ? " bf16" : " fp32"));
        config.gradient_accumulation_steps = 2;  // ZeRO-1's boundary accumulation included
        auto options = options_for(config, ctx, 6);
        tiny::TinyRunResult run = tiny::run_tiny(options);
        tiny::DataParallelArithmetic arithmetic;
        arithmetic.compute_dtype = precision == MixedPrecision::kBf16 ? at::kBFloat16 : at::kFloat;
        // ZeRO-1 in bf16 rounds its fp32 micro-batch sum once, at the boundary.
        arithmetic.accumulate_before_reduce = name == "zero-1" && precision == MixedPrecision::kBf16;
        shardtrain::testing::expect_same_bits(run, tiny::run_tiny_data_parallel_reference(options, 1, arithmetic));
        EXPECT_EQ(run.memory.gathered_peak, 0) << "a single rank gathered parameters";
      }
    }
  });
}

TEST(DistFsdpPure, OptimizerStateIsBf16AtFourBytesPerParameter) {
  run_on_ranks(2, [](RankContext& ctx) {
    auto config = fsdp_config(ShardingStrategy::kFullShard, MixedPrecision::kNo);
    auto accelerator_holder = accelerator_for(config, ctx);
    shardtrain::Accelerator& accelerator = *accelerator_holder;
    torch::manual_seed(0);
    tiny::TinyConfig model_config;
    tiny::TinyModel model(model_config);
    model->to(at::kBFloat16);  // a bf16 load with mixed_precision: no is Accelerate's pure mode
    auto prepared = accelerator.prepare(model, {}, micro_batch(2));
    auto& engine = dynamic_cast<shardtrain::engine::ShardedEngine&>(shardtrain::AcceleratorInternals::engine(accelerator));
    EXPECT_TRUE(engine.plan().pure_low_precision);
    EXPECT_EQ(engine.exp_avg_partition().scalar_type(), at::kBFloat16);
    EXPECT_EQ(engine.exp_avg_sq_partition().scalar_type(), at::kBFloat16);
    EXPECT_EQ(engine.parameter_partition().scalar_type(), at::kBFloat16);
    EXPECT_FALSE(engine.master_partition().defined()) << "pure mode keeps no fp32 master";
    EXPECT_DOUBLE_EQ(accelerator.precision_plan().optimizer_bytes_per_param_total(), 4.0);
    // Measured: two bf16 moments over the partition and no master, 4 bytes an
    // element; the partition is this rank's 1/W of each unit plus at most W - 1
    // padding elements per unit (flat layout, no alignment).
    const auto memory = accelerator.memory();
    const int64_t partition = engine.parameter_partition().numel();
    EXPECT_EQ(memory.optimizer + memory.master, 4 * partition) << "measured optimizer bytes";
    const int64_t padding = partition * ctx.world_size() - accelerator.precision_plan().num_params;
    EXPECT_GE(padding, 0);
    EXPECT_LE(padding, static_cast<int64_t>(engine.unit_paths().size()) * (ctx.world_size() - 1));
  });
}

TEST(DistFsdpPure, SmallUpdatesAreLostInPureModeButNotInStandardMode) {
  run_on_ranks(2, [](RankContext& ctx) {
    auto fall = [&](bool pure, double lr) {
      auto config = fsdp_config(ShardingStrategy::kFullShard, pure ? MixedPrecision::kNo : MixedPrecision::kBf16);
      auto options = options_for(config, ctx, 200);
      options.lr = lr;
      options.load_dtype = "bf16";
      options.model.init_std = 0.02;
      auto run = tiny::run_tiny(options);
      return run.losses.front() - run.losses.back();
    };
    const double standard_small = fall(false, 1e-5);
    const double pure_small = fall(true, 1e-5);
    if (ctx.rank() == 0) {
      std::cout << "lr 1e-5, 200 steps: loss fell " << standard_small << " (standard) vs " << pure_small
                << " (pure)" << std::endl;
    }
    EXPECT_GT(standard_small, 0.0);
    EXPECT_LT(pure_small, 0.2 * standard_small) << "the seeds' phenomenon: pure bf16 loses sub-ulp updates";
    const double standard_large = fall(false, 1e-3);
    const double pure_large = fall(true, 1e-3);
    EXPECT_GT(standard_large, 0.1);
    EXPECT_GT(pure_large, 0.1) << "at lr 1e-3 the updates exceed half an ulp: pure mode trains too";
  });
}

TEST(DistFsdpDtypes, AllGatherInParamDtypeReduceScatterInReduceDtype) {
  run_on_ranks(2, [](RankContext& ctx) {
    std::vector<shardtrain::comm::CollectiveEvent> events;
    auto config = fsdp_config(ShardingStrategy::kFullShard, MixedPrecision::kBf16);
    config.fsdp.reduce_dtype = shardtrain::DType::kFp32;
    auto options = options_for(config, ctx, 2);
    ctx.comm->set_observer([&](const shardtrain::comm::CollectiveEvent& e) { events.push_back(e); });
    tiny::run_tiny(options);
    ctx.comm->set_observer(nullptr);
    int gathers = 0, reductions = 0;
    for (const auto& e : events) {
      if (e.op == "all_gather" && e.input_numel > 1) {
        ++gathers;
        // full_state_dict at the end gathers the fp32 masters; training gathers bf16.
        EXPECT_TRUE(e.dtype == at::kBFloat16 || e.dtype == at::kFloat) << c10::toString(e.dtype);
      }
      if (e.op == "reduce_scatter") {
        ++reductions;
        EXPECT_EQ(e.dtype, at::kFloat) << "reduce-scatter must run in reduce_dtype";
      }
    }
    int bf16_gathers = 0;
    for (const auto& e : events) bf16_gathers += e.op == "all_gather" && e.dtype == at::kBFloat16;
    EXPECT_GT(bf16_gathers, 0) << "parameters must be all-gathered in param_dtype (bf16)";
    EXPECT_GT(gathers, 0);
    EXPECT_GT(reductions, 0);
  });
}

TEST(DistFsdpPrefetch, BackwardPreGathersTheLastBlockBeforeTheHeadsBackwardAsTheRootsPreBackwardHookDoes) {
  run_on_ranks(2, [](RankContext& ctx) {
    // The op of the first collective backward issues, with and without
    // backward prefetch. The head (in the root, reduced as its gradient
    // arrives) runs its backward before the last block's.
    auto first_backward_collective = [&](shardtrain::BackwardPrefetch mode) {
      auto config = fsdp_config(ShardingStrategy::kFullShard, MixedPrecision::kNo);
      config.fsdp.backward_prefetch = mode;
      auto accelerator_holder = accelerator_for(config, ctx);
      shardtrain::Accelerator& accelerator = *accelerator_holder;
      torch::manual_seed(0);
      tiny::TinyConfig model_config;
      tiny::TinyModel model(model_config);
      auto prepared = accelerator.prepare(model, {}, micro_batch(2));
      at::Tensor tokens =
          at::stack({tiny::synthetic_sample(0, 0, model_config), tiny::synthetic_sample(0, 1, model_config)});
      at::Tensor logits = prepared(tokens);
      std::vector<shardtrain::comm::CollectiveEvent> events;
      ctx.comm->set_observer([&](const shardtrain::comm::CollectiveEvent& e) { events.push_back(e); });
      accelerator.backward(logits.mean());
      ctx.comm->set_observer(nullptr);
      accelerator.step();
      return events.empty() ? std::string("none") : events.front().op;
    };
    EXPECT_EQ(first_backward_collective(shardtrain::BackwardPrefetch::kBackwardPre), "all_gather")
        << "the last block's gather must go out when the output's gradient arrives";
    EXPECT_EQ(first_backward_collective(shardtrain::BackwardPrefetch::kNoPrefetch), "reduce_scatter")
        << "without prefetch the head's gradient goes out before the last block is gathered";
  });
}

TEST(DistFsdpReshard, ShardGradOpKeepsUnitsGatheredUntilBackwardFullShardDoesNot) {
  run_on_ranks(2, [](RankContext& ctx) {
    int64_t gathered_after_forward[2] = {0, 0};
    int64_t at_rest[2] = {0, 0};
    const ShardingStrategy strategies[2] = {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp};
    for (int k = 0; k < 2; ++k) {
      auto accelerator_holder = accelerator_for(fsdp_config(strategies[k], MixedPrecision::kBf16), ctx);
      shardtrain::Accelerator& accelerator = *accelerator_holder;
      torch::manual_seed(0);
      tiny::TinyConfig model_config;
      tiny::TinyModel model(model_config);
      auto prepared = accelerator.prepare(model, {}, micro_batch(2));
      at::Tensor tokens = at::stack({tiny::synthetic_sample(0, 0, model_config), tiny::synthetic_sample(0, 1, model_config)});
      at::Tensor logits = prepared(tokens);
      gathered_after_forward[k] = accelerator.memory().gathered;
      accelerator.backward(logits.mean());
      accelerator.step();
      at_rest[k] = accelerator.memory().gathered;
    }
    const int64_t block_bytes = (4 * 64 * 64 + 64 * 256 + 256 + 256 * 64 + 64 + 2 * 64) * 2;
    EXPECT_GE(gathered_after_forward[1] - gathered_after_forward[0], 4 * block_bytes - 1024)
        << "SHARD_GRAD_OP must keep the 4 blocks gathered between forward and backward";
    EXPECT_LT(gathered_after_forward[0], 2 * block_bytes) << "FULL_SHARD frees each block after its forward";
    EXPECT_EQ(at_rest[0], 0);
    EXPECT_EQ(at_rest[1], 0) << "SHARD_GRAD_OP reshards after backward";
  });
}

TEST(DistFsdpDelays, RandomDelaysBeforeCollectivesLeaveLossesUnchanged) {
  std::vector<double> losses[2];
  for (int delayed = 0; delayed < 2; ++delayed) {
    MultiRankOptions harness;
    if (delayed) harness.env["SHARDTRAIN_COMM_INJECT_DELAY_MS"] = "3";
    const std::filesystem::path out =
        shardtrain::testing::test_scratch_dir() / ("delays" + std::to_string(delayed) + ".txt");
    run_on_ranks(2, [out](RankContext& ctx) {
      auto run = tiny::run_tiny(options_for(fsdp_config(ShardingStrategy::kFullShard, MixedPrecision::kBf16), ctx, 6));
      if (ctx.rank() != 0) return;
      std::ofstream file(out);
      file.precision(17);
      for (double l : run.losses) file << l << "\n";
    }, harness);
    if (shardtrain::testing::is_rank_process()) continue;  // a rank of the other call runs on
    std::ifstream file(out);
    for (double l; file >> l;) losses[delayed].push_back(l);
  }
  if (shardtrain::testing::is_rank_process()) return;
  ASSERT_EQ(losses[0].size(), 6u);
  EXPECT_EQ(losses[0], losses[1]);
}

/// A unit with a frozen base weight and a trainable low-rank adapter (LoRA's shape).
struct AdapterBlockImpl : torch::nn::Module, shardtrain::Unit {
  AdapterBlockImpl()
      : Unit("AdapterBlock"), base(register_module("base", torch::nn::Linear(8, 8))),
        down(register_module("down", torch::nn::Linear(torch::nn::LinearOptions(8, 2).bias(false)))),
        up(register_module("up", torch::nn::Linear(torch::nn::LinearOptions(2, 8).bias(false)))) {
    base->weight.set_requires_grad(false);
    base->bias.set_requires_grad(false);
  }
  at::Tensor forward(const at::Tensor& x) {
    return run_unit(x, [this](const at::Tensor& h) { return at::tanh(base(h) + up(down(h))); });
  }
  torch::nn::Linear base, down, up;
};
TORCH_MODULE(AdapterBlock);

struct AdapterModelImpl : torch::nn::Module {
  AdapterModelImpl() : first(register_module("first", AdapterBlock())), second(register_module("second", AdapterBlock())) {}
  at::Tensor forward(const at::Tensor& x) { return second(first(x)); }
  AdapterBlock first, second;
};
TORCH_MODULE(AdapterModel);

TEST(DistFsdpFrozen, FrozenParametersNeverChangeTrainableOnesMatchTheReference) {
  run_on_ranks(2, [](RankContext& ctx) {
    auto config = fsdp_config(ShardingStrategy::kFullShard, MixedPrecision::kNo);
    config.fsdp.transformer_layer_cls_to_wrap = {"AdapterBlock"};
    config.optimizer.lr = 1e-2;
    auto accelerator_holder = accelerator_for(config, ctx);
    shardtrain::Accelerator& accelerator = *accelerator_holder;
    torch::manual_seed(4);
    AdapterModel model;
    torch::manual_seed(4);
    AdapterModel reference;
    std::map<std::string, at::Tensor> initial;
    for (const auto& item : reference->named_parameters()) initial[item.key()] = item.value().detach().clone();
    std::vector<at::Tensor> trainable;
    for (const auto& p : reference->parameters()) {
      if (p.requires_grad()) trainable.push_back(p);
    }
    // The engines' Adam arithmetic (tiny/reference_adam.h says why not torch::optim::AdamW),
    // without decay, as fsdp_config states.
    tiny::ReferenceAdam optimizer(trainable, torch::optim::AdamWOptions(1e-2).weight_decay(0.0), /*decoupled=*/true);
    auto prepared = accelerator.prepare(model, {}, micro_batch(2));
    for (int step = 0; step < 5; ++step) {
      at::Tensor all = at::sin(at::arange(32, at::kFloat).view({4, 8}) * (step + 1));
      accelerator.backward(prepared(all.narrow(0, 2 * ctx.rank(), 2)).pow(2).mean());
      accelerator.step();
      shardtrain::testing::data_parallel_reference_step(*reference, optimizer, 2, [&](int r) {
        return reference->forward(all.narrow(0, 2 * r, 2)).pow(2).mean();
      });
    }
    auto state = accelerator.full_state_dict();
    auto expected = reference->named_parameters();
    ASSERT_EQ(state.size(), expected.size());
    for (const auto& [name, value] : state) {
      if (name.find("base") != std::string::npos) {
        EXPECT_TRUE(at::equal(value, initial[name])) << name << " is frozen but changed";
      } else {
        EXPECT_FALSE(at::equal(value, initial[name])) << name << " is trainable but did not change";
        // The same per-rank arithmetic: the same bits.
        EXPECT_TRUE(at::equal(value, expected[name]))
            << name << ": max |difference| " << (value - expected[name]).abs().max().item<double>();
      }
    }
  });
}

TEST(DistFsdpMemory, ModelStateBytesMatchThePrecisionPlan) {
  run_on_ranks(2, [](RankContext& ctx) {
    for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard}) {
      for (bool pure : {false, true}) {
        auto options = options_for(fsdp_config(strategy, pure ? MixedPrecision::kNo : MixedPrecision::kBf16), ctx, 1);
        options.load_dtype = pure ? "bf16" : "fp32";
        options.model.hidden = 128;
        options.model.ffn = 512;
        auto run = tiny::run_tiny(options);
        const auto& plan = run.plan;
        auto within = [&](const char* kind, int64_t measured, double per_param) {
          const double predicted = per_param * plan.num_params;
          if (predicted == 0) {
            EXPECT_EQ(measured, 0) << kind;
            return;
          }
          EXPECT_LE(std::abs(measured - predicted) / predicted, 0.05)
              << kind << " (" << plan.engine << "): measured " << measured << ", plan " << predicted;
        };
        within("params", run.memory.params, plan.params_bytes);
        within("grads", run.memory.grads, plan.grads_bytes);
        within("master", run.memory.master, plan.master_bytes);
        within("optimizer", run.memory.optimizer, plan.optimizer_bytes);
      }
    }
  });
}

}  // namespace

namespace {

std::atomic<int> g_block_calls{0};

/// A unit that counts how often its body runs.
struct CountingBlockImpl : torch::nn::Module, shardtrain::Unit {
  CountingBlockImpl() : Unit("CountingBlock"), linear(register_module("linear", torch::nn::Linear(8, 8))) {}
  at::Tensor forward(const at::Tensor& x) {
    return run_unit(x, [this](const at::Tensor& h) {
      ++g_block_calls;
      return at::gelu(linear(h)) + h;
    });
  }
  torch::nn::Linear linear;
};
TORCH_MODULE(CountingBlock);

struct CountingModelImpl : torch::nn::Module {
  CountingModelImpl()
      : embed(register_module("embed", torch::nn::Linear(4, 8))), a(register_module("a", CountingBlock())),
        b(register_module("b", CountingBlock())), head(register_module("head", torch::nn::Linear(8, 1))) {}
  at::Tensor forward(const at::Tensor& x) { return head(b(a(embed(x)))); }
  torch::nn::Linear embed;
  CountingBlock a, b;
  torch::nn::Linear head;
};
TORCH_MODULE(CountingModel);

TEST(DistFsdpCheckpointing, UnitsAreRecomputedInBackwardWithIdenticalResults) {
  run_on_ranks(2, [](RankContext& ctx) {
    std::vector<std::pair<std::string, at::Tensor>> results[2];
    std::vector<double> losses[2];
    int calls[2];
    for (int recompute = 0; recompute < 2; ++recompute) {
      for (ShardingStrategy strategy : {ShardingStrategy::kFullShard}) {
        auto config = fsdp_config(strategy, MixedPrecision::kNo);
        config.fsdp.transformer_layer_cls_to_wrap = {"CountingBlock"};
        config.fsdp.activation_checkpointing = recompute == 1;
        config.optimizer.lr = 1e-2;
        auto accelerator_holder = accelerator_for(config, ctx);
        shardtrain::Accelerator& accelerator = *accelerator_holder;
        torch::manual_seed(2);
        CountingModel model;
        auto prepared = accelerator.prepare(model, {}, micro_batch(3));
        g_block_calls = 0;
        for (int step = 0; step < 4; ++step) {
          at::Tensor x = at::cos(at::arange(12, at::kFloat).view({3, 4}) * (ctx.rank() + step + 1));
          at::Tensor loss = prepared(x).pow(2).mean();
          accelerator.backward(loss);
          accelerator.step();
          losses[recompute].push_back(loss.item<double>());
        }
        calls[recompute] = g_block_calls;
        results[recompute] = accelerator.full_state_dict();
      }
    }
    EXPECT_EQ(calls[0], 2 * 4) << "two blocks, four steps";
    EXPECT_EQ(calls[1], 2 * 2 * 4) << "with checkpointing every block body runs again in backward";
    EXPECT_EQ(losses[0], losses[1]);
    for (std::size_t i = 0; i < results[0].size(); ++i) {
      EXPECT_TRUE(at::equal(results[0][i].second, results[1][i].second)) << results[0][i].first;
    }
  });
}

TEST(DistFsdpGathers, LimitAllGathersPacesGathersBehindTheUnitsReleasedTwoBefore) {
  run_on_ranks(2, [](RankContext& ctx) {
    auto paced = [&](shardtrain::TrainingConfig config) {
      config.fsdp.transformer_layer_cls_to_wrap = {"CountingBlock"};
      auto accelerator = accelerator_for(config, ctx);
      torch::manual_seed(2);
      CountingModel model;
      auto prepared = accelerator->prepare(model, {}, micro_batch(3));
      accelerator->reset_traffic();
      for (int step = 0; step < 3; ++step) {
        accelerator->backward(prepared(at::ones({3, 4})).pow(2).mean());
        accelerator->step();
      }
      return accelerator->traffic().paced_gathers;
    };
    auto config = fsdp_config(ShardingStrategy::kFullShard, MixedPrecision::kNo);
    // Units a and b are freed after forward and after backward, the root
    // after backward (unpaced). A gather waits when two releases are queued
    // and takes the older one off: in the first step b's backward gather (a,
    // then b released in forward); in each later step the root's gather (b
    // and a released in backward), b's in forward (a released in that
    // backward and in this forward) and b's in backward; a's come with one
    // release queued, or prefetched. 1 + 3 + 3.
    EXPECT_EQ(paced(config), 7);
    config.fsdp.limit_all_gathers = false;
    EXPECT_EQ(paced(config), 0);
    EXPECT_GT(paced(shardtrain::testing::zero_test_config(3, MixedPrecision::kNo)), 0) << "ZeRO-3 paces always";
  });
}

std::atomic<int> g_lookup_calls{0};

/// A block that is an embedding lookup: its backward reads no parameter.
struct LookupBlockImpl : torch::nn::Module, shardtrain::Unit {
  LookupBlockImpl() : Unit("LookupBlock"), table(register_parameter("table", at::randn({16, 8}))) {}
  at::Tensor forward(const at::Tensor& ids) {
    return run_unit(ids, [this](const at::Tensor& i) {
      ++g_lookup_calls;
      return at::embedding(table, i);
    });
  }
  bool backward_reads_parameters() const override { return false; }
  at::Tensor table;
};
TORCH_MODULE(LookupBlock);

struct LookupModelImpl : torch::nn::Module {
  LookupModelImpl()
      : lookup(register_module("lookup", LookupBlock())), a(register_module("a", CountingBlock())),
        head(register_module("head", torch::nn::Linear(8, 1))) {}
  at::Tensor forward(const at::Tensor& ids) { return head(a(lookup(ids))); }
  LookupBlock lookup;
  CountingBlock a;
  torch::nn::Linear head;
};
TORCH_MODULE(LookupModel);

TEST(DistFsdpCheckpointing, ALookupUnitIsNotRecomputedAndTrainsAsWithoutCheckpointing) {
  run_on_ranks(2, [](RankContext& ctx) {
    std::vector<std::pair<std::string, at::Tensor>> results[2];
    std::vector<double> losses[2];
    int lookups[2], blocks[2];
    for (int recompute = 0; recompute < 2; ++recompute) {
      auto config = fsdp_config(ShardingStrategy::kFullShard, MixedPrecision::kNo);
      config.fsdp.transformer_layer_cls_to_wrap = {"CountingBlock", "LookupBlock"};
      config.fsdp.activation_checkpointing = recompute == 1;
      config.optimizer.lr = 1e-2;
      auto accelerator = accelerator_for(config, ctx);
      torch::manual_seed(2);
      LookupModel model;
      auto prepared = accelerator->prepare(model, {}, micro_batch(3));
      g_lookup_calls = 0;
      g_block_calls = 0;
      for (int step = 0; step < 3; ++step) {
        const at::Tensor ids = (at::arange(6, at::kLong).view({3, 2}) * (ctx.rank() + step + 1)) % 16;
        at::Tensor loss = prepared(ids).pow(2).mean();
        accelerator->backward(loss);
        accelerator->step();
        losses[recompute].push_back(loss.item<double>());
      }
      lookups[recompute] = g_lookup_calls;
      blocks[recompute] = g_block_calls;
      results[recompute] = accelerator->full_state_dict();
    }
    EXPECT_EQ(blocks[1], 2 * 3) << "the block is recomputed";
    EXPECT_EQ(lookups[1], 3) << "the lookup is not: its parameters are freed after its forward";
    EXPECT_EQ(losses[0], losses[1]);
    for (std::size_t i = 0; i < results[0].size(); ++i) {
      EXPECT_TRUE(at::equal(results[0][i].second, results[1][i].second)) << results[0][i].first;
    }
  });
}

}  // namespace

namespace {

std::atomic<int> g_block_buffer_dtype{-1};
std::atomic<int> g_root_buffer_dtype{-1};

/// A unit with a constant buffer that bf16 cannot represent (1/3), a running
/// statistic updated in forward, and an integer counter.
struct BufferedBlockImpl : torch::nn::Module, shardtrain::Unit {
  BufferedBlockImpl()
      : Unit("BufferedBlock"), linear(register_module("linear", torch::nn::Linear(8, 8))),
        scale(register_buffer("scale", at::full({8}, 1.0 / 3.0))),
        running(register_buffer("running", at::zeros({8}))),
        calls(register_buffer("calls", at::zeros({1}, at::kLong))) {}
  at::Tensor forward(const at::Tensor& x) {
    return run_unit(x, [this](const at::Tensor& h) {
      g_block_buffer_dtype = static_cast<int>(scale.scalar_type());
      {
        at::NoGradGuard no_grad;
        running.mul_(0.5).add_(h.detach().mean(0).to(running.scalar_type()), 0.5);
        calls.add_(1);
      }
      return at::tanh(linear(h * scale.to(h.scalar_type())));
    });
  }
  torch::nn::Linear linear;
  at::Tensor scale, running, calls;
};
TORCH_MODULE(BufferedBlock);

struct BufferedModelImpl : torch::nn::Module {
  BufferedModelImpl()
      : first(register_module("first", BufferedBlock())), second(register_module("second", BufferedBlock())),
        offset(register_buffer("offset", at::full({8}, 0.1))) {}
  at::Tensor forward(const at::Tensor& x) {
    g_root_buffer_dtype = static_cast<int>(offset.scalar_type());
    // The compute dtype is the weights' (reading the dtype of a freed view reads no data).
    at::Tensor h = x.to(first->linear->weight.scalar_type()) + offset.to(first->linear->weight.scalar_type());
    return second(first(h)).to(at::kFloat);
  }
  BufferedBlock first, second;
  at::Tensor offset;
};
TORCH_MODULE(BufferedModel);

std::vector<double> train_buffered(shardtrain::Accelerator& accelerator, BufferedModel& model, int rank, int first,
                                   int steps) {
  std::vector<double> losses;
  for (int step = first; step < first + steps; ++step) {
    at::Tensor x = at::sin(at::arange(16, at::kFloat).view({2, 8}) * (rank + 1) * (step + 1));
    at::Tensor out = shardtrain::PreparedModel<BufferedModel>(model, &accelerator)(x);
    at::Tensor loss = out.pow(2).mean();
    accelerator.backward(loss);
    accelerator.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

TEST(DistFsdpBuffers, BufferDtypeCastsBuffersForComputeAndStateDictsKeepTheOriginals) {
  run_on_ranks(2, [](RankContext& ctx) {
    const at::Tensor third = at::full({8}, 1.0 / 3.0);
    ASSERT_FALSE(at::equal(third.to(at::kBFloat16).to(at::kFloat), third)) << "1/3 must not survive bf16";
    auto config_for = [](bool buffers_fp32) {
      auto config = fsdp_config(ShardingStrategy::kFullShard, MixedPrecision::kBf16);
      config.fsdp.transformer_layer_cls_to_wrap = {"BufferedBlock"};
      config.optimizer.lr = 1e-2;
      if (buffers_fp32) config.fsdp.buffer_dtype = shardtrain::DType::kFp32;
      return config;
    };
    for (bool buffers_fp32 : {false, true}) {
      auto accelerator = accelerator_for(config_for(buffers_fp32), ctx);
      torch::manual_seed(5);
      BufferedModel model;
      accelerator->prepare(model, {}, micro_batch(2));
      g_block_buffer_dtype = -1;
      g_root_buffer_dtype = -1;
      train_buffered(*accelerator, model, ctx.rank(), 0, 2);
      // mixed_precision bf16 resolves fsdp_buffer_dtype to bf16 (FSDP's MixedPrecision(buffer_dtype=bf16)).
      const at::ScalarType expected = buffers_fp32 ? at::kFloat : at::kBFloat16;
      EXPECT_EQ(g_block_buffer_dtype, static_cast<int>(expected)) << "a unit's buffer during forward";
      EXPECT_EQ(g_root_buffer_dtype, static_cast<int>(expected)) << "a root buffer during forward";
      EXPECT_EQ(model->first->calls.scalar_type(), at::kLong) << "integer buffers are never cast";
      EXPECT_EQ(model->first->calls.item<int64_t>(), 2);

      std::map<std::string, at::Tensor> state;
      for (auto& [name, value] : accelerator->full_state_dict()) state[name] = value;
      ASSERT_TRUE(state.count("first.scale") && state.count("offset") && state.count("second.running") &&
                  state.count("first.calls"));
      // Constant buffers come back in full precision, exactly (not bf16-rounded).
      EXPECT_EQ(state["first.scale"].scalar_type(), at::kFloat);
      EXPECT_TRUE(at::equal(state["first.scale"], third));
      EXPECT_TRUE(at::equal(state["offset"], at::full({8}, 0.1)));
      // A buffer changed in forward: its current value, widened to the original dtype.
      EXPECT_EQ(state["second.running"].scalar_type(), at::kFloat);
      EXPECT_TRUE(at::equal(state["second.running"], model->second->running.to(at::kFloat)));
      EXPECT_GT(state["second.running"].abs().sum().item<double>(), 0.0);
      EXPECT_EQ(state["first.calls"].item<int64_t>(), 2);
      EXPECT_EQ(state["first.linear.weight"].scalar_type(), at::kFloat) << "parameters stay fp32 masters";
    }

    // Checkpoints: save after 2 steps, run 2 more; a fresh run loading the
    // checkpoint (its buffers cast again from the model's originals) matches.
    const std::string dir = shardtrain::testing::test_scratch_dir().string();
    std::vector<double> straight, resumed;
    {
      auto accelerator = accelerator_for(config_for(false), ctx);
      torch::manual_seed(5);
      BufferedModel model;
      accelerator->prepare(model, {}, micro_batch(2));
      train_buffered(*accelerator, model, ctx.rank(), 0, 2);
      accelerator->save_state(dir, "buffers");
      straight = train_buffered(*accelerator, model, ctx.rank(), 2, 2);
    }
    {
      auto accelerator = accelerator_for(config_for(false), ctx);
      torch::manual_seed(9);  // different init: everything must come from the checkpoint
      BufferedModel model;
      accelerator->prepare(model, {}, micro_batch(2));
      accelerator->load_state(dir, "buffers");
      g_block_buffer_dtype = -1;
      resumed = train_buffered(*accelerator, model, ctx.rank(), 2, 2);
      EXPECT_EQ(g_block_buffer_dtype, static_cast<int>(at::kBFloat16));
    }
    EXPECT_EQ(straight, resumed);
  });
}

TEST(DistFsdpKeepLowPrecisionGrads, GradientShardStaysBf16AndTrainingFollowsTheFp32GradientRun) {
  run_on_ranks(2, [](RankContext& ctx) {
    // The shard's dtype and bytes: bf16, 2 bytes per parameter per copy of the model.
    for (bool keep : {false, true}) {
      auto config = fsdp_config(ShardingStrategy::kFullShard, MixedPrecision::kBf16);
      config.fsdp.keep_low_precision_grads = keep;
      auto options = options_for(config, ctx, 1);
      auto run = tiny::run_tiny(options);
      EXPECT_EQ(run.plan.grad_dtype, keep ? "bf16" : "fp32");
      EXPECT_DOUBLE_EQ(run.plan.grads_bytes * ctx.world_size(), keep ? 2.0 : 4.0);
      auto accelerator = accelerator_for(config, ctx);
      torch::manual_seed(0);
      tiny::TinyModel model(tiny::TinyConfig{});
      accelerator->prepare(model, {}, micro_batch(2));
      auto& engine = dynamic_cast<shardtrain::engine::ShardedEngine&>(shardtrain::AcceleratorInternals::engine(*accelerator));
      EXPECT_EQ(engine.gradient_partition().scalar_type(), keep ? at::kBFloat16 : at::kFloat);
      // Measured by the run: the gradient partition (1/W of every unit plus at
      // most W - 1 padding elements per unit) at 2 or 4 bytes an element.
      const int64_t partition = engine.gradient_partition().numel();
      EXPECT_EQ(run.memory.grads, partition * (keep ? 2 : 4)) << "measured gradient bytes";
      const int64_t padding = partition * ctx.world_size() - run.plan.num_params;
      EXPECT_GE(padding, 0);
      EXPECT_LE(padding, static_cast<int64_t>(engine.unit_paths().size()) * (ctx.world_size() - 1));
      EXPECT_EQ(engine.master_partition().scalar_type(), at::kFloat) << "the master stays fp32";
      EXPECT_EQ(engine.exp_avg_partition().scalar_type(), at::kFloat) << "the optimizer state stays fp32";
    }

    // With reduce_dtype bf16 (the default) and one micro-batch the reduced
    // gradient is bf16 either way: upcasting it is exact, so the runs agree bit for bit.
    auto losses = [&](bool keep, bool fp32_reduce, int64_t accumulation) {
      auto config = fsdp_config(ShardingStrategy::kFullShard, MixedPrecision::kBf16);
      config.fsdp.keep_low_precision_grads = keep;
      if (fp32_reduce) config.fsdp.reduce_dtype = shardtrain::DType::kFp32;
      config.gradient_accumulation_steps = accumulation;
      return tiny::run_tiny(options_for(config, ctx, 40)).losses;
    };
    EXPECT_EQ(losses(true, false, 1), losses(false, false, 1));

    // With an fp32 reduction and 2 accumulated micro-batches the kept run
    // rounds each reduced gradient and their sum to bf16: both runs equal the
    // per-rank reference doing exactly that (or not), bit for bit.
    auto run_with = [&](bool keep) {
      auto config = fsdp_config(ShardingStrategy::kFullShard, MixedPrecision::kBf16);
      config.fsdp.keep_low_precision_grads = keep;
      config.fsdp.reduce_dtype = shardtrain::DType::kFp32;
      config.gradient_accumulation_steps = 2;
      auto options = options_for(config, ctx, 20);
      auto run = tiny::run_tiny(options);
      tiny::DataParallelArithmetic arithmetic;
      arithmetic.compute_dtype = at::kBFloat16;
      arithmetic.reduce_dtype = at::kFloat;
      arithmetic.grad_dtype = keep ? at::kBFloat16 : at::kFloat;
      if (ctx.rank() == 0) {
        SCOPED_TRACE(keep ? "kept bf16 gradients" : "fp32 gradients");
        shardtrain::testing::expect_same_bits(run, tiny::run_tiny_data_parallel_reference(options, 2, arithmetic));
      }
      return run.losses;
    };
    const auto kept = run_with(true);
    const auto full = run_with(false);
    EXPECT_NE(kept, full) << "bf16 gradient accumulation must round somewhere";
    EXPECT_LT(kept.back(), kept.front() * 0.95) << "training with bf16 gradients did not learn";
  });
}

}  // namespace
