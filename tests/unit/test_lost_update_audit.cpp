// The lost-update detector: what the fused CPU steps count (element_math.h's
// audit), checked against the spacing of fp32, bf16 and fp16 values, against
// the one-lane rule on awkward inputs, at sample periods and thread counts;
// the warning's rule (LostUpdateWatch); and the precision_audit config block.

#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <string>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "engine/lost_update_watch.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/element_math.h"
#include "shardtrain/kernels.h"
#include "shardtrain/config.h"
#include "shardtrain/error.h"
#include "support/awkward_values.h"

namespace {

namespace kernels = shardtrain::kernels;
namespace kmath = shardtrain::kernels::math;
using kernels::AdamParams;
using kernels::SgdParams;
using kernels::UpdateAudit;

struct Counts {
  int64_t audited, lost, lost_if_bf16;
  bool operator==(const Counts& o) const {
    return audited == o.audited && lost == o.lost && lost_if_bf16 == o.lost_if_bf16;
  }
};
std::ostream& operator<<(std::ostream& out, const Counts& c) {
  return out << "{audited " << c.audited << ", lost " << c.lost << ", lost_if_bf16 " << c.lost_if_bf16 << "}";
}

UpdateAudit new_audit(int64_t period = 1) {
  UpdateAudit audit;
  audit.counts = at::zeros({3}, at::kLong);
  audit.sample_period = period;
  return audit;
}
Counts counts_of(const UpdateAudit& audit) {
  const int64_t* c = audit.counts.data_ptr<int64_t>();
  return {c[0], c[1], c[2]};
}

// n elements at 1.0 with gradients +1, -1, ... and the last `zero` of them 0.
// Adam's first bias-corrected step moves an element by lr * g / (|g| + eps),
// which is lr to 8 digits for |g| = 1 (eps 1e-8), and 0 for g = 0.
constexpr int64_t kElements = 1000, kZeroGrads = 100;
at::Tensor unit_gradients() {
  at::Tensor g = at::ones({kElements}, at::kFloat);
  g.slice(0, 1, kElements, 2).fill_(-1.0f);
  g.slice(0, kElements - kZeroGrads, kElements).zero_();
  return g;
}

Counts first_adam_step(at::ScalarType state, double lr) {
  at::Tensor p = at::ones({kElements}, state), m = at::zeros({kElements}, state), v = at::zeros({kElements}, state);
  AdamParams params;
  params.lr = lr;
  params.weight_decay = 0.0;
  UpdateAudit audit = new_audit();
  if (state == at::kFloat) {
    kernels::adam_step(p, m, v, unit_gradients(), nullptr, params, &audit);
  } else {
    kernels::adam_step_low_precision(p, m, v, unit_gradients().to(state), params, &audit);
  }
  return counts_of(audit);
}

TEST(UnitLostUpdateAudit, AnUpdateBelowHalfAnUlpOfTheStoredTypeIsCountedLost) {
  const int64_t moving = kElements - kZeroGrads;
  // Around 1.0 the spacings are: fp32 2^-23 above / 2^-24 below, fp16 2^-10 /
  // 2^-11, bf16 2^-7 / 2^-8. An update is lost when it is below half of the
  // spacing on its side: 1e-3 is below bf16's 2^-9 = 1.95e-3 but above fp16's
  // 2^-12 = 2.4e-4; 1e-2 is above both of bf16's; 1e-8 is below fp32's 2^-25 = 3e-8.
  EXPECT_EQ(first_adam_step(at::kFloat, 1e-3), (Counts{kElements, 0, moving})) << "fp32 master keeps it; bf16 would not";
  EXPECT_EQ(first_adam_step(at::kFloat, 1e-2), (Counts{kElements, 0, 0}));
  EXPECT_EQ(first_adam_step(at::kFloat, 1e-8), (Counts{kElements, moving, moving})) << "below fp32's half ulp";
  EXPECT_EQ(first_adam_step(at::kBFloat16, 1e-3), (Counts{kElements, moving, moving})) << "pure bf16 loses every update";
  EXPECT_EQ(first_adam_step(at::kBFloat16, 1e-2), (Counts{kElements, 0, 0}));
  EXPECT_EQ(first_adam_step(at::kHalf, 1e-3), (Counts{kElements, 0, moving})) << "fp16 has 3 more bits than bf16";
}

TEST(UnitLostUpdateAudit, SgdUpdatesAreCountedByTheSameRule) {
  for (const auto& [lr, expected] : {std::pair{1e-3, Counts{kElements, 0, kElements - kZeroGrads}}, {1e-2, Counts{kElements, 0, 0}}}) {
    at::Tensor p = at::ones({kElements}, at::kFloat);
    SgdParams params;
    params.lr = lr;
    UpdateAudit audit = new_audit();
    kernels::sgd_step(p, nullptr, unit_gradients(), nullptr, params, &audit);
    EXPECT_EQ(counts_of(audit), expected) << "lr " << lr;
  }
}

/// The one-lane rule over a whole buffer, with element_math.h's scalar lanes:
/// what the vector kernels must count, lane mask, tail and NaN included.
template <bool kFused>
Counts scalar_adam_counts(const at::Tensor& p, const at::Tensor& m, const at::Tensor& v, const at::Tensor& g,
                          const AdamParams& params, int64_t period, at::ScalarType state) {
  using Ops = kmath::ScalarOps<kFused>;
  const kmath::AdamScalars c = kernels::adam_scalars(params);
  const at::Tensor p32 = p.to(at::kFloat), m32 = m.to(at::kFloat), v32 = v.to(at::kFloat), g32 = g.to(at::kFloat);
  Counts counts{0, 0, 0};
  for (int64_t i = 0; i < p.numel(); ++i) {
    if (!kmath::audited_element(i, period)) continue;
    float pi = p32.data_ptr<float>()[i], mi = m32.data_ptr<float>()[i], vi = v32.data_ptr<float>()[i];
    const float before = pi;
    const float update = kmath::adam_update<Ops>(pi, mi, vi, g32.data_ptr<float>()[i], c);
    const float stored = at::scalar_tensor(pi, at::kFloat).to(state).item<float>();
    const float bf16_before = kmath::bf16_round(before);
    ++counts.audited;
    counts.lost += kmath::update_lost(before, stored, update);
    counts.lost_if_bf16 +=
        kmath::update_lost(bf16_before, kmath::adam_bf16_master_after<Ops>(bf16_before, update, c), update);
  }
  return counts;
}

TEST(UnitLostUpdateAudit, VectorCountsEqualTheOneLaneRuleOnAwkwardValuesAtAnySamplePeriod) {
  // 100003 elements: with 2 threads ATen splits them at 50002, so chunks and
  // vectors straddle the 256-element granules.
  constexpr int64_t n = 100003;
  const bool fused = kernels::cpu::fuses_multiply_add();
  for (const at::ScalarType state : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const int64_t period : {int64_t{1}, int64_t{3}, int64_t{7}}) {
      for (const double wd : {0.0, 0.1}) {
        // awkward values: zeros, subnormals, extremes, inf and NaN among ordinary ones.
        const at::Tensor p0 = shardtrain::testing::awkward_values(n, 1, true).to(state);
        const at::Tensor m0 = (shardtrain::testing::awkward_values(n, 2, false) * 1e-3).to(state);
        const at::Tensor v0 = (shardtrain::testing::awkward_values(n, 3, false).abs() * 1e-6).to(state);
        const at::Tensor g = shardtrain::testing::awkward_values(n, 4, true).to(state);
        AdamParams params;
        params.lr = 1e-3;
        params.weight_decay = wd;
        params.step = 3;
        const Counts expected = fused ? scalar_adam_counts<true>(p0, m0, v0, g, params, period, state)
                                      : scalar_adam_counts<false>(p0, m0, v0, g, params, period, state);
        for (const int threads : {1, 2}) {
          at::set_num_threads(threads);
          at::Tensor p = p0.clone(), m = m0.clone(), v = v0.clone();
          UpdateAudit audit = new_audit(period);
          if (state == at::kFloat) {
            kernels::adam_step(p, m, v, g, nullptr, params, &audit);
          } else {
            kernels::adam_step_low_precision(p, m, v, g, params, &audit);
          }
          EXPECT_EQ(counts_of(audit), expected) << c10::toString(state) << " period " << period << " wd " << wd
                                                << " threads " << threads;
          // The period selects whole granules of 256 starting at granule 0.
          int64_t audited = 0;
          for (int64_t i = 0; i < n; ++i) audited += (i / 256) % period == 0;
          EXPECT_EQ(counts_of(audit).audited, audited);
        }
        at::set_num_threads(2);
      }
    }
  }
}

