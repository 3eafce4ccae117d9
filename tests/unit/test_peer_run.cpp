// run_peer_command (tests/support/peer_python.h): a peer that crashed by a
// signal runs once more; a second crash, and any other failure, is the
// result, and so is a run past its timeout. The peers here are shell scripts
// that count their runs in a file.
#include <chrono>
#include <string>

#include <gtest/gtest.h>

#include "support/peer_python.h"
#include "support/scratch_dir.h"

namespace {

/// Far above the milliseconds these shell peers take.
constexpr std::chrono::seconds kBound{60};

/// A peer that crashes (prints torch's spawn message and fails) on its
/// first `crashes` runs, then succeeds; or, with `plain_failure`, fails
/// without the message every time.
std::string counting_peer(const shardtrain::testing::ScratchDir& scratch, int crashes, bool plain_failure = false) {
  const std::string count = scratch.file("runs");
  return "sh -c 'n=$(cat " + count + " 2>/dev/null || echo 0); echo $((n + 1)) > " + count + "; " +
         (plain_failure ? std::string("echo ValueError: bad peer; exit 1")
                        : "if [ $n -lt " + std::to_string(crashes) +
                              " ]; then echo process 1 terminated with signal SIGABRT; exit 1; fi; echo trained") +
         "'";
}

TEST(UnitPeerRun, APeerThatCrashedByASignalRunsOnceMore) {
  const shardtrain::testing::ScratchDir scratch;
  const auto run = shardtrain::testing::run_peer_command(counting_peer(scratch, 1), scratch.file("peer.log"), kBound);
  EXPECT_EQ(run.result.exit_code, 0) << run.result.output;
  EXPECT_EQ(run.runs, 2);
  EXPECT_EQ(run.result.output, "trained\n");
}

TEST(UnitPeerRun, ASecondCrashAndAnyOtherFailureAreTheResult) {
  {
    const shardtrain::testing::ScratchDir scratch;
    const auto run = shardtrain::testing::run_peer_command(counting_peer(scratch, 2), scratch.file("peer.log"), kBound);
    EXPECT_NE(run.result.exit_code, 0);
    EXPECT_EQ(run.runs, 2);
    EXPECT_NE(run.result.output.find("terminated with signal"), std::string::npos) << run.result.output;
  }
  {
    const shardtrain::testing::ScratchDir scratch;
    const auto run =
        shardtrain::testing::run_peer_command(counting_peer(scratch, 0, /*plain_failure=*/true), scratch.file("peer.log"), kBound);
    EXPECT_NE(run.result.exit_code, 0);
    EXPECT_EQ(run.runs, 1) << "a failure without a crash was run again";
  }
  {
    const shardtrain::testing::ScratchDir scratch;
    const auto run = shardtrain::testing::run_peer_command(counting_peer(scratch, 0), scratch.file("peer.log"), kBound);
    EXPECT_EQ(run.result.exit_code, 0);
    EXPECT_EQ(run.runs, 1);
  }
  {
    // A peer that hangs (after saying a process crashed) is killed at its
    // timeout and not run again.
    const shardtrain::testing::ScratchDir scratch;
    const auto run = shardtrain::testing::run_peer_command(
        "echo process 1 terminated with signal SIGABRT; sleep 30", scratch.file("peer.log"), std::chrono::seconds(1));
    EXPECT_TRUE(run.result.timed_out);
    EXPECT_NE(run.result.exit_code, 0);
    EXPECT_EQ(run.runs, 1);
  }
}

}  // namespace
