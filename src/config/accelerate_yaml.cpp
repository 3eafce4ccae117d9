// Reading Accelerate's keys: the top level of an `accelerate config` file
// (compute_environment, distributed_type, mixed_precision, the launch
// settings), its fsdp_config and parallelism_config blocks, and its
// deepspeed_config block, which fills the DeepSpeed keys the DeepSpeed JSON
// leaves out. The same keys are read from Accelerate's JSON spelling.
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "config/config_keys.h"

namespace shardtrain::config_detail {
namespace {

const std::vector<std::string> kDistributedTypeNames = {"NO", "MULTI_CPU", "MULTI_GPU", "DEEPSPEED", "FSDP"};

}  // namespace

DistributedType read_distributed_type(const Field& field) {
  // Accelerate's other backends: known names, but not something shardtrain runs.
  static const std::set<std::string> kUnsupported = {"MULTI_NPU",  "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                                                     "MULTI_XPU",  "MULTI_HPU", "XLA",        "TPU",
                                                     "MEGATRON_LM"};
  if (field.node.is_scalar() && kUnsupported.count(uppercase(field.node.text)) != 0) {
    field.fail(field.key + ": " + field.node.text + " is not supported by shardtrain; use one of " +
               join(kDistributedTypeNames, ", "));
  }
  return choose<DistributedType>(field,
                                 {{"NO", DistributedType::kNo},
                                  {"MULTI_CPU", DistributedType::kMultiCpu},
                                  {"MULTI_GPU", DistributedType::kMultiGpu},
                                  {"DEEPSPEED", DistributedType::kDeepSpeed},
                                  {"FSDP", DistributedType::kFsdp}},
                                 kDistributedTypeNames);
}

MixedPrecision read_mixed_precision(const Field& field) {
  // PyYAML reads an unquoted `no` as False; files written through it say false.
  if (field.node.kind == Kind::kBool && !field.node.boolean) return MixedPrecision::kNo;
  if (field.node.is_scalar() && lowercase(field.node.text) == "fp8") {
    field.fail(field.key + ": fp8 is recognised but not implemented by shardtrain (it has no FP8 GEMMs); use bf16, "
               "or one of no, fp16");
  }
  return choose<MixedPrecision>(
      field, {{"no", MixedPrecision::kNo}, {"fp16", MixedPrecision::kFp16}, {"bf16", MixedPrecision::kBf16}},
      {"no", "fp16", "bf16"});
}

namespace {

ShardingStrategy read_sharding_strategy(const Field& field) {
  const std::vector<std::string> names = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
                                          "HYBRID_SHARD_ZERO2"};
  // Accelerate numbers the strategies 1-5 in this order (FULL_SHARD = 1).
  if (field.numeric()) {
    const int64_t index = field.integer("one of " + join(names, ", ") + " or a number 1-5");
    if (index < 1 || index > 5) field.expected("one of " + join(names, ", ") + " or a number 1-5");
    return static_cast<ShardingStrategy>(index);
  }
  std::vector<std::pair<std::string, ShardingStrategy>> accepted;
  for (std::size_t i = 0; i < names.size(); ++i) {
    accepted.emplace_back(names[i], static_cast<ShardingStrategy>(i + 1));
  }
  return choose<ShardingStrategy>(field, accepted, names);
}

// ---------------------------------------------------------------- Accelerate blocks

BackwardPrefetch read_backward_prefetch(const Field& field) {
  return choose<BackwardPrefetch>(field,
                                  {{"BACKWARD_PRE", BackwardPrefetch::kBackwardPre},
                                   {"BACKWARD_POST", BackwardPrefetch::kBackwardPost},
                                   {"NO_PREFETCH", BackwardPrefetch::kNoPrefetch}},
                                  {"BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"});
}

void read_fsdp_config(ParseState& state, const Field& block) {
  require_map(block, "{fsdp_sharding_strategy: FULL_SHARD}");
  state.has_fsdp_config = true;
  FsdpConfig& fsdp = state.config.fsdp;
  Section section(state, block.source, "fsdp_config.");
  section
      .on("fsdp_version",
          [&](const Field& f) {
            // FSDP2 replaces the strategy by fsdp_reshard_after_forward, which is read either way.
            f.integer_in(1, 2, "1 or 2");
          })
      .on("fsdp_sharding_strategy",
          [&](const Field& f) { state.sharding_from_strategy_key = read_sharding_strategy(f); })
      .on("fsdp_reshard_after_forward",
          [&](const Field& f) {
            // Accelerate 1.x: a boolean (FSDP2) or a strategy name (FSDP1).
            const std::string lower = lowercase(f.node.text);
            if (f.node.kind == Kind::kBool || (f.node.kind == Kind::kString && (lower == "true" || lower == "false"))) {
              state.sharding_from_reshard_key =
                  f.boolean() ? ShardingStrategy::kFullShard : ShardingStrategy::kShardGradOp;
            } else {
              state.sharding_from_reshard_key = read_sharding_strategy(f);
            }
          })
      .on("fsdp_auto_wrap_policy",
          [&](const Field& f) {
            state.fsdp_policy_given = true;
            fsdp.auto_wrap_policy = choose<AutoWrapPolicy>(
                f,
                {{"TRANSFORMER_BASED_WRAP", AutoWrapPolicy::kTransformerBased},
                 {"SIZE_BASED_WRAP", AutoWrapPolicy::kSizeBased},
                 {"NO_WRAP", AutoWrapPolicy::kNoWrap}},
                {"TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"});
          })
      .on("fsdp_transformer_layer_cls_to_wrap",
          [&](const Field& f) { fsdp.transformer_layer_cls_to_wrap = f.names(); })
      .on("fsdp_min_num_params",
          [&](const Field& f) {
            state.fsdp_min_num_params_given = true;
            fsdp.min_num_params = f.integer_at_least(0, "an integer >= 0");
          })
      .on("fsdp_backward_prefetch", [&](const Field& f) { fsdp.backward_prefetch = read_backward_prefetch(f); })
      .deprecated("fsdp_backward_prefetch_policy", "fsdp_backward_prefetch",
                  [&](const Field& f) { fsdp.backward_prefetch = read_backward_prefetch(f); })
      .on("fsdp_forward_prefetch", [&](const Field& f) { fsdp.forward_prefetch = f.boolean(); })
      .on("fsdp_offload_params", [&](const Field& f) { fsdp.offload_params = f.boolean(); })
      // Some FSDP2 configs spell it after fully_shard's CPUOffloadPolicy;
      // Accelerate itself would ignore the key, so the reading is said aloud.
      .on("fsdp_cpu_offload",
          [&](const Field& f) {
            fsdp.offload_params = f.boolean();
            state.warn(f.key + " is not Accelerate's key (Accelerate would ignore it); read as " +
                       "fsdp_config.fsdp_offload_params: " + (fsdp.offload_params ? "true" : "false") + " (" +
                       f.where() + ")");
          })
      .on("fsdp_sync_module_states",
          [&](const Field& f) { fsdp.sync_module_states = f.boolean(); })
      .on("fsdp_cpu_ram_efficient_loading", [&](const Field& f) { fsdp.cpu_ram_efficient_loading = f.boolean(); })
      .on("fsdp_activation_checkpointing", [&](const Field& f) { fsdp.activation_checkpointing = f.boolean(); })
      .on("fsdp_use_orig_params", [&](const Field& f) { fsdp.use_orig_params = f.boolean(); })
      .on("fsdp_limit_all_gathers", [&](const Field& f) { fsdp.limit_all_gathers = f.boolean(); })
      .on("fsdp_state_dict_type",
          [&](const Field& f) {
            if (f.node.is_scalar() && uppercase(f.node.text) == "LOCAL_STATE_DICT") {
              f.fail(f.key + ": LOCAL_STATE_DICT is not supported by shardtrain (it only loads on the same world "
                     "size and wrapping); use FULL_STATE_DICT or SHARDED_STATE_DICT");
            }
            fsdp.state_dict_type = choose<StateDictType>(f,
                                                         {{"FULL_STATE_DICT", StateDictType::kFullStateDict},
                                                          {"SHARDED_STATE_DICT", StateDictType::kShardedStateDict}},
                                                         {"FULL_STATE_DICT", "SHARDED_STATE_DICT"});
          })
      .on("fsdp_ignored_modules", [&](const Field& f) { fsdp.ignored_modules = f.names(); })
      .on("fsdp_pure_low_precision", [&](const Field& f) { fsdp.pure_low_precision = f.boolean(); })
      .on("fsdp_param_dtype", [&](const Field& f) { fsdp.param_dtype = read_dtype(f); })
      .on("fsdp_reduce_dtype", [&](const Field& f) { fsdp.reduce_dtype = read_dtype(f); })
      .on("fsdp_buffer_dtype", [&](const Field& f) { fsdp.buffer_dtype = read_dtype(f); })
      .on("fsdp_keep_low_precision_grads", [&](const Field& f) { fsdp.keep_low_precision_grads = f.boolean(); });
  section.read(block.node);
}

template <typename T>
PluginSetting<T> plugin_setting(const Field& field, T value) {
  return PluginSetting<T>{std::move(value), field.origin()};
}

void read_deepspeed_plugin(ParseState& state, const Field& block) {
  require_map(block, "{zero_stage: 3, deepspeed_config_file: ds_config.json}");
  PluginValues& plugin = state.plugin;
  // Older `accelerate config` files carry an empty block whatever the type.
  plugin.present = !block.node.members.empty();
  Section section(state, block.source, "deepspeed_config.");
  section
      .on("deepspeed_config_file",
          [&](const Field& f) {
            plugin.deepspeed_config_file = plugin_setting(f, f.text());
            plugin.deepspeed_config_file_line = f.node.line;
          })
      .on("zero_stage",
          [&](const Field& f) {
            plugin.zero_stage = plugin_setting(f, static_cast<int>(f.integer_in(0, 3, "an integer 0-3")));
          })
      .on("offload_optimizer_device",
          [&](const Field& f) { plugin.offload_optimizer_device = plugin_setting(f, read_offload_device(f)); })
      .on("offload_param_device",
          [&](const Field& f) { plugin.offload_param_device = plugin_setting(f, read_offload_device(f)); })
      .on("offload_optimizer_nvme_path",
          [&](const Field& f) {
            // Accelerate writes the string "none" when no path was asked for.
            if (lowercase(f.text()) != "none") plugin.offload_optimizer_nvme_path = plugin_setting(f, f.text());
          })
      .on("offload_param_nvme_path",
          [&](const Field& f) {
            if (lowercase(f.text()) != "none") plugin.offload_param_nvme_path = plugin_setting(f, f.text());
          })
      .on("gradient_accumulation_steps",
          [&](const Field& f) {
            if (!f.is_auto()) {
              plugin.gradient_accumulation_steps = plugin_setting(f, f.integer_at_least(1, "an integer >= 1"));
            }
          })
      .on("gradient_clipping",
          [&](const Field& f) {
            if (f.is_auto() || lowercase(f.text()) == "none") return;
            plugin.gradient_clipping = plugin_setting(f, f.number_in(0, true, 1e300, "a number >= 0 (0 = off)"));
          })
      .on("zero3_save_16bit_model",
          [&](const Field& f) { plugin.zero3_save_16bit_model = plugin_setting(f, f.boolean()); })
      .on("zero3_init_flag", [&](const Field& f) { plugin.zero3_init_flag = plugin_setting(f, f.boolean()); })
      // How `accelerate launch` starts DeepSpeed's own multi-node launcher;
      // shardtrain launch is started on every machine instead.
      .accept({"deepspeed_multinode_launcher"})
      .not_implemented({"deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter",
                        "deepspeed_moe_layer_cls_names"});
  section.read(block.node);
}

/// Accelerate's parallelism_config (FSDP2's device mesh). shardtrain is data
/// parallel only: tensor, context or sequence parallelism fails, and the
/// data-parallel mesh sizes are warned about and left to fsdp_config.
void read_parallelism_config(ParseState& state, const Field& block) {
  require_map(block, "{parallelism_config_tp_size: 1}");
  const std::string prefix = "parallelism_config_";
  auto refuse_above_one = [](const char* kind) {
    return [kind](const Field& f) {
      refuse_parallelism(f, f.integer_at_least(1, "an integer >= 1"), kind,
                         "set it to 1 (shardtrain shards data-parallel only, FSDP or ZeRO over all processes)");
    };
  };
  auto warn_above_one = [&state](const Field& f) {
    if (f.integer_at_least(1, "an integer >= 1") > 1) {
      state.warn(f.key + ": " + f.node.text + " is recognised but not implemented by shardtrain; it is ignored, " +
                 "and the sharding follows fsdp_config (fsdp_sharding_strategy or fsdp_reshard_after_forward; " +
                 "HYBRID_SHARD for replicated shard groups) (" + f.where() + ")");
    }
  };
  Section section(state, block.source, "parallelism_config.");
  for (const std::string& name : {prefix, std::string()}) {
    section.on(name + "tp_size", refuse_above_one("tensor parallelism"))
        .on(name + "cp_size", refuse_above_one("context parallelism"))
        .on(name + "sp_size", refuse_above_one("sequence parallelism"))
        .on(name + "dp_replicate_size", warn_above_one)
        .on(name + "dp_shard_size", warn_above_one);
  }
  // How the parallelisms above would run; inert while their sizes are 1.
  section.accept_prefix(prefix + "cp_").accept_prefix(prefix + "sp_").accept_prefix("cp_").accept_prefix("sp_");
  section.read(block.node);
}

}  // namespace