TEST(UnitLostUpdateAudit, CountsAccumulateOverCallsAndBadCountersAreAClearError) {
  UpdateAudit audit = new_audit();
  for (int call = 0; call < 2; ++call) {
    at::Tensor p = at::ones({kElements}, at::kBFloat16), m = at::zeros({kElements}, at::kBFloat16), v = at::zeros({kElements}, at::kBFloat16);
    AdamParams params;
    params.lr = 1e-3;
    kernels::adam_step_low_precision(p, m, v, unit_gradients().to(at::kBFloat16), params, &audit);
  }
  EXPECT_EQ(counts_of(audit), (Counts{2 * kElements, 2 * (kElements - kZeroGrads), 2 * (kElements - kZeroGrads)}));

  at::Tensor p = at::ones({8}), m = at::zeros({8}), v = at::zeros({8}), g = at::ones({8});
  UpdateAudit wrong;
  wrong.counts = at::zeros({3}, at::kFloat);
  try {
    kernels::adam_step(p, m, v, g, nullptr, AdamParams{}, &wrong);
    FAIL() << "float counters were accepted";
  } catch (const shardtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("audit counts must be a contiguous int64 tensor of 3 elements"),
              std::string::npos)
        << e.what();
  }
}

// ---- the warning's rule

shardtrain::PrecisionAuditConfig audit_config(int64_t warmup, double threshold) {
  shardtrain::PrecisionAuditConfig c;
  c.warmup_steps = warmup;
  c.threshold = threshold;
  return c;
}

