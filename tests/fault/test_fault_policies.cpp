// What a run does when something goes wrong mid-training: a checkpoint save
// that fails (injected write errors at every phase, ENOSPC/EACCES/EIO, and a
// real full tmpfs) costs that checkpoint and nothing else; inf/NaN gradients
// in bf16/fp32 skip the step or stop the run; fp16 overflow on every step ends
// at min_loss_scale with an error; and ranks that would train different
// configs or models are stopped in prepare().

#include <sys/statvfs.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "accelerator_internals.h"
#include "checkpoint/checkpoint.h"
#include "shardtrain/accelerator.h"
#include "shardtrain/error.h"
#include "support/multirank.h"
#include "support/run_outputs.h"
#include "support/scoped_environment.h"
#include "support/test_scratch.h"
#include "support/tiny_compare.h"
#include "tiny/tiny_model.h"
#include "tiny/tiny_train.h"

namespace {

namespace fs = std::filesystem;
using shardtrain::MixedPrecision;
using shardtrain::testing::accelerator_for;
using shardtrain::testing::micro_batch;
using shardtrain::testing::RankContext;
using shardtrain::testing::run_on_ranks;
using shardtrain::testing::ScopedEnvironment;
using shardtrain::testing::zero_test_config;

/// A small training loop on the tiny model, one call per optimizer step.
struct TinyLoop {
  std::unique_ptr<shardtrain::Accelerator> accelerator;
  tiny::TinyConfig model_config;
  tiny::TinyModel model{nullptr};
  std::optional<shardtrain::PreparedModel<tiny::TinyModel>> prepared;
  int rank = 0;

  TinyLoop(const shardtrain::TrainingConfig& config, RankContext& ctx) : rank(ctx.rank()) {
    accelerator = accelerator_for(config, ctx);
    torch::manual_seed(0);
    model = tiny::TinyModel(model_config);
    prepared.emplace(accelerator->prepare(model, {}, micro_batch(2)));
  }
  /// One step on the batch of `step`; `loss_factor` multiplies this rank's loss.
  double step(int step, double loss_factor = 1.0) {
    at::Tensor tokens = at::stack({tiny::synthetic_sample(0, 4 * step + 2 * rank, model_config),
                                   tiny::synthetic_sample(0, 4 * step + 2 * rank + 1, model_config)});
    at::Tensor logits = (*prepared)(tokens);
    at::Tensor loss = tiny::next_token_loss(logits, tokens) * loss_factor;
    accelerator->backward(loss);
    accelerator->step();
    accelerator->zero_grad();
    return loss.item<double>();
  }
  std::vector<at::Tensor> parameters() {
    std::vector<at::Tensor> values;
    for (auto& [name, value] : shardtrain::AcceleratorInternals::engine(*accelerator).full_state_dict()) {
      values.push_back(value.clone());
    }
    return values;
  }
};

bool same_tensors(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!at::equal(a[i], b[i])) return false;
  }
  return true;
}

std::vector<std::string> leftovers(const fs::path& dir) {
  std::vector<std::string> found;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name[0] == '.' || name.find(".tmp") != std::string::npos) found.push_back(name);
  }
  return found;
}

// ---- 1. a failed save costs one checkpoint, not the run

