// The learning-rate schedules, as DeepSpeed's and transformers' compute them
// (lr_scheduler.h).
#include "shardtrain/lr_scheduler.h"

#include <algorithm>
#include <cctype>
#include <cmath>

#include "shardtrain/error.h"

namespace shardtrain {
namespace {

constexpr double kPi = 3.14159265358979323846;

bool iequals(const std::string& a, const char* b) {
  const std::string other(b);
  return a.size() == other.size() &&
         std::equal(a.begin(), a.end(), other.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

LRScheduler::Kind parse_kind(const std::string& type) {
  using Kind = LRScheduler::Kind;
  if (iequals(type, "constant")) return Kind::kConstant;
  if (iequals(type, "WarmupLR")) return Kind::kWarmupLR;
  if (iequals(type, "WarmupDecayLR")) return Kind::kWarmupDecayLR;
  if (iequals(type, "WarmupCosineLR")) return Kind::kWarmupCosineLR;
  if (iequals(type, "linear")) return Kind::kLinear;
  if (iequals(type, "cosine")) return Kind::kCosine;
  ST_THROW(ConfigError, "scheduler.type '", type,
           "' is not supported; expected one of WarmupLR, WarmupDecayLR, WarmupCosineLR, linear, "
           "cosine, constant");
}

}  // namespace

LRScheduler::LRScheduler(const SchedulerConfig& config, double base_lr)
    : kind_(parse_kind(config.type)), base_lr_(base_lr) {
  ST_CHECK_T(ConfigError, std::isfinite(base_lr) && base_lr >= 0.0,
             "optimizer lr must be finite and non-negative, got ", base_lr);
  const bool deepspeed_kind =
      kind_ == Kind::kWarmupLR || kind_ == Kind::kWarmupDecayLR || kind_ == Kind::kWarmupCosineLR;
  const bool needs_total = kind_ == Kind::kWarmupDecayLR || kind_ == Kind::kWarmupCosineLR ||
                           kind_ == Kind::kLinear || kind_ == Kind::kCosine;
  if (kind_ == Kind::kConstant) return;

  if (needs_total) {
    ST_CHECK_T(ConfigError, config.total_num_steps.has_value(), "scheduler.params.total_num_steps is required by ",
               type_name(), " (set it, or \"auto\" and let the run length fill it)");
    ST_CHECK_T(ConfigError, *config.total_num_steps > 0,
               "scheduler.params.total_num_steps must be positive, got ", *config.total_num_steps);
    total_ = *config.total_num_steps;
  }

  if (deepspeed_kind) {
    const int64_t warmup = config.warmup_num_steps.value_or(1000);
    // DeepSpeed (0.19.6 on) refuses a warmup of 0 for its schedulers, which
    // warm up over at least 2 steps (the clamp below) in any case; "auto"
    // resolves to at least 1, as transformers fills it.
    ST_CHECK_T(ConfigError, warmup >= 1, "scheduler.params.warmup_num_steps must be a positive integer for ",
               type_name(), ", got ", warmup, " (DeepSpeed refuses it too; its warmup lasts at least 2 steps). For "
               "no warmup use transformers' linear or cosine schedule with warmup_num_steps 0");
    if (iequals(config.warmup_type, "log")) {
      log_warmup_ = true;
    } else if (iequals(config.warmup_type, "linear")) {
      log_warmup_ = false;
    } else {
      ST_THROW(ConfigError, "scheduler.params.warmup_type '", config.warmup_type,
               "' is not supported; expected log or linear");
    }
    // WarmupDecayLR with total_num_steps below the warmup runs as DeepSpeed
    // runs it (the lr drops to warmup_min_lr when the warmup ends); the
    // config's resolution warns about it (resolve_scheduler).
    // DeepSpeed clamps to 2 so that log(warmup) is not 0.
    warmup_ = std::max<int64_t>(2, warmup);
    inverse_log_warmup_ = 1.0 / std::log(static_cast<double>(warmup_));
    if (kind_ == Kind::kWarmupCosineLR) {
      cos_min_ratio_ = config.cos_min_ratio;
      warmup_min_ratio_ = config.warmup_min_ratio;
      ST_CHECK_T(ConfigError, std::isfinite(cos_min_ratio_) && std::isfinite(warmup_min_ratio_),
                 "scheduler.params.cos_min_ratio and warmup_min_ratio must be finite");
    } else {
      min_lr_ = config.warmup_min_lr.value_or(0.0);
      max_lr_ = config.warmup_max_lr.value_or(kind_ == Kind::kWarmupDecayLR ? SchedulerConfig::kWarmupDecayMaxLrDefault
                                                                              : base_lr);
      ST_CHECK_T(ConfigError, std::isfinite(min_lr_) && min_lr_ >= 0.0,
                 "scheduler.params.warmup_min_lr must be finite and non-negative, got ", min_lr_);
      ST_CHECK_T(ConfigError, std::isfinite(max_lr_) && max_lr_ >= 0.0,
                 "scheduler.params.warmup_max_lr must be finite and non-negative, got ", max_lr_);
    }
    return;
  }

  // Transformers' schedules: warmup 0 means none.
  warmup_ = config.warmup_num_steps.value_or(0);
  ST_CHECK_T(ConfigError, warmup_ >= 0, "scheduler.params.warmup_num_steps must be >= 0, got ", warmup_);
}

const char* LRScheduler::type_name() const {
  switch (kind_) {
    case Kind::kConstant:
      return "constant";
    case Kind::kWarmupLR:
      return "WarmupLR";
    case Kind::kWarmupDecayLR:
      return "WarmupDecayLR";
    case Kind::kWarmupCosineLR:
      return "WarmupCosineLR";
    case Kind::kLinear:
      return "linear";
    case Kind::kCosine:
      return "cosine";
  }
  return "unknown";
}

void LRScheduler::set_step_count(int64_t step_count) {
  ST_CHECK(step_count >= 0, "lr scheduler step count must be >= 0, got ", step_count);
  step_count_ = step_count;
}

double LRScheduler::warmup_gamma(int64_t it) const {
  // DeepSpeed multiplies by the precomputed inverse rather than dividing.
  if (log_warmup_) return inverse_log_warmup_ * std::log(static_cast<double>(it + 1));
  return static_cast<double>(it) / static_cast<double>(warmup_);
}

double LRScheduler::lr_at(int64_t step) const {
  ST_CHECK(step >= 0, "lr_at: step must be >= 0, got ", step);
  switch (kind_) {
    case Kind::kConstant:
      return base_lr_;

    case Kind::kWarmupLR:
    case Kind::kWarmupDecayLR: {
      const int64_t it = step - 1;  // DeepSpeed's last_batch_iteration
      if (it < 0) return min_lr_;
      double gamma = 1.0;
      if (it < warmup_) {
        gamma = warmup_gamma(it);
      } else if (kind_ == Kind::kWarmupDecayLR) {
        gamma = std::max(0.0, static_cast<double>(total_ - it) /
                                  std::max(1.0, static_cast<double>(total_ - warmup_)));
      }
      return min_lr_ + (max_lr_ - min_lr_) * gamma;
    }

    case Kind::kWarmupCosineLR: {
      const int64_t it = step - 1;
      if (it < 0) return 0.0;  // DeepSpeed's get_lr before the first step()
      double ratio;
      if (it < warmup_) {
        ratio = warmup_min_ratio_ + warmup_gamma(it) * (1.0 - warmup_min_ratio_);
      } else {
        const double real_last_step = static_cast<double>(it - warmup_ + 1);
        const double real_total_steps = static_cast<double>(std::max<int64_t>(1, total_ - warmup_));
        // Clamped so the ratio stays at cos_min_ratio past total_num_steps
        // (current DeepSpeed; older releases let the cosine swing back up).
        const double progress = std::min(1.0, real_last_step / real_total_steps);
        const double cosine = (1.0 + std::cos(kPi * progress)) / 2.0;
        ratio = std::max(0.0, cos_min_ratio_ + (1.0 - cos_min_ratio_) * cosine);
      }
      return base_lr_ * ratio;
    }

    case Kind::kLinear: {
      if (step < warmup_) {
        return base_lr_ * (static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup_)));
      }
      const double factor = std::max(0.0, static_cast<double>(total_ - step) /
                                               static_cast<double>(std::max<int64_t>(1, total_ - warmup_)));
      return base_lr_ * factor;
    }

    case Kind::kCosine: {
      if (step < warmup_) {
        return base_lr_ * (static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup_)));
      }
      // Transformers' num_cycles = 0.5; like Transformers, no clamp past the end.
      const double progress = static_cast<double>(step - warmup_) /
                              static_cast<double>(std::max<int64_t>(1, total_ - warmup_));
      const double factor = std::max(0.0, 0.5 * (1.0 + std::cos(kPi * 0.5 * 2.0 * progress)));
      return base_lr_ * factor;
    }
  }
  return base_lr_;
}

}  // namespace shardtrain
