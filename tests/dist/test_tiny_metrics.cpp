// train_tiny's plain-LibTorch reference writes the same metrics file as an
// engine run (`--reference --metrics-out`), so the two compare with one tool.

#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/scratch_dir.h"
#include "support/tiny_compare.h"
#include "tiny/tiny_train.h"

namespace {

std::vector<nlohmann::json> read_json_lines(const std::string& path) {
  std::vector<nlohmann::json> lines;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

/// Every key path in `value` ("mem.params", ...), so nested objects compare too.
std::set<std::string> key_paths(const nlohmann::json& value, const std::string& prefix = "") {
  std::set<std::string> keys;
  for (auto it = value.begin(); it != value.end(); ++it) {
    const std::string path = prefix + it.key();
    keys.insert(path);
    if (it->is_object()) {
      for (const auto& nested : key_paths(*it, path + ".")) keys.insert(nested);
    }
  }
  return keys;
}

TEST(DistTinyMetrics, ReferenceRunWritesTheEngineRunsMetricsFields) {
  shardtrain::testing::ScratchDir dir;
  tiny::TinyRunOptions options;
  options.config = shardtrain::testing::zero_test_config(3, shardtrain::MixedPrecision::kNo);
  options.steps = 3;
  options.seed = 5;
  options.micro_batch = 4;
  options.quiet = true;
  options.metrics_out = dir.file("engine.jsonl");
  tiny::run_tiny(options);
  options.metrics_out = dir.file("reference.jsonl");
  const tiny::TinyRunResult reference = tiny::run_tiny_reference(options, 1);

  const auto engine_lines = read_json_lines(dir.file("engine.jsonl"));
  const auto reference_lines = read_json_lines(dir.file("reference.jsonl"));
  ASSERT_EQ(engine_lines.size(), 3u);
  ASSERT_EQ(reference_lines.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(key_paths(reference_lines[i]), key_paths(engine_lines[i])) << "line " << i + 1;
    EXPECT_EQ(reference_lines[i]["step"], static_cast<int64_t>(i + 1));
    EXPECT_EQ(reference_lines[i]["loss"].get<double>(), reference.losses[i]);
    EXPECT_GT(reference_lines[i]["tokens"].get<int64_t>(), 0);
    EXPECT_GT(reference_lines[i]["mem"]["params"].get<int64_t>(), 0);
    // Adam's two moments per parameter once the first step has created them.
    EXPECT_EQ(reference_lines[i]["mem"]["optimizer"].get<int64_t>(),
              2 * reference_lines[i]["mem"]["params"].get<int64_t>());
  }
  // Same global batch, same tokens per step.
  EXPECT_EQ(reference_lines[0]["tokens"], engine_lines[0]["tokens"]);
}

}  // namespace
