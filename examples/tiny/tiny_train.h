#pragma once
// The train_tiny run as a function, shared by the example program and the
// tests (which run it on several ranks inside the multi-rank harness and
// compare it with the plain-LibTorch reference in the same process).

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "shardtrain/accelerator.h"
#include "tiny/tiny_model.h"

namespace tiny {

struct TinyRunOptions {
  std::optional<std::string> config_path;
  std::optional<shardtrain::TrainingConfig> config;
  int steps = 30;
  uint64_t seed = 0;
  std::optional<double> lr;   ///< overrides the config's optimizer lr
  int micro_batch = 4;
  std::string metrics_out;    ///< JSON lines, one object per optimizer step (rank 0)
  TinyConfig model;
  /// Load dtype of the model ("fp32", "bf16").
  std::string load_dtype = "fp32";
  /// cpu | cuda | cuda:N | auto (see shardtrain::resolve_device); ignored when
  /// `communicator` is given (its device is used).
  std::string device = "cpu";
  /// Run inside an existing job (tests); otherwise connect from the environment.
  shardtrain::comm::CommunicatorPtr communicator;
  bool quiet = false;
  /// Save the state here (DIR) after every `save_every` steps and at the end (0: never).
  std::string save_dir;
  int save_every = 0;
  /// Resume from DIR's latest checkpoint and train on up to `steps`.
  std::string resume_dir;
  /// Stop after this many steps of this process (0: run to `steps`): a run "killed" mid-way.
  int stop_after = 0;
  /// Keep at most this many checkpoints in save_dir (0: all).
  int keep_last = 0;
};

struct TinyRunResult {
  std::vector<double> losses;      ///< global mean loss of each optimizer step
  std::vector<double> grad_norms;  ///< -1 where not computed
  /// StepInfo's lost-update fractions of each step (-1 where not measured;
  /// empty for --reference runs, which have no engine).
  std::vector<double> lost_update_fracs, lost_update_fracs_if_bf16;
  std::vector<std::pair<std::string, at::Tensor>> final_params;  ///< fp32, in host memory, by name
  shardtrain::MemoryReport memory;
  shardtrain::PrecisionPlan plan;
  int64_t skipped_steps = 0;
};

/// Tokens of global sample `index` of the synthetic task: arithmetic
/// progressions mod vocab with a per-sample start and stride, so the next
/// token is predictable from context (attention has to find the stride).
at::Tensor synthetic_sample(uint64_t seed, int64_t index, const TinyConfig& config);

/// Mean cross-entropy of predicting tokens[:, 1:] from logits[:, :-1].
at::Tensor next_token_loss(const at::Tensor& logits, const at::Tensor& tokens);

/// The engine run (zero / fsdp per the config) on the current job.
TinyRunResult run_tiny(const TinyRunOptions& options);

/// The plain LibTorch loop: one process, same init, same global batch
/// (world_size x micro_batch x accumulation samples per step), the same
/// optimizer formula, schedule and clipping, no shardtrain engine.
TinyRunResult run_tiny_reference(const TinyRunOptions& options, int world_size);

/// How an engine combines the ranks' gradients, for the reference below.
struct DataParallelArithmetic {
  /// ZeRO-1: each rank sums its micro-batches' gradients first and reduces
  /// once at the boundary. Otherwise every micro-batch is reduced and the
  /// reduced gradients are summed (ZeRO-2/3, FSDP).
  bool accumulate_before_reduce = false;
  /// HYBRID_SHARD: ranks are summed within each machine of this many ranks,
  /// then the machines' sums are added (0: one machine).
  int local_world_size = 0;
  /// bf16: forward and backward run on bf16(master), as the engines compute
  /// under mixed_precision bf16; each rank's bf16 gradient is reduced as the
  /// Gloo reduce-scatter does (fp32 sums in rank order, the mean rounded
  /// once to bf16; ZeRO-1 accumulates a rank's micro-batches in fp32 and
  /// rounds the sum) and the fp32 master is updated. One machine only.
  at::ScalarType compute_dtype = at::kFloat;
  /// The reduction's dtype (FSDP's reduce_dtype); unset: the compute dtype.
  std::optional<at::ScalarType> reduce_dtype;
  /// The sharded gradient's dtype across micro-batches (bf16 under
  /// fsdp_keep_low_precision_grads: each reduced gradient is rounded to it
  /// and the sum is kept in it).
  at::ScalarType grad_dtype = at::kFloat;
};

/// The plain LibTorch loop doing each rank's arithmetic in one process: every
/// rank's micro-batch goes through the model on its own, as on its rank, and
/// the per-rank fp32 gradients are summed in rank order (the order in which
/// shardtrain's Gloo reductions add) and divided by the world size. Same
/// init, data, optimizer and schedule as the engine run. Clipping as the
/// engines clip: the norm from fp64 sums of squares of the reduced gradient,
/// the coefficient min(1, max_norm / (norm + 1e-6)) applied to the fp32
/// gradient as one float multiply. For world sizes that are powers of two
/// every division is exact, so an engine run matches this loop bit for bit:
/// the expected difference is zero (the norm itself only up to the order of
/// its fp64 sum; see DistZeroClipping).
TinyRunResult run_tiny_data_parallel_reference(const TinyRunOptions& options, int world_size,
                                               DataParallelArithmetic arithmetic = {});

}  // namespace tiny