TEST(FaultCheckpointSave, AFailedSaveAtAnyPhaseOnAnyRankCostsOneCheckpointAndNotTheRun) {
  struct Injection {
    const char* spec;
    const char* reason;
  };
  const std::vector<Injection> injections = {
      {"rank_file:1:28", "No space left on device"}, {"rank_file:0:13", "Permission denied"},
      {"rank_manifest:1:5", "Input/output error"},   {"index:0:28", "No space left on device"},
      {"latest:0:5", "Input/output error"},
  };
  run_on_ranks(2, [&](RankContext& ctx) {
    // Reference: the same five steps with no save at all.
    std::vector<double> expected;
    {
      TinyLoop loop(zero_test_config(3, MixedPrecision::kNo), ctx);
      for (int step = 0; step < 5; ++step) expected.push_back(loop.step(step));
    }
    for (const auto& injection : injections) {
      const fs::path dir = shardtrain::testing::test_scratch_dir() / "failed-save" / injection.spec;
      if (ctx.rank() == 0) {
        fs::remove_all(dir);
        fs::create_directories(dir);
      }
      ctx.comm->barrier();
      TinyLoop loop(zero_test_config(3, MixedPrecision::kNo), ctx);
      std::vector<double> losses;
      for (int step = 0; step < 2; ++step) losses.push_back(loop.step(step));
      ASSERT_FALSE(loop.accelerator->save_state(dir.string()).empty());
      losses.push_back(loop.step(2));
      const auto before = loop.parameters();
      std::string failed;
      {
        const ScopedEnvironment fail_at{{"SHARDTRAIN_CHECKPOINT_FAIL_AT", injection.spec}};
        failed = loop.accelerator->save_state(dir.string());
      }
      EXPECT_EQ(failed, "") << injection.spec << ": the save must report failure on every rank";
      ctx.comm->barrier();
      EXPECT_EQ(shardtrain::testing::read_latest_tag(dir), "step_2") << injection.spec;
      EXPECT_FALSE(fs::exists(dir / "step_3")) << injection.spec;
      EXPECT_TRUE(leftovers(dir).empty()) << injection.spec << ": left " << leftovers(dir).size() << " entries";
      EXPECT_TRUE(same_tensors(before, loop.parameters())) << injection.spec << ": the save changed the model";
      // Training goes on as if no save had been tried, and the next save works.
      for (int step = 3; step < 5; ++step) losses.push_back(loop.step(step));
      EXPECT_EQ(losses, expected) << injection.spec;
      EXPECT_EQ(loop.accelerator->save_state(dir.string()), (dir / "step_5").string()) << injection.spec;
      EXPECT_EQ(shardtrain::testing::read_latest_tag(dir), "step_5");
      // The previous complete checkpoint still loads, in a fresh run.
      TinyLoop resumed(zero_test_config(3, MixedPrecision::kNo), ctx);
      resumed.accelerator->load_state(dir.string(), "step_2");
      EXPECT_EQ(resumed.accelerator->last_step().step, 2);
    }
  });
}

TEST(FaultCheckpointSave, CheckpointOnErrorStopThrowsOnEveryRankWithTheSameCleanState) {
  run_on_ranks(2, [&](RankContext& ctx) {
    const fs::path dir = shardtrain::testing::test_scratch_dir() / "failed-save-stop";
    if (ctx.rank() == 0) {
      fs::remove_all(dir);
      fs::create_directories(dir);
    }
    ctx.comm->barrier();
    auto config = zero_test_config(2, MixedPrecision::kBf16);
    config.checkpoint_on_error = shardtrain::CheckpointErrorPolicy::kStop;
    TinyLoop loop(config, ctx);
    loop.step(0);
    ASSERT_FALSE(loop.accelerator->save_state(dir.string()).empty());
    loop.step(1);
    {
      const ScopedEnvironment fail_at{{"SHARDTRAIN_CHECKPOINT_FAIL_AT", "rank_file:1:28"}};
      try {
        loop.accelerator->save_state(dir.string());
        ADD_FAILURE() << "rank " << ctx.rank() << ": checkpoint_on_error: stop did not throw";
      } catch (const shardtrain::CheckpointSaveError& e) {
        const std::string what = e.what();
        // Both ranks name the rank that failed and its reason.
        EXPECT_NE(what.find("rank 1: writing"), std::string::npos) << what;
        EXPECT_NE(what.find("No space left on device"), std::string::npos) << what;
        EXPECT_NE(what.find("latest: step_1"), std::string::npos) << what;
      }
    }
    ctx.comm->barrier();
    EXPECT_EQ(shardtrain::testing::read_latest_tag(dir), "step_1");
    EXPECT_TRUE(leftovers(dir).empty());
  });
}

