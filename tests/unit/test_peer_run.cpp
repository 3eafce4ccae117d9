// run_peer_command (tests/support/peer_python.h): a peer that crashed by a
// signal runs once more; a second crash, and any other failure, is the
// result. The peers here are shell scripts that count their runs in a file.
#include <string>

#include <gtest/gtest.h>

#include "support/peer_python.h"
#include "support/scratch_dir.h"

namespace {

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
  const auto run = shardtrain::testing::run_peer_command(counting_peer(scratch, 1), scratch.file("peer.log"));
  EXPECT_EQ(run.status, 0) << run.output;
  EXPECT_EQ(run.runs, 2);
  EXPECT_EQ(run.output, "trained\n");
}

TEST(UnitPeerRun, ASecondCrashAndAnyOtherFailureAreTheResult) {
  {
    const shardtrain::testing::ScratchDir scratch;
    const auto run = shardtrain::testing::run_peer_command(counting_peer(scratch, 2), scratch.file("peer.log"));
    EXPECT_NE(run.status, 0);
    EXPECT_EQ(run.runs, 2);
    EXPECT_NE(run.output.find("terminated with signal"), std::string::npos) << run.output;
  }
  {
    const shardtrain::testing::ScratchDir scratch;
    const auto run =
        shardtrain::testing::run_peer_command(counting_peer(scratch, 0, /*plain_failure=*/true), scratch.file("peer.log"));
    EXPECT_NE(run.status, 0);
    EXPECT_EQ(run.runs, 1) << "a failure without a crash was run again";
  }
  {
    const shardtrain::testing::ScratchDir scratch;
    const auto run = shardtrain::testing::run_peer_command(counting_peer(scratch, 0), scratch.file("peer.log"));
    EXPECT_EQ(run.status, 0);
    EXPECT_EQ(run.runs, 1);
  }
}

}  // namespace
