#pragma once
// When the lost-update fraction (StepInfo::lost_update_frac) deserves a
// warning: the precision_audit settings' rule, kept apart from the
// Accelerator so it can be tested step by step without an engine.

#include <cstdint>
#include <deque>
#include <optional>
#include <string>

#include "shardtrain/config.h"

namespace shardtrain::engine {

class LostUpdateWatch {
 public:
  /// A warning is repeated at most this often (optimizer steps).
  static constexpr int64_t kRepeatEvery = 500;

  /// `mode`: the precision mode in words ("fsdp pure, bf16 shards"); `has_fp32_master`
  /// picks the fixes the warning offers.
  LostUpdateWatch(PrecisionAuditConfig config, std::string mode, bool has_fp32_master);

  /// Feeds step `step`'s measured fraction (< 0: not measured, ignored).
  /// Returns the warning when one is due: after config.warmup_steps steps,
  /// when the mean over the last max(1, warmup_steps) measured steps is above
  /// config.threshold, and no warning came in the last kRepeatEvery steps.
  std::optional<std::string> observe(int64_t step, double lost_update_frac, double lr);

 private:
  PrecisionAuditConfig config_;
  std::string mode_;
  bool has_fp32_master_;
  std::deque<double> window_;
  double window_sum_ = 0;
  std::optional<int64_t> last_warned_;
};

}  // namespace shardtrain::engine
