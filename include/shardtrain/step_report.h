#pragma once
/// @file step_report.h
/// What an optimizer step did and how many bytes of model state a rank
/// holds: the engine fills them, the Accelerator adds what only it knows
/// (the step count, the learning rate, the totals, the process's peak RSS)
/// and returns them (Accelerator::last_step(), Accelerator::memory()).

#include <cstdint>

namespace shardtrain {

/// What the last optimizer step did (also written to the metrics file).
struct StepInfo {
  int64_t step = 0;        ///< optimizer steps taken so far (not counting skipped ones)
  double lr = 0;
  double grad_norm = -1;   ///< global (unscaled) gradient norm; -1 when not computed
  double loss_scale = 1;
  /// fp16 overflow or non-finite gradients: the update was not applied.
  bool skipped = false;
  int64_t skipped_total = 0;
  /// bf16/fp32: this step was skipped because a gradient held inf or NaN
  /// (non_finite_policy: skip), and how many steps were so far.
  bool non_finite = false;
  int64_t non_finite_total = 0;
  /// The lost-update detector (config precision_audit), the same on every
  /// rank: the fraction of parameter elements whose non-zero update was
  /// rounded away when stored (in pure low precision the bf16/fp16 shard; else
  /// the fp32 master, near 0), and the fraction a bf16 master would have lost
  /// with the same updates. -1: not measured this step.
  double lost_update_frac = -1;
  double lost_update_frac_if_bf16 = -1;
};

/// Bytes of model state on this rank, by kind (the precision plan's rows;
/// see PrecisionPlan for the prediction). With the optimizer offload alone
/// and the model on a GPU, `params` also counts the pinned host copy of the
/// partition that the host step writes (PrecisionPlan's rows leave it out;
/// its host_bytes count it); `offloaded` says how much of it all is in host
/// memory.
struct MemoryReport {
  int64_t params = 0;     ///< low-precision shards / replicated params at rest
  int64_t grads = 0;      ///< gradient partitions / buffers at rest
  int64_t master = 0;     ///< fp32 master copies that are not the params themselves
  int64_t optimizer = 0;  ///< optimizer state (m, v, momentum)
  /// The part of params, grads, master and optimizer that the offload keeps in
  /// host memory; the rest is on the model's device.
  int64_t offloaded = 0;
  /// Currently gathered (unsharded) parameter buffers, with the shards
  /// uploaded for gathers in flight under the parameter offload.
  int64_t gathered = 0;
  int64_t gathered_peak = 0;  ///< maximum of `gathered` since the last reset
  /// The most bytes gradient reductions in flight held at once since the last
  /// reset: the unsharded gradients handed to them and their sharded results
  /// (none between steps: backward waits for every reduction).
  int64_t reducing_peak = 0;
  /// The most bytes of unsharded parameter values this rank held at once
  /// while prepare() sharded the model: the module's own parameter storage
  /// not yet replaced by shards, plus the engine's gathered and loading
  /// buffers. With weights loaded on rank 0 only (cpu_ram_efficient_loading)
  /// the other ranks stay near one unit; a normal load holds the whole model.
  int64_t load_peak = 0;
  int64_t peak_rss = 0;   ///< the process's peak resident set (the Accelerator's, not the engine's)
};

/// Bytes of parameter values this rank all-gathered since the last
/// Accelerator::reset_traffic(): each gather's full buffer in the dtype it
/// travels in (this rank's own shard included; zero where parameters are not
/// sharded). The communication the sharding costs, per kind of weight.
struct TrafficReport {
  int64_t param_gather_bytes = 0;
  /// The part of it that is frozen weights (a LoRA base: bf16 values, or the
  /// NF4 bytes of a quantized one).
  int64_t frozen_gather_bytes = 0;
  /// Gathers that first waited until the device had freed the unit released
  /// two before them (limit_all_gathers; on a CPU every free is done when it
  /// returns, and the wait with it).
  int64_t paced_gathers = 0;
};

}  // namespace shardtrain
