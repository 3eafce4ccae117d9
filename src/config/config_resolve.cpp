// resolve_auto: fills "auto" and unset values from the run, following
// Transformers' HfTrainerDeepSpeedConfig and Accelerate's _prepare_deepspeed
// (reference/deepspeed.md §3), and checks what only the run can check.
#include <algorithm>
#include <string>

#include "config/config_internal.h"
#include "shardtrain/config.h"
#include "shardtrain/error.h"

namespace shardtrain {
namespace {

using config_detail::format_double;

/// DeepSpeed's `train_batch_size = micro x accumulation x world`, with any
/// one of the three derived from the other two.
void resolve_batch_triple(TrainingConfig& config, const AutoContext& context) {
  const int64_t world = context.world_size;
  auto& micro = config.train_micro_batch_size_per_gpu;
  auto& accumulation = config.gradient_accumulation_steps;
  auto& total = config.train_batch_size;
  // Accelerate takes "auto" micro batches from the data loader before DeepSpeed
  // checks the triple, so the loader's size counts as given.
  if (!micro && context.micro_batch_size) {
    if (*context.micro_batch_size < 1) {
      ST_THROW(ConfigError, "the data loader's micro batch size must be at least 1, got ",
               *context.micro_batch_size);
    }
    micro = context.micro_batch_size;
  }

  auto derive = [&](int64_t numerator, int64_t denominator, const std::string& derived,
                    const std::string& denominator_text) {
    if (numerator % denominator != 0 || numerator / denominator < 1) {
      ST_THROW(ConfigError, "train_batch_size ", numerator, " is not a multiple of ", denominator_text, " = ",
               denominator, ", so ", derived,
               " cannot be derived; make train_batch_size = train_micro_batch_size_per_gpu * "
               "gradient_accumulation_steps * world size");
    }
    return numerator / denominator;
  };

  if (total && micro && accumulation) {
    const int64_t product = *micro * *accumulation * world;
    if (*total != product) {
      ST_THROW(ConfigError, "train_batch_size ", *total, " != train_micro_batch_size_per_gpu ", *micro,
               " * gradient_accumulation_steps ", *accumulation, " * world size ", world, " = ", product,
               "; fix one of them or set it to \"auto\"");
    }
  } else if (total && micro) {
    accumulation = derive(*total, *micro * world, "gradient_accumulation_steps",
                          "train_micro_batch_size_per_gpu " + std::to_string(*micro) + " * world size " +
                              std::to_string(world));
  } else if (total && accumulation) {
    micro = derive(*total, *accumulation * world, "train_micro_batch_size_per_gpu",
                   "gradient_accumulation_steps " + std::to_string(*accumulation) + " * world size " +
                       std::to_string(world));
  } else if (micro) {
    if (!accumulation) accumulation = 1;
    total = *micro * *accumulation * world;
  } else if (total) {
    accumulation = 1;
    micro = derive(*total, world, "train_micro_batch_size_per_gpu", "world size");
  } else if (!context.leave_run_values_auto) {
    ST_THROW(ConfigError,
             "train_micro_batch_size_per_gpu is \"auto\" (or unset) and the run gave no micro batch size: set it "
             "(or train_batch_size) in the config, or pass the data loader's batch size "
             "(AutoContext::micro_batch_size; `shardtrain config check --micro-batch B`)");
  }
}

void resolve_zero(TrainingConfig& config, const AutoContext& context) {
  ZeroConfig& zero = config.zero;
  const std::optional<int64_t>& hidden = context.hidden_size;
  if (hidden && *hidden < 1) ST_THROW(ConfigError, "the model's hidden size must be at least 1, got ", *hidden);
  // Without the model an "auto" bucket stays "auto" (config check); a run
  // without a hidden size takes DeepSpeed's defaults below.
  auto left_to_the_model = [&](const std::string& key) {
    return !hidden && context.leave_run_values_auto && config.is_auto(key);
  };
  // Transformers' trainer_config_finalize: only an "auto" follows the model;
  // an absent key keeps DeepSpeed's fixed default.
  if (!zero.reduce_bucket_size && !left_to_the_model(config_detail::kReduceBucketKey)) {
    zero.reduce_bucket_size = config.is_auto(config_detail::kReduceBucketKey) && hidden
                                  ? *hidden * *hidden
                                  : config_detail::kDeepSpeedReduceBucketSize;
  }
  if (!zero.stage3_prefetch_bucket_size && !left_to_the_model(config_detail::kPrefetchBucketKey)) {
    zero.stage3_prefetch_bucket_size = config.is_auto(config_detail::kPrefetchBucketKey) && hidden
                                           ? (9 * *hidden * *hidden) / 10
                                           : config_detail::kDeepSpeedPrefetchBucketSize;
  }
  if (!zero.stage3_param_persistence_threshold && !left_to_the_model(config_detail::kPersistenceKey)) {
    zero.stage3_param_persistence_threshold = config.is_auto(config_detail::kPersistenceKey) && hidden
                                                  ? 10 * *hidden
                                                  : config_detail::kDeepSpeedParamPersistenceThreshold;
  }
  if (!zero.overlap_comm) zero.overlap_comm = ZeroConfig::default_overlap_comm(zero.stage);
}

void resolve_optimizer(TrainingConfig& config, const AutoContext& context) {
  OptimizerConfig& optimizer = config.optimizer;
  // An "auto" hyperparameter is the run's (Transformers: learning_rate,
  // adam_beta1/2, adam_epsilon, weight_decay): config check leaves it so.
  auto from_the_run = [&](const char* name) {
    return context.leave_run_values_auto && config.is_auto(std::string("optimizer.params.") + name);
  };
  if (!optimizer.lr && !from_the_run("lr")) optimizer.lr = 1e-3;
  if (!optimizer.betas && !from_the_run("betas")) optimizer.betas = std::array<double, 2>{0.9, 0.999};
  if (!optimizer.eps && !from_the_run("eps")) optimizer.eps = 1e-8;
  // A DeepSpeed optimizer block builds FusedAdam / DeepSpeedCPUAdam, whose
  // weight_decay defaults to 0 (torch_adam is not implemented), as
  // Transformers' "auto" (its weight_decay, 0.0) does. Without a block the
  // program's optimizer is torch.optim.AdamW's, 0.01.
  if (!optimizer.weight_decay && !from_the_run("weight_decay")) {
    optimizer.weight_decay = optimizer.type == "AdamW" && !optimizer.specified ? 0.01 : 0.0;
  }
  // DeepSpeed's "Adam" is AdamW unless adam_w_mode says otherwise
  // (ADAM_W_MODE_DEFAULT = True); its "AdamW" always decouples the decay.
  if (optimizer.type == "AdamW") {
    optimizer.adam_w_mode = true;
  } else if (optimizer.type == "Adam" && !optimizer.adam_w_mode) {
    optimizer.adam_w_mode = true;
  }
  if (optimizer.nesterov && optimizer.momentum <= 0) {
    ST_THROW(ConfigError, "optimizer.params.nesterov: true needs optimizer.params.momentum > 0, got ",
             format_double(optimizer.momentum));
  }
}

void resolve_scheduler(TrainingConfig& config, const AutoContext& context) {
  SchedulerConfig& scheduler = config.scheduler;
  if (!scheduler.warmup_min_lr) scheduler.warmup_min_lr = 0.0;
  // DeepSpeed's WarmupDecayLR passes its own warmup_max_lr default (1e-3) on;
  // WarmupLR's absent one is the optimizer's lr, as Transformers' "auto" is.
  if (!scheduler.warmup_max_lr) {
    const bool absent = !config.is_auto("scheduler.params.warmup_max_lr");
    scheduler.warmup_max_lr = scheduler.type == "WarmupDecayLR" && absent
                                  ? std::optional<double>(SchedulerConfig::kWarmupDecayMaxLrDefault)
                                  : config.optimizer.lr;
  }
  const bool run_gives_warmup = config.is_auto(config_detail::kWarmupStepsKey) && !context.warmup_steps;
  if (!scheduler.warmup_num_steps && !(run_gives_warmup && context.leave_run_values_auto)) {
    // "auto" is the run's warmup (Transformers: warmup_steps / warmup_ratio,
    // 0 unless asked), at least 1 for DeepSpeed's schedulers, which refuse 0
    // (transformers' own fill does the same); an absent key is DeepSpeed's
    // default for its schedulers.
    const int64_t floor = config_detail::is_deepspeed_scheduler(scheduler.type) ? 1 : 0;
    scheduler.warmup_num_steps = config.is_auto(config_detail::kWarmupStepsKey)
                                     ? std::max(floor, context.warmup_steps.value_or(0))
                                     : config_detail::default_warmup_steps(scheduler.type);
  }
  if (scheduler.warmup_num_steps && *scheduler.warmup_num_steps < 0) {
    ST_THROW(ConfigError, "scheduler.params.warmup_num_steps must be an integer >= 0, got ",
             *scheduler.warmup_num_steps);
  }
  if (!scheduler.total_num_steps) scheduler.total_num_steps = context.total_steps;
  if (scheduler.specified && config_detail::scheduler_needs_total_steps(scheduler.type)) {
    if (!scheduler.total_num_steps && context.leave_run_values_auto) return;
    if (!scheduler.total_num_steps) {
      ST_THROW(ConfigError, "scheduler ", scheduler.type,
               " needs scheduler.params.total_num_steps, which is \"auto\" (or unset) and the run length is "
               "unknown: set it in the config or pass the run's optimizer steps (AutoContext::total_steps; "
               "`shardtrain config check --steps S`)");
    }
    if (*scheduler.total_num_steps < 1) {
      ST_THROW(ConfigError, "scheduler.params.total_num_steps must be an integer >= 1, got ",
               *scheduler.total_num_steps);
    }
    if (scheduler.warmup_num_steps && *scheduler.warmup_num_steps > *scheduler.total_num_steps) {
      config.warnings.push_back(
          "scheduler.params.warmup_num_steps " + std::to_string(*scheduler.warmup_num_steps) +
          " is larger than total_num_steps " + std::to_string(*scheduler.total_num_steps) +
          (scheduler.type == "WarmupDecayLR"
               ? ": WarmupDecayLR warms up over all of them, then drops to warmup_min_lr at once (no decay)"
               : ": the warmup does not end within total_num_steps"));
    }
  }
}

void resolve_fsdp_dtypes(TrainingConfig& config) {
  FsdpConfig& fsdp = config.fsdp;
  // With mixed_precision: no nothing is cast: an unset dtype stays unset and
  // means "the dtype the model was loaded in" (bf16 for pure low precision).
  if (config.mixed_precision == MixedPrecision::kNo) return;
  const DType precision = config.mixed_precision == MixedPrecision::kBf16 ? DType::kBf16 : DType::kFp16;
  if (!fsdp.param_dtype) fsdp.param_dtype = precision;
  // FSDP's MixedPrecision: reduce_dtype falls back to param_dtype.
  if (!fsdp.reduce_dtype) fsdp.reduce_dtype = fsdp.param_dtype;
  if (!fsdp.buffer_dtype) fsdp.buffer_dtype = precision;
}

void check_values(const TrainingConfig& config) {
  const LossScaleConfig& fp16 = config.fp16;
  if (fp16.loss_scale_window <= 0) {
    ST_THROW(ConfigError, "fp16.loss_scale_window must be a positive integer, got ", fp16.loss_scale_window);
  }
  if (!(fp16.min_loss_scale > 0)) {
    ST_THROW(ConfigError, "fp16.min_loss_scale must be a number > 0, got ", format_double(fp16.min_loss_scale));
  }
  if (fp16.hysteresis < 1) ST_THROW(ConfigError, "fp16.hysteresis must be a positive integer, got ", fp16.hysteresis);
  if (fp16.loss_scale < 0) {
    ST_THROW(ConfigError, "fp16.loss_scale must be a number >= 0 (0 = dynamic loss scaling), got ",
             format_double(fp16.loss_scale));
  }
  if (config.zero.stage < 0 || config.zero.stage > 3) {
    ST_THROW(ConfigError, "zero_optimization.stage must be an integer 0-3, got ", config.zero.stage);
  }
  if (config.gradient_clipping && *config.gradient_clipping < 0) {
    ST_THROW(ConfigError, "gradient_clipping must be a number >= 0 (0 = off), got ",
             format_double(*config.gradient_clipping));
  }
  auto at_least_one = [](const std::optional<int64_t>& value, const char* key) {
    if (value && *value < 1) ST_THROW(ConfigError, key, " must be an integer >= 1, got ", *value);
  };
  at_least_one(config.train_batch_size, "train_batch_size");
  at_least_one(config.train_micro_batch_size_per_gpu, "train_micro_batch_size_per_gpu");
  at_least_one(config.gradient_accumulation_steps, "gradient_accumulation_steps");
}

}  // namespace

TrainingConfig resolve_auto(TrainingConfig config, const AutoContext& context) {
  if (context.world_size < 1) ST_THROW(ConfigError, "world size must be at least 1, got ", context.world_size);
  config_detail::check_precision_flags(config, "resolve_auto");
  // Keep the three precision fields in step for configs built in code.
  if (config.fp16.enabled) config.mixed_precision = MixedPrecision::kFp16;
  if (config.bf16) config.mixed_precision = MixedPrecision::kBf16;
  config.fp16.enabled = config.mixed_precision == MixedPrecision::kFp16;
  config.bf16 = config.mixed_precision == MixedPrecision::kBf16;
  check_values(config);

  resolve_batch_triple(config, context);
  // The run's world is what train_batch_size was checked against; a printed
  // resolved config then reads back and resolves to the same numbers.
  config.num_processes = context.world_size;
  const bool run_gives_clipping = config.is_auto(config_detail::kGradientClippingKey) && !context.max_grad_norm;
  if (!config.gradient_clipping && !(run_gives_clipping && context.leave_run_values_auto)) {
    // Accelerate's "auto" is 1.0 (Transformers: max_grad_norm, default 1.0);
    // an absent key means no clipping.
    config.gradient_clipping = config.is_auto(config_detail::kGradientClippingKey)
                                   ? context.max_grad_norm.value_or(1.0)
                                   : 0.0;
  }
  resolve_zero(config, context);
  resolve_optimizer(config, context);
  resolve_scheduler(config, context);
  resolve_fsdp_dtypes(config);
  // Kept for config check, whose printout then says "auto" where the run decides.
  if (!context.leave_run_values_auto) config.auto_keys.clear();
  check_values(config);
  return config;
}

}  // namespace shardtrain
