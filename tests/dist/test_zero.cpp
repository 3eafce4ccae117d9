// The ZeRO engine against the plain LibTorch reference (train_tiny --reference):
// FP32 parity for stages 1-3 at world 2 and 4 (overlap_comm on and off), bf16
// master partitions, the analytic partition of an odd-sized parameter,
// clipping, gradient accumulation, memory against the precision plan, and
// who waits for the post-step all-gather.
#include <map>
#include <optional>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "accelerator_internals.h"
#include "shardtrain/accelerator.h"
#include "support/multirank.h"
#include "support/tiny_compare.h"
#include "tiny/tiny_train.h"
#include "backends/zero/zero_engine.h"
#include "engine/sharded_engine.h"

namespace {

using shardtrain::testing::RankContext;
using shardtrain::testing::run_on_ranks;

using shardtrain::testing::accelerator_for;
using shardtrain::testing::micro_batch;

shardtrain::TrainingConfig zero_config(int stage, shardtrain::MixedPrecision precision, int64_t accumulation = 1,
                                       double clip = 0.0) {
  return shardtrain::testing::zero_test_config(stage, precision, accumulation, clip);
}

tiny::TinyRunOptions tiny_options(const shardtrain::TrainingConfig& config, RankContext& ctx, int steps) {
  return shardtrain::testing::tiny_run_options(config, ctx, steps, /*seed=*/7);
}

using shardtrain::testing::expect_same_bits;

/// The tiny model, seeded 0, prepared on `accelerator` for micro-batches of 2.
shardtrain::PreparedModel<tiny::TinyModel> prepare_tiny(shardtrain::Accelerator& accelerator,
                                                        const tiny::TinyConfig& model_config) {
  torch::manual_seed(0);
  return accelerator.prepare(tiny::TinyModel(model_config), {}, micro_batch(2));
}

struct ParityCase {
  int stage;
  int world;
  /// Unset: DeepSpeed's default for the stage (off for 1 and 2, on for 3).
  std::optional<bool> overlap_comm = std::nullopt;
};

class DistZeroParity : public ::testing::TestWithParam<ParityCase> {};

TEST_P(DistZeroParity, Fp32LossesAndFinalParametersMatchTheReference) {
  const ParityCase c = GetParam();
  run_on_ranks(c.world, [c](RankContext& ctx) {
    auto config = zero_config(c.stage, shardtrain::MixedPrecision::kNo);
    config.zero.overlap_comm = c.overlap_comm;
    auto options = tiny_options(config, ctx, 30);
    tiny::TinyRunResult engine_run = tiny::run_tiny(options);
    if (ctx.rank() != 0) return;
    tiny::DataParallelArithmetic arithmetic;
    arithmetic.accumulate_before_reduce = c.stage == 1;
    tiny::TinyRunResult reference = tiny::run_tiny_data_parallel_reference(options, c.world, arithmetic);
    ASSERT_EQ(engine_run.losses.size(), 30u);
    EXPECT_LT(engine_run.losses.back(), engine_run.losses.front() * 0.95) << "the loss did not fall";
    expect_same_bits(engine_run, reference);
  });
}

INSTANTIATE_TEST_SUITE_P(DistStagesWorlds, DistZeroParity,
                         ::testing::Values(ParityCase{1, 2}, ParityCase{2, 2}, ParityCase{3, 2}, ParityCase{1, 4},
                                           ParityCase{2, 4}, ParityCase{3, 4}, ParityCase{1, 2, true},
                                           ParityCase{2, 4, true}, ParityCase{3, 2, false}),
                         [](const auto& info) {
                           const auto& overlap = info.param.overlap_comm;
                           return "stage" + std::to_string(info.param.stage) + "_world" +
                                  std::to_string(info.param.world) +
                                  (!overlap ? "" : *overlap ? "_overlap_comm" : "_no_overlap_comm");
                         });

TEST(DistZeroBf16, Stage3MastersAreFp32AndTheLowPrecisionCopyIsTheirRounding) {
  run_on_ranks(2, [](RankContext& ctx) {
    auto config = zero_config(3, shardtrain::MixedPrecision::kBf16);
    auto accelerator_holder = accelerator_for(config, ctx);
    shardtrain::Accelerator& accelerator = *accelerator_holder;
    torch::manual_seed(3);
    tiny::TinyConfig model_config;
    tiny::TinyModel model(model_config);
    model->to(at::kBFloat16);  // loaded in bf16: the master is still fp32
    shardtrain::RunInfo run;
    run.micro_batch_size = 4;
    run.hidden_size = model_config.hidden;
    auto prepared = accelerator.prepare(model, {}, run);
    auto& engine = dynamic_cast<shardtrain::engine::ShardedEngine&>(shardtrain::AcceleratorInternals::engine(accelerator));
    ASSERT_EQ(engine.name(), "zero-3");
    for (int step = 0; step < 3; ++step) {
      at::Tensor tokens = at::stack({tiny::synthetic_sample(1, step * 8 + ctx.rank() * 4, model_config),
                                     tiny::synthetic_sample(1, step * 8 + ctx.rank() * 4 + 1, model_config)});
      at::Tensor logits = prepared(tokens);
      EXPECT_EQ(model->blocks[0]->as<tiny::TinyBlock>()->qkv->weight.scalar_type(), at::kBFloat16);
      at::Tensor loss = at::cross_entropy_loss(logits.narrow(1, 0, 31).reshape({-1, 256}),
                                               tokens.narrow(1, 1, 31).reshape({-1}));
      accelerator.backward(loss);
      accelerator.step();
      ASSERT_EQ(engine.master_partition().scalar_type(), at::kFloat);
      ASSERT_EQ(engine.low_precision_partition().scalar_type(), at::kBFloat16);
      EXPECT_TRUE(at::equal(engine.low_precision_partition(), engine.master_partition().to(at::kBFloat16)))
          << "low-precision copy differs from bf16(master) after step " << step;
    }
    const auto plan = accelerator.precision_plan();
    EXPECT_EQ(plan.master_dtype, "fp32");
    EXPECT_DOUBLE_EQ(plan.optimizer_bytes_per_param_total(), 12.0);
  });
}

TEST(DistZeroBf16, Stage3EqualsTheBf16PerRankReferenceBitForBit) {
  run_on_ranks(2, [](RankContext& ctx) {
    auto options = tiny_options(zero_config(3, shardtrain::MixedPrecision::kBf16), ctx, 30);
    tiny::TinyRunResult bf16_run = tiny::run_tiny(options);
    if (ctx.rank() != 0) return;
    // bf16 compute on bf16(master), bf16 gradients averaged in fp32 and
    // rounded once, fp32 master: the same arithmetic, so the same bits, on
    // whichever GEMM path (native or widened) this process uses.
    tiny::DataParallelArithmetic arithmetic;
    arithmetic.compute_dtype = at::kBFloat16;
    tiny::TinyRunResult reference = tiny::run_tiny_data_parallel_reference(options, 2, arithmetic);
    expect_same_bits(bf16_run, reference);
    EXPECT_LT(bf16_run.losses.back(), bf16_run.losses.front() * 0.95);
  });
}

TEST(DistZeroPartition, OddSizedParameterIsSplitWithThePaddedTailOnTheLastRank) {
  run_on_ranks(2, [](RankContext& ctx) {
    // One 3x5 weight (15 elements): chunk ceil(15/2) = 8; rank 0 owns [0, 8), rank 1 owns [8, 15) + 1 padding.
    auto model = std::make_shared<torch::nn::Module>();
    at::Tensor weight = model->register_parameter("weight", at::arange(15, at::kFloat).view({3, 5}) + 1);
    shardtrain::TrainingConfig config;
    config.distributed_type = shardtrain::DistributedType::kDeepSpeed;
    config.zero.stage = 3;
    config.zero.stage3_param_persistence_threshold = 0;
    shardtrain::engine::PlanContext context;
    context.world_size = ctx.comm->world_size();
    const auto& backend = shardtrain::zero::backend();
    const shardtrain::engine::EnginePlan plan = backend.plan(config, context);
    shardtrain::engine::ShardedEngine engine(model, backend.groups(ctx.comm, plan), plan);
    auto ranges = engine.owned_ranges();
    ASSERT_EQ(ranges.size(), 1u);
    EXPECT_EQ(ranges[0].name, "weight");
    EXPECT_EQ(ranges[0].begin, ctx.rank() == 0 ? 0 : 8);
    EXPECT_EQ(ranges[0].length, ctx.rank() == 0 ? 8 : 7);
    const at::Tensor& master = engine.master_partition();
    ASSERT_EQ(master.numel(), 8);
    at::Tensor expected = ctx.rank() == 0 ? at::arange(1, 9, at::kFloat)
                                          : at::cat({at::arange(9, 16, at::kFloat), at::zeros({1})});
    EXPECT_TRUE(at::equal(master, expected)) << master;
    // Gathered back, the parameter is whole again.
    auto state = engine.full_state_dict();
    ASSERT_EQ(state.size(), 1u);
    EXPECT_TRUE(at::equal(state[0].second, at::arange(15, at::kFloat).view({3, 5}) + 1));
  });
}

TEST(DistZeroClipping, GlobalNormMatchesTheReference) {
  run_on_ranks(2, [](RankContext& ctx) {
    auto options = tiny_options(zero_config(3, shardtrain::MixedPrecision::kNo, 1, /*clip=*/0.05), ctx, 5);
    tiny::TinyRunResult engine_run = tiny::run_tiny(options);
    if (ctx.rank() != 0) return;
    tiny::TinyRunResult reference = tiny::run_tiny_data_parallel_reference(options, 2);
    // Both norms are sqrt of an fp64 sum of the same fp32 squares (exact in
    // fp64), added in another order: n additions err by at most n * 2^-53 of
    // the sum (gamma_n), and the square root halves that relative error.
    const double n = static_cast<double>(engine_run.plan.num_params);
    const double norm_tolerance = 0.5 * n * std::ldexp(1.0, -53) / (1 - n * std::ldexp(1.0, -53));
    for (std::size_t i = 0; i < engine_run.grad_norms.size(); ++i) {
      ASSERT_GT(reference.grad_norms[i], 0.05) << "the test needs norms above max_norm so clipping acts";
      EXPECT_LE(std::abs(engine_run.grad_norms[i] - reference.grad_norms[i]) / reference.grad_norms[i], norm_tolerance)
          << "step " << i + 1 << ": " << engine_run.grad_norms[i] << " vs " << reference.grad_norms[i];
    }
    // The coefficient min(1, 0.05 / (norm + 1e-6)) is used as a float; the
    // norms' last-bit difference in fp64 does not reach it, so the same bits.
    expect_same_bits(engine_run, reference);
  });
}

TEST(DistZeroAccumulation, FourMicroBatchesEqualOneFourTimesLargerBatch) {
  run_on_ranks(2, [](RankContext& ctx) {
    for (int stage : {1, 2, 3}) {
      auto accumulated = tiny_options(zero_config(stage, shardtrain::MixedPrecision::kNo, 4), ctx, 8);
      accumulated.micro_batch = 2;
      tiny::TinyRunResult run = tiny::run_tiny(accumulated);
      if (ctx.rank() != 0) continue;
      // 2 ranks x 4 micro-batches of 2, each through the model on its own;
      // stage 1 sums a rank's micro-batches before reducing, 2 and 3 reduce each.
      tiny::DataParallelArithmetic arithmetic;
      arithmetic.accumulate_before_reduce = stage == 1;
      tiny::TinyRunResult reference = tiny::run_tiny_data_parallel_reference(accumulated, 2, arithmetic);
      SCOPED_TRACE("stage " + std::to_string(stage));
      expect_same_bits(run, reference);
    }
  });
}

// ZeRO-1 sums a window's micro-batches in a full-size fp32 accumulator
// before reducing them. With one micro-batch per window it reduces straight
// from autograd, so it must not hold that accumulator (4 bytes per parameter,
// unsharded) at all; with more, it holds it, and the plan counts it.
TEST(DistZeroMemory, StageOneHoldsItsFullSizeAccumulatorOnlyWhenMicroBatchesAccumulate) {
  run_on_ranks(2, [](RankContext& ctx) {
    const tiny::TinyRunResult stage2 = tiny::run_tiny(tiny_options(zero_config(2, shardtrain::MixedPrecision::kNo), ctx, 2));
    for (int64_t accumulation : {1, 2}) {
      SCOPED_TRACE("gradient_accumulation_steps " + std::to_string(accumulation));
      auto options = tiny_options(zero_config(1, shardtrain::MixedPrecision::kNo, accumulation), ctx, 2);
      const tiny::TinyRunResult run = tiny::run_tiny(options);
      const int64_t accumulator = accumulation > 1 ? 4 * run.plan.num_params : 0;
      // The gradient partition is stage 2's; the accumulator comes on top.
      EXPECT_EQ(run.memory.grads, stage2.memory.grads + accumulator);
      EXPECT_DOUBLE_EQ(run.plan.grads_bytes * run.plan.num_params,
                       stage2.plan.grads_bytes * stage2.plan.num_params + static_cast<double>(accumulator));
    }
  }, {});
}

TEST(DistZeroMemory, ModelStateBytesMatchThePrecisionPlanAtWorlds1To4) {
  for (int world : {1, 2, 4}) {
    run_on_ranks(world, [world](RankContext& ctx) {
      for (int stage : {1, 2, 3}) {
        for (auto precision : {shardtrain::MixedPrecision::kNo, shardtrain::MixedPrecision::kBf16}) {
          auto config = zero_config(stage, precision);
          // Prefetch window of one block, so "one unit plus the window" is a real bound.
          const int64_t block_numel = 4 * 128 * 128 + (128 * 512 + 512) + (512 * 128 + 128) + 2 * 128;
          config.zero.stage3_prefetch_bucket_size = block_numel;
          auto options = tiny_options(config, ctx, 2);
          options.model.hidden = 128;
          options.model.ffn = 512;
          options.model.layers = 8;
          tiny::TinyRunResult run = tiny::run_tiny(options);
          const auto& plan = run.plan;
          auto within = [&](const char* kind, int64_t measured, double per_param) {
            const double predicted = per_param * plan.num_params;
            if (predicted == 0) {
              EXPECT_EQ(measured, 0) << kind;
              return;
            }
            EXPECT_LE(std::abs(measured - predicted) / predicted, 0.05)
                << kind << ": measured " << measured << " B, plan " << predicted << " B (stage " << stage
                << ", world " << world << ")";
          };
          within("params", run.memory.params, plan.params_bytes);
          within("grads", run.memory.grads, plan.grads_bytes);
          within("master", run.memory.master, plan.master_bytes);
          within("optimizer", run.memory.optimizer, plan.optimizer_bytes);
          if (stage == 3) {
            // Gathered working set: the root (held from forward to the end of
            // backward), the running block and the one-block prefetch window,
            // each with its gather staging buffer — never the whole model.
            const int64_t elem = precision == shardtrain::MixedPrecision::kBf16 ? 2 : 4;
            const int64_t root_numel = 256 * 128 + 32 * 128 + 128 + 128 * 256;
            const int64_t bound = (root_numel + 2 * 2 * block_numel) * elem + 4096 * elem /* padding */;
            EXPECT_LE(run.memory.gathered_peak, bound) << "stage 3 gathered more than one unit plus the window";
            EXPECT_LT(run.memory.gathered_peak, plan.num_params * elem / 2) << "stage 3 gathered most of the model";
          }
        }
      }
    }, {});
  }
}

}  // namespace

