// Hang forensics: when ranks stop calling the same collectives, the error
// names where they diverged and what each rank was doing there, within the
// collective timeout, instead of "all_gather timed out". The two classic
// mistakes: a rank-dependent branch that skips one unit's forward, and a
// collective API (save_state) called inside `if (is_main_process)`.


#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shardtrain/accelerator.h"
#include "shardtrain/error.h"
#include "support/multirank.h"
#include "support/test_scratch.h"
#include "support/tiny_compare.h"
#include "tiny/tiny_model.h"
#include "tiny/tiny_train.h"
#include "support/contains.h"

namespace {

namespace fs = std::filesystem;
using shardtrain::MixedPrecision;
using shardtrain::testing::RankContext;
using Clock = std::chrono::steady_clock;

constexpr auto kCommTimeout = std::chrono::milliseconds(3000);

using shardtrain::testing::contains;

shardtrain::testing::MultiRankOptions forensic_options() {
  shardtrain::testing::MultiRankOptions options;
  options.comm_timeout = kCommTimeout;
  options.timeout = std::chrono::seconds(120);
  return options;
}

/// The longest an error may take: the collective timeout (Gloo's own, or
/// GlooWork's 5 s after it), then the report's two windows of at most the
/// timeout each (collecting the logs, then waiting until every rank has read
/// them), and 2 s for scheduling on a loaded 2-core machine.
double error_deadline_s() { return 3 * std::chrono::duration<double>(kCommTimeout).count() + 5.0 + 2.0; }

at::Tensor batch_of(int step, int rank, const tiny::TinyConfig& config) {
  return at::stack({tiny::synthetic_sample(0, 4 * step + 2 * rank, config),
                    tiny::synthetic_sample(0, 4 * step + 2 * rank + 1, config)});
}


/// The tiny model under ZeRO-3 on this rank.
struct TinyJob {
  std::unique_ptr<shardtrain::Accelerator> accelerator;
  tiny::TinyConfig config;
  tiny::TinyModel model{nullptr};
  std::optional<shardtrain::PreparedModel<tiny::TinyModel>> prepared;

  explicit TinyJob(RankContext& ctx)
      : accelerator(shardtrain::testing::accelerator_for(shardtrain::testing::zero_test_config(3, MixedPrecision::kNo),
                                                         ctx)) {
    torch::manual_seed(0);
    model = tiny::TinyModel(config);
    prepared.emplace(accelerator->prepare(model, {}, shardtrain::testing::micro_batch(2)));
  }
};

TEST(FaultHangReport, RankThatSkipsAUnitForwardIsNamedWithTheUnits) {
  shardtrain::testing::run_on_ranks(2, [](RankContext& ctx) {
    TinyJob job(ctx);
    auto& accelerator = job.accelerator;
    const auto& config = job.config;
    const auto start = Clock::now();
    try {
      for (int step = 0; step < 3; ++step) {
        at::Tensor tokens = batch_of(step, ctx.rank(), config);
        at::Tensor logits = job.prepared->run([&](tiny::TinyModel& m) {
          at::Tensor positions = at::arange(tokens.size(1), tokens.options());
          at::Tensor h = m->embed(tokens) + m->position(positions).unsqueeze(0);
          for (std::size_t i = 0; i < m->blocks->size(); ++i) {
            if (ctx.rank() == 1 && i == 1) continue;  // the rank-dependent branch under test
            h = m->blocks[i]->as<tiny::TinyBlock>()->forward(h);
          }
          return m->head(tiny::rms_norm(h, m->norm_f)).to(at::kFloat);
        });
        accelerator->backward(tiny::next_token_loss(logits, tokens));
        accelerator->step();
        accelerator->zero_grad();
      }
      ADD_FAILURE() << "three steps completed although rank 1 skipped a unit";
    } catch (const shardtrain::Error& e) {
      const std::string what = e.what();
      EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), error_deadline_s()) << what;
      EXPECT_TRUE(contains(what, "hang report")) << what;
      // Rank 1's gather of block 2 met rank 0's gather of block 1: the first
      // collective that differs is named with both units.
      EXPECT_TRUE(contains(what, "the ranks diverge at seq")) << what;
      EXPECT_TRUE(contains(what, "rank 0 is in gather blocks.1 (TinyBlock) > all_gather")) << what;
      EXPECT_TRUE(contains(what, "rank 1 in gather blocks.2 (TinyBlock) > all_gather")) << what;
      EXPECT_TRUE(contains(what, "latest:")) << what;
    }
  }, forensic_options());
}

TEST(FaultHangReport, SaveStateOnRankZeroOnlyIsNamed) {
  shardtrain::testing::run_on_ranks(2, [](RankContext& ctx) {
    TinyJob job(ctx);
    auto& accelerator = job.accelerator;
    auto train_step = [&](int step) {
      at::Tensor tokens = batch_of(step, ctx.rank(), job.config);
      accelerator->backward(tiny::next_token_loss((*job.prepared)(tokens), tokens));
      accelerator->step();
      accelerator->zero_grad();
    };
    train_step(0);
    const fs::path dir = shardtrain::testing::test_scratch_dir() / "checkpoints";
    const auto start = Clock::now();
    try {
      // The classic mistake: save_state is collective, called on one rank.
      if (accelerator->is_main_process()) {
        accelerator->save_state(dir.string());
      } else {
        for (int step = 1; step < 4; ++step) train_step(step);
      }
      ADD_FAILURE() << "rank " << ctx.rank() << " went on although only rank 0 saved";
    } catch (const shardtrain::Error& e) {
      const std::string what = e.what();
      EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), error_deadline_s()) << what;
      EXPECT_TRUE(contains(what, "the ranks diverge at seq")) << what;
      EXPECT_TRUE(contains(what, "rank 0 is in save_state() > ")) << what;
      EXPECT_TRUE(contains(what, "rank 1 in gather ")) << what;
    }
  }, forensic_options());
}

TEST(FaultHangReport, RankOutsideAnyCollectiveIsReportedMissing) {
  shardtrain::testing::run_on_ranks(3, [](RankContext& ctx) {
    at::Tensor t = at::ones({8});
    ctx.comm->all_reduce(t);  // every rank's seq 0
    if (ctx.rank() == 2) {
      // Busy elsewhere (no collective) until the others have given up.
      std::this_thread::sleep_for(std::chrono::milliseconds(3 * kCommTimeout.count() + 4000));
      return;
    }
    try {
      ctx.comm->all_reduce(t);
      ADD_FAILURE() << "all_reduce completed without rank 2";
    } catch (const shardtrain::TimeoutError& e) {
      const std::string what = e.what();
      EXPECT_TRUE(contains(what, "rank 2 is missing: it sent no log")) << what;
      EXPECT_TRUE(contains(what, "no divergence in the logged window")) << what;
      EXPECT_TRUE(contains(what, "at seq 1, all_reduce(sum)(Float, 8 -> 8)")) << what;
    }
  }, forensic_options());
}

}  // namespace