/// Whether this process may mount a tmpfs (root with CAP_SYS_ADMIN).
bool can_mount_tmpfs() {
  const fs::path mount = shardtrain::testing::test_scratch_dir() / "tmpfs-probe";
  fs::create_directories(mount);
  const bool mounted = std::system(("mount -t tmpfs -o size=64k tmpfs '" + mount.string() + "' 2>/dev/null").c_str()) == 0;
  if (mounted) std::system(("umount '" + mount.string() + "'").c_str());
  fs::remove_all(mount);
  return mounted;
}

/// Bytes of the regular files under `dir`.
uintmax_t bytes_under(const fs::path& dir) {
  uintmax_t bytes = 0;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (entry.is_regular_file()) bytes += entry.file_size();
  }
  return bytes;
}

TEST(FaultCheckpointSave, AFullTmpfsFailsTheSaveFreesItsSpaceAndTrainingGoesOn) {
  if (!shardtrain::testing::is_rank_process() && !can_mount_tmpfs()) {
    GTEST_SKIP() << "cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN); the injected failures above "
                    "cover the same paths";
  }
  run_on_ranks(2, [&](RankContext& ctx) {
    const fs::path base = shardtrain::testing::test_scratch_dir() / "tmpfs-save";
    const fs::path dir = base / "mnt";
    TinyLoop loop(zero_test_config(3, MixedPrecision::kNo), ctx);
    loop.step(0);
    // Room for one checkpoint (measured on a normal disk) and half of another.
    if (ctx.rank() == 0) {
      fs::remove_all(base);
      fs::create_directories(base / "probe");
    }
    ctx.comm->barrier();
    const std::string probe = loop.accelerator->save_state((base / "probe").string());
    ASSERT_FALSE(probe.empty());
    uintmax_t checkpoint_bytes = 0;
    for (const auto& entry : fs::recursive_directory_iterator(probe)) {
      if (entry.is_regular_file()) checkpoint_bytes += entry.file_size();
    }
    if (ctx.rank() == 0) {
      fs::create_directories(dir);
      const uintmax_t size = (checkpoint_bytes * 3 / 2 + 65535) / 4096 * 4096;
      ASSERT_EQ(std::system(("mount -t tmpfs -o size=" + std::to_string(size) + " tmpfs '" + dir.string() + "'").c_str()),
                0);
    }
    ctx.comm->barrier();
    ASSERT_FALSE(loop.accelerator->save_state(dir.string()).empty()) << "the first checkpoint fits";
    loop.step(1);
    struct statvfs before {};
    ::statvfs(dir.c_str(), &before);
    EXPECT_EQ(loop.accelerator->save_state(dir.string()), "") << "the second one does not";
    ctx.comm->barrier();
    struct statvfs after {};
    ::statvfs(dir.c_str(), &after);
    EXPECT_EQ(after.f_bfree, before.f_bfree) << "the failed save's partial files must not keep the disk full";
    EXPECT_EQ(shardtrain::testing::read_latest_tag(dir), "step_1");
    EXPECT_TRUE(leftovers(dir).empty());
    const double loss = loop.step(2);
    EXPECT_TRUE(std::isfinite(loss)) << "training goes on";
    ctx.comm->barrier();
    if (ctx.rank() == 0) {
      std::system(("umount '" + dir.string() + "'").c_str());
      fs::remove_all(base);
    }
  });
}