void add_accelerate_keys(Section& section, ParseState& state) {
  TrainingConfig& config = state.config;
  section
      .on("compute_environment",
          [&](const Field& f) {
            config.compute_environment =
                choose<std::string>(f, {{"LOCAL_MACHINE", "LOCAL_MACHINE"}, {"AMAZON_SAGEMAKER", "AMAZON_SAGEMAKER"}},
                                    {"LOCAL_MACHINE", "AMAZON_SAGEMAKER"});
          })
      .on("distributed_type",
          [&](const Field& f) {
            state.distributed_type = read_distributed_type(f);
            state.distributed_type_origin = f.origin();
          })
      .on("mixed_precision",
          [&](const Field& f) {
            state.accelerate_precision = read_mixed_precision(f);
            state.accelerate_precision_origin = f.origin();
          })
      .on("num_processes",
          [&](const Field& f) {
            config.num_processes =
                static_cast<int>(f.integer_in(1, std::numeric_limits<int>::max(), "a positive integer"));
            state.note_launch_key(f);
          })
      .on("num_machines",
          [&](const Field& f) {
            config.num_machines =
                static_cast<int>(f.integer_in(1, std::numeric_limits<int>::max(), "a positive integer"));
            state.note_launch_key(f);
          })
      .on("machine_rank",
          [&](const Field& f) {
            config.machine_rank = static_cast<int>(f.integer_in(0, std::numeric_limits<int>::max(), "an integer >= 0"));
            state.note_launch_key(f);
          })
      .on("main_process_ip",
          [&](const Field& f) {
            config.main_process_ip = f.text();
            state.note_launch_key(f);
          })
      .on("main_process_port",
          [&](const Field& f) {
            config.main_process_port = static_cast<int>(f.integer_in(1, 65535, "a port 1-65535"));
            state.note_launch_key(f);
          })
      .on("main_training_function", [&](const Field& f) { config.main_training_function = f.text(); })
      .on("fsdp_config", [&](const Field& f) { read_fsdp_config(state, f); })
      .on("deepspeed_config", [&](const Field& f) { read_deepspeed_plugin(state, f); })
      // Written by `accelerate config`; they choose devices, TPUs, compilers
      // or launch details that a shardtrain run does not take from the config.
      .on("parallelism_config", [&](const Field& f) { read_parallelism_config(state, f); })
      .not_implemented({"fp8_config", "megatron_lm_config"})
      .accept({"use_cpu", "debug", "downcast_bf16", "enable_cpu_affinity", "gpu_ids", "rdzv_backend",
               "same_network", "dynamo_config", "ipex_config", "mpirun_config", "commands", "command_file",
               "use_mps_device"})
      // Accelerate's SageMakerConfig: how `accelerate launch` submits a
      // SageMaker job, which a shardtrain run started on the machine ignores.
      .accept({"ec2_instance_type", "iam_role_name", "image_uri", "profile", "region", "base_job_name",
               "pytorch_version", "transformers_version", "py_version", "sagemaker_inputs_file",
               "sagemaker_metrics_file", "additional_args"})
      .accept_prefix("tpu_");
}

