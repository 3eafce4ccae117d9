#pragma once
// Comparing a train_tiny engine run with its reference (shared by the engine tests).

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "support/multirank.h"
#include "tiny/tiny_train.h"

namespace shardtrain::testing {

/// train_tiny options for a run inside the multi-rank harness.
inline tiny::TinyRunOptions tiny_run_options(const TrainingConfig& config, RankContext& ctx, int steps,
                                             uint64_t seed) {
  tiny::TinyRunOptions options;
  options.config = config;
  options.steps = steps;
  options.seed = seed;
  options.micro_batch = 4;
  options.communicator = ctx.comm;
  options.quiet = true;
  return options;
}

/// Largest |a_i - b_i| / |b_i|.
inline double max_relative(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]) / std::abs(b[i]));
  return worst;
}

/// Every parameter within `tolerance` of the reference's, relative to max(1, its largest magnitude).
inline void expect_params_close(const tiny::TinyRunResult& actual, const tiny::TinyRunResult& reference,
                                double tolerance) {
  ASSERT_EQ(actual.final_params.size(), reference.final_params.size());
  std::map<std::string, at::Tensor> by_name(reference.final_params.begin(), reference.final_params.end());
  for (const auto& [name, value] : actual.final_params) {
    ASSERT_TRUE(by_name.count(name)) << "parameter " << name << " missing from the reference";
    const at::Tensor& ref = by_name[name];
    const double diff = (value - ref).abs().max().item<double>();
    const double scale = std::max(1.0, ref.abs().max().item<double>());
    EXPECT_LE(diff / scale, tolerance) << name << ": max |difference| " << diff;
  }
}

}  // namespace shardtrain::testing
