// DeepSpeed's dynamic fp16 loss-scaling rule, step by step (loss_scaler.h).
#include "engine/loss_scaler.h"

#include <algorithm>
#include <cmath>

#include "shardtrain/error.h"

namespace shardtrain::engine {

DynamicLossScaler::DynamicLossScaler(const LossScaleConfig& config, bool raise_error_at_min_scale)
    : raise_error_at_min_scale_(raise_error_at_min_scale) {
  state_ = LossScalerState{};
  if (!config.enabled) {
    mode_ = Mode::kDisabled;
    state_.scale = 1.0;
    state_.cur_hysteresis = 1;
    return;
  }
  ST_CHECK_T(ConfigError, std::isfinite(config.loss_scale) && config.loss_scale >= 0.0,
             "fp16.loss_scale must be 0 (dynamic) or a positive static scale, got ",
             config.loss_scale);
  if (config.loss_scale != 0.0) {
    mode_ = Mode::kStatic;
    state_.scale = config.loss_scale;
    state_.cur_hysteresis = 1;
    return;
  }
  // DeepSpeed's validators reject these (validate_positive_int / _finite).
  ST_CHECK_T(ConfigError, config.loss_scale_window > 0,
             "fp16.loss_scale_window must be a positive integer, got ", config.loss_scale_window);
  ST_CHECK_T(ConfigError, config.hysteresis > 0, "fp16.hysteresis must be a positive integer, got ",
             config.hysteresis);
  ST_CHECK_T(ConfigError, std::isfinite(config.min_loss_scale) && config.min_loss_scale > 0.0,
             "fp16.min_loss_scale must be positive and finite, got ", config.min_loss_scale);
  const double initial = std::ldexp(1.0, config.initial_scale_power);
  ST_CHECK_T(ConfigError, std::isfinite(initial) && initial > 0.0,
             "fp16.initial_scale_power ", config.initial_scale_power,
             " gives a loss scale that is not a finite positive double");
  mode_ = Mode::kDynamic;
  window_ = config.loss_scale_window;
  hysteresis_ = config.hysteresis;
  consecutive_hysteresis_ = config.consecutive_hysteresis;
  min_scale_ = config.min_loss_scale;
  state_.scale = initial;
  state_.cur_hysteresis = hysteresis_;
  state_.cur_iter = 0;
  state_.last_overflow_iter = -1;
}

void DynamicLossScaler::update(bool overflow) {
  if (mode_ != Mode::kDynamic) {
    if (overflow) ++state_.skipped_steps;
    ++state_.cur_iter;
    return;
  }
  if (overflow) {
    if (hysteresis_ == 1 || state_.cur_hysteresis == 1) {
      if (state_.scale == min_scale_ && raise_error_at_min_scale_) {
        ST_THROW(Error, "fp16 overflow while the loss scale is already at fp16.min_loss_scale (",
                 min_scale_, ") after ", state_.cur_iter,
                 " steps: cannot decrease the scale any more (DeepSpeed stops the run here). "
                 "The gradients overflow at any scale: check the loss for inf/NaN, lower the "
                 "learning rate, or use bf16");
      }
      state_.scale = std::max(state_.scale / 2.0, min_scale_);
    } else {
      --state_.cur_hysteresis;
    }
    state_.last_overflow_iter = state_.cur_iter;
    ++state_.skipped_steps;
  } else {
    if (consecutive_hysteresis_) state_.cur_hysteresis = hysteresis_;
    const int64_t stable = state_.cur_iter - state_.last_overflow_iter - 1;
    if (stable > 0 && stable % window_ == 0) {
      if (!consecutive_hysteresis_) state_.cur_hysteresis = hysteresis_;
      state_.scale *= 2.0;
    }
  }
  ++state_.cur_iter;
}

void DynamicLossScaler::load_state(const LossScalerState& state) {
  ST_CHECK(std::isfinite(state.scale) && state.scale > 0.0,
           "loss scaler state: scale must be positive and finite, got ", state.scale);
  ST_CHECK(state.cur_iter >= 0 && state.skipped_steps >= 0 && state.skipped_steps <= state.cur_iter,
           "loss scaler state: counters are inconsistent (cur_iter ", state.cur_iter,
           ", skipped_steps ", state.skipped_steps, ")");
  ST_CHECK(state.last_overflow_iter >= -1 && state.last_overflow_iter < state.cur_iter,
           "loss scaler state: last_overflow_iter ", state.last_overflow_iter,
           " must be -1 or an iteration before cur_iter ", state.cur_iter);
  if (mode_ != Mode::kDynamic) {
    // The configured scale wins (1 when fp16 is off, the static fp16.loss_scale
    // otherwise), so a run may resume with a different precision setting; the
    // counters carry over because they describe the steps already taken.
    const double own_scale = state_.scale;
    state_ = state;
    state_.scale = own_scale;
    state_.cur_hysteresis = 1;
    return;
  }
  ST_CHECK(state.cur_hysteresis >= 1 && state.cur_hysteresis <= hysteresis_,
           "loss scaler state: cur_hysteresis ", state.cur_hysteresis,
           " is outside [1, fp16.hysteresis=", hysteresis_, "]");
  state_ = state;
}

}  // namespace shardtrain::engine
