// The per-test scratch directory (support/test_scratch.h): the test process
// and its rank processes write into one directory, which is gone after a
// passing test and kept, with its path printed, after a failing one. Checked
// by running a probe test of this binary as a child process, once passing
// and once failing, and looking at what it left.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include <gtest/gtest.h>

#include "support/multirank.h"
#include "support/test_scratch.h"

namespace fs = std::filesystem;

namespace shardtrain::testing {
namespace {

// The probe: run only by the tests below (a disabled test runs only when
// named with --gtest_also_run_disabled_tests).
TEST(DistHarnessScratch, DISABLED_Probe) {
  const fs::path dir = test_scratch_dir();
  if (!is_rank_process()) std::printf("probe scratch: %s\n", dir.c_str());
  std::ofstream(dir / "parent.txt") << "written before the ranks start\n";
  run_on_ranks(2, [dir](RankContext& ctx) {
    EXPECT_EQ(test_scratch_dir(), dir);
    EXPECT_TRUE(fs::exists(dir / "parent.txt"));
    std::ofstream(dir / ("rank" + std::to_string(ctx.rank()) + ".txt")) << ctx.rank() << "\n";
  });
  EXPECT_TRUE(fs::exists(dir / "rank0.txt"));
  EXPECT_TRUE(fs::exists(dir / "rank1.txt"));
  EXPECT_EQ(test_scratch_subdir("sub"), dir / "sub");
  EXPECT_TRUE(fs::is_directory(dir / "sub"));
  if (std::getenv("PROBE_FAILS") != nullptr) ADD_FAILURE() << "the probe fails on purpose";
}

struct ProbeRun {
  CommandResult result;
  fs::path scratch;
};

ProbeRun run_probe(bool fails) {
  ProbeRun run;
  run.result = run_command(std::string(fails ? "PROBE_FAILS=1 " : "") + "/proc/" + std::to_string(::getpid()) +
                               "/exe --gtest_filter=DistHarnessScratch.DISABLED_Probe "
                               "--gtest_also_run_disabled_tests 2>&1",
                           std::chrono::seconds(120));
  std::smatch match;
  if (std::regex_search(run.result.output, match, std::regex("probe scratch: (\\S+)"))) run.scratch = match[1].str();
  return run;
}

TEST(DistHarnessScratch, RanksWriteIntoTheTestsDirectoryWhichAPassingTestRemoves) {
  const ProbeRun run = run_probe(false);
  ASSERT_EQ(run.result.exit_code, 0) << run.result.output;
  ASSERT_FALSE(run.scratch.empty()) << run.result.output;
  // Under gtest's temporary directory, named after the test, so a kept one is easy to place.
  EXPECT_EQ(run.scratch.parent_path(), fs::path(::testing::TempDir()).parent_path());
  EXPECT_EQ(run.scratch.filename().string().rfind("shardtrain-DistHarnessScratch.DISABLED_Probe-", 0), 0u)
      << run.scratch;
  EXPECT_FALSE(fs::exists(run.scratch)) << "a passing test left " << run.scratch;
}

TEST(DistHarnessScratch, AFailingTestKeepsItsDirectoryAndNamesIt) {
  const ProbeRun run = run_probe(true);
  EXPECT_NE(run.result.exit_code, 0) << run.result.output;
  ASSERT_FALSE(run.scratch.empty()) << run.result.output;
  EXPECT_NE(run.result.output.find("kept for the failed test: " + run.scratch.string()), std::string::npos)
      << run.result.output;
  for (const char* name : {"parent.txt", "rank0.txt", "rank1.txt"}) {
    EXPECT_TRUE(fs::exists(run.scratch / name)) << name;
  }
  fs::remove_all(run.scratch);
}

}  // namespace
}  // namespace shardtrain::testing
