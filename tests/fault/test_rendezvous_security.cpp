// The rendezvous of a running job: its store listens on MASTER_ADDR only, and
// a process without the job's token (a bare TCP client speaking the
// protocol, or shardtrain's own client with a wrong token) is refused with a
// clear error while the job goes on.

#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "comm/rendezvous/store.h"
#include "shardtrain/error.h"
#include "support/multirank.h"
#include "support/contains.h"

namespace {

using shardtrain::testing::RankContext;

using shardtrain::testing::contains;

TEST(FaultRendezvous, IntrudersAreRefusedAndTheJobGoesOn) {
  shardtrain::testing::run_on_ranks(2, [](RankContext& ctx) {
    const int port = ctx.env.master_port;
    if (ctx.rank() == 0) {
      // MASTER_ADDR is 127.0.0.1: nothing off this machine can reach the store.
      EXPECT_EQ(shardtrain::testing::listening_ipv4_address(port), "0100007F");
    }
    ctx.comm->barrier();
    if (ctx.rank() == 1) {
      // A separate process with no token: bash speaks the handshake with a
      // zero nonce, a zero MAC and an empty job id (the job's own, so only the
      // token can refuse it), and prints what the store answers.
      const std::string intruder =
          "bash -c 'exec 3<>/dev/tcp/127.0.0.1/" + std::to_string(port) +
          " && printf STRDZV02 >&3 && head -c 65 /dev/zero >&3 && timeout 5 cat <&3'";
      const auto refused = shardtrain::testing::run_command(intruder, std::chrono::seconds(20));
      EXPECT_FALSE(refused.timed_out) << refused.output;
      EXPECT_TRUE(contains(refused.output, "wrong or missing rendezvous token")) << refused.output;
      // shardtrain's own client with a wrong token.
      try {
        shardtrain::comm::rendezvous::RendezvousStore stranger({"127.0.0.1", port, "not-this-jobs-token"},
                                                               std::chrono::seconds(5));
        ADD_FAILURE() << "a client with a wrong token joined the store";
      } catch (const shardtrain::ConfigError& e) {
        EXPECT_TRUE(contains(e.what(), "refused this process")) << e.what();
      }
    }
    // The job goes on: a collective after the intrusions gives the right sum.
    at::Tensor t = at::full({4}, static_cast<double>(ctx.rank() + 1));
    ctx.comm->all_reduce(t);
    EXPECT_TRUE(at::equal(t, at::full({4}, 3.0))) << t;
  });
}

TEST(FaultRendezvous, RankWithTheWrongTokenIsStoppedAtStart) {
  shardtrain::testing::MultiRankOptions options;
  options.skip_init = true;
  shardtrain::testing::run_on_ranks(2, [](RankContext& ctx) {
    shardtrain::InitOptions init;
    init.backend = "gloo";
    init.timeout = std::chrono::milliseconds(3000);
    shardtrain::DistEnv env = ctx.env;
    if (ctx.rank() == 1) {
      env.rdzv_token = "a-different-token";
      try {
        shardtrain::init_distributed(env, init);
        ADD_FAILURE() << "rank 1 joined with a wrong token";
      } catch (const shardtrain::ConfigError& e) {
        EXPECT_TRUE(contains(e.what(), "refused this process")) << e.what();
      }
      return;
    }
    try {
      shardtrain::init_distributed(env, init);
      ADD_FAILURE() << "rank 0 completed a rendezvous that rank 1 was refused from";
    } catch (const shardtrain::TimeoutError& e) {
      EXPECT_TRUE(contains(e.what(), "only 1 did")) << e.what();
    }
  }, options);
}

}  // namespace