const std::set<std::string> kAccelerateMarkerKeys = {
    "compute_environment", "distributed_type", "mixed_precision",        "num_processes", "num_machines",
    "machine_rank",        "main_process_ip",  "main_process_port",      "fsdp_config",   "deepspeed_config",
    "use_cpu",             "rdzv_backend",     "main_training_function", "downcast_bf16"};

// ---------------------------------------------------------------- merging

namespace {

template <typename T, typename Show>
void apply_plugin(ParseState& state, const std::optional<PluginSetting<T>>& setting, const std::string& path,
                  T& target, Show show) {
  if (!setting) return;
  const auto found = state.explicit_keys.find(path);
  if (found != state.explicit_keys.end()) {
    if (!(target == setting->value)) {
      state.warn(setting->origin + " is overridden by " + path + ": " + show(target) + " (" + found->second + ")");
    }
    return;
  }
  target = setting->value;
  state.claim(path, setting->origin);
}

template <typename T, typename Show>
void apply_plugin(ParseState& state, const std::optional<PluginSetting<T>>& setting, const std::string& path,
                  std::optional<T>& target, Show show) {
  if (!setting) return;
  const auto found = state.explicit_keys.find(path);
  if (found != state.explicit_keys.end() && target) {
    if (!(*target == setting->value)) {
      state.warn(setting->origin + " is overridden by " + path + ": " + show(*target) + " (" + found->second + ")");
    }
    return;
  }
  target = setting->value;
  state.claim(path, setting->origin);
}

}  // namespace