namespace {

TEST(DistZeroBuckets, ReduceBucketSizeDoesNotChangeTheNumbers) {
  run_on_ranks(2, [](RankContext& ctx) {
    std::vector<double> losses[2];
    for (int variant = 0; variant < 2; ++variant) {
      for (int stage : {0, 2, 3}) {
        auto config = zero_config(stage, shardtrain::MixedPrecision::kBf16);
        // One unit per reduction vs every unit in one reduction: each element is
        // still summed over ranks in rank order, so the results are bit-identical.
        config.zero.reduce_bucket_size = variant == 0 ? 1 : 1000000000;
        auto run = tiny::run_tiny(tiny_options(config, ctx, 4));
        losses[variant].insert(losses[variant].end(), run.losses.begin(), run.losses.end());
      }
    }
    EXPECT_EQ(losses[0], losses[1]);
  });
}

TEST(DistZeroSubGroups, SubGroupSizeZeroStepsPerParameterWithTheSameNumbers) {
  // DeepSpeed's sub_group_size: 0 (one sub-group per parameter), 7 elements
  // (slices that cut through parameters) and the default (one slice): the
  // fused step is elementwise, so every slicing gives the same bits.
  // Stage 0 keeps every state unsharded on every rank; 1 and 3 shard it.
  run_on_ranks(2, [](RankContext& ctx) {
    for (int stage : {0, 1, 3}) {
      std::vector<std::vector<double>> losses;
      std::vector<std::vector<std::pair<std::string, at::Tensor>>> params;
      for (int64_t sub_group_size : {int64_t{0}, int64_t{7}, shardtrain::ZeroConfig::kDefaultSubGroupSize}) {
        auto config = zero_config(stage, shardtrain::MixedPrecision::kBf16);
        config.zero.sub_group_size = sub_group_size;
        auto run = tiny::run_tiny(tiny_options(config, ctx, 4));
        losses.push_back(run.losses);
        params.push_back(run.final_params);
      }
      for (size_t variant = 1; variant < losses.size(); ++variant) {
        EXPECT_EQ(losses[variant], losses[0]) << "stage " << stage << ", variant " << variant;
        ASSERT_EQ(params[variant].size(), params[0].size());
        for (size_t i = 0; i < params[0].size(); ++i) {
          EXPECT_TRUE(at::equal(params[variant][i].second, params[0][i].second))
              << "stage " << stage << ": " << params[0][i].first;
        }
      }
    }
  });
}

}  // namespace

