#pragma once
/// @file lr_scheduler.h
/// Learning-rate schedules: DeepSpeed's WarmupLR, WarmupDecayLR and
/// WarmupCosineLR (deepspeed/runtime/lr_schedules.py) and Transformers'
/// "linear" / "cosine" with warmup (get_linear_schedule_with_warmup,
/// get_cosine_schedule_with_warmup), plus "constant".
///
/// The scheduler is a pure function of the number of optimizer updates already
/// applied, so its whole checkpoint state is that counter.
///
/// Step conventions, reproduced from how each original is driven:
///  * DeepSpeed constructs its scheduler with last_batch_iteration = -1, which
///    sets the lr of the first update to get_lr() at iteration -1 (warmup_min_lr
///    for WarmupLR/WarmupDecayLR, 0 for WarmupCosineLR), and calls
///    scheduler.step() after every applied update. The lr of update k+1 is
///    therefore DeepSpeed's formula at last_batch_iteration = k - 1:
///      lr_at(0)   = formula(-1)
///      lr_at(k)   = formula(k - 1)
///    e.g. WarmupLR/log: lr_at(k) = min + (max - min) * log(k) / log(W) for
///    1 <= k <= W, with W = max(2, warmup_num_steps); the first two updates
///    both use warmup_min_lr, exactly as under DeepSpeed.
///  * Transformers' schedules are LambdaLR(last_epoch = 0 at construction), so
///    the lr of update k+1 is base_lr * lambda(k): lr_at(k) = base_lr * lambda(k).
/// Skipped (fp16 overflow) updates do not advance the counter: DeepSpeed and
/// Accelerate do not step the scheduler for them either.
///
/// One scheduler step per optimizer update, whatever the world size, as
/// DeepSpeed's engine and the Trainer step theirs (and Accelerate with a
/// DeepSpeed scheduler, whose wrapper leaves the stepping to DeepSpeed).
/// Accelerate's prepare() of a torch scheduler differs: with
/// split_batches=False (its default) it steps it num_processes times per
/// update, so a schedule written for such a script runs num_processes times
/// faster than here. Dividing its warmup and total steps by num_processes
/// gives the same lr sequence for the linear, cosine and constant schedules
/// where they divide evenly (rounded otherwise; not for a log warmup).

#include <cstdint>
#include <string>

#include "shardtrain/config.h"

namespace shardtrain {

struct LRSchedulerState {
  /// Optimizer updates applied so far (DeepSpeed's last_batch_iteration + 1).
  int64_t step_count = 0;
};

class LRScheduler {
 public:
  enum class Kind { kConstant, kWarmupLR, kWarmupDecayLR, kWarmupCosineLR, kLinear, kCosine };

  /// `base_lr` is the optimizer's lr: WarmupLR/WarmupDecayLR's warmup_max_lr
  /// when that is unset, WarmupCosineLR's and Transformers' peak lr.
  /// Throws ConfigError naming the scheduler.* key for an unknown type or
  /// warmup_type, a missing total_num_steps where the type needs it, a
  /// non-positive warmup_num_steps for the DeepSpeed types (DeepSpeed raises
  /// ValueError), a negative one for linear/cosine, and WarmupDecayLR with
  /// total_num_steps < warmup_num_steps (DeepSpeed only warns, then drops
  /// from warmup_max_lr straight to warmup_min_lr when warmup ends).
  LRScheduler(const SchedulerConfig& config, double base_lr);

  /// The lr for update number step+1, given `step` updates already applied.
  double lr_at(int64_t step) const;
  /// The lr for the next update.
  double lr() const { return lr_at(step_count_); }
  /// Records one applied update.
  void advance() { ++step_count_; }

  int64_t step_count() const { return step_count_; }
  void set_step_count(int64_t step_count);
  LRSchedulerState state() const { return LRSchedulerState{step_count_}; }
  void load_state(const LRSchedulerState& state) { set_step_count(state.step_count); }
  /// DeepSpeed's state_dict value for the same point of the run
  /// ({'last_batch_iteration': step_count - 1}), for checkpoint interchange.
  int64_t deepspeed_last_batch_iteration() const { return step_count_ - 1; }

  Kind kind() const { return kind_; }
  /// The canonical type name ("WarmupLR", ..., "linear", "cosine", "constant").
  const char* type_name() const;

 private:
  /// DeepSpeed's warmup gamma at last_batch_iteration `it` (0 <= it < warmup_).
  double warmup_gamma(int64_t it) const;

  Kind kind_ = Kind::kConstant;
  double base_lr_ = 0.0;
  double min_lr_ = 0.0;   ///< WarmupLR/WarmupDecayLR warmup_min_lr
  double max_lr_ = 0.0;   ///< WarmupLR/WarmupDecayLR warmup_max_lr
  int64_t warmup_ = 0;    ///< max(2, warmup_num_steps) for DeepSpeed types; as given otherwise
  int64_t total_ = 0;
  bool log_warmup_ = true;
  double inverse_log_warmup_ = 0.0;
  double cos_min_ratio_ = 0.0;
  double warmup_min_ratio_ = 0.0;
  int64_t step_count_ = 0;
};

}  // namespace shardtrain
