#pragma once
// Facts shared by the config readers, resolve_auto and the writers. Private to src/config.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "config/config_tree.h"
#include "shardtrain/config.h"

namespace shardtrain::config_detail {

// DeepSpeed's defaults for the values "auto" derives from the hidden size.
constexpr int64_t kDeepSpeedReduceBucketSize = ZeroConfig::kDefaultReduceBucketSize;
constexpr int64_t kDeepSpeedPrefetchBucketSize = ZeroConfig::kDefaultPrefetchBucketSize;
constexpr int64_t kDeepSpeedParamPersistenceThreshold = ZeroConfig::kDefaultParamPersistenceThreshold;
// DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR default warmup.
constexpr int64_t kDeepSpeedWarmupSteps = 1000;

// Keys whose "auto" differs from their absence (see TrainingConfig::auto_keys).
inline const std::string kGradientClippingKey = "gradient_clipping";
inline const std::string kReduceBucketKey = "zero_optimization.reduce_bucket_size";
inline const std::string kPrefetchBucketKey = "zero_optimization.stage3_prefetch_bucket_size";
inline const std::string kPersistenceKey = "zero_optimization.stage3_param_persistence_threshold";
inline const std::string kWarmupStepsKey = "scheduler.params.warmup_num_steps";

/// The accepted spellings of each enum (first = canonical, as written back).
std::optional<DType> dtype_from_name(const std::string& name);
const std::vector<std::string>& optimizer_types();           ///< AdamW, Adam, SGD
const std::vector<std::string>& scheduler_types();           ///< WarmupLR, ..., constant
/// The type takes total_num_steps (scheduler_params): WarmupDecayLR, WarmupCosineLR, linear, cosine.
bool scheduler_needs_total_steps(const std::string& type);
/// WarmupLR, WarmupDecayLR, WarmupCosineLR (as against transformers' linear, cosine, constant).
bool is_deepspeed_scheduler(const std::string& type);
/// DeepSpeed's own schedulers default to 1000 warmup steps; the others to 0.
int64_t default_warmup_steps(const std::string& type);
/// The scheduler.params keys `type` takes: its constructor's keyword
/// arguments (DeepSpeed calls scheduler(optimizer, **params), so any other is
/// a TypeError there). The reader refuses the others; the writer writes these.
const std::vector<std::string>& scheduler_params(const std::string& type);
/// `key` is a parameter of some scheduler (of scheduler_types()).
bool is_scheduler_param(const std::string& key);

/// Raises ConfigError when fp16 and bf16 are both on, or when either
/// contradicts mixed_precision; `where` names the caller for the message.
void check_precision_flags(const TrainingConfig& config, const std::string& where);

/// The whole config as a tree: Accelerate keys, then the DeepSpeed keys
/// (inline, which the reader accepts in any config file), then fsdp_config.
Node training_config_tree(const TrainingConfig& config);
/// The DeepSpeed part only; `for_deepspeed` leaves out the optimizer and
/// scheduler parameters that the chosen type does not take (DeepSpeed
/// passes them to the constructor, which would reject them).
Node deepspeed_tree(const TrainingConfig& config, bool for_deepspeed);
/// Accelerate's top-level keys and fsdp_config, as `accelerate config` writes them.
Node accelerate_tree(const TrainingConfig& config, bool with_fsdp_config);

}  // namespace shardtrain::config_detail
