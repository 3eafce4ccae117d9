// Reading DeepSpeed's keys: the top level of a DeepSpeed JSON (batch sizes,
// gradient clipping, data types) and its blocks (optimizer, scheduler,
// fp16/bf16, zero_optimization with its offload blocks, tensor_parallel),
// plus the extras shardtrain honours in any config file (precision_audit,
// strict, ...). config_load.cpp runs these keys over every document, since
// an Accelerate file may carry them inline.
#include <algorithm>
#include <array>
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "config/config_keys.h"

namespace shardtrain::config_detail {
namespace {

std::string canonical_type(const Field& field, const std::vector<std::string>& implemented,
                           const std::vector<std::string>& known_elsewhere, const std::string& owner) {
  const std::string text = field.text();
  for (const auto& name : implemented) {
    if (lowercase(name) == lowercase(text)) return name;
  }
  for (const auto& name : known_elsewhere) {
    if (lowercase(name) == lowercase(text)) {
      field.fail(field.key + " " + text + " is " + owner +
                 " that shardtrain does not implement; allowed values: " + join(implemented, ", "));
    }
  }
  std::string message = field.key + ": " + text + " is not one of " + join(implemented, ", ");
  if (auto suggestion = nearest(text, implemented)) message += " (did you mean " + *suggestion + "?)";
  field.fail(message);
}

// ---------------------------------------------------------------- DeepSpeed blocks

void read_optimizer_params(ParseState& state, const Field& block) {
  require_map(block, "{lr: 0.001, weight_decay: 0.01}");
  OptimizerConfig& optimizer = state.config.optimizer;
  Section section(state, block.source, "optimizer.params.");
  section
      .on("lr",
          [&](const Field& f) {
            assign(state, f, optimizer.lr, [&] { return f.number_in(0, true, 1e300, "a number >= 0 or \"auto\""); });
          })
      .on("betas",
          [&](const Field& f) {
            assign(state, f, optimizer.betas, [&] {
              const std::string expectation = "a list of two numbers in [0, 1) or \"auto\"";
              if (f.node.kind != Kind::kList || f.node.items.size() != 2) f.expected(expectation);
              std::array<double, 2> betas{};
              for (std::size_t i = 0; i < 2; ++i) {
                Field item{f.source, f.key, f.path, f.node.items[i]};
                const auto value = item.numeric();
                if (!value || value->number < 0 || value->number >= 1) f.expected(expectation);
                betas[i] = value->number;
              }
              return betas;
            });
          })
      .on("eps",
          [&](const Field& f) {
            assign(state, f, optimizer.eps, [&] { return f.number_in(0, false, 1, "a number in (0, 1] or \"auto\""); });
          })
      .on("weight_decay",
          [&](const Field& f) {
            assign(state, f, optimizer.weight_decay,
                   [&] { return f.number_in(0, true, 1e300, "a number >= 0 or \"auto\""); });
          })
      .on("momentum",
          [&](const Field& f) {
            assign(state, f, optimizer.momentum, [&] { return f.number_in(0, true, 1e300, "a number >= 0"); });
          })
      .on("nesterov", [&](const Field& f) { assign(state, f, optimizer.nesterov, [&] { return f.boolean(); }); })
      .on("adam_w_mode",
          [&](const Field& f) { assign(state, f, optimizer.adam_w_mode, [&] { return f.boolean(); }); })
      .not_implemented({"torch_adam", "bias_correction", "amsgrad", "dampening", "maximize", "foreach", "fused",
                        "capturable", "differentiable", "freeze_step", "cuda_aware", "comm_backend_name",
                        "max_coeff", "min_coeff"});
  section.read(block.node);
}

void read_optimizer(ParseState& state, const Field& block) {
  require_map(block, "{type: AdamW, params: {lr: 0.001}}");
  OptimizerConfig& optimizer = state.config.optimizer;
  const Node* type = block.node.find("type");
  if (type == nullptr || type->kind == Kind::kNull) {
    block.fail("optimizer.type is missing; use one of " + join(config_detail::optimizer_types(), ", "));
  }
  optimizer.specified = true;
  optimizer.type = canonical_type(Field{block.source, "optimizer.type", "optimizer.type", *type},
                                  config_detail::optimizer_types(),
                                  {"OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Lamb", "Lion", "Adagrad", "Muon",
                                   "MuAdam", "MuAdamW", "MuSGD", "FusedAdam", "CPUAdam", "Adafactor"},
                                  "a DeepSpeed optimizer");
  Section section(state, block.source, "optimizer.");
  section.on("type", [](const Field&) {})
      .on("params", [&](const Field& f) { read_optimizer_params(state, f); })
      .not_implemented({"legacy_fusion"});
  section.read(block.node);
}

void read_scheduler_params(ParseState& state, const Field& block) {
  require_map(block, "{warmup_num_steps: 100}");
  SchedulerConfig& scheduler = state.config.scheduler;
  // A key of another scheduler would be read and never used (a WarmupCosineLR
  // that ignores its warmup_max_lr); DeepSpeed stops with a TypeError.
  const std::vector<std::string>& takes = config_detail::scheduler_params(scheduler.type);
  for (const auto& [key, value] : block.node.members) {
    // null sets nothing: dumps of older `shardtrain config check` runs list every scheduler's keys, unused ones null.
    const bool another_schedulers = key != "last_batch_iteration" && value.kind != Kind::kNull &&
                                    std::find(takes.begin(), takes.end(), key) == takes.end() &&
                                    config_detail::is_scheduler_param(key);
    if (another_schedulers) {
      Field{block.source, "scheduler.params." + key, "scheduler.params." + key, value}.fail(
          "scheduler.params." + key + " is not a parameter of " + scheduler.type + ", which takes " +
          (takes.empty() ? std::string("none") : join(takes, ", ")) +
          " (DeepSpeed refuses it too); remove it, or pick the scheduler it belongs to (a dump of an older "
          "`shardtrain config check` lists every scheduler's keys: delete the others)");
    }
  }
  Section section(state, block.source, "scheduler.params.");
  section
      .on("warmup_min_lr",
          [&](const Field& f) {
            assign(state, f, scheduler.warmup_min_lr,
                   [&] { return f.number_in(0, true, 1e300, "a number >= 0 or \"auto\""); });
          })
      .on("warmup_max_lr",
          [&](const Field& f) {
            assign(state, f, scheduler.warmup_max_lr,
                   [&] { return f.number_in(0, true, 1e300, "a number >= 0 or \"auto\""); });
          })
      .on("warmup_num_steps",
          [&](const Field& f) {
            // DeepSpeed's schedulers refuse 0 (they warm up over at least 2 steps); transformers' take it.
            assign(state, f, scheduler.warmup_num_steps, [&] {
              return config_detail::is_deepspeed_scheduler(scheduler.type)
                         ? f.integer_at_least(1, "a positive integer or \"auto\" for " + scheduler.type +
                                                     " (DeepSpeed refuses 0)")
                         : f.integer_at_least(0, "an integer >= 0 or \"auto\"");
            });
          })
      .on("total_num_steps",
          [&](const Field& f) {
            assign(state, f, scheduler.total_num_steps,
                   [&] { return f.integer_at_least(1, "an integer >= 1 or \"auto\""); });
          })
      .on("warmup_type",
          [&](const Field& f) {
            assign(state, f, scheduler.warmup_type,
                   [&] { return choose<std::string>(f, {{"log", "log"}, {"linear", "linear"}}, {"log", "linear"}); });
          })
      .on("cos_min_ratio",
          [&](const Field& f) {
            assign(state, f, scheduler.cos_min_ratio, [&] { return f.number_in(0, true, 1, "a number in [0, 1]"); });
          })
      .on("warmup_min_ratio",
          [&](const Field& f) {
            assign(state, f, scheduler.warmup_min_ratio,
                   [&] { return f.number_in(0, true, 1, "a number in [0, 1]"); });
          })
      .not_implemented({"last_batch_iteration"});
  section.read(block.node);
}

void read_scheduler(ParseState& state, const Field& block) {
  require_map(block, "{type: WarmupLR, params: {warmup_num_steps: 100}}");
  SchedulerConfig& scheduler = state.config.scheduler;
  const Node* type = block.node.find("type");
  if (type == nullptr || type->kind == Kind::kNull) {
    block.fail("scheduler.type is missing; use one of " + join(config_detail::scheduler_types(), ", "));
  }
  scheduler.specified = true;
  scheduler.type = canonical_type(
      Field{block.source, "scheduler.type", "scheduler.type", *type}, config_detail::scheduler_types(),
      {"OneCycle", "LRRangeTest", "constant_with_warmup", "cosine_with_restarts", "polynomial", "inverse_sqrt",
       "reduce_lr_on_plateau", "cosine_with_min_lr", "warmup_stable_decay"},
      "a scheduler");
  Section section(state, block.source, "scheduler.");
  section.on("type", [](const Field&) {}).on("params", [&](const Field& f) { read_scheduler_params(state, f); });
  section.read(block.node);
}

/// fp16.enabled / bf16.enabled: "auto" follows mixed_precision (Accelerate's fill_match).
void read_enabled(ParseState& state, const Field& field, std::optional<bool>& enabled, std::string& origin) {
  if (field.is_auto()) {
    if (state.take_auto(field)) enabled.reset();
    return;
  }
  enabled = field.boolean();
  origin = field.origin();
  state.set_explicit(field);
}

void read_fp16(ParseState& state, const Field& block) {
  require_map(block, "{enabled: true, loss_scale: 0}");
  LossScaleConfig& fp16 = state.config.fp16;
  Section section(state, block.source, "fp16.");
  section
      .on("enabled",
          [&](const Field& f) { read_enabled(state, f, state.fp16_enabled, state.fp16_origin); })
      .on("loss_scale",
          [&](const Field& f) {
            assign(state, f, fp16.loss_scale,
                   [&] { return f.number_in(0, true, 1e300, "a number >= 0 (0 = dynamic loss scaling)"); });
          })
      .on("initial_scale_power",
          [&](const Field& f) {
            assign(state, f, fp16.initial_scale_power,
                   [&] { return static_cast<int>(f.integer_in(0, 63, "an integer 0-63")); });
          })
      .on("loss_scale_window",
          [&](const Field& f) {
            assign(state, f, fp16.loss_scale_window, [&] {
              return static_cast<int>(f.integer_in(1, std::numeric_limits<int>::max(), "a positive integer"));
            });
          })
      .on("hysteresis",
          [&](const Field& f) {
            assign(state, f, fp16.hysteresis, [&] {
              return static_cast<int>(f.integer_in(1, std::numeric_limits<int>::max(), "a positive integer"));
            });
          })
      .on("consecutive_hysteresis",
          [&](const Field& f) { assign(state, f, fp16.consecutive_hysteresis, [&] { return f.boolean(); }); })
      .on("min_loss_scale",
          [&](const Field& f) {
            assign(state, f, fp16.min_loss_scale, [&] { return f.number_in(0, false, 1e300, "a number > 0"); });
          })
      .on("raise_error_at_min_scale",
          [&](const Field& f) { assign(state, f, fp16.raise_error_at_min_scale, [&] { return f.boolean(); }); })
      .not_implemented({"auto_cast", "fp16_master_weights_and_grads", "type"});
  section.read(block.node);
}

void read_bf16(ParseState& state, const Field& block, const std::string& name) {
  require_map(block, "{enabled: true}");
  Section section(state, block.source, name + ".", "bf16.");
  section
      .on("enabled",
          [&](const Field& f) { read_enabled(state, f, state.bf16_enabled, state.bf16_origin); })
      .not_implemented({"immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
                        "bf16_optimizer_states"});
  section.read(block.node);
}

void read_offload(ParseState& state, const Field& block, bool optimizer_offload) {
  require_map(block, "{device: cpu, pin_memory: true}");
  ZeroConfig& zero = state.config.zero;
  const std::string prefix = optimizer_offload ? "zero_optimization.offload_optimizer."
                                               : "zero_optimization.offload_param.";
  OffloadDevice& device = optimizer_offload ? zero.offload_optimizer : zero.offload_param;
  std::string& nvme_path = optimizer_offload ? zero.offload_optimizer_nvme_path : zero.offload_param_nvme_path;
  std::optional<bool>& pin_memory = optimizer_offload ? state.optimizer_pin_memory : state.param_pin_memory;
  Section section(state, block.source, prefix);
  section.on("device", [&](const Field& f) { assign(state, f, device, [&] { return read_offload_device(f); }); })
      .on("nvme_path", [&](const Field& f) { assign(state, f, nvme_path, [&] { return f.text(); }); })
      .on("pin_memory", [&](const Field& f) { assign(state, f, pin_memory, [&] { return f.boolean(); }); });
  if (optimizer_offload) {
    section.not_implemented({"buffer_count", "pipeline_read", "pipeline_write", "fast_init", "ratio",
                             "super_offload", "cpuadam_cores_perc", "pipeline"});
  } else {
    section.not_implemented({"buffer_count", "buffer_size", "max_in_cpu"});
  }
  section.read(block.node);
}

void read_zero_optimization(ParseState& state, const Field& block) {
  ZeroConfig& zero = state.config.zero;
  const std::string stage_expectation = "an integer 0-3";
  if (block.node.kind == Kind::kBool) {
    // DeepSpeed's oldest format (read_zero_config_deprecated): true is stage 1.
    zero.stage = block.node.boolean ? 1 : 0;
    state.set_explicit(Field{block.source, "zero_optimization.stage", "zero_optimization.stage", block.node});
    state.warn("zero_optimization: " + block.node.text + " is deprecated (DeepSpeed reads it as stage " +
               std::to_string(zero.stage) + "); use zero_optimization: {stage: " + std::to_string(zero.stage) +
               "} (" + block.where() + ")");
    return;
  }
  if (block.node.kind != Kind::kMap && block.numeric()) {
    // DeepSpeed's first configs wrote the stage alone: "zero_optimization": 2.
    Field stage{block.source, "zero_optimization.stage", "zero_optimization.stage", block.node};
    zero.stage = static_cast<int>(stage.integer_in(0, 3, stage_expectation));
    state.set_explicit(stage);
    state.warn("zero_optimization: " + block.node.text + " (a bare stage number) is deprecated; use " +
               "zero_optimization: {stage: " + block.node.text + "} (" + block.where() + ")");
    return;
  }
  require_map(block, "{stage: 3}");
  auto non_negative = [](const Field& f) { return f.integer_at_least(0, "an integer >= 0"); };
  auto prefetch_bucket = [&](const Field& f) {
    assign(state, f, zero.stage3_prefetch_bucket_size, [&] { return f.integer_at_least(0, "an integer >= 0 or \"auto\""); });
  };
  auto persistence_threshold = [&](const Field& f) {
    assign(state, f, zero.stage3_param_persistence_threshold,
           [&] { return f.integer_at_least(0, "an integer >= 0 or \"auto\""); });
  };
  auto max_live_parameters = [&](const Field& f) {
    assign(state, f, zero.stage3_max_live_parameters, [&] { return non_negative(f); });
  };
  auto max_reuse_distance = [&](const Field& f) {
    assign(state, f, zero.stage3_max_reuse_distance, [&] { return non_negative(f); });
  };
  auto gather_16bit_on_save = [&](const Field& f) {
    assign(state, f, zero.stage3_gather_16bit_weights_on_model_save, [&] { return f.boolean(); });
  };
  // Another spelling of `key`: its "auto" and explicit-value bookkeeping
  // keys on that one path, so two spellings in one config collide as one key.
  auto read_as = [](const std::string& key, std::function<void(const Field&)> handler) {
    return [key, handler](const Field& f) { handler(Field{f.source, f.key, "zero_optimization." + key, f.node}); };
  };
  Section section(state, block.source, "zero_optimization.");
  section
      .on("stage",
          [&](const Field& f) {
            zero.stage = static_cast<int>(f.integer_in(0, 3, stage_expectation));
            state.set_explicit(f);
          })
      .on("contiguous_gradients",
          [&](const Field& f) { assign(state, f, zero.contiguous_gradients, [&] { return f.boolean(); }); })
      .on("reduce_scatter", [&](const Field& f) { assign(state, f, zero.reduce_scatter, [&] { return f.boolean(); }); })
      .on("reduce_bucket_size",
          [&](const Field& f) {
            // DeepSpeed's Field(ge=0); 0 reduces each gradient as it is ready, as 1 does.
            assign(state, f, zero.reduce_bucket_size,
                   [&] { return f.integer_at_least(0, "an integer >= 0 or \"auto\""); });
          })
      .on("allgather_partitions",
          [&](const Field& f) { assign(state, f, zero.allgather_partitions, [&] { return f.boolean(); }); })
      .on("allgather_bucket_size",
          [&](const Field& f) { assign(state, f, zero.allgather_bucket_size, [&] { return non_negative(f); }); })
      .on("overlap_comm", [&](const Field& f) { assign(state, f, zero.overlap_comm, [&] { return f.boolean(); }); })
      .on("round_robin_gradients",
          [&](const Field& f) { assign(state, f, zero.round_robin_gradients, [&] { return f.boolean(); }); })
      // DeepSpeed's Field(ge=0): 0 is one sub-group per parameter.
      .on("sub_group_size",
          [&](const Field& f) { assign(state, f, zero.sub_group_size, [&] { return non_negative(f); }); })
      .on("stage3_prefetch_bucket_size", prefetch_bucket)
      .on("stage3_param_persistence_threshold", persistence_threshold)
      .on("stage3_max_live_parameters", max_live_parameters)
      .on("stage3_max_reuse_distance", max_reuse_distance)
      .on("stage3_gather_16bit_weights_on_model_save", gather_16bit_on_save)
      // DeepSpeed's field names, which its model accepts besides the stage3_
      // aliases (populate_by_name); read as the prefixed keys.
      .on("prefetch_bucket_size", read_as("stage3_prefetch_bucket_size", prefetch_bucket))
      .on("param_persistence_threshold", read_as("stage3_param_persistence_threshold", persistence_threshold))
      .on("max_live_parameters", read_as("stage3_max_live_parameters", max_live_parameters))
      .on("max_reuse_distance", read_as("stage3_max_reuse_distance", max_reuse_distance))
      .on("gather_16bit_weights_on_model_save",
          read_as("stage3_gather_16bit_weights_on_model_save", gather_16bit_on_save))
      .on("offload_optimizer", [&](const Field& f) { read_offload(state, f, true); })
      .on("offload_param", [&](const Field& f) { read_offload(state, f, false); })
      .deprecated("cpu_offload", "offload_optimizer: {device: cpu}",
                  [&](const Field& f) {
                    Field device{f.source, f.key, "zero_optimization.offload_optimizer.device", f.node};
                    assign(state, device, zero.offload_optimizer,
                           [&] { return f.boolean() ? OffloadDevice::kCpu : OffloadDevice::kNone; });
                  })
      .deprecated("cpu_offload_param", "offload_param: {device: cpu}",
                  [&](const Field& f) {
                    Field device{f.source, f.key, "zero_optimization.offload_param.device", f.node};
                    assign(state, device, zero.offload_param,
                           [&] { return f.boolean() ? OffloadDevice::kCpu : OffloadDevice::kNone; });
                  })
      .deprecated("cpu_offload_use_pin_memory", "offload_optimizer.pin_memory",
                  [&](const Field& f) { assign(state, f, state.optimizer_pin_memory, [&] { return f.boolean(); }); })
      .deprecated("stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
                  read_as("stage3_gather_16bit_weights_on_model_save", gather_16bit_on_save))
      .not_implemented({"use_multi_rank_bucket_allreduce", "ignore_unused_parameters", "legacy_stage1",
                        "load_from_fp32_weights", "elastic_checkpoint", "pipeline_loading_checkpoint", "zenflow",
                        "stage3_model_persistence_threshold", "stage3_module_granularity_threshold",
                        "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
                        "model_persistence_threshold", "module_granularity_threshold",
                        "use_all_reduce_for_fetch_params", "allgather_sequential",
                        "memory_efficient_linear", "override_module_apply", "leaf_module",
                        "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
                        "zero_quantized_gradients", "zeropp_loco_param", "mics_shard_size",
                        "mics_hierarchical_params_gather", "log_trace_cache_warnings", "enable_sanity_checks",
                        "save_muon_momentum_buffer_in_memory"});
  section.read(block.node);
}

void read_precision_audit(ParseState& state, const Field& block) {
  require_map(block, "{warmup_steps: 20, threshold: 0.5, sample_fraction: 1.0}");
  PrecisionAuditConfig& audit = state.config.precision_audit;
  Section section(state, block.source, "precision_audit.");
  section
      .on("warmup_steps",
          [&](const Field& f) { assign(state, f, audit.warmup_steps, [&] { return f.integer_at_least(0, "an integer >= 0"); }); })
      .on("threshold",
          [&](const Field& f) {
            assign(state, f, audit.threshold, [&] { return f.number_in(0, true, 1, "a fraction in [0, 1]"); });
          })
      .on("sample_fraction", [&](const Field& f) {
        assign(state, f, audit.sample_fraction,
               [&] { return f.number_in(0, true, 1, "a fraction in [0, 1] (0 turns the audit off)"); });
      });
  section.read(block.node);
}

/// DeepSpeed's AutoTP block (TPTrainingConfig). Tensor parallelism is not
/// implemented: autotp_size above 1 fails as parallelism_config's tp_size
/// does; its other fields only matter then.
void read_tensor_parallel(ParseState& state, const Field& block) {
  require_map(block, "{autotp_size: 1}");
  Section section(state, block.source, "tensor_parallel.");
  section
      .on("autotp_size",
          [&](const Field& f) {
            refuse_parallelism(f, f.integer_at_least(0, "an integer >= 0"), "tensor parallelism (DeepSpeed AutoTP)",
                               "remove the tensor_parallel block (shardtrain shards data-parallel only)");
          })
      .accept({"dtype", "tp_overlap_comm", "tensor_parallel", "tp", "injection_policy_tuple", "partition_config",
               "preset_model", "keep_module_on_host", "replace_with_kernel_inject", "kernel_inject"});
  section.read(block.node);
}

}  // namespace

void add_deepspeed_keys(Section& section, ParseState& state) {
  TrainingConfig& config = state.config;
  section
      .on("train_batch_size",
          [&](const Field& f) {
            assign(state, f, config.train_batch_size,
                   [&] { return f.integer_at_least(1, "an integer >= 1 or \"auto\""); });
          })
      .on("train_micro_batch_size_per_gpu",
          [&](const Field& f) {
            assign(state, f, config.train_micro_batch_size_per_gpu,
                   [&] { return f.integer_at_least(1, "an integer >= 1 or \"auto\""); });
          })
      .on("gradient_accumulation_steps",
          [&](const Field& f) {
            assign(state, f, config.gradient_accumulation_steps,
                   [&] { return f.integer_at_least(1, "an integer >= 1 or \"auto\""); });
          })
      .on("gradient_clipping",
          [&](const Field& f) {
            assign(state, f, config.gradient_clipping,
                   [&] { return f.number_in(0, true, 1e300, "a number >= 0 (0 = off) or \"auto\""); });
          })
      .on("steps_per_print",
          [&](const Field& f) {
            assign(state, f, config.steps_per_print, [&] {
              return static_cast<int>(f.integer_in(1, std::numeric_limits<int>::max(), "a positive integer"));
            });
          })
      .on("communication_data_type",
          [&](const Field& f) { assign(state, f, config.communication_data_type, [&] { return read_dtype(f); }); })
      .on("data_types",
          [&](const Field& f) {
            require_map(f, "{grad_accum_dtype: fp32}");
            Section data_types(state, f.source, "data_types.");
            data_types.on("grad_accum_dtype", [&](const Field& g) {
              assign(state, g, config.zero.grad_accum_dtype, [&] { return read_dtype(g); });
            });
            data_types.read(f.node);
          })
      .on("optimizer", [&](const Field& f) { read_optimizer(state, f); })
      .on("scheduler", [&](const Field& f) { read_scheduler(state, f); })
      .on("fp16", [&](const Field& f) { read_fp16(state, f); })
      .on("bf16", [&](const Field& f) { read_bf16(state, f, "bf16"); })
      // DeepSpeed keeps the old section name "for backwards compatibility"
      // (precision_config.py) and says nothing, so neither does this reader.
      .on("bfloat16", [&](const Field& f) { read_bf16(state, f, "bfloat16"); })
      .on("zero_optimization", [&](const Field& f) { read_zero_optimization(state, f); })
      .on("gradient_checkpointing",
          [&](const Field& f) { assign(state, f, config.gradient_checkpointing, [&] { return f.boolean(); }); })
      .on("zero3_init_flag",
          [&](const Field& f) { assign(state, f, config.zero3_init_flag, [&] { return f.boolean(); }); })
      .on("strict", [&](const Field& f) { config.strict = config.strict || f.boolean(); })
      .on("precision_audit", [&](const Field& f) { read_precision_audit(state, f); })
      .on("non_finite_policy",
          [&](const Field& f) {
            assign(state, f, config.non_finite_policy, [&] {
              return choose<NonFinitePolicy>(f, {{"skip", NonFinitePolicy::kSkip}, {"stop", NonFinitePolicy::kStop}},
                                             {"skip", "stop"});
            });
          })
      .on("checkpoint_on_error",
          [&](const Field& f) {
            assign(state, f, config.checkpoint_on_error, [&] {
              return choose<CheckpointErrorPolicy>(
                  f, {{"continue", CheckpointErrorPolicy::kContinue}, {"stop", CheckpointErrorPolicy::kStop}},
                  {"continue", "stop"});
            });
          })
      // DeepSpeed's guards for optimizers it did not test or would swap for its
      // CPU Adam; shardtrain only has its own three optimizers, so they say nothing.
      .accept({"zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer"})
      // DeepSpeed's AutoTP (TPTrainingConfig): tensor parallelism is not
      // implemented, so a size above 1 fails as parallelism_config's does.
      .on("tensor_parallel", [&](const Field& f) { read_tensor_parallel(state, f); })
      .not_implemented({"wall_clock_breakdown", "prescale_gradients", "gradient_predivide_factor",
                        "memory_breakdown", "dump_state", "sparse_gradients", "disable_allgather", "aio", "amp",
                        "activation_checkpointing", "flops_profiler", "tensorboard", "wandb", "csv_monitor",
                        "comet", "elasticity", "autotuning", "checkpoint", "data_efficiency",
                        "curriculum_learning", "compression_training", "sparse_attention", "pipeline",
                        "seq_parallel_communication_data_type", "compile", "nebula", "weight_quantization",
                        "hybrid_engine", "quantize_training", "eigenvalue", "progressive_layer_drop", "timers",
                        "use_node_local_storage", "load_universal_checkpoint", "graph_harvesting",
                        "torch_autocast", "dataloader_drop_last", "zero_allow_comm_data_type_fp32"});
}

const std::set<std::string> kDeepSpeedMarkerKeys = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "optimizer",        "scheduler",                      "fp16",                        "bf16",
    "bfloat16",         "zero_optimization",              "communication_data_type",     "steps_per_print"};

}  // namespace shardtrain::config_detail