TEST(FaultCheckpointSave, AnExportNeedsOnlyItsOwnSizeOnDiskAndAFullDiskFailsItCleanly) {
  // save_model used to write a full optimizer checkpoint (12 bytes per
  // parameter) before the export (4 in fp32): it failed on a disk with room
  // for the export alone.
  if (!shardtrain::testing::is_rank_process() && !can_mount_tmpfs()) {
    GTEST_SKIP() << "cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)";
  }
  run_on_ranks(2, [&](RankContext& ctx) {
    const fs::path base = shardtrain::testing::test_scratch_dir() / "tmpfs-export";
    TinyLoop loop(zero_test_config(3, MixedPrecision::kNo), ctx);
    loop.step(0);
    if (ctx.rank() == 0) {
      fs::remove_all(base);
      fs::create_directories(base / "fits");
      fs::create_directories(base / "full");
    }
    ctx.comm->barrier();
    loop.accelerator->save_model((base / "probe").string(), "fp32");
    const uintmax_t export_bytes = bytes_under(base / "probe");
    // tmpfs counts whole pages per file: the export's files, rounded up, and one spare page each.
    uintmax_t pages = 0;
    for (const auto& entry : fs::directory_iterator(base / "probe")) pages += entry.file_size() / 4096 + 2;
    if (ctx.rank() == 0) {
      ASSERT_EQ(std::system(("mount -t tmpfs -o size=" + std::to_string(pages * 4096) + " tmpfs '" +
                             (base / "fits").string() + "'").c_str()), 0);
      ASSERT_EQ(std::system(("mount -t tmpfs -o size=" + std::to_string(export_bytes / 2 / 4096 * 4096) + " tmpfs '" +
                             (base / "full").string() + "'").c_str()), 0);
    }
    ctx.comm->barrier();
    loop.accelerator->save_model((base / "fits" / "hf").string(), "fp32");
    EXPECT_EQ(bytes_under(base / "fits" / "hf"), export_bytes) << "the export fits where only the export fits";
    try {
      loop.accelerator->save_model((base / "full" / "hf").string(), "fp32");
      ADD_FAILURE() << "an export larger than the disk succeeded";
    } catch (const shardtrain::CheckpointSaveError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("save_model to " + (base / "full" / "hf").string() + " failed on rank 0"),
                std::string::npos) << message;
      EXPECT_NE(message.find("No space left on device"), std::string::npos) << message;
    }
    ctx.comm->barrier();
    EXPECT_TRUE(fs::is_empty(base / "full")) << "the failed export left files behind";
    EXPECT_TRUE(std::isfinite(loop.step(1))) << "training goes on";
    ctx.comm->barrier();
    if (ctx.rank() == 0) {
      std::system(("umount '" + (base / "fits").string() + "'").c_str());
      std::system(("umount '" + (base / "full").string() + "'").c_str());
      fs::remove_all(base);
    }
  });
}

// ---- 3. inf/NaN gradients and fp16 overflow

