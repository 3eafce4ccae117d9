// The lost-update warning's rule (see lost_update_watch.h).

#include "engine/lost_update_watch.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <sstream>
#include <utility>

namespace shardtrain::engine {

LostUpdateWatch::LostUpdateWatch(PrecisionAuditConfig config, std::string mode, bool has_fp32_master)
    : config_(config), mode_(std::move(mode)), has_fp32_master_(has_fp32_master) {}

std::optional<std::string> LostUpdateWatch::observe(int64_t step, double lost_update_frac, double lr) {
  if (!(lost_update_frac >= 0)) return std::nullopt;
  const size_t window = static_cast<size_t>(std::max<int64_t>(1, config_.warmup_steps));
  window_.push_back(lost_update_frac);
  window_sum_ += lost_update_frac;
  while (window_.size() > window) {
    window_sum_ -= window_.front();
    window_.pop_front();
  }
  if (step <= config_.warmup_steps || window_.size() < window) return std::nullopt;
  const double mean = window_sum_ / static_cast<double>(window_.size());
  if (!(mean > config_.threshold)) return std::nullopt;
  if (last_warned_ && step - *last_warned_ < kRepeatEvery) return std::nullopt;
  last_warned_ = step;

  std::ostringstream out;
  out << "lost-update detector: over the last " << window_.size() << " steps (to step " << step << ") "
      << std::fixed << std::setprecision(1) << 100.0 * mean
      << "% of the parameter updates were rounded away when stored (" << mode_ << "; lr "
      << std::defaultfloat << std::setprecision(3) << lr << "). Those weights did not move: an update smaller than "
      << "half a unit in the last place of the stored value leaves it unchanged, so the loss can stay flat. ";
  if (has_fp32_master_) {
    out << "Even the fp32 master loses these updates: the learning rate is too small to move the weights; raise it.";
  } else {
    out << "Fixes: keep an fp32 master (FSDP standard mode: mixed_precision: bf16 with the model loaded in fp32, "
           "or fsdp_pure_low_precision: false; or DeepSpeed ZeRO, which always has one), or raise the learning rate.";
  }
  out << " (precision_audit.threshold " << config_.threshold << " sets when this warns; it repeats at most every "
      << kRepeatEvery << " steps.)";
  return out.str();
}

}  // namespace shardtrain::engine
