#pragma once
// fp16 loss scaling, with DeepSpeed's DynamicLossScaler rule
// (deepspeed/runtime/fp16/loss_scaler.py, update_scale), so a shardtrain fp16
// run skips the same steps and uses the same scales as the DeepSpeed run it
// replaces. The rule, with scale_factor 2:
//
//   overflow:  if hysteresis == 1 or cur_hysteresis == 1:
//                  scale = max(scale / 2, min_loss_scale)
//              else cur_hysteresis -= 1
//              last_overflow_iter = cur_iter
//   no overflow:
//              if consecutive_hysteresis: cur_hysteresis = hysteresis
//              stable = cur_iter - last_overflow_iter - 1
//              if stable > 0 and stable % loss_scale_window == 0:
//                  if not consecutive_hysteresis: cur_hysteresis = hysteresis
//                  scale *= 2
//   cur_iter += 1
//
// Three modes: disabled (fp16 off: scale 1, never changes), static
// (fp16.loss_scale != 0: that scale, never changes) and dynamic
// (fp16.loss_scale == 0: starts at 2^initial_scale_power). In every mode
// update(true) counts a skipped step, because the engines skip an
// overflowing fp16 step whatever the scaling mode, as DeepSpeed does.

#include <cstdint>

#include "shardtrain/config.h"

namespace shardtrain::engine {

/// Everything update() reads or writes; saved in checkpoints so a resumed run
/// continues the scale schedule exactly.
struct LossScalerState {
  double scale = 1.0;
  int cur_hysteresis = 1;
  int64_t cur_iter = 0;
  int64_t last_overflow_iter = -1;
  int64_t skipped_steps = 0;
};

class DynamicLossScaler {
 public:
  /// Throws ConfigError naming the fp16.* key when an enabled config is
  /// invalid (window, hysteresis or min scale not positive, negative static
  /// scale, 2^initial_scale_power not a finite double).
  ///
  /// `raise_error_at_min_scale`: DeepSpeed's engine constructs its scaler with
  /// true, which aborts the run when an overflow arrives while the scale already
  /// sits at min_loss_scale (with no hysteresis left). The default here
  /// (false) keeps flooring at min_loss_scale and skipping steps instead; pass
  /// true to fail like DeepSpeed (update() then throws shardtrain::Error).
  explicit DynamicLossScaler(const LossScaleConfig& config, bool raise_error_at_min_scale = false);

  /// The factor to multiply the loss by before backward (1 when disabled).
  double scale() const { return state_.scale; }
  /// Call once per optimizer step with the overflow flag reduced (MAX) over
  /// every rank, after the step was applied or skipped.
  void update(bool overflow);
  /// Steps skipped because of overflow so far.
  int64_t skipped_steps() const { return state_.skipped_steps; }
  /// Number of update() calls so far (DeepSpeed's cur_iter).
  int64_t iteration() const { return state_.cur_iter; }

  bool enabled() const { return mode_ != Mode::kDisabled; }
  bool dynamic() const { return mode_ == Mode::kDynamic; }

  LossScalerState state() const { return state_; }
  /// Restores a state saved by state(). A disabled or static scaler keeps its
  /// configured scale and adopts only the counters (a run may resume under a
  /// different precision setting). Throws Error when the values cannot come
  /// from a scaler (non-positive or non-finite scale, inconsistent counters,
  /// cur_hysteresis outside [1, fp16.hysteresis] for a dynamic scaler).
  void load_state(const LossScalerState& state);

 private:
  enum class Mode { kDisabled, kStatic, kDynamic };

  Mode mode_ = Mode::kDisabled;
  int window_ = 1000;
  int hysteresis_ = 2;
  bool consecutive_hysteresis_ = false;
  double min_scale_ = 1.0;
  bool raise_error_at_min_scale_ = false;
  LossScalerState state_;
};

}  // namespace shardtrain::engine