TEST(UnitLostUpdateWatch, WarnsOnlyAfterTheWarmUpWhileTheMeanStaysAboveTheThreshold) {
  shardtrain::engine::LostUpdateWatch watch(audit_config(20, 0.5), "fsdp pure: bf16 parameters, no fp32 master",
                                            false);
  for (int64_t step = 1; step <= 20; ++step) {
    EXPECT_FALSE(watch.observe(step, 0.9, 1e-5)) << "step " << step << " is inside the warm-up";
  }
  const auto warning = watch.observe(21, 0.9, 1e-5);
  ASSERT_TRUE(warning);
  for (const char* part : {"90.0% of the parameter updates were rounded away", "fsdp pure: bf16 parameters",
                           "lr 1e-05", "FSDP standard mode", "raise the learning rate", "precision_audit.threshold"}) {
    EXPECT_NE(warning->find(part), std::string::npos) << part << " missing from: " << *warning;
  }
  // Repeated at most every kRepeatEvery steps.
  int warnings = 0;
  for (int64_t step = 22; step <= 21 + shardtrain::engine::LostUpdateWatch::kRepeatEvery; ++step) {
    warnings += watch.observe(step, 0.9, 1e-5).has_value();
  }
  EXPECT_EQ(warnings, 1) << "exactly one repeat at step 21 + kRepeatEvery";
}

TEST(UnitLostUpdateWatch, AMeanBelowTheThresholdOrUnmeasuredStepsNeverWarn) {
  shardtrain::engine::LostUpdateWatch watch(audit_config(4, 0.5), "zero-3: bf16 parameters, fp32 master", true);
  // 0.9 and 0.05 alternating: a mean of 0.475 over any 4 steps.
  for (int64_t step = 1; step <= 200; ++step) {
    EXPECT_FALSE(watch.observe(step, step % 2 ? 0.9 : 0.05, 1e-3)) << "step " << step;
    EXPECT_FALSE(watch.observe(step, -1, 1e-3)) << "-1 means not measured";
  }
  shardtrain::engine::LostUpdateWatch fp32(audit_config(0, 0.5), "zero-3: bf16 parameters, fp32 master", true);
  const auto warning = fp32.observe(1, 1.0, 1e-9);
  ASSERT_TRUE(warning) << "warm-up 0 warns from the first step";
  EXPECT_NE(warning->find("Even the fp32 master loses these updates"), std::string::npos) << *warning;
}

// ---- precision_audit in both formats

TEST(UnitPrecisionAuditConfig, ReadInYamlAndJsonWithNearestKeyWarningsAndRangeErrors) {
  const auto yaml = shardtrain::parse_config(
      "distributed_type: FSDP\nprecision_audit:\n  warmup_steps: 5\n  threshold: 0.25\n  sample_fraction: 0.1\n",
      "yaml");
  EXPECT_EQ(yaml.precision_audit.warmup_steps, 5);
  EXPECT_DOUBLE_EQ(yaml.precision_audit.threshold, 0.25);
  EXPECT_EQ(yaml.precision_audit.sample_period(), 10);
  const auto json = shardtrain::parse_config(
      R"({"zero_optimization": {"stage": 3}, "precision_audit": {"sample_fraction": 0, "treshold": 0.2}})", "json");
  EXPECT_EQ(json.precision_audit.sample_period(), 0) << "0 turns the audit off";
  EXPECT_DOUBLE_EQ(json.precision_audit.threshold, 0.5) << "the misspelt key is not applied";
  bool suggested = false;
  for (const auto& w : json.warnings) {
    suggested = suggested || w.find("did you mean 'precision_audit.threshold'?") != std::string::npos;
  }
  EXPECT_TRUE(suggested) << "no nearest-key warning for precision_audit.treshold";
  EXPECT_EQ(shardtrain::PrecisionAuditConfig{}.sample_period(), 1) << "the default audits every element";
  try {
    shardtrain::parse_config("precision_audit:\n  threshold: 1.5\n", "yaml");
    FAIL() << "threshold 1.5 was accepted";
  } catch (const shardtrain::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("precision_audit.threshold"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("a fraction in [0, 1]"), std::string::npos) << e.what();
  }
}

}  // namespace
