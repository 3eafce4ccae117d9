// The Accelerator end to end: every shipped config runs, fp16 loss scaling
// skips overflowing steps, the optimizer and parameter offloads change
// nothing numerically, the stage-3 prefetch trace is rebuilt when the unit
// order changes, an unmarked model runs as one unit, the custom-optimizer
// escape hatch, metric collectives.
#include <filesystem>
#include <mutex>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ringbuffer_sink.h>

#include "accelerator_internals.h"
#include "engine/engine.h"
#include "tiny/reference_adam.h"
#include "shardtrain/accelerator.h"
#include "shardtrain/error.h"
#include "shardtrain/logging.h"
#include "support/log_capture.h"
#include "support/multirank.h"
#include "support/test_scratch.h"
#include "support/tiny_compare.h"
#include "tiny/tiny_train.h"

namespace {

using shardtrain::testing::RankContext;
using shardtrain::testing::run_on_ranks;
using shardtrain::testing::accelerator_for;
using shardtrain::testing::micro_batch;

std::vector<std::string> shipped_configs() {
  std::vector<std::string> files;
  for (const char* dir : {"/configs", "/configs/articles"}) {
    for (const auto& entry : std::filesystem::directory_iterator(std::string(SHARDTRAIN_SOURCE_DIR) + dir)) {
      const std::string ext = entry.path().extension().string();
      if (ext == ".json" || ext == ".yaml" || ext == ".yml") files.push_back(entry.path().string());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

TEST(DistConfigs, EveryShippedConfigTrainsOnTwoRanks) {
  // Includes the configs copied verbatim from the articles (configs/articles).
  run_on_ranks(2, [](RankContext& ctx) {
    int ran = 0;
    const auto configs = shipped_configs();
    for (const auto& path : configs) {
      tiny::TinyRunOptions options;
      options.config_path = path;
      options.steps = 3;
      options.micro_batch = 2;
      options.communicator = ctx.comm;
      options.quiet = true;
      try {
        tiny::TinyRunResult run = tiny::run_tiny(options);
        ASSERT_EQ(run.losses.size(), 3u) << path;
        for (double loss : run.losses) EXPECT_TRUE(std::isfinite(loss)) << path;
        ++ran;
      } catch (const std::exception& e) {
        ADD_FAILURE() << path << ": " << e.what();
      }
    }
    EXPECT_EQ(ran, static_cast<int>(configs.size()));
    EXPECT_GE(configs.size(), 20u) << "configs/ lost files";
  });
}

/// A model small enough to reason about: y = w2(w1 x).
struct PairImpl : torch::nn::Module {
  PairImpl() : first(register_module("first", torch::nn::Linear(4, 8))), second(register_module("second", torch::nn::Linear(8, 1))) {}
  at::Tensor forward(const at::Tensor& x) { return second(first(x)); }
  torch::nn::Linear first, second;
};
TORCH_MODULE(Pair);

shardtrain::TrainingConfig deepspeed(int stage, shardtrain::MixedPrecision precision) {
  shardtrain::TrainingConfig config = shardtrain::testing::zero_test_config(stage, precision);
  config.optimizer.lr = 1e-2;
  return config;
}

TEST(DistFp16, OverflowingStepIsSkippedAndTheScaleFollowsDeepSpeedsRule) {
  run_on_ranks(2, [](RankContext& ctx) {
    auto config = deepspeed(3, shardtrain::MixedPrecision::kFp16);
    config.fp16.initial_scale_power = 4;  // scale 16
    config.fp16.hysteresis = 1;
    auto accelerator_holder = accelerator_for(config, ctx);
    shardtrain::Accelerator& accelerator = *accelerator_holder;
    torch::manual_seed(0);
    Pair model;
    auto prepared = accelerator.prepare(model, {}, micro_batch(2));
    EXPECT_NE(accelerator.precision_plan().notes.find("fp16 on CPU"), std::string::npos);
    EXPECT_EQ(shardtrain::AcceleratorInternals::engine(accelerator).loss_scale(), 16.0);
    at::Tensor x = at::ones({2, 4});
    // Normal step.
    accelerator.backward(prepared(x).pow(2).mean());
    accelerator.step();
    EXPECT_FALSE(accelerator.last_step().skipped);
    EXPECT_EQ(accelerator.last_step().step, 1);
    auto before = accelerator.full_state_dict();
    // A loss whose gradients overflow fp16 (65504) once scaled.
    accelerator.backward(prepared(x).pow(2).mean() * 1e6);
    accelerator.step();
    EXPECT_TRUE(accelerator.last_step().skipped);
    EXPECT_EQ(accelerator.last_step().skipped_total, 1);
    EXPECT_EQ(accelerator.last_step().step, 1);
    EXPECT_EQ(shardtrain::AcceleratorInternals::engine(accelerator).loss_scale(), 8.0) << "hysteresis 1: the first overflow halves the scale";
    auto after = accelerator.full_state_dict();
    for (std::size_t i = 0; i < before.size(); ++i) {
      EXPECT_TRUE(at::equal(before[i].second, after[i].second)) << before[i].first << " changed on a skipped step";
    }
    accelerator.backward(prepared(x).pow(2).mean());
    accelerator.step();
    EXPECT_FALSE(accelerator.last_step().skipped);
    EXPECT_EQ(accelerator.last_step().step, 2);
  });
}

TEST(DistFp16, TinyRunTrainsWithDynamicLossScaling) {
  run_on_ranks(2, [](RankContext& ctx) {
    tiny::TinyRunOptions options;
    options.config_path = std::string(SHARDTRAIN_SOURCE_DIR) + "/configs/zero3_fp16.json";
    options.steps = 30;
    options.lr = 1e-3;
    options.communicator = ctx.comm;
    options.quiet = true;
    tiny::TinyRunResult run = tiny::run_tiny(options);
    EXPECT_LT(run.losses.back(), run.losses.front() * 0.97);
  });
}

// With the model on the CPU the offload has nothing to move: the same losses,
// and no host copy of the gradient or the bf16 partition beside the ones the
// step already reads (6 bytes a trainable element would be waste), nothing
// counted as offloaded, whether the parameters are offloaded too or not.
TEST(DistOffload, OffloadOnTheCpuGivesBitIdenticalLossesAndHoldsNoExtraCopies) {
  run_on_ranks(2, [](RankContext& ctx) {
    auto run = [&](bool offload_optimizer, bool offload_param) {
      auto config = deepspeed(3, shardtrain::MixedPrecision::kBf16);
      if (offload_optimizer) config.zero.offload_optimizer = shardtrain::OffloadDevice::kCpu;
      if (offload_param) config.zero.offload_param = shardtrain::OffloadDevice::kCpu;
      tiny::TinyRunOptions options;
      options.config = config;
      options.steps = 5;
      options.communicator = ctx.comm;
      options.quiet = true;
      return tiny::run_tiny(options);
    };
    const tiny::TinyRunResult on_device = run(false, false);
    for (const bool params_too : {false, true}) {
      SCOPED_TRACE(params_too ? "offload_param and offload_optimizer" : "offload_optimizer");
      const tiny::TinyRunResult offloaded = run(true, params_too);
      EXPECT_EQ(offloaded.losses, on_device.losses);
      EXPECT_EQ(offloaded.memory.grads, on_device.memory.grads);
      EXPECT_EQ(offloaded.memory.params, on_device.memory.params);
      EXPECT_EQ(offloaded.memory.master, on_device.memory.master);
      EXPECT_EQ(offloaded.memory.optimizer, on_device.memory.optimizer);
      EXPECT_EQ(offloaded.memory.offloaded, 0);
    }
  });
}

// SHARDTRAIN_OFFLOAD_ON_CPU=1 gives the offload its host copies on the CPU
// too, so that its copies and its host step run without a GPU. The step is
// the same kernel on copies of the same values, so every case trains bit for
// bit as without offload, also across a save and a resume mid-run (the
// moments saved from and loaded into their host copies):
// - ZeRO-3 bf16 with offload_optimizer: the step writes a host copy of the
//   bf16 partition, uploaded after it;
// - ZeRO-3 bf16 with offload_param as well, FSDP standard and pure bf16 with
//   fsdp_offload_params: the partition itself lives on the host, the step
//   writes it there, each gather uploads its shard first;
// - FSDP pure under NO_SHARD (optimizer only): the step updates a host copy
//   of the model's own partition, brought down before each step; without
//   that the case fails.
// The memory report counts what moved: the device keeps the 16-bit
// partition unless the parameters are offloaded, and nothing else at rest.
TEST(DistOffload, WithItsHostCopiesForcedOnTheCpuTheOffloadTrainsBitForBitAsWithoutIt) {
  shardtrain::testing::MultiRankOptions harness;
  harness.env["SHARDTRAIN_OFFLOAD_ON_CPU"] = "1";
  harness.timeout = std::chrono::seconds(300);
  run_on_ranks(2, [](RankContext& ctx) {
    const std::filesystem::path out = shardtrain::testing::test_scratch_dir();
    struct Case {
      std::string name;
      shardtrain::TrainingConfig config;
      std::string load_dtype;
      bool params_offloaded;
    };
    auto zero3 = deepspeed(3, shardtrain::MixedPrecision::kBf16);
    zero3.zero.offload_optimizer = shardtrain::OffloadDevice::kCpu;
    auto zero3_params = zero3;
    zero3_params.zero.offload_param = shardtrain::OffloadDevice::kCpu;
    auto fsdp = shardtrain::load_config(std::string(SHARDTRAIN_SOURCE_DIR) + "/configs/fsdp_full_shard_bf16.yaml");
    fsdp.fsdp.offload_params = true;
    auto pure = shardtrain::load_config(std::string(SHARDTRAIN_SOURCE_DIR) + "/configs/fsdp_pure_bf16.yaml");
    pure.fsdp.offload_params = true;
    auto pure_no_shard = pure;
    pure_no_shard.fsdp.sharding_strategy = shardtrain::ShardingStrategy::kNoShard;
    const std::vector<Case> cases = {{"zero3", zero3, "fp32", false},
                                     {"zero3_params", zero3_params, "fp32", true},
                                     {"fsdp", fsdp, "fp32", true},
                                     {"fsdp_pure", pure, "bf16", true},
                                     {"fsdp_pure_no_shard", pure_no_shard, "bf16", false}};
    for (const Case& c : cases) {
      SCOPED_TRACE(c.name);
      auto run = [&](bool offload, const std::string& save, const std::string& resume, int stop_after) {
        tiny::TinyRunOptions options;
        options.config = c.config;
        if (!offload) {
          options.config->zero.offload_optimizer = shardtrain::OffloadDevice::kNone;
          options.config->zero.offload_param = shardtrain::OffloadDevice::kNone;
          options.config->fsdp.offload_params = false;
        }
        options.load_dtype = c.load_dtype;
        options.steps = 6;
        options.lr = 1e-3;
        options.communicator = ctx.comm;
        options.quiet = true;
        options.save_dir = save;
        options.save_every = save.empty() ? 0 : 3;
        options.resume_dir = resume;
        options.stop_after = stop_after;
        return tiny::run_tiny(options);
      };
      const tiny::TinyRunResult on_host = run(false, "", "", 0);
      const tiny::TinyRunResult offloaded = run(true, "", "", 0);
      const std::string checkpoints = (out / c.name).string();
      const tiny::TinyRunResult first_half = run(true, checkpoints, "", 3);
      const tiny::TinyRunResult resumed = run(true, checkpoints, checkpoints, 0);
      EXPECT_EQ(offloaded.losses, on_host.losses);
      std::vector<double> halves = first_half.losses;
      halves.insert(halves.end(), resumed.losses.begin(), resumed.losses.end());
      EXPECT_EQ(halves, on_host.losses);
      ASSERT_EQ(resumed.final_params.size(), on_host.final_params.size());
      for (std::size_t k = 0; k < on_host.final_params.size(); ++k) {
        EXPECT_TRUE(at::equal(offloaded.final_params[k].second, on_host.final_params[k].second))
            << on_host.final_params[k].first;
        EXPECT_TRUE(at::equal(resumed.final_params[k].second, on_host.final_params[k].second))
            << on_host.final_params[k].first;
      }
      // The tiny model has no frozen weights: params are the 16-bit partition
      // alone. The gradient partition moved; the partition too, or else it
      // has one host copy more.
      const shardtrain::MemoryReport& before = on_host.memory;
      const shardtrain::MemoryReport& after = offloaded.memory;
      EXPECT_EQ(after.grads, before.grads);
      EXPECT_EQ(after.params, (c.params_offloaded ? 1 : 2) * before.params);
      EXPECT_EQ(after.master, before.master);
      EXPECT_EQ(after.optimizer, before.optimizer);
      EXPECT_EQ(before.offloaded, 0);
      const int64_t on_device = c.params_offloaded ? 0 : before.params;
      EXPECT_EQ(after.offloaded, after.params + after.grads + after.master + after.optimizer - on_device);
      // The precision plan predicts the split from the parameter count; the
      // shards' padding to a multiple of the world size is all it leaves out.
      const shardtrain::PrecisionPlan& plan = offloaded.plan;
      EXPECT_NEAR(static_cast<double>(after.offloaded), plan.host_bytes_per_rank(), 0.05 * plan.host_bytes_per_rank());
      // Nothing at rest on the device under the parameter offload: the plan's
      // subtraction of the same four binary fractions, summed in another
      // order, is exact to a few ulps of the total.
      EXPECT_NEAR(static_cast<double>(on_device), plan.device_bytes_per_rank(),
                  c.params_offloaded ? 4 * 0x1p-52 * plan.total_bytes_per_rank() : 0.05 * plan.device_bytes_per_rank());
    }
  }, harness);
}

/// Two blocks whose call order flips at a chosen forward.
struct FlipBlockImpl : torch::nn::Module, shardtrain::Unit {
  FlipBlockImpl() : Unit("FlipBlock"), linear(register_module("linear", torch::nn::Linear(4, 4))) {}
  at::Tensor forward(const at::Tensor& x) { return run_unit(x, [this](const at::Tensor& h) { return linear(h); }); }
  torch::nn::Linear linear;
};
TORCH_MODULE(FlipBlock);

struct FlipModelImpl : torch::nn::Module {
  FlipModelImpl() : a(register_module("a", FlipBlock())), b(register_module("b", FlipBlock())) {}
  at::Tensor forward(const at::Tensor& x) { return flipped ? a(b(x)) : b(a(x)); }
  FlipBlock a, b;
  bool flipped = false;
};
TORCH_MODULE(FlipModel);

TEST(DistZeroTrace, ChangedUnitOrderRebuildsThePrefetchTraceWithAWarning) {
  run_on_ranks(2, [](RankContext& ctx) {
    auto sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(64);
    shardtrain::logger().sinks().push_back(sink);
    auto accelerator_holder = accelerator_for(deepspeed(3, shardtrain::MixedPrecision::kNo), ctx);
    shardtrain::Accelerator& accelerator = *accelerator_holder;
    FlipModel model;
    auto prepared = accelerator.prepare(model, {}, micro_batch(2));
    at::Tensor x = at::ones({2, 4});
    for (int step = 0; step < 4; ++step) {
      model->flipped = step >= 2;
      accelerator.backward(prepared(x).sum());
      accelerator.step();
    }
    std::string warnings;
    for (const auto& line : sink->last_formatted()) warnings += line;
    EXPECT_NE(warnings.find("unit order changed at forward 3"), std::string::npos) << warnings;
    EXPECT_NE(warnings.find("unit 'b'"), std::string::npos) << warnings;
  });
}

TEST(DistZeroUnmarked, ModelWithoutUnitsRunsAsOneUnitAndMatchesPlainTraining) {
  run_on_ranks(2, [](RankContext& ctx) {
    auto accelerator_holder = accelerator_for(deepspeed(3, shardtrain::MixedPrecision::kNo), ctx);
    shardtrain::Accelerator& accelerator = *accelerator_holder;
    torch::manual_seed(5);
    Pair model;
    torch::manual_seed(5);
    Pair reference;
    // The engines' Adam arithmetic (tiny/reference_adam.h says why not torch::optim::AdamW),
    // without decay: a DeepSpeed AdamW block without weight_decay builds FusedAdam, whose default is 0.
    tiny::ReferenceAdam optimizer(reference->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.0),
                                  /*decoupled=*/true);
    auto prepared = accelerator.prepare(model, {}, micro_batch(2));
    for (int step = 0; step < 5; ++step) {
      at::Tensor all = at::arange(16, at::kFloat).view({4, 4}) / (step + 1);
      accelerator.backward(prepared(all.narrow(0, 2 * ctx.rank(), 2)).pow(2).mean());
      accelerator.step();
      shardtrain::testing::data_parallel_reference_step(*reference, optimizer, 2, [&](int r) {
        return reference->forward(all.narrow(0, 2 * r, 2)).pow(2).mean();
      });
    }
    auto state = accelerator.full_state_dict();
    auto expected = reference->named_parameters();
    for (const auto& [name, value] : state) {  // the same per-rank arithmetic: the same bits
      EXPECT_TRUE(at::equal(value, expected[name]))
          << name << ": max |difference| " << (value - expected[name]).abs().max().item<double>();
    }
  });
}

// The end of the data inside an accumulation window: end_accumulation_early()
// makes the next backward the window's last, as Accelerate syncs at the end
// of a dataloader, each loss still divided by the configured steps. A window
// of 2 of 4 micro-batches then updates exactly as a window of 2 of 2 whose
// losses are halved: the same gradients (every scaling a power of two), so
// the same bits, at ZeRO-1 (gradients held unreduced until the boundary) and
// ZeRO-3.
TEST(DistAccumulation, EndingAWindowEarlyAppliesTheShortWindowsUpdate) {
  run_on_ranks(2, [](RankContext& ctx) {
    for (int stage : {1, 3}) {
      auto batch = [&](int micro) {
        return at::arange(8, at::kFloat).view({2, 4}) / (micro + 1) + ctx.rank();
      };
      torch::manual_seed(3);
      Pair early_model;
      auto early = accelerator_for(shardtrain::testing::zero_test_config(stage, shardtrain::MixedPrecision::kNo, 4),
                                   ctx);
      auto early_prepared = early->prepare(early_model, {}, micro_batch(2));
      early->backward(early_prepared(batch(0)).pow(2).mean());
      EXPECT_FALSE(early->sync_gradients());
      early->end_accumulation_early();
      early->backward(early_prepared(batch(1)).pow(2).mean());
      EXPECT_TRUE(early->sync_gradients()) << "stage " << stage;
      early->step();
      EXPECT_EQ(early->last_step().step, 1) << "stage " << stage;
      // The next window is a full one again.
      for (int micro = 0; micro < 3; ++micro) early->backward(early_prepared(batch(micro)).pow(2).mean());
      EXPECT_FALSE(early->sync_gradients()) << "stage " << stage;

      torch::manual_seed(3);
      Pair halved_model;
      auto halved = accelerator_for(shardtrain::testing::zero_test_config(stage, shardtrain::MixedPrecision::kNo, 2),
                                    ctx);
      auto halved_prepared = halved->prepare(halved_model, {}, micro_batch(2));
      for (int micro = 0; micro < 2; ++micro) halved->backward(halved_prepared(batch(micro)).pow(2).mean() * 0.5);
      halved->step();

      auto expected = halved->full_state_dict();
      auto got = early->full_state_dict();
      ASSERT_EQ(got.size(), expected.size());
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_TRUE(at::equal(got[i].second, expected[i].second)) << "stage " << stage << ", " << got[i].first;
      }
    }
  });
}

TEST(DistCustomOptimizer, AnyTorchOptimizerStepsTheMasterShards) {
  run_on_ranks(2, [](RankContext& ctx) {
    std::vector<std::pair<std::string, at::Tensor>> results[2];
    for (int custom = 0; custom < 2; ++custom) {
      auto config = deepspeed(2, shardtrain::MixedPrecision::kNo);
      config.optimizer.type = "SGD";
      config.optimizer.momentum = 0.9;
      auto accelerator_holder = accelerator_for(config, ctx);
      shardtrain::Accelerator& accelerator = *accelerator_holder;
      torch::manual_seed(1);
      Pair model;
      shardtrain::OptimizerOptions optimizer;
      optimizer.lr = 0.1;
      if (custom) {
        optimizer.custom_factory = [](std::vector<at::Tensor> shards) {
          return std::make_unique<torch::optim::SGD>(shards, torch::optim::SGDOptions(0.1).momentum(0.9));
        };
      }
      shardtrain::RunInfo run;
      run.micro_batch_size = 2;
      auto prepared = accelerator.prepare(model, optimizer, run);
      for (int step = 0; step < 4; ++step) {
        accelerator.backward(prepared(at::ones({2, 4}) * (ctx.rank() + step)).pow(2).mean());
        accelerator.step();
      }
      results[custom] = accelerator.full_state_dict();
    }
    for (std::size_t i = 0; i < results[0].size(); ++i) {
      // The fused SGD evaluates torch::optim::SGD's formula in its order: the same bits.
      EXPECT_TRUE(at::equal(results[0][i].second, results[1][i].second))
          << results[0][i].first << ": max |difference| "
          << (results[0][i].second - results[1][i].second).abs().max().item<double>();
    }
  });
}

// A custom optimizer's own state (Adam's moments and step count) is part of
// a checkpoint: loaded into a fresh run at the same world size after two
// steps, the next two steps give the uninterrupted run's values bit for bit
// (with its state restarted they would not). Loading writes into the
// master, which the custom optimizer made a leaf that requires grad. At
// another world size the state cannot be resharded: the model still loads,
// and the custom optimizer starts fresh on every rank.
TEST(DistCustomOptimizer, ItsStateResumesFromACheckpointAtTheSameWorldSize) {
  // Pair under ZeRO `stage` with a custom Adam, its initial values from `seed`.
  struct Run {
    std::unique_ptr<shardtrain::Accelerator> accelerator;
    shardtrain::PreparedModel<Pair> prepared;
    void steps(int rank, int from, int to) {
      for (int step = from; step < to; ++step) {
        accelerator->backward(prepared(at::ones({2, 4}) * (rank + step)).pow(2).mean());
        accelerator->step();
      }
    }
  };
  auto start = [](RankContext& ctx, int stage, uint64_t seed) {
    auto accelerator = accelerator_for(deepspeed(stage, shardtrain::MixedPrecision::kNo), ctx);
    torch::manual_seed(seed);
    shardtrain::OptimizerOptions adam;
    adam.custom_factory = [](std::vector<at::Tensor> shards) {
      return std::make_unique<torch::optim::Adam>(shards, torch::optim::AdamOptions(0.05));
    };
    auto prepared = accelerator->prepare(Pair(), adam, micro_batch(2));
    return Run{std::move(accelerator), prepared};
  };
  const std::string ckpt = (shardtrain::testing::test_scratch_dir() / "custom_adam").string();
  run_on_ranks(2, [&](RankContext& ctx) {
    std::vector<std::pair<std::string, at::Tensor>> uninterrupted, resumed;
    {
      Run run = start(ctx, 3, 1);
      run.steps(ctx.rank(), 0, 2);
      run.accelerator->save_state(ckpt);
      run.steps(ctx.rank(), 2, 4);
      uninterrupted = run.accelerator->full_state_dict();
    }
    {
      Run run = start(ctx, 3, 2);  // other initial values: everything must come from the checkpoint
      run.accelerator->load_state(ckpt);
      run.steps(ctx.rank(), 2, 4);
      resumed = run.accelerator->full_state_dict();
    }
    ASSERT_EQ(resumed.size(), uninterrupted.size());
    for (std::size_t i = 0; i < resumed.size(); ++i) {
      EXPECT_TRUE(at::equal(resumed[i].second, uninterrupted[i].second))
          << resumed[i].first << ": max |difference| "
          << (resumed[i].second - uninterrupted[i].second).abs().max().item<double>();
    }
  });
  run_on_ranks(1, [&](RankContext& ctx) {
    Run run = start(ctx, 3, 2);
    shardtrain::testing::LogCapture log;
    run.accelerator->load_state(ckpt);  // the model loads; the custom optimizer restarts
    EXPECT_NE(log.text().find("rank 0's custom optimizer state was saved over another layout; the custom "
                              "optimizer starts with a fresh state on every rank"),
              std::string::npos)
        << log.text();
    run.steps(0, 2, 3);
    for (const auto& [name, value] : run.accelerator->full_state_dict()) {
      EXPECT_TRUE(value.isfinite().all().item<bool>()) << name;
    }
  });
  // Replicas (ZeRO-0) saved at world 2 and resumed at world 3: rank 2 has no
  // file of its own, so no rank loads the custom state, and the replicas,
  // stepping the same gradients from the same fresh state, stay equal. (Had
  // ranks 0 and 1 loaded it alone, their copies would drift from rank 2's.)
  const std::string replicas = (shardtrain::testing::test_scratch_dir() / "custom_adam_zero0").string();
  run_on_ranks(2, [&](RankContext& ctx) {
    Run run = start(ctx, 0, 1);
    run.steps(ctx.rank(), 0, 2);
    run.accelerator->save_state(replicas);
  });
  run_on_ranks(3, [&](RankContext& ctx) {
    Run run = start(ctx, 0, 2);
    run.accelerator->load_state(replicas);
    run.steps(ctx.rank(), 2, 4);
    for (const auto& [name, value] : run.accelerator->full_state_dict()) {
      at::Tensor first = value.clone();
      ctx.comm->broadcast(first, 0);
      EXPECT_TRUE(at::equal(value, first)) << name << " on rank " << ctx.rank() << " differs from rank 0's";
    }
  });
}

/// A communicator that claims to move tensors on a GPU (and moves nothing):
/// what an NCCL group looks like to an engine whose model stayed on the CPU.
class GpuClaimingCommunicator final : public shardtrain::comm::Communicator {
 public:
  GpuClaimingCommunicator() : Communicator(0, 1, {0}, shardtrain::comm::CommOptions{}) {}
  std::string backend() const override { return "nccl"; }
  at::Device device() const override { return at::Device(at::kCUDA, 0); }

 protected:
  using WorkPtr = shardtrain::comm::WorkPtr;
  using Event = shardtrain::comm::CollectiveEvent;
  using Op = shardtrain::comm::ReduceOp;
  [[noreturn]] static void unreachable() { throw std::logic_error("no collective may run on this communicator"); }
  WorkPtr do_all_gather(const at::Tensor&, const at::Tensor&, const Event&) override { unreachable(); }
  WorkPtr do_reduce_scatter(const at::Tensor&, const at::Tensor&, Op, const Event&) override { unreachable(); }
  WorkPtr do_reduce_scatter_v(const at::Tensor&, const at::Tensor&, const std::vector<int64_t>&, Op,
                              const Event&) override {
    unreachable();
  }
  WorkPtr do_all_reduce(const at::Tensor&, Op, const Event&) override { unreachable(); }
  WorkPtr do_broadcast(const at::Tensor&, int, const Event&) override { unreachable(); }
  void do_barrier(const Event&) override { unreachable(); }
  std::shared_ptr<Communicator> do_new_group(const std::vector<int>&, int64_t) override { unreachable(); }
};

TEST(DistDevice, AModelOnAnotherDeviceThanTheCommunicatorsIsAConfigErrorAtPrepare) {
  shardtrain::AcceleratorOptions options;
  options.communicator = std::make_shared<GpuClaimingCommunicator>();
  options.print_plan = false;
  shardtrain::Accelerator accelerator(options);
  EXPECT_EQ(accelerator.device(), at::Device(at::kCUDA, 0)) << "the accelerator computes where its communicator moves";
  tiny::TinyModel model(tiny::TinyConfig{});
  try {
    accelerator.prepare(model, {}, micro_batch(2));
    FAIL() << "a CPU model under a GPU communicator must not prepare";
  } catch (const shardtrain::ConfigError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("the model is on cpu but the nccl communicator moves tensors on cuda:0"), std::string::npos)
        << message;
    EXPECT_NE(message.find("model->to(accelerator.device())"), std::string::npos) << message;
  }
}

TEST(DistMetrics, GatherForMetricsAndReduce) {
  run_on_ranks(3, [](RankContext& ctx) {
    shardtrain::AcceleratorOptions options;
    options.communicator = ctx.comm;
    shardtrain::Accelerator accelerator(options);
    at::Tensor mine = at::full({2, 3}, ctx.rank(), at::kInt);
    at::Tensor all = accelerator.gather_for_metrics(mine);
    EXPECT_EQ(all.sizes(), (std::vector<int64_t>{6, 3}));
    EXPECT_EQ(all.scalar_type(), at::kInt);
    EXPECT_TRUE(at::equal(all, at::arange(3, at::kInt).repeat_interleave(2).view({6, 1}).expand({6, 3})));
    at::Tensor value = at::full({1}, static_cast<float>(ctx.rank() + 1));
    EXPECT_FLOAT_EQ(accelerator.reduce(value, "mean").item<float>(), 2.0f);
    EXPECT_FLOAT_EQ(accelerator.reduce(value, "sum").item<float>(), 6.0f);
    EXPECT_FLOAT_EQ(accelerator.reduce(value, "max").item<float>(), 3.0f);
    EXPECT_FLOAT_EQ(value.item<float>(), static_cast<float>(ctx.rank() + 1)) << "reduce must not modify its input";
    EXPECT_THROW(accelerator.reduce(value, "median"), shardtrain::ConfigError);
    EXPECT_TRUE(accelerator.device().is_cpu()) << "gloo computes on the CPU";
    EXPECT_TRUE(accelerator.reduce(value, "sum").device().is_cpu()) << "the result comes back where the input was";
    accelerator.wait_for_everyone();
  });
}

}  // namespace
