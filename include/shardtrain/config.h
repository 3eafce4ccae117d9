#pragma once
/// @file config.h
/// One configuration model for every run, read from either input format:
///  * an Accelerate YAML (`accelerate config` output: distributed_type,
///    mixed_precision, fsdp_config.*, deepspeed_config.*, ...), which may point
///    at a DeepSpeed JSON through deepspeed_config.deepspeed_config_file;
///  * a DeepSpeed JSON (train_batch_size, zero_optimization.*, fp16, bf16, ...).
///
/// Values the user wrote as "auto" stay unset (std::nullopt) until
/// resolve_auto() fills them from the run (data loader, world size, model
/// hidden size, run length), following Transformers/Accelerate's rules.
///
/// Errors (ConfigError) name the key, the value and the allowed values;
/// unknown keys produce a warning naming the nearest known key (an error with
/// `strict: true`), and known keys that shardtrain does not implement produce
/// a warning saying so. Warnings are collected in TrainingConfig::warnings and
/// logged by the Accelerator on rank 0.

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace shardtrain {

enum class DistributedType { kNo, kMultiCpu, kMultiGpu, kDeepSpeed, kFsdp };
enum class MixedPrecision { kNo, kFp16, kBf16 };
enum class OffloadDevice { kNone, kCpu, kNvme };
enum class ShardingStrategy { kFullShard = 1, kShardGradOp = 2, kNoShard = 3, kHybridShard = 4, kHybridShardZero2 = 5 };
enum class AutoWrapPolicy { kTransformerBased, kSizeBased, kNoWrap };
enum class BackwardPrefetch { kBackwardPre, kBackwardPost, kNoPrefetch };
enum class StateDictType { kFullStateDict, kShardedStateDict };
/// Element type named in a config ("fp32"/"float32", "bf16"/"bfloat16", "fp16"/"float16").
enum class DType { kFp32, kBf16, kFp16 };

const char* to_string(DistributedType);
const char* to_string(MixedPrecision);
const char* to_string(OffloadDevice);
const char* to_string(ShardingStrategy);
const char* to_string(AutoWrapPolicy);
const char* to_string(BackwardPrefetch);
const char* to_string(StateDictType);
const char* to_string(DType);

/// DeepSpeed's `fp16` block. loss_scale == 0 means dynamic loss scaling.
struct LossScaleConfig {
  bool enabled = false;
  double loss_scale = 0.0;
  int initial_scale_power = 16;
  int loss_scale_window = 1000;
  int hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1.0;
  /// An overflow while the scale already sits at min_loss_scale stops the run
  /// with an error (DeepSpeed's DynamicLossScaler default; newer DeepSpeed
  /// reads it from this key). false: keep skipping steps at the floor.
  bool raise_error_at_min_scale = true;
};

/// `non_finite_policy:` what a bf16/fp32 step does with inf/NaN gradients
/// (fp16 has the loss scaler instead): skip the step and warn, or stop.
enum class NonFinitePolicy { kSkip, kStop };
/// `checkpoint_on_error:` what a failed save_state does after cleaning up:
/// warn and go on training (the next save retries), or stop.
enum class CheckpointErrorPolicy { kContinue, kStop };
const char* to_string(NonFinitePolicy);
const char* to_string(CheckpointErrorPolicy);

/// DeepSpeed's `optimizer` block (or options given in code).
struct OptimizerConfig {
  /// Whether the config had an optimizer block at all.
  bool specified = false;
  /// "AdamW", "Adam" or "SGD" (case-insensitive on input, canonical here).
  std::string type = "AdamW";
  std::optional<double> lr;                 ///< nullopt = "auto"; default 1e-3 after resolution
  std::optional<std::array<double, 2>> betas;  ///< default {0.9, 0.999}
  std::optional<double> eps;                ///< default 1e-8
  /// default 0.01 for AdamW without an optimizer block (torch's), else 0 (DeepSpeed's FusedAdam, SGD)
  std::optional<double> weight_decay;
  double momentum = 0.0;                    ///< SGD
  bool nesterov = false;                    ///< SGD
  /// DeepSpeed's Adam: adam_w_mode=true means decoupled weight decay (AdamW).
  std::optional<bool> adam_w_mode;
};

/// DeepSpeed's `scheduler` block, plus Transformers-style "linear"/"cosine" with warmup.
struct SchedulerConfig {
  /// DeepSpeed's WarmupDecayLR passes this warmup_max_lr on when none is given
  /// (its WarmupLR takes the optimizer's lr instead).
  static constexpr double kWarmupDecayMaxLrDefault = 1e-3;
  bool specified = false;
  /// "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "linear", "cosine" or "constant".
  std::string type = "constant";
  std::optional<double> warmup_min_lr;      ///< WarmupLR/WarmupDecayLR; default 0
  std::optional<double> warmup_max_lr;      ///< default = optimizer lr (WarmupDecayLR: kWarmupDecayMaxLrDefault)
  std::optional<int64_t> warmup_num_steps;  ///< default 1000 (DeepSpeed) / 0
  std::optional<int64_t> total_num_steps;   ///< WarmupDecayLR, WarmupCosineLR, linear, cosine; "auto" = run length
  std::string warmup_type = "log";          ///< "log" or "linear"
  double cos_min_ratio = 0.0001;            ///< WarmupCosineLR
  double warmup_min_ratio = 0.0;            ///< WarmupCosineLR
};

/// DeepSpeed's `zero_optimization` block (defaults as DeepSpeed's pydantic model).
struct ZeroConfig {
  /// DeepSpeed's fixed defaults, written once: the config readers, the
  /// accelerator and the engines' option structs all take them from here.
  static constexpr int64_t kDefaultReduceBucketSize = 500000000;
  static constexpr int64_t kDefaultAllgatherBucketSize = 500000000;
  static constexpr int64_t kDefaultSubGroupSize = 1000000000;
  static constexpr int64_t kDefaultPrefetchBucketSize = 50000000;
  static constexpr int64_t kDefaultParamPersistenceThreshold = 100000;
  static constexpr int64_t kDefaultMaxLiveParameters = 1000000000;
  static constexpr int64_t kDefaultMaxReuseDistance = 1000000000;
  /// overlap_comm when the config leaves it out (DeepSpeed: on for stage 3 only).
  static constexpr bool default_overlap_comm(int stage) { return stage == 3; }

  int stage = 0;
  bool contiguous_gradients = true;
  bool reduce_scatter = true;
  std::optional<int64_t> reduce_bucket_size;          ///< default 5e8; "auto" = H*H
  bool allgather_partitions = true;
  /// Read, and has no effect: DeepSpeed stages its post-step all-gather in
  /// buckets of this size; shardtrain gathers each unit into the buffer its
  /// parameters view, issued after the step and waited for by that unit's
  /// next forward, so nothing is staged (GatherScheduler::regather_after_step).
  int64_t allgather_bucket_size = kDefaultAllgatherBucketSize;
  /// Communication under computation: gradient buckets reduced while
  /// backward goes on and, for ZeRO-1/2 (and stage 3's persisted
  /// parameters), the post-step all-gather run under the next forward, so
  /// that the parameters are complete only through PreparedModel or from the
  /// next forward (Accelerator::step()). false: both are waited for, and
  /// step() returns with the parameters complete, as DeepSpeed's ZeRO-1/2.
  std::optional<bool> overlap_comm;                   ///< default: default_overlap_comm(stage)
  int64_t sub_group_size = kDefaultSubGroupSize;      ///< elements per optimizer step slice; 0: one per parameter
  std::optional<int64_t> stage3_prefetch_bucket_size;        ///< default 5e7; "auto" = 0.9*H*H
  std::optional<int64_t> stage3_param_persistence_threshold; ///< default 1e5; "auto" = 10*H
  int64_t stage3_max_live_parameters = kDefaultMaxLiveParameters;
  int64_t stage3_max_reuse_distance = kDefaultMaxReuseDistance;
  bool stage3_gather_16bit_weights_on_model_save = false;
  OffloadDevice offload_optimizer = OffloadDevice::kNone;
  OffloadDevice offload_param = OffloadDevice::kNone;
  bool offload_pin_memory = true;
  /// offload_optimizer.nvme_path / offload_param.nvme_path (required with device nvme).
  std::string offload_optimizer_nvme_path;
  std::string offload_param_nvme_path;
  bool round_robin_gradients = false;
  /// data_types.grad_accum_dtype; default fp32.
  DType grad_accum_dtype = DType::kFp32;
};

/// Accelerate's `fsdp_config` block (names without the `fsdp_` prefix).
struct FsdpConfig {
  ShardingStrategy sharding_strategy = ShardingStrategy::kFullShard;
  AutoWrapPolicy auto_wrap_policy = AutoWrapPolicy::kNoWrap;
  std::vector<std::string> transformer_layer_cls_to_wrap;
  int64_t min_num_params = 100000000;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kBackwardPre;
  bool forward_prefetch = false;
  bool offload_params = false;
  bool sync_module_states = true;
  bool cpu_ram_efficient_loading = false;
  bool activation_checkpointing = false;
  bool use_orig_params = true;
  bool limit_all_gathers = true;
  StateDictType state_dict_type = StateDictType::kFullStateDict;
  /// fsdp_pure_low_precision: explicit switch; unset = Accelerate's rule
  /// (low-precision load with mixed_precision: no).
  std::optional<bool> pure_low_precision;
  std::optional<DType> param_dtype;   ///< default: the mixed_precision dtype
  std::optional<DType> reduce_dtype;  ///< default: the mixed_precision dtype
  std::optional<DType> buffer_dtype;  ///< default: the mixed_precision dtype
  bool keep_low_precision_grads = false;
  std::vector<std::string> ignored_modules;
};

/// `precision_audit:` the lost-update detector (a shardtrain extra, read in
/// both formats). Every optimizer step counts the elements whose update was
/// rounded away when stored (StepInfo::lost_update_frac); after
/// `warmup_steps` the run warns when the mean over the last `warmup_steps`
/// steps exceeds `threshold`.
struct PrecisionAuditConfig {
  int64_t warmup_steps = 20;
  double threshold = 0.5;
  /// Fraction of the elements counted (a fixed subset: every
  /// round(1/sample_fraction)-th granule of 256); 0 turns the audit off.
  double sample_fraction = 1.0;
  /// The kernels' sample period: 0 when off, else round(1 / sample_fraction).
  int64_t sample_period() const;
};

struct TrainingConfig {
  // ---- Accelerate top level
  std::string compute_environment = "LOCAL_MACHINE";
  DistributedType distributed_type = DistributedType::kNo;
  MixedPrecision mixed_precision = MixedPrecision::kNo;
  int num_processes = 1;
  int num_machines = 1;
  int machine_rank = 0;
  std::string main_process_ip;
  int main_process_port = 29500;
  std::string main_training_function = "main";

  // ---- DeepSpeed top level (also reachable from Accelerate's deepspeed_config.*)
  std::optional<int64_t> train_batch_size;                 ///< "auto" = micro x accumulation x world
  std::optional<int64_t> train_micro_batch_size_per_gpu;   ///< "auto" = data loader batch size
  std::optional<int64_t> gradient_accumulation_steps;      ///< default 1
  std::optional<double> gradient_clipping;                 ///< 0 / unset = no clipping
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  LossScaleConfig fp16;
  bool bf16 = false;
  std::optional<DType> communication_data_type;
  int steps_per_print = 10;
  bool zero3_init_flag = false;
  ZeroConfig zero;
  FsdpConfig fsdp;
  /// Honoured top-level extras users put in their files (e.g. `gradient_checkpointing`).
  bool gradient_checkpointing = false;
  PrecisionAuditConfig precision_audit;
  NonFinitePolicy non_finite_policy = NonFinitePolicy::kSkip;
  CheckpointErrorPolicy checkpoint_on_error = CheckpointErrorPolicy::kContinue;

  // ---- bookkeeping
  bool strict = false;
  /// Files this config was read from (the YAML and/or the DeepSpeed JSON).
  std::vector<std::string> sources;
  /// Warnings collected while reading (unknown keys, not-implemented keys, ...).
  std::vector<std::string> warnings;
  /// DeepSpeed keys (dotted, e.g. "zero_optimization.reduce_bucket_size") the
  /// files set to "auto". Where "auto" and "absent" mean different things
  /// (gradient_clipping: 1.0 vs off; the hidden-size bucket formulas vs
  /// DeepSpeed's fixed defaults; scheduler warmup: the run's vs DeepSpeed's
  /// 1000) resolve_auto reads this; it empties the list once everything is resolved.
  std::vector<std::string> auto_keys;
  /// Whether `key` (DeepSpeed's dotted name) was "auto" and is not resolved yet.
  bool is_auto(const std::string& key) const;

  /// The ZeRO stage the run uses: zero.stage under DEEPSPEED; 0 otherwise.
  int zero_stage() const;
  /// Training compute dtype implied by mixed_precision / fp16.enabled / bf16.enabled.
  DType compute_dtype() const;
};

/// Facts about the run that "auto" values are resolved from.
struct AutoContext {
  int world_size = 1;
  std::optional<int64_t> micro_batch_size;   ///< from the data loader
  std::optional<int64_t> hidden_size;        ///< model hidden size H
  std::optional<int64_t> total_steps;        ///< optimizer steps of the run
  std::optional<int64_t> warmup_steps;       ///< the run's warmup (scheduler warmup_num_steps "auto"); else 0
  std::optional<double> max_grad_norm;       ///< the run's clipping norm (gradient_clipping "auto"); else 1.0
  /// For `shardtrain config check` without the run's facts: what only the
  /// run, its data loader or its model supplies (micro batch, "auto" steps,
  /// warmup, clipping, hidden-size buckets) stays unset, and "auto" keys stay
  /// recorded, instead of failing or taking defaults. Runs leave it false.
  bool leave_run_values_auto = false;
};

/// Reads a config file: `.yaml`/`.yml` as Accelerate YAML, `.json` as DeepSpeed
/// JSON (other extensions: sniffed from the content). Relative
/// deepspeed_config_file paths resolve against the working directory, as
/// Accelerate's do, then against the YAML's directory.
TrainingConfig load_config(const std::string& path);

/// Parses from text; `format` is "yaml" or "json". `base_dir` resolves
/// relative file references.
TrainingConfig parse_config(const std::string& text, const std::string& format,
                            const std::string& base_dir = ".");

/// Fills every "auto"/unset value and checks consistency (batch triple,
/// fp16 and bf16 both on, ...). Throws ConfigError naming the keys.
/// Also records context.world_size as num_processes (the world the batch
/// triple was checked against), so a printed resolved config reads back.
TrainingConfig resolve_auto(TrainingConfig config, const AutoContext& context);

/// The resolved config as YAML text (for `shardtrain config check`, checkpoints).
std::string to_yaml(const TrainingConfig& config);
/// The resolved config as JSON text.
std::string to_json(const TrainingConfig& config);

/// `shardtrain config convert`: the same run expressed for the other engine.
/// `target` is "fsdp" or "deepspeed"; notes on what has no equivalent are
/// appended to `notes`. Returns YAML (Accelerate) for fsdp, JSON for deepspeed.
std::string convert_config(const TrainingConfig& config, const std::string& target,
                           std::vector<std::string>& notes);

/// Environment overrides set by `shardtrain launch` (SHARDTRAIN_CONFIG_FILE,
/// SHARDTRAIN_DEEPSPEED_CONFIG_FILE, SHARDTRAIN_MIXED_PRECISION,
/// SHARDTRAIN_DISTRIBUTED_TYPE); returns nullopt when none is set.
std::optional<TrainingConfig> config_from_environment();

}  // namespace shardtrain
