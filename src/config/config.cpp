// Enum names and the small TrainingConfig members; the readers live in
// config_load.cpp (files and the merge), accelerate_yaml.cpp,
// deepspeed_json.cpp, cli_overrides.cpp and config_keys.cpp, "auto"
// resolution in config_resolve.cpp and the writers in config_output.cpp.
#include <algorithm>
#include <cmath>
#include <map>

#include "config/config_internal.h"
#include "shardtrain/config.h"
#include "shardtrain/error.h"

namespace shardtrain {

// The names are the ones the files use, so to_string output reads back.
const char* to_string(DistributedType type) {
  switch (type) {
    case DistributedType::kNo: return "NO";
    case DistributedType::kMultiCpu: return "MULTI_CPU";
    case DistributedType::kMultiGpu: return "MULTI_GPU";
    case DistributedType::kDeepSpeed: return "DEEPSPEED";
    case DistributedType::kFsdp: return "FSDP";
  }
  return "?";
}

const char* to_string(MixedPrecision precision) {
  switch (precision) {
    case MixedPrecision::kNo: return "no";
    case MixedPrecision::kFp16: return "fp16";
    case MixedPrecision::kBf16: return "bf16";
  }
  return "?";
}

const char* to_string(OffloadDevice device) {
  switch (device) {
    case OffloadDevice::kNone: return "none";
    case OffloadDevice::kCpu: return "cpu";
    case OffloadDevice::kNvme: return "nvme";
  }
  return "?";
}

const char* to_string(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kFullShard: return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp: return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard: return "NO_SHARD";
    case ShardingStrategy::kHybridShard: return "HYBRID_SHARD";
    case ShardingStrategy::kHybridShardZero2: return "HYBRID_SHARD_ZERO2";
  }
  return "?";
}

const char* to_string(AutoWrapPolicy policy) {
  switch (policy) {
    case AutoWrapPolicy::kTransformerBased: return "TRANSFORMER_BASED_WRAP";
    case AutoWrapPolicy::kSizeBased: return "SIZE_BASED_WRAP";
    case AutoWrapPolicy::kNoWrap: return "NO_WRAP";
  }
  return "?";
}

const char* to_string(BackwardPrefetch prefetch) {
  switch (prefetch) {
    case BackwardPrefetch::kBackwardPre: return "BACKWARD_PRE";
    case BackwardPrefetch::kBackwardPost: return "BACKWARD_POST";
    case BackwardPrefetch::kNoPrefetch: return "NO_PREFETCH";
  }
  return "?";
}

const char* to_string(StateDictType type) {
  switch (type) {
    case StateDictType::kFullStateDict: return "FULL_STATE_DICT";
    case StateDictType::kShardedStateDict: return "SHARDED_STATE_DICT";
  }
  return "?";
}

const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::kFp32: return "fp32";
    case DType::kBf16: return "bf16";
    case DType::kFp16: return "fp16";
  }
  return "?";
}

const char* to_string(NonFinitePolicy policy) { return policy == NonFinitePolicy::kSkip ? "skip" : "stop"; }
const char* to_string(CheckpointErrorPolicy policy) {
  return policy == CheckpointErrorPolicy::kContinue ? "continue" : "stop";
}

int64_t PrecisionAuditConfig::sample_period() const {
  if (!(sample_fraction > 0)) return 0;
  return std::max<int64_t>(1, std::llround(1.0 / sample_fraction));
}

int TrainingConfig::zero_stage() const {
  return distributed_type == DistributedType::kDeepSpeed ? zero.stage : 0;
}

DType TrainingConfig::compute_dtype() const {
  if (mixed_precision == MixedPrecision::kBf16 || bf16) return DType::kBf16;
  if (mixed_precision == MixedPrecision::kFp16 || fp16.enabled) return DType::kFp16;
  return DType::kFp32;
}

bool TrainingConfig::is_auto(const std::string& key) const {
  return std::find(auto_keys.begin(), auto_keys.end(), key) != auto_keys.end();
}

namespace config_detail {

std::optional<DType> dtype_from_name(const std::string& name) {
  std::string lower = lowercase(name);
  // Accelerate and Transformers users write torch's spelling too.
  if (lower.rfind("torch.", 0) == 0) lower = lower.substr(6);
  if (lower == "fp32" || lower == "float32" || lower == "float") return DType::kFp32;
  if (lower == "bf16" || lower == "bfloat16") return DType::kBf16;
  if (lower == "fp16" || lower == "float16" || lower == "half") return DType::kFp16;
  return std::nullopt;
}

const std::vector<std::string>& optimizer_types() {
  static const std::vector<std::string> kTypes = {"AdamW", "Adam", "SGD"};
  return kTypes;
}

const std::vector<std::string>& scheduler_types() {
  static const std::vector<std::string> kTypes = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
                                                  "linear",   "cosine",        "constant"};
  return kTypes;
}

bool is_deepspeed_scheduler(const std::string& type) {
  return type == "WarmupLR" || type == "WarmupDecayLR" || type == "WarmupCosineLR";
}

int64_t default_warmup_steps(const std::string& type) {
  return is_deepspeed_scheduler(type) ? kDeepSpeedWarmupSteps : 0;
}

const std::vector<std::string>& scheduler_params(const std::string& type) {
  // deepspeed/runtime/lr_schedules.py's constructors (last_batch_iteration,
  // which all three take, is read and warned about separately); transformers'
  // get_scheduler: warmup and total steps for linear and cosine, none for constant.
  static const std::map<std::string, std::vector<std::string>> kParams = {
      {"WarmupLR", {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"}},
      {"WarmupDecayLR", {"total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"}},
      {"WarmupCosineLR", {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"}},
      {"linear", {"warmup_num_steps", "total_num_steps"}},
      {"cosine", {"warmup_num_steps", "total_num_steps"}},
      {"constant", {}},
  };
  static const std::vector<std::string> kNone;
  auto it = kParams.find(type);
  return it == kParams.end() ? kNone : it->second;
}

bool scheduler_needs_total_steps(const std::string& type) {
  const auto& params = scheduler_params(type);
  return std::find(params.begin(), params.end(), "total_num_steps") != params.end();
}

bool is_scheduler_param(const std::string& key) {
  for (const std::string& type : scheduler_types()) {
    const auto& params = scheduler_params(type);
    if (std::find(params.begin(), params.end(), key) != params.end()) return true;
  }
  return false;
}

void check_precision_flags(const TrainingConfig& config, const std::string& where) {
  if (config.fp16.enabled && config.bf16) {
    ST_THROW(ConfigError, where, ": fp16.enabled and bf16.enabled are both true; enable at most one of them");
  }
  const bool fp16_mismatch = config.mixed_precision == MixedPrecision::kFp16 && config.bf16;
  const bool bf16_mismatch = config.mixed_precision == MixedPrecision::kBf16 && config.fp16.enabled;
  if (fp16_mismatch || bf16_mismatch) {
    ST_THROW(ConfigError, where, ": mixed_precision ", to_string(config.mixed_precision), " conflicts with ",
             fp16_mismatch ? "bf16.enabled: true" : "fp16.enabled: true",
             "; use one precision (mixed_precision is one of no, fp16, bf16)");
  }
}

}  // namespace config_detail
}  // namespace shardtrain
