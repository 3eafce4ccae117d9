// A save killed at any point leaves the previous checkpoint complete and
// `latest` naming a complete checkpoint; the run resumes from it correctly.
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/multirank.h"
#include "support/run_outputs.h"
#include "support/test_scratch.h"

namespace {

namespace fs = std::filesystem;
using shardtrain::testing::run_command;

std::vector<double> losses_of(const fs::path& metrics) {
  std::vector<double> losses;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) losses.push_back(nlohmann::json::parse(line).at("loss").get<double>());
  }
  return losses;
}

TEST(FaultCheckpointCrash, SaveKilledAtAnyPointLeavesALoadableCheckpoint) {
  const fs::path root = shardtrain::testing::test_scratch_dir();
  auto launch = [&](const fs::path& dir, const std::string& extra, const std::string& env = "") {
    const std::string command = env + " " + std::string(SHARDTRAIN_BIN_DIR) + "/shardtrain launch --num_processes 2 " +
                                "--main_process_port " + std::to_string(shardtrain::testing::pick_free_port()) + " " +
                                SHARDTRAIN_BIN_DIR + "/train_tiny --config " + SHARDTRAIN_SOURCE_DIR +
                                "/configs/zero3_fp32.json --micro-batch 4 --save-dir " + dir.string() +
                                " --save-every 2 " + extra;
    return run_command(command, std::chrono::seconds(120));
  };
  const auto straight = launch(root / "straight", "--steps 4 --metrics-out " + (root / "straight.jsonl").string());
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const auto expected = losses_of(root / "straight.jsonl");
  ASSERT_EQ(expected.size(), 4u);

  for (const char* point : {"after_rank_files", "after_index", "after_rename", "before_latest_rename"}) {
    const fs::path dir = root / point;
    const auto first = launch(dir, "--steps 2");
    ASSERT_EQ(first.exit_code, 0) << first.output;
    ASSERT_EQ(shardtrain::testing::read_latest_tag(dir), "step_2");
    const auto killed = launch(dir, "--steps 4 --resume " + dir.string(),
                               std::string("SHARDTRAIN_CHECKPOINT_KILL_AT=") + point);
    EXPECT_NE(killed.exit_code, 0) << point << ": the save was not killed\n" << killed.output;
    EXPECT_NE(killed.output.find("rank 0"), std::string::npos) << killed.output;
    // `latest` still names the complete step-2 checkpoint.
    EXPECT_EQ(shardtrain::testing::read_latest_tag(dir), "step_2") << point;
    EXPECT_TRUE(fs::exists(dir / "step_2" / "index.json")) << point;
    const fs::path metrics = dir / "resumed.jsonl";
    const auto resumed = launch(dir, "--steps 4 --resume " + dir.string() + " --metrics-out " + metrics.string());
    ASSERT_EQ(resumed.exit_code, 0) << point << "\n" << resumed.output;
    const auto losses = losses_of(metrics);
    ASSERT_EQ(losses.size(), 2u) << point;
    EXPECT_EQ(losses[0], expected[2]) << point << ": step 3 after resuming";
    EXPECT_EQ(losses[1], expected[3]) << point << ": step 4 after resuming";
    EXPECT_EQ(shardtrain::testing::read_latest_tag(dir), "step_4") << point;
  }
}

}  // namespace