namespace {

TEST(DistZeroReuse, MaxReuseDistanceKeepsLateUnitsGatheredUntilTheirBackward) {
  run_on_ranks(2, [](RankContext& ctx) {
    int64_t gathered_after_forward[2];
    for (int keep = 0; keep < 2; ++keep) {
      auto config = zero_config(3, shardtrain::MixedPrecision::kBf16);
      config.zero.stage3_max_reuse_distance = keep ? 1000000000 : 0;
      auto accelerator_holder = accelerator_for(config, ctx);
      shardtrain::Accelerator& accelerator = *accelerator_holder;
      const tiny::TinyConfig model_config;
      auto prepared = prepare_tiny(accelerator, model_config);
      at::Tensor tokens = at::stack({tiny::synthetic_sample(0, 0, model_config), tiny::synthetic_sample(0, 1, model_config)});
      for (int step = 0; step < 2; ++step) {  // the second forward has the recorded order
        at::Tensor logits = prepared(tokens);
        if (step == 1) gathered_after_forward[keep] = accelerator.memory().gathered;
        accelerator.backward(logits.mean());
        accelerator.step();
      }
    }
    const int64_t block_bytes = (4 * 64 * 64 + 64 * 256 + 256 + 256 * 64 + 64 + 2 * 64) * 2;
    EXPECT_GE(gathered_after_forward[1] - gathered_after_forward[0], 4 * block_bytes - 1024)
        << "with a large stage3_max_reuse_distance every block stays gathered for its backward";
  });
}

}  // namespace