TEST(FaultNonFinite, ANanLossSkipsTheStepLeavesTheWeightsAndCountsItOrStopsTheRun) {
  run_on_ranks(2, [&](RankContext& ctx) {
    for (const MixedPrecision precision : {MixedPrecision::kBf16, MixedPrecision::kNo}) {
      for (const double clip : {0.0, 1.0}) {  // with clipping the norm answers; without, a check pass does
        auto config = zero_test_config(3, precision, 1, clip);
        TinyLoop loop(config, ctx);
        loop.step(0);
        const auto before = loop.parameters();
        // Only rank 1's loss is NaN: the reduced gradients are NaN on every rank.
        loop.step(1, ctx.rank() == 1 ? std::numeric_limits<double>::quiet_NaN() : 1.0);
        const auto& info = loop.accelerator->last_step();
        EXPECT_TRUE(info.skipped && info.non_finite) << "clip " << clip;
        EXPECT_EQ(info.non_finite_total, 1);
        EXPECT_EQ(info.step, 1) << "a skipped step is not counted";
        EXPECT_TRUE(same_tensors(before, loop.parameters())) << "the NaN reached the weights (clip " << clip << ")";
        EXPECT_TRUE(std::isfinite(loop.step(2)));
        EXPECT_FALSE(loop.accelerator->last_step().skipped);
        EXPECT_EQ(loop.accelerator->last_step().step, 2);
      }
    }
    auto stop = zero_test_config(3, MixedPrecision::kBf16);
    stop.non_finite_policy = shardtrain::NonFinitePolicy::kStop;
    TinyLoop loop(stop, ctx);
    loop.step(0);
    const auto before = loop.parameters();
    try {
      loop.step(1, std::numeric_limits<double>::infinity());
      ADD_FAILURE() << "non_finite_policy: stop did not throw";
    } catch (const shardtrain::Error& e) {
      EXPECT_NE(std::string(e.what()).find("non_finite_policy: stop"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(same_tensors(before, loop.parameters())) << "the run stopped with the last good weights";
  });
}

TEST(FaultNonFinite, Fp16OverflowOnEveryStepLowersTheScaleToItsMinimumThenStops) {
  run_on_ranks(2, [&](RankContext& ctx) {
    auto config = zero_test_config(2, MixedPrecision::kFp16);
    config.fp16.initial_scale_power = 3;  // 8, 4, 2, 1
    config.fp16.hysteresis = 1;
    config.fp16.min_loss_scale = 1;
    TinyLoop loop(config, ctx);
    std::vector<double> scales;
    std::string error;
    for (int step = 0; step < 10 && error.empty(); ++step) {
      try {
        loop.step(step, std::numeric_limits<double>::infinity());
        scales.push_back(loop.accelerator->last_step().loss_scale);
      } catch (const shardtrain::Error& e) {
        error = e.what();
      }
    }
    // Each overflow halves the scale; the step that overflows at scale 1 (the
    // minimum) cannot lower it again and ends the run, as DeepSpeed's
    // raise_error_at_min_scale does.
    EXPECT_EQ(scales, (std::vector<double>{8, 4, 2}));
    EXPECT_NE(error.find("already at fp16.min_loss_scale (1)"), std::string::npos) << "no error at the minimum: " << error;
  });
}

// ---- 2. ranks that disagree are stopped at prepare()

std::string policy_prepare_error(const shardtrain::TrainingConfig& config, RankContext& ctx, int64_t hidden,
                          std::optional<uint64_t> seed = std::nullopt) {
  auto accelerator = accelerator_for(config, ctx);
  tiny::TinyConfig model_config;
  model_config.hidden = hidden;
  torch::manual_seed(0);
  tiny::TinyModel model(model_config);
  shardtrain::RunInfo run = micro_batch(2);
  run.seed = seed;
  try {
    accelerator->prepare(model, {}, run);
  } catch (const shardtrain::ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(FaultRankAgreement, ADifferentConfigModelOrSeedOnOneRankIsAnErrorNamingTheFirstDifference) {
  run_on_ranks(2, [&](RankContext& ctx) {
    tiny::TinyConfig defaults;
    const bool odd = ctx.rank() == 1;
    const std::string stage = policy_prepare_error(zero_test_config(odd ? 2 : 3, MixedPrecision::kBf16), ctx, defaults.hidden);
    EXPECT_NE(stage.find("ranks disagree on the resolved config"), std::string::npos) << stage;
    EXPECT_NE(stage.find("rank 0 has '  stage: 3'"), std::string::npos) << stage;
    EXPECT_NE(stage.find("rank 1 has '  stage: 2'"), std::string::npos) << stage;

    const std::string dtype = policy_prepare_error(zero_test_config(3, odd ? MixedPrecision::kNo : MixedPrecision::kBf16),
                                            ctx, defaults.hidden);
    EXPECT_NE(dtype.find("mixed_precision"), std::string::npos) << dtype;

    const std::string model =
        policy_prepare_error(zero_test_config(3, MixedPrecision::kBf16), ctx, odd ? defaults.hidden * 2 : defaults.hidden);
    EXPECT_NE(model.find("ranks disagree on the model"), std::string::npos) << model;
    EXPECT_NE(model.find("param "), std::string::npos) << model;

    const std::string seed =
        policy_prepare_error(zero_test_config(3, MixedPrecision::kBf16), ctx, defaults.hidden, odd ? 2u : 1u);
    EXPECT_NE(seed.find("rank 0 has 'seed: 1' and rank 1 has 'seed: 2'"), std::string::npos) << seed;

    EXPECT_EQ(policy_prepare_error(zero_test_config(3, MixedPrecision::kBf16), ctx, defaults.hidden, 7u), "")
        << "identical ranks pass";
  });
}

}  // namespace
