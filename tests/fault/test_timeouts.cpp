// No hangs: a collective one rank never joins, a rank that dies, and a
// rendezvous that not every rank reaches all end in a clear error within the timeout.
#include <chrono>
#include <thread>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "shardtrain/error.h"
#include "support/multirank.h"

namespace {

using shardtrain::testing::MultiRankOptions;
using shardtrain::testing::RankContext;
using shardtrain::testing::run_on_ranks;
using Clock = std::chrono::steady_clock;

TEST(FaultTimeout, CollectiveThatOneRankNeverJoinsTimesOutOnTheOthers) {
  MultiRankOptions options;
  options.comm_timeout = std::chrono::milliseconds(2000);
  options.timeout = std::chrono::seconds(60);
  run_on_ranks(3, [](RankContext& ctx) {
    if (ctx.rank() == 2) {
      // Alive but absent: stays until the others have given up.
      std::this_thread::sleep_for(std::chrono::seconds(9));
      return;
    }
    at::Tensor t = at::ones({1000}, at::kBFloat16);
    auto start = Clock::now();
    try {
      ctx.comm->all_reduce(t);
      ADD_FAILURE() << "all_reduce returned although rank 2 never joined";
    } catch (const shardtrain::TimeoutError& e) {
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      EXPECT_LT(seconds, 2.0 + 5.0) << "timeout fired late";
      std::string what = e.what();
      EXPECT_NE(what.find("all_reduce(sum)"), std::string::npos) << what;
      EXPECT_NE(what.find("rank " + std::to_string(ctx.rank()) + " of 3"), std::string::npos) << what;
      EXPECT_NE(what.find("BFloat16"), std::string::npos) << what;
      EXPECT_NE(what.find("1000 -> 1000 elements"), std::string::npos) << what;
      EXPECT_NE(what.find("2000 ms"), std::string::npos) << what;
    }
  }, options);
}

TEST(FaultTimeout, RankThatDiesGivesAnErrorNotAHang) {
  MultiRankOptions options;
  options.comm_timeout = std::chrono::milliseconds(3000);
  run_on_ranks(2, [](RankContext& ctx) {
    if (ctx.rank() == 1) {
      shardtrain::testing::mark_rank_body_ran();
      std::_Exit(0);  // dies without a word
    }
    at::Tensor out = at::empty({200});
    auto start = Clock::now();
    EXPECT_THROW(ctx.comm->all_gather(out, at::ones({100})), shardtrain::Error);
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 3.0 + 5.0);
  }, options);
}

TEST(FaultTimeout, RendezvousThatNotEveryRankReachesTimesOut) {
  MultiRankOptions options;
  options.skip_init = true;
  run_on_ranks(2, [](RankContext& ctx) {
    if (ctx.rank() == 1) return;  // never shows up
    shardtrain::InitOptions init;
    init.backend = "gloo";
    init.timeout = std::chrono::milliseconds(1500);
    auto start = Clock::now();
    try {
      shardtrain::init_distributed(ctx.env, init);
      ADD_FAILURE() << "rendezvous completed with a missing rank";
    } catch (const shardtrain::TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("for all 2 ranks"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 1.5 + 5.0);
  }, options);
}

TEST(FaultTimeout, ClientWithNoServerTimesOut) {
  MultiRankOptions options;
  options.skip_init = true;
  run_on_ranks(2, [](RankContext& ctx) {
    if (ctx.rank() == 0) return;  // rank 0 (the store host) is missing
    shardtrain::InitOptions init;
    init.backend = "gloo";
    init.timeout = std::chrono::milliseconds(1500);
    try {
      shardtrain::init_distributed(ctx.env, init);
      ADD_FAILURE() << "joined a rendezvous that has no host";
    } catch (const shardtrain::TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("could not join the rendezvous"), std::string::npos) << e.what();
    }
  }, options);
}

}  // namespace
