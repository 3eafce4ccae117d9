// Writing configs: to_yaml / to_json (every field, one order, readable back
// by load_config) and convert_config (the same run for the other engine,
// using Accelerate's concept guide "FSDP vs DeepSpeed").
#include <string>
#include <vector>

#include "config/config_internal.h"
#include "shardtrain/config.h"
#include "shardtrain/error.h"

namespace shardtrain {
namespace config_detail {
namespace {

Node auto_value() { return Node::of("auto"); }

Node optional_int(const std::optional<int64_t>& value) { return value ? Node::of(*value) : auto_value(); }
Node optional_double(const std::optional<double>& value) { return value ? Node::of(*value) : auto_value(); }

/// An unset value whose "auto" and absence differ prints as what it means.
Node int_or_default(const TrainingConfig& config, const std::optional<int64_t>& value, const std::string& key,
                    int64_t absent_default) {
  if (value) return Node::of(*value);
  return config.is_auto(key) ? auto_value() : Node::of(absent_default);
}

Node dtype_or_null(const std::optional<DType>& dtype) { return dtype ? Node::of(to_string(*dtype)) : Node::null(); }

Node optimizer_tree(const TrainingConfig& config, bool for_deepspeed) {
  const OptimizerConfig& optimizer = config.optimizer;
  const bool sgd = optimizer.type == "SGD";
  Node params = Node::map();
  params.add("lr", optional_double(optimizer.lr));
  if (!for_deepspeed || !sgd) {
    if (optimizer.betas) {
      params.add("betas", Node::list().push(Node::of((*optimizer.betas)[0])).push(Node::of((*optimizer.betas)[1])));
    } else {
      params.add("betas", auto_value());
    }
    params.add("eps", optional_double(optimizer.eps));
  }
  params.add("weight_decay", optional_double(optimizer.weight_decay));
  if (!for_deepspeed || sgd) {
    params.add("momentum", Node::of(optimizer.momentum));
    params.add("nesterov", Node::of(optimizer.nesterov));
  }
  if (!for_deepspeed || (optimizer.type == "Adam" && optimizer.adam_w_mode)) {
    params.add("adam_w_mode", optimizer.adam_w_mode ? Node::of(*optimizer.adam_w_mode) : Node::null());
  }
  return Node::map().add("type", Node::of(optimizer.type)).add("params", std::move(params));
}

Node scheduler_tree(const TrainingConfig& config) {
  const SchedulerConfig& scheduler = config.scheduler;
  const std::string& type = scheduler.type;
  // Only the keys the type takes: DeepSpeed refuses any other, and a value
  // the schedule never reads would only mislead whoever reads the dump.
  Node params = Node::map();
  for (const std::string& key : scheduler_params(type)) {
    if (key == "warmup_min_lr") params.add(key, optional_double(scheduler.warmup_min_lr));
    if (key == "warmup_max_lr") params.add(key, optional_double(scheduler.warmup_max_lr));
    if (key == "warmup_num_steps") {
      params.add(key, int_or_default(config, scheduler.warmup_num_steps, kWarmupStepsKey, default_warmup_steps(type)));
    }
    if (key == "total_num_steps") params.add(key, optional_int(scheduler.total_num_steps));
    if (key == "warmup_type") params.add(key, Node::of(scheduler.warmup_type));
    if (key == "cos_min_ratio") params.add(key, Node::of(scheduler.cos_min_ratio));
    if (key == "warmup_min_ratio") params.add(key, Node::of(scheduler.warmup_min_ratio));
  }
  return Node::map().add("type", Node::of(type)).add("params", std::move(params));
}

Node offload_tree(OffloadDevice device, const std::string& nvme_path, bool pin_memory, bool for_deepspeed) {
  Node offload = Node::map().add("device", Node::of(to_string(device)));
  if (!nvme_path.empty()) {
    offload.add("nvme_path", Node::of(nvme_path));
  } else if (!for_deepspeed) {
    offload.add("nvme_path", Node::null());
  }
  offload.add("pin_memory", Node::of(pin_memory));
  return offload;
}

Node zero_tree(const TrainingConfig& config, bool for_deepspeed) {
  const ZeroConfig& zero = config.zero;
  Node tree = Node::map();
  tree.add("stage", Node::of(zero.stage))
      .add("contiguous_gradients", Node::of(zero.contiguous_gradients))
      .add("reduce_scatter", Node::of(zero.reduce_scatter))
      .add("reduce_bucket_size",
           int_or_default(config, zero.reduce_bucket_size, kReduceBucketKey, kDeepSpeedReduceBucketSize))
      .add("allgather_partitions", Node::of(zero.allgather_partitions))
      .add("allgather_bucket_size", Node::of(zero.allgather_bucket_size))
      .add("overlap_comm", zero.overlap_comm ? Node::of(*zero.overlap_comm) : Node::null())
      .add("round_robin_gradients", Node::of(zero.round_robin_gradients))
      .add("sub_group_size", Node::of(zero.sub_group_size))
      .add("stage3_prefetch_bucket_size", int_or_default(config, zero.stage3_prefetch_bucket_size,
                                                         kPrefetchBucketKey, kDeepSpeedPrefetchBucketSize))
      .add("stage3_param_persistence_threshold",
           int_or_default(config, zero.stage3_param_persistence_threshold, kPersistenceKey,
                          kDeepSpeedParamPersistenceThreshold))
      .add("stage3_max_live_parameters", Node::of(zero.stage3_max_live_parameters))
      .add("stage3_max_reuse_distance", Node::of(zero.stage3_max_reuse_distance))
      .add("stage3_gather_16bit_weights_on_model_save", Node::of(zero.stage3_gather_16bit_weights_on_model_save))
      .add("offload_optimizer", offload_tree(zero.offload_optimizer, zero.offload_optimizer_nvme_path,
                                             zero.offload_pin_memory, for_deepspeed))
      .add("offload_param",
           offload_tree(zero.offload_param, zero.offload_param_nvme_path, zero.offload_pin_memory, for_deepspeed));
  return tree;
}

Node fsdp_tree(const FsdpConfig& fsdp) {
  Node tree = Node::map();
  tree.add("fsdp_sharding_strategy", Node::of(to_string(fsdp.sharding_strategy)))
      .add("fsdp_auto_wrap_policy", Node::of(to_string(fsdp.auto_wrap_policy)))
      // Accelerate writes the classes as one comma-separated string.
      .add("fsdp_transformer_layer_cls_to_wrap", Node::of(join(fsdp.transformer_layer_cls_to_wrap, ",")))
      .add("fsdp_min_num_params", Node::of(fsdp.min_num_params))
      .add("fsdp_backward_prefetch", Node::of(to_string(fsdp.backward_prefetch)))
      .add("fsdp_forward_prefetch", Node::of(fsdp.forward_prefetch))
      .add("fsdp_offload_params", Node::of(fsdp.offload_params))
      .add("fsdp_sync_module_states", Node::of(fsdp.sync_module_states))
      .add("fsdp_cpu_ram_efficient_loading", Node::of(fsdp.cpu_ram_efficient_loading))
      .add("fsdp_activation_checkpointing", Node::of(fsdp.activation_checkpointing))
      .add("fsdp_use_orig_params", Node::of(fsdp.use_orig_params))
      .add("fsdp_limit_all_gathers", Node::of(fsdp.limit_all_gathers))
      .add("fsdp_state_dict_type", Node::of(to_string(fsdp.state_dict_type)))
      .add("fsdp_pure_low_precision", fsdp.pure_low_precision ? Node::of(*fsdp.pure_low_precision) : Node::null())
      .add("fsdp_param_dtype", dtype_or_null(fsdp.param_dtype))
      .add("fsdp_reduce_dtype", dtype_or_null(fsdp.reduce_dtype))
      .add("fsdp_buffer_dtype", dtype_or_null(fsdp.buffer_dtype))
      .add("fsdp_keep_low_precision_grads", Node::of(fsdp.keep_low_precision_grads))
      .add("fsdp_ignored_modules", Node::of(join(fsdp.ignored_modules, ",")));
  return tree;
}

}  // namespace

Node deepspeed_tree(const TrainingConfig& config, bool for_deepspeed) {
  Node tree = Node::map();
  tree.add("train_batch_size", optional_int(config.train_batch_size))
      .add("train_micro_batch_size_per_gpu", optional_int(config.train_micro_batch_size_per_gpu))
      .add("gradient_accumulation_steps", optional_int(config.gradient_accumulation_steps));
  if (config.gradient_clipping) {
    tree.add("gradient_clipping", Node::of(*config.gradient_clipping));
  } else {
    tree.add("gradient_clipping", config.is_auto(kGradientClippingKey) ? auto_value() : Node::of(0.0));
  }
  tree.add("steps_per_print", Node::of(config.steps_per_print));
  if (!for_deepspeed || config.communication_data_type) {
    tree.add("communication_data_type", dtype_or_null(config.communication_data_type));
  }
  // DeepSpeed's own default (None: the model's dtype) is written as nothing:
  // an explicit fp32 under bf16 at stage 0 is refused by its engine.
  if (!for_deepspeed || config.zero.grad_accum_dtype != DType::kFp32) {
    tree.add("data_types", Node::map().add("grad_accum_dtype", Node::of(to_string(config.zero.grad_accum_dtype))));
  }
  // No block means the program brings its own optimizer / scheduler (DeepSpeed's
  // client optimizer); printing defaults would claim a choice nobody made.
  if (config.optimizer.specified) tree.add("optimizer", optimizer_tree(config, for_deepspeed));
  if (config.scheduler.specified) tree.add("scheduler", scheduler_tree(config));
  const LossScaleConfig& fp16 = config.fp16;
  Node fp16_tree = Node::map()
                       .add("enabled", Node::of(fp16.enabled))
                       .add("loss_scale", Node::of(fp16.loss_scale))
                       .add("initial_scale_power", Node::of(fp16.initial_scale_power))
                       .add("loss_scale_window", Node::of(fp16.loss_scale_window))
                       .add("hysteresis", Node::of(fp16.hysteresis))
                       .add("consecutive_hysteresis", Node::of(fp16.consecutive_hysteresis))
                       .add("min_loss_scale", Node::of(fp16.min_loss_scale));
  // Not every DeepSpeed reads this key (its config models refuse unknown
  // keys): a DeepSpeed file carries it only when it says what the default does not.
  if (!for_deepspeed || !fp16.raise_error_at_min_scale) {
    fp16_tree.add("raise_error_at_min_scale", Node::of(fp16.raise_error_at_min_scale));
  }
  tree.add("fp16", std::move(fp16_tree));
  tree.add("bf16", Node::map().add("enabled", Node::of(config.bf16)));
  tree.add("zero_optimization", zero_tree(config, for_deepspeed));
  return tree;
}

Node accelerate_tree(const TrainingConfig& config, bool with_fsdp_config) {
  Node tree = Node::map();
  tree.add("compute_environment", Node::of(config.compute_environment))
      .add("distributed_type", Node::of(to_string(config.distributed_type)))
      .add("mixed_precision", Node::of(to_string(config.mixed_precision)))
      .add("num_processes", Node::of(config.num_processes))
      .add("num_machines", Node::of(config.num_machines))
      .add("machine_rank", Node::of(config.machine_rank))
      .add("main_process_ip", config.main_process_ip.empty() ? Node::null() : Node::of(config.main_process_ip))
      .add("main_process_port", Node::of(config.main_process_port))
      .add("main_training_function", Node::of(config.main_training_function));
  if (with_fsdp_config) tree.add("fsdp_config", fsdp_tree(config.fsdp));
  return tree;
}

Node precision_audit_tree(const PrecisionAuditConfig& audit) {
  Node tree = Node::map();
  tree.add("warmup_steps", Node::of(audit.warmup_steps))
      .add("threshold", Node::of(audit.threshold))
      .add("sample_fraction", Node::of(audit.sample_fraction));
  return tree;
}

bool is_default(const PrecisionAuditConfig& audit) {
  const PrecisionAuditConfig defaults;
  return audit.warmup_steps == defaults.warmup_steps && audit.threshold == defaults.threshold &&
         audit.sample_fraction == defaults.sample_fraction;
}

Node training_config_tree(const TrainingConfig& config) {
  Node tree = accelerate_tree(config, false);
  tree.add("gradient_checkpointing", Node::of(config.gradient_checkpointing))
      .add("zero3_init_flag", Node::of(config.zero3_init_flag))
      .add("strict", Node::of(config.strict))
      .add("precision_audit", precision_audit_tree(config.precision_audit))
      .add("non_finite_policy", Node::of(to_string(config.non_finite_policy)))
      .add("checkpoint_on_error", Node::of(to_string(config.checkpoint_on_error)));
  for (auto& member : deepspeed_tree(config, false).members) tree.add(member.first, std::move(member.second));
  tree.add("fsdp_config", fsdp_tree(config.fsdp));
  return tree;
}

}  // namespace config_detail

std::string to_yaml(const TrainingConfig& config) {
  return config_detail::emit_yaml(config_detail::training_config_tree(config));
}

std::string to_json(const TrainingConfig& config) {
  return config_detail::emit_json(config_detail::training_config_tree(config));
}

// ---------------------------------------------------------------- convert

namespace {

using config_detail::format_double;
using config_detail::join;
using config_detail::Node;

bool is_data_parallel(DistributedType type) {
  return type == DistributedType::kNo || type == DistributedType::kMultiCpu || type == DistributedType::kMultiGpu;
}

void note_launch_settings(const TrainingConfig& config, std::vector<std::string>& notes) {
  std::vector<std::string> settings;
  if (config.num_processes != 1) settings.push_back("num_processes " + std::to_string(config.num_processes));
  if (config.num_machines != 1) settings.push_back("num_machines " + std::to_string(config.num_machines));
  if (config.machine_rank != 0) settings.push_back("machine_rank " + std::to_string(config.machine_rank));
  if (!config.main_process_ip.empty()) settings.push_back("main_process_ip " + config.main_process_ip);
  if (config.main_process_port != 29500) {
    settings.push_back("main_process_port " + std::to_string(config.main_process_port));
  }
  if (settings.empty()) return;
  notes.push_back("launch settings (" + join(settings, ", ") +
                  ") are not DeepSpeed keys: pass them to `shardtrain launch`, or keep an Accelerate YAML with "
                  "distributed_type: DEEPSPEED and deepspeed_config.deepspeed_config_file naming this JSON");
}

std::string to_deepspeed(const TrainingConfig& source, std::vector<std::string>& notes) {
  TrainingConfig out = source;
  out.distributed_type = DistributedType::kDeepSpeed;
  if (source.distributed_type == DistributedType::kDeepSpeed) {
    notes.push_back("the config already uses DeepSpeed; it is written out unchanged");
  } else if (is_data_parallel(source.distributed_type)) {
    out.zero.stage = 0;
    notes.push_back(std::string("distributed_type ") + to_string(source.distributed_type) +
                    " (plain data parallelism) becomes ZeRO stage 0");
  } else {
    const FsdpConfig& fsdp = source.fsdp;
    ZeroConfig& zero = out.zero;
    switch (fsdp.sharding_strategy) {
      case ShardingStrategy::kFullShard: zero.stage = 3; break;
      case ShardingStrategy::kShardGradOp: zero.stage = 2; break;
      case ShardingStrategy::kNoShard: zero.stage = 0; break;
      case ShardingStrategy::kHybridShard:
        zero.stage = 3;
        notes.push_back("HYBRID_SHARD becomes ZeRO stage 3 sharded over all ranks: its DeepSpeed counterpart, "
                        "ZeRO++ hpZ (zero_hpz_partition_size = GPUs per node), is not implemented by shardtrain");
        break;
      case ShardingStrategy::kHybridShardZero2:
        zero.stage = 2;
        notes.push_back("HYBRID_SHARD_ZERO2 becomes ZeRO stage 2 over all ranks: DeepSpeed has no intra-node-only "
                        "sharding without ZeRO++ hpZ, which shardtrain does not implement");
        break;
    }
    if (fsdp.offload_params) {
      if (zero.stage == 3) {
        zero.offload_param = OffloadDevice::kCpu;
        zero.offload_optimizer = OffloadDevice::kCpu;
        notes.push_back("fsdp_offload_params (parameters, gradients and optimizer step together) becomes "
                        "offload_param and offload_optimizer on cpu; DeepSpeed can also offload just one of them");
      } else if (zero.stage > 0) {
        zero.offload_optimizer = OffloadDevice::kCpu;
        notes.push_back("fsdp_offload_params becomes offload_optimizer cpu only: DeepSpeed offloads parameters at "
                        "stage 3 alone");
      } else {
        notes.push_back("fsdp_offload_params has no equivalent at ZeRO stage 0 (DeepSpeed offload needs ZeRO "
                        "1-3); it is dropped");
      }
    }
    if (fsdp.cpu_ram_efficient_loading) {
      out.zero3_init_flag = true;
      if (zero.stage != 3) {
        notes.push_back("fsdp_cpu_ram_efficient_loading becomes zero3_init_flag, which only acts at stage 3");
      }
    }
    zero.stage3_gather_16bit_weights_on_model_save = fsdp.state_dict_type == StateDictType::kFullStateDict;
    notes.push_back(std::string("fsdp_state_dict_type ") + to_string(fsdp.state_dict_type) +
                    " becomes stage3_gather_16bit_weights_on_model_save: " +
                    (zero.stage3_gather_16bit_weights_on_model_save ? "true" : "false") +
                    "; DeepSpeed's consolidated weights are 16-bit where FSDP's full state dict keeps the fp32 "
                    "master values");
    if (fsdp.pure_low_precision.value_or(false)) {
      notes.push_back("fsdp_pure_low_precision has no DeepSpeed equivalent: ZeRO always keeps fp32 master weights "
                      "and optimizer state (12 bytes/parameter for Adam instead of 4)");
    }
    if (fsdp.reduce_dtype && *fsdp.reduce_dtype != source.compute_dtype()) {
      out.communication_data_type = fsdp.reduce_dtype;
      notes.push_back(std::string("fsdp_reduce_dtype ") + to_string(*fsdp.reduce_dtype) +
                      " becomes communication_data_type");
    }
    if (fsdp.keep_low_precision_grads) {
      notes.push_back("fsdp_keep_low_precision_grads has no DeepSpeed equivalent (ZeRO accumulates gradients in "
                      "data_types.grad_accum_dtype)");
    }
    if (fsdp.activation_checkpointing) {
      out.gradient_checkpointing = true;
      notes.push_back("fsdp_activation_checkpointing becomes gradient_checkpointing: true (DeepSpeed's own "
                      "activation_checkpointing block is not implemented by shardtrain)");
    }
    if (!fsdp.transformer_layer_cls_to_wrap.empty() || fsdp.auto_wrap_policy != AutoWrapPolicy::kNoWrap) {
      notes.push_back(std::string("fsdp_auto_wrap_policy ") + to_string(fsdp.auto_wrap_policy) +
                      (fsdp.transformer_layer_cls_to_wrap.empty()
                           ? std::string()
                           : " (" + join(fsdp.transformer_layer_cls_to_wrap, ",") + ")") +
                      " is not needed: ZeRO partitions parameter by parameter");
    }
    notes.push_back("fsdp_backward_prefetch, fsdp_forward_prefetch, fsdp_use_orig_params, fsdp_sync_module_states "
                    "and fsdp_limit_all_gathers have no DeepSpeed keys: ZeRO-3 prefetches by "
                    "stage3_prefetch_bucket_size and synchronises parameters itself");
    if (!fsdp.ignored_modules.empty()) {
      notes.push_back("fsdp_ignored_modules (" + join(fsdp.ignored_modules, ",") + ") has no DeepSpeed equivalent");
    }
  }
  note_launch_settings(source, notes);
  if (out.scheduler.specified && (out.scheduler.type == "linear" || out.scheduler.type == "cosine" ||
                                  out.scheduler.type == "constant")) {
    notes.push_back("scheduler type " + out.scheduler.type +
                    " is a Transformers scheduler that shardtrain reads but DeepSpeed itself does not");
  }
  Node tree = config_detail::deepspeed_tree(out, true);
  if (out.zero3_init_flag) tree.add("zero3_init_flag", Node::of(true));
  if (out.gradient_checkpointing) tree.add("gradient_checkpointing", Node::of(true));
  if (!config_detail::is_default(out.precision_audit)) {
    tree.add("precision_audit", config_detail::precision_audit_tree(out.precision_audit));
  }
  return config_detail::emit_json(tree);
}

void note_training_settings(const TrainingConfig& source, std::vector<std::string>& notes) {
  std::vector<std::string> settings;
  auto add_int = [&](const char* name, const std::optional<int64_t>& value) {
    if (value) settings.push_back(std::string(name) + " " + std::to_string(*value));
  };
  add_int("train_micro_batch_size_per_gpu", source.train_micro_batch_size_per_gpu);
  add_int("gradient_accumulation_steps", source.gradient_accumulation_steps);
  add_int("train_batch_size", source.train_batch_size);
  if (source.gradient_clipping && *source.gradient_clipping > 0) {
    settings.push_back("gradient_clipping " + format_double(*source.gradient_clipping));
  } else if (source.is_auto(config_detail::kGradientClippingKey)) {
    settings.push_back("gradient_clipping auto (1.0)");
  }
  if (!settings.empty()) {
    notes.push_back(join(settings, ", ") +
                    ": training-loop settings with no Accelerate FSDP key; give them to the Accelerator "
                    "(gradient accumulation, data loader batch size, clip_grad_norm_)");
  }
  if (source.optimizer.specified || source.scheduler.specified) {
    std::string what;
    if (source.optimizer.specified) what = "optimizer " + source.optimizer.type;
    if (source.scheduler.specified) {
      what += std::string(what.empty() ? "" : " and ") + "scheduler " + source.scheduler.type;
    }
    notes.push_back(what + " from the DeepSpeed config: under FSDP the program creates them in code");
  }
  const LossScaleConfig defaults;
  const LossScaleConfig& fp16 = source.fp16;
  const bool tuned = fp16.loss_scale != defaults.loss_scale ||
                     fp16.initial_scale_power != defaults.initial_scale_power ||
                     fp16.loss_scale_window != defaults.loss_scale_window || fp16.hysteresis != defaults.hysteresis ||
                     fp16.consecutive_hysteresis != defaults.consecutive_hysteresis ||
                     fp16.min_loss_scale != defaults.min_loss_scale;
  if (fp16.enabled && tuned) {
    notes.push_back("fp16 loss-scaling settings (loss_scale " + format_double(fp16.loss_scale) +
                    ", initial_scale_power " + std::to_string(fp16.initial_scale_power) + ", loss_scale_window " +
                    std::to_string(fp16.loss_scale_window) + ", hysteresis " + std::to_string(fp16.hysteresis) +
                    ", min_loss_scale " + format_double(fp16.min_loss_scale) +
                    ") have no Accelerate YAML key; FSDP uses the default dynamic loss scaler");
  }
}

std::string to_fsdp(const TrainingConfig& source, std::vector<std::string>& notes) {
  TrainingConfig out = source;
  out.distributed_type = DistributedType::kFsdp;
  FsdpConfig& fsdp = out.fsdp;
  if (source.distributed_type == DistributedType::kFsdp) {
    notes.push_back("the config already uses FSDP; it is written out unchanged");
  } else if (is_data_parallel(source.distributed_type)) {
    fsdp.sharding_strategy = ShardingStrategy::kNoShard;
    notes.push_back(std::string("distributed_type ") + to_string(source.distributed_type) +
                    " (plain data parallelism) becomes NO_SHARD");
  } else {
    const ZeroConfig& zero = source.zero;
    switch (zero.stage) {
      case 3: fsdp.sharding_strategy = ShardingStrategy::kFullShard; break;
      case 2: fsdp.sharding_strategy = ShardingStrategy::kShardGradOp; break;
      case 1:
        fsdp.sharding_strategy = ShardingStrategy::kShardGradOp;
        notes.push_back("ZeRO stage 1 becomes SHARD_GRAD_OP: FSDP has no optimizer-state-only sharding, so "
                        "gradients are sharded too (less memory, the same results)");
        break;
      default: fsdp.sharding_strategy = ShardingStrategy::kNoShard; break;
    }
    const bool offload_optimizer = zero.offload_optimizer != OffloadDevice::kNone;
    const bool offload_param = zero.offload_param != OffloadDevice::kNone;
    if (offload_optimizer || offload_param) {
      fsdp.offload_params = true;
      if (offload_optimizer != offload_param) {
        notes.push_back(std::string("only ") + (offload_optimizer ? "offload_optimizer" : "offload_param") +
                        " was set; fsdp_offload_params is all-or-nothing and offloads parameters, gradients and "
                        "the optimizer step together");
      }
      if (zero.offload_optimizer == OffloadDevice::kNvme || zero.offload_param == OffloadDevice::kNvme) {
        notes.push_back("NVMe offload has no FSDP equivalent; fsdp_offload_params offloads to CPU memory");
      }
    }
    fsdp.cpu_ram_efficient_loading = source.zero3_init_flag;
    if (fsdp.cpu_ram_efficient_loading) fsdp.sync_module_states = true;
    fsdp.state_dict_type = zero.stage3_gather_16bit_weights_on_model_save ? StateDictType::kFullStateDict
                                                                          : StateDictType::kShardedStateDict;
    notes.push_back(std::string("stage3_gather_16bit_weights_on_model_save: ") +
                    (zero.stage3_gather_16bit_weights_on_model_save ? "true" : "false") + " becomes " +
                    to_string(fsdp.state_dict_type) +
                    "; FSDP's full state dict holds the fp32 master values, not 16-bit copies");
    // DeepSpeed always keeps fp32 masters; FSDP's standard mode is its twin.
    fsdp.pure_low_precision = false;
    notes.push_back("fsdp_pure_low_precision: false keeps fp32 master weights and optimizer state, as DeepSpeed "
                    "did (FSDP standard mode)");
    if (source.communication_data_type) {
      fsdp.reduce_dtype = source.communication_data_type;
      notes.push_back(std::string("communication_data_type ") + to_string(*source.communication_data_type) +
                      " becomes fsdp_reduce_dtype");
    }
    if (source.zero.grad_accum_dtype != DType::kFp32) {
      notes.push_back(std::string("data_types.grad_accum_dtype ") + to_string(source.zero.grad_accum_dtype) +
                      " has no FSDP equivalent (FSDP accumulates in the reduce dtype, or the parameter dtype)");
    }
    notes.push_back("reduce_bucket_size, allgather_bucket_size, overlap_comm, sub_group_size and the stage3_* "
                    "prefetch/persistence/live-parameter limits tune DeepSpeed's communication and have no FSDP "
                    "keys: FSDP communicates per wrapped unit (see fsdp_backward_prefetch, fsdp_forward_prefetch)");
    if (fsdp.auto_wrap_policy == AutoWrapPolicy::kNoWrap && fsdp.transformer_layer_cls_to_wrap.empty()) {
      notes.push_back("DeepSpeed needs no wrapping policy; the converted config wraps the whole model as one unit "
                      "(NO_WRAP). For per-layer sharding set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP and "
                      "fsdp_transformer_layer_cls_to_wrap to the decoder layer class (e.g. LlamaDecoderLayer)");
    }
    note_training_settings(source, notes);
  }
  Node tree = config_detail::accelerate_tree(out, true);
  if (out.gradient_checkpointing) tree.add("gradient_checkpointing", Node::of(true));
  if (!config_detail::is_default(out.precision_audit)) {
    tree.add("precision_audit", config_detail::precision_audit_tree(out.precision_audit));
  }
  return config_detail::emit_yaml(tree);
}

}  // namespace

std::string convert_config(const TrainingConfig& config, const std::string& target, std::vector<std::string>& notes) {
  const std::string normalized = config_detail::lowercase(target);
  if (normalized == "deepspeed") return to_deepspeed(config, notes);
  if (normalized == "fsdp") return to_fsdp(config, notes);
  ST_THROW(ConfigError, "convert target ", target, " is not one of fsdp, deepspeed");
}

}  // namespace shardtrain
