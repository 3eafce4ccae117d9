// The precision study on a short run: the seeds' relations hold on measured
// numbers, every step's lost-update fractions reach the metrics file, and the
// relations cannot hold without the detector.

#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "build_config.h"  // SHARDTRAIN_SOURCE_DIR
#include "study/precision_study.h"
#include "support/scratch_dir.h"

namespace {

namespace fs = std::filesystem;

study::StudyOptions short_study(const std::string& dir) {
  study::StudyOptions o;
  o.configs_dir = std::string(SHARDTRAIN_SOURCE_DIR) + "/configs/llama";
  o.model_dir = std::string(SHARDTRAIN_SOURCE_DIR) + "/examples/tiny_llama";
  o.output_dir = dir;
  o.steps = 100;
  o.seq_len = 64;
  o.micro_batch = 4;
  o.warmup = 10;
  o.plot = false;  // the picture is UnitPlot's business; this test needs no gnuplot
  o.quiet = true;
  return o;
}

TEST(DistPrecisionStudy, TheSeedsRelationsHoldOnAShortStudyAndNeedTheDetector) {
  shardtrain::testing::ScratchDir scratch;
  const study::StudyOptions options = short_study(scratch.path());
  const study::StudyResult result = study::run_precision_study(options);
  std::cout << study::study_markdown(result, options);
  ASSERT_EQ(result.runs.size(), 7u);
  for (const auto& relation : result.relations) {
    EXPECT_TRUE(relation.holds) << relation.claim << ": " << relation.measured;
  }
  // Every step of every run carries both fractions in its metrics file.
  for (const auto& run : result.runs) {
    std::ifstream in(run.metrics_path);
    std::string line;
    int64_t steps = 0;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line);
      ASSERT_TRUE(j["lost_update_frac"].is_number()) << run.name << ": " << line;
      ASSERT_TRUE(j["lost_update_frac_if_bf16"].is_number()) << run.name << ": " << line;
      ++steps;
    }
    EXPECT_EQ(steps, options.steps) << run.metrics_path;
  }
  EXPECT_TRUE(fs::exists(fs::path(scratch.path()) / "study.md"));
  EXPECT_TRUE(fs::exists(fs::path(scratch.path()) / "study.json"));

  // A detector that reports nothing lost (switched off, or broken) cannot
  // pass: the relations about lost updates fail on the same curves.
  std::vector<study::StudyRun> blind = result.runs;
  for (auto& run : blind) run.mean_lost_update_frac = run.mean_lost_update_frac_if_bf16 = 0;
  int failing = 0;
  for (const auto& relation : study::check_relations(blind)) failing += !relation.holds;
  EXPECT_GE(failing, 2) << "the pure-mode and the one-run relations must rest on the detector";
}

}  // namespace