namespace {

// ZeRO-1/2 keep every parameter gathered between steps: step() all-gathers
// the stepped values, and overlap_comm decides who waits for them.
struct RegatherCase {
  int stage;
  bool overlap_comm;
};

class DistZeroRegather : public ::testing::TestWithParam<RegatherCase> {};

/// Every parameter of `module` equals the engine's stepped value, bit for bit
/// (fp32: the master is what the ranks gather). Returns how many it compared.
int expect_module_holds_stepped_values(torch::nn::Module& module, shardtrain::engine::ShardedEngine& engine) {
  std::map<std::string, at::Tensor> module_values;
  for (const auto& item : module.named_parameters()) module_values[item.key()] = item.value().clone();
  int compared = 0;
  for (const auto& [name, value] : engine.full_state_dict()) {
    auto found = module_values.find(name);
    if (found == module_values.end()) continue;  // a buffer
    EXPECT_TRUE(at::equal(found->second, value)) << name;
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int>(module_values.size()));
  return compared;
}

// overlap_comm on: step() leaves the post-step gathers in flight, the next
// forward waits for each unit's own, and PreparedModel::module() for all.
// Off (DeepSpeed's default for stages 1 and 2): step() returns with the
// parameters complete, so even a handle kept from before prepare() reads the
// stepped values.
TEST_P(DistZeroRegather, OverlapLeavesTheGathersInFlightUntilAForwardOrModuleWithoutItStepWaits) {
  const RegatherCase c = GetParam();
  run_on_ranks(2, [c](RankContext& ctx) {
    auto config = zero_config(c.stage, shardtrain::MixedPrecision::kNo);
    config.zero.overlap_comm = c.overlap_comm;
    auto accelerator_holder = accelerator_for(config, ctx);
    shardtrain::Accelerator& accelerator = *accelerator_holder;
    const tiny::TinyConfig model_config;
    torch::manual_seed(0);
    tiny::TinyModel kept_handle(model_config);
    auto prepared = accelerator.prepare(kept_handle, {}, micro_batch(2));
    auto& engine =
        dynamic_cast<shardtrain::engine::ShardedEngine&>(shardtrain::AcceleratorInternals::engine(accelerator));
    // Every entry of the tiny model is trainable and kept gathered.
    const int expected_in_flight = c.overlap_comm ? static_cast<int>(engine.unit_paths().size()) : 0;
    at::Tensor tokens =
        at::stack({tiny::synthetic_sample(0, ctx.rank(), model_config), tiny::synthetic_sample(1, ctx.rank(), model_config)});
    for (int step = 0; step < 2; ++step) {
      accelerator.backward(prepared(tokens).mean());
      accelerator.step();
      EXPECT_EQ(engine.gathers_in_flight(), expected_in_flight) << "step " << step;
      accelerator.zero_grad();
    }
    if (!c.overlap_comm) {
      EXPECT_GT(expect_module_holds_stepped_values(*kept_handle, engine), 0);
      return;
    }
    { torch::NoGradGuard no_grad; (void)prepared(tokens); }
    EXPECT_EQ(engine.gathers_in_flight(), 0);
    accelerator.backward(prepared(tokens).mean());
    accelerator.step();
    ASSERT_GT(engine.gathers_in_flight(), 0);
    auto& module = *prepared.module();
    EXPECT_EQ(engine.gathers_in_flight(), 0);
    EXPECT_GT(expect_module_holds_stepped_values(module, engine), 0);
  });
}

INSTANTIATE_TEST_SUITE_P(DistStages, DistZeroRegather,
                         ::testing::Values(RegatherCase{1, true}, RegatherCase{2, true}, RegatherCase{1, false},
                                           RegatherCase{2, false}),
                         [](const auto& info) {
                           return "stage" + std::to_string(info.param.stage) +
                                  (info.param.overlap_comm ? "_overlap_comm" : "_no_overlap_comm");
                         });

}  // namespace