void apply_plugin_values(ParseState& state) {
  const PluginValues& plugin = state.plugin;
  TrainingConfig& config = state.config;
  auto show_int = [](auto value) { return std::to_string(value); };
  auto show_device = [](OffloadDevice device) { return std::string(to_string(device)); };
  auto show_text = [](const std::string& text) { return text; };
  auto show_bool = [](bool value) { return std::string(value ? "true" : "false"); };
  auto show_double = [](double value) { return config_detail::format_double(value); };
  apply_plugin(state, plugin.zero_stage, "zero_optimization.stage", config.zero.stage, show_int);
  apply_plugin(state, plugin.offload_optimizer_device, "zero_optimization.offload_optimizer.device",
               config.zero.offload_optimizer, show_device);
  apply_plugin(state, plugin.offload_param_device, "zero_optimization.offload_param.device",
               config.zero.offload_param, show_device);
  apply_plugin(state, plugin.offload_optimizer_nvme_path, "zero_optimization.offload_optimizer.nvme_path",
               config.zero.offload_optimizer_nvme_path, show_text);
  apply_plugin(state, plugin.offload_param_nvme_path, "zero_optimization.offload_param.nvme_path",
               config.zero.offload_param_nvme_path, show_text);
  apply_plugin(state, plugin.gradient_accumulation_steps, "gradient_accumulation_steps",
               config.gradient_accumulation_steps, show_int);
  apply_plugin(state, plugin.gradient_clipping, "gradient_clipping", config.gradient_clipping, show_double);
  apply_plugin(state, plugin.zero3_save_16bit_model, "zero_optimization.stage3_gather_16bit_weights_on_model_save",
               config.zero.stage3_gather_16bit_weights_on_model_save, show_bool);
  apply_plugin(state, plugin.zero3_init_flag, "zero3_init_flag", config.zero3_init_flag, show_bool);
}

}  // namespace shardtrain::config_detail
