// Loading a config: the file or text, then one reading of the document whose
// top level knows Accelerate's keys and DeepSpeed's keys together (an
// Accelerate YAML, an Accelerate JSON, a DeepSpeed JSON and shardtrain's own
// resolved dumps are all the same shape to it), the DeepSpeed JSON an
// Accelerate file names, and the merge: which engine and which precision
// the formats and the launcher's overrides add up to, and the checks across
// keys; then what the launcher takes from that reading (launch_settings.h).
// The keys themselves are read in accelerate_yaml.cpp and deepspeed_json.cpp.
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "config/config_keys.h"
#include "shardtrain/config.h"
#include "shardtrain/error.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;
using config_detail::add_accelerate_keys;
using config_detail::check_document_size;
using config_detail::summarise_repeated_warnings;
using config_detail::add_deepspeed_keys;
using config_detail::apply_plugin_values;
using config_detail::describe;
using config_detail::join;
using config_detail::kAccelerateMarkerKeys;
using config_detail::kDeepSpeedMarkerKeys;
using config_detail::lowercase;
using config_detail::Node;
using config_detail::Override;
using config_detail::Overrides;
using config_detail::ParseState;
using config_detail::PluginSetting;
using config_detail::Section;
using Kind = Node::Kind;

// ---------------------------------------------------------------- files

std::string read_text_file(const std::string& path, const std::string& what) {
  std::error_code ignored;
  if (!fs::exists(path, ignored)) ST_THROW(ConfigError, what, " ", path, " not found");
  if (fs::is_directory(path, ignored)) ST_THROW(ConfigError, what, " ", path, " is a directory, not a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) ST_THROW(ConfigError, what, " ", path, " cannot be read (permissions?)");
  // Refused before it is read: a huge file would take the memory the limit protects.
  const auto size = fs::file_size(path, ignored);
  if (!ignored) check_document_size(static_cast<std::size_t>(size), what + " " + path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

/// "yaml" or "json" from the extension; otherwise from the first character.
std::string format_of(const std::string& path, const std::string& text) {
  const std::string extension = lowercase(fs::path(path).extension().string());
  if (extension == ".json") return "json";
  if (extension == ".yaml" || extension == ".yml") return "yaml";
  const auto first = text.find_first_not_of(" \t\r\n");
  return first != std::string::npos && text[first] == '{' ? "json" : "yaml";
}

Node parse_document(const std::string& text, const std::string& format, const std::string& source,
                    std::vector<std::string>& warnings) {
  if (format == "yaml") return config_detail::parse_yaml_document(text, source, warnings);
  if (format == "json") return config_detail::parse_json_document(text, source);
  ST_THROW(ConfigError, "config format ", format, " is not one of yaml, json");
}

/// A referenced DeepSpeed JSON: relative to the working directory first, as
/// Accelerate opens it, then next to the YAML (so a config folder can move as
/// a whole).
std::string locate_deepspeed_file(const PluginSetting<std::string>& setting, const std::string& base_dir) {
  const fs::path given(setting.value);
  std::vector<fs::path> candidates;
  if (given.is_absolute()) {
    candidates.push_back(given);
  } else {
    candidates.push_back(fs::absolute(given).lexically_normal());
    const fs::path next_to_yaml = (fs::path(base_dir) / given).lexically_normal();
    if (next_to_yaml != candidates.front()) candidates.push_back(next_to_yaml);
  }
  std::error_code ignored;
  for (const auto& candidate : candidates) {
    if (fs::is_regular_file(candidate, ignored)) return candidate.string();
  }
  std::vector<std::string> tried;
  for (const auto& candidate : candidates) tried.push_back(candidate.string());
  ST_THROW(ConfigError, setting.origin, ": DeepSpeed config file ", setting.value, " not found (looked at ",
           join(tried, ", "), "); give the path of an existing DeepSpeed JSON file");
}

void read_deepspeed_file(ParseState& state, const std::string& path) {
  const std::string text = read_text_file(path, "DeepSpeed config file");
  const Node root = parse_document(text, format_of(path, text), path, state.config.warnings);
  if (root.kind != Kind::kMap) {
    ST_THROW(ConfigError, path, ": expected a JSON object of DeepSpeed keys at the top level, got ", describe(root));
  }
  state.config.sources.push_back(path);
  Section section(state, path, "");
  add_deepspeed_keys(section, state);
  section.read(root);
}

// ---------------------------------------------------------------- merging

/// One precision from Accelerate's mixed_precision and DeepSpeed's fp16/bf16
/// blocks, with Accelerate's rules: "no" only fills "auto" (so a JSON that
/// enables bf16 keeps it), and fp16 against an enabled bf16 is an error.
void reconcile_precision(ParseState& state) {
  TrainingConfig& config = state.config;
  if (state.fp16_enabled.value_or(false) && state.bf16_enabled.value_or(false)) {
    ST_THROW(ConfigError, "fp16.enabled and bf16.enabled are both true (", state.fp16_origin, "; ",
             state.bf16_origin, "); enable at most one of them");
  }
  MixedPrecision precision = state.accelerate_precision.value_or(MixedPrecision::kNo);
  if (state.accelerate_precision && precision != MixedPrecision::kNo) {
    const bool wants_fp16 = precision == MixedPrecision::kFp16;
    const std::optional<bool>& same = wants_fp16 ? state.fp16_enabled : state.bf16_enabled;
    const std::optional<bool>& other = wants_fp16 ? state.bf16_enabled : state.fp16_enabled;
    const std::string& same_origin = wants_fp16 ? state.fp16_origin : state.bf16_origin;
    const std::string& other_origin = wants_fp16 ? state.bf16_origin : state.fp16_origin;
    if (other.value_or(false)) {
      ST_THROW(ConfigError, state.accelerate_precision_origin, " conflicts with ", other_origin,
               "; use one precision: make mixed_precision match the DeepSpeed config or set its ",
               wants_fp16 ? "bf16" : "fp16",
               ".enabled to false or \"auto\" (mixed_precision is one of no, fp16, bf16)");
    }
    if (same.has_value() && !*same) {
      ST_THROW(ConfigError, state.accelerate_precision_origin, " conflicts with ", same_origin,
               "; set it to true or \"auto\", or mixed_precision to no");
    }
  } else if (state.fp16_enabled.value_or(false) || state.bf16_enabled.value_or(false)) {
    precision = state.fp16_enabled.value_or(false) ? MixedPrecision::kFp16 : MixedPrecision::kBf16;
    if (state.accelerate_precision && !state.accelerate_precision_from_override) {
      state.warn(state.accelerate_precision_origin + " is overridden by " +
                 (precision == MixedPrecision::kFp16 ? state.fp16_origin : state.bf16_origin) +
                 ": the DeepSpeed config's precision is used (as Accelerate does)");
    }
  }
  config.mixed_precision = precision;
  config.fp16.enabled = precision == MixedPrecision::kFp16;
  config.bf16 = precision == MixedPrecision::kBf16;
}

bool selects_engine(DistributedType type) {
  return type == DistributedType::kDeepSpeed || type == DistributedType::kFsdp;
}

void decide_distributed_type(ParseState& state, bool accelerate_shaped, bool deepspeed_shaped,
                             const std::string& source, const std::optional<DistributedType>& override_type,
                             const std::string& override_origin) {
  TrainingConfig& config = state.config;
  std::optional<DistributedType> inferred;
  std::string inferred_from;
  if (!state.distributed_type) {
    if (state.plugin.present || deepspeed_shaped) {
      inferred = DistributedType::kDeepSpeed;
      inferred_from = state.plugin.present ? "deepspeed_config" : "DeepSpeed keys";
    } else if (state.has_fsdp_config) {
      inferred = DistributedType::kFsdp;
      inferred_from = "fsdp_config";
    }
  }
  if (override_type) {
    if (state.distributed_type) {
      if (selects_engine(*state.distributed_type) != selects_engine(*override_type) ||
          (selects_engine(*override_type) && *override_type != *state.distributed_type)) {
        state.warn(state.distributed_type_origin + " is overridden by " + override_origin);
      }
      config.distributed_type = *override_type;
    } else if (inferred && !selects_engine(*override_type)) {
      // A data-parallel override (SHARDTRAIN_DISTRIBUTED_TYPE=MULTI_CPU set by
      // hand) does not undo the engine a file configures without naming it.
      state.warn(override_origin + " is ignored: " + source + " configures " + to_string(*inferred) + " (" +
                 inferred_from + ") without naming distributed_type");
      config.distributed_type = *inferred;
    } else {
      config.distributed_type = *override_type;
    }
    return;
  }
  if (state.distributed_type) {
    config.distributed_type = *state.distributed_type;
  } else if (inferred) {
    config.distributed_type = *inferred;
    // A DeepSpeed JSON on its own means DeepSpeed; an Accelerate file that
    // forgot distributed_type deserves a word.
    if (accelerate_shaped) {
      state.warn(source + " has no distributed_type; " + to_string(*inferred) + " is inferred from its " +
                 inferred_from);
    }
  } else {
    config.distributed_type = DistributedType::kNo;
  }
}

/// Checks across keys, once every file is read.
void check_combinations(ParseState& state) {
  TrainingConfig& config = state.config;
  ZeroConfig& zero = config.zero;
  FsdpConfig& fsdp = config.fsdp;

  if (config.machine_rank >= config.num_machines) {
    auto origin = [&](const std::string& key, int value) {
      const std::string* given = state.launch_key_origin(key);
      return given != nullptr ? *given : key + " " + std::to_string(value) + " (the default)";
    };
    // The file must hold together on its own: every rank reads it, whatever
    // flags `shardtrain launch` was given.
    ST_THROW(ConfigError, origin("machine_rank", config.machine_rank), " is out of range for ",
             origin("num_machines", config.num_machines), "; use 0 .. ", config.num_machines - 1,
             " in the file, or leave machine_rank out of it and pass --machine_rank to shardtrain launch");
  }

  if (state.optimizer_pin_memory && state.param_pin_memory && *state.optimizer_pin_memory != *state.param_pin_memory) {
    state.warn("zero_optimization.offload_optimizer.pin_memory and offload_param.pin_memory differ; shardtrain has "
               "one pin_memory setting for both and uses offload_optimizer's (" +
               std::string(*state.optimizer_pin_memory ? "true" : "false") + ")");
  }
  zero.offload_pin_memory = state.optimizer_pin_memory.value_or(state.param_pin_memory.value_or(true));

  if (state.sharding_from_strategy_key && state.sharding_from_reshard_key &&
      *state.sharding_from_strategy_key != *state.sharding_from_reshard_key) {
    state.warn(std::string("fsdp_config.fsdp_sharding_strategy ") + to_string(*state.sharding_from_strategy_key) +
               " and fsdp_config.fsdp_reshard_after_forward (" + to_string(*state.sharding_from_reshard_key) +
               ") disagree; fsdp_reshard_after_forward, Accelerate's newer key, is used");
  }
  if (state.sharding_from_reshard_key) {
    fsdp.sharding_strategy = *state.sharding_from_reshard_key;
  } else if (state.sharding_from_strategy_key) {
    fsdp.sharding_strategy = *state.sharding_from_strategy_key;
  }
  if (!state.fsdp_policy_given) {
    if (!fsdp.transformer_layer_cls_to_wrap.empty()) {
      fsdp.auto_wrap_policy = AutoWrapPolicy::kTransformerBased;
    } else if (state.fsdp_min_num_params_given) {
      fsdp.auto_wrap_policy = AutoWrapPolicy::kSizeBased;
    }
  }
  if (fsdp.cpu_ram_efficient_loading && !fsdp.sync_module_states) {
    // Only rank 0 loads the weights; without the broadcast the others train on garbage.
    state.warn("fsdp_config.fsdp_cpu_ram_efficient_loading: true needs fsdp_sync_module_states; it is set to true");
    fsdp.sync_module_states = true;
  }

  // An fsdp_config next to another distributed_type is kept without a word:
  // every resolved dump carries one, and convert_config reads it.
  // TRANSFORMER_BASED_WRAP without class names is what Accelerate's own
  // templates ship: it falls back to the model's _no_split_modules, and the
  // FSDP engine likewise wraps every block unit the model marks
  // (EnginePlan::unnamed_takes_blocks_only).

  if (config.distributed_type != DistributedType::kDeepSpeed) return;
  for (const bool optimizer_offload : {true, false}) {
    const OffloadDevice device = optimizer_offload ? zero.offload_optimizer : zero.offload_param;
    const std::string& path = optimizer_offload ? zero.offload_optimizer_nvme_path : zero.offload_param_nvme_path;
    const std::string name = optimizer_offload ? "offload_optimizer" : "offload_param";
    if (device == OffloadDevice::kNvme && path.empty()) {
      ST_THROW(ConfigError, "zero_optimization.", name, ".device nvme needs zero_optimization.", name,
               ".nvme_path (deepspeed_config.", name, "_nvme_path in an Accelerate YAML): the directory to swap to");
    }
  }
  if (zero.offload_param != OffloadDevice::kNone && zero.stage != 3) {
    state.warn(std::string("zero_optimization.offload_param.device ") + to_string(zero.offload_param) +
               " needs ZeRO stage 3 (parameters are only partitioned there); it is ignored at stage " +
               std::to_string(zero.stage));
    zero.offload_param = OffloadDevice::kNone;
  }
  if (zero.offload_optimizer != OffloadDevice::kNone && zero.stage == 0) {
    state.warn(std::string("zero_optimization.offload_optimizer.device ") + to_string(zero.offload_optimizer) +
               " needs ZeRO stage 1, 2 or 3; it is ignored at stage 0");
    zero.offload_optimizer = OffloadDevice::kNone;
  }
  if (config.zero3_init_flag && zero.stage != 3) {
    state.warn("zero3_init_flag only has an effect with ZeRO stage 3 (stage is " + std::to_string(zero.stage) + ")");
  }
}

}  // namespace

namespace config_detail {
namespace {

/// Reads the main document (and the DeepSpeed JSON it names), then merges,
/// infers and checks; the state keeps what the launcher needs besides the config.
ParseState read_state(const Node& root, const std::string& format, const std::string& source,
                      const std::string& base_dir, const Overrides& overrides) {
  ParseState state;
  if (root.kind == Kind::kNull) {
    state.warn(source + " contains no settings (it is empty or only comments); the defaults are used");
  } else if (root.kind != Kind::kMap) {
    ST_THROW(ConfigError, source, ": expected a mapping of config keys at the top level, got ", describe(root));
  }

  // A Hugging Face model config.json passed where a training config goes:
  // every key would be "unknown", which hides what went wrong.
  if (root.kind == Kind::kMap && (root.find("model_type") != nullptr || root.find("architectures") != nullptr) &&
      root.find("zero_optimization") == nullptr && root.find("distributed_type") == nullptr) {
    const Node* type = root.find("model_type");
    ST_THROW(ConfigError, source, " is a model's config.json (",
             type != nullptr && type->is_scalar() ? "model_type " + type->text : std::string("it has architectures"),
             "), not a training config: pass it as the model's config (llama_finetune --model-config FILE) and give "
             "an Accelerate YAML or DeepSpeed JSON as the training config");
  }

  bool accelerate_shaped = false;
  bool deepspeed_shaped = false;
  for (const auto& [key, value] : root.members) {
    accelerate_shaped = accelerate_shaped || kAccelerateMarkerKeys.count(key) != 0 || key.rfind("tpu_", 0) == 0;
    deepspeed_shaped = deepspeed_shaped || kDeepSpeedMarkerKeys.count(key) != 0;
  }
  // A JSON without Accelerate keys is a DeepSpeed config, even a nearly empty one.
  deepspeed_shaped = deepspeed_shaped || (format == "json" && !accelerate_shaped && root.kind == Kind::kMap);

  Section top(state, source, "");
  add_accelerate_keys(top, state);
  add_deepspeed_keys(top, state);
  top.read(root);

  const OverrideValues override_values = read_overrides(overrides);
  if (overrides.deepspeed_config_file) state.plugin.present = true;

  decide_distributed_type(state, accelerate_shaped, deepspeed_shaped, source, override_values.type,
                          override_values.type_origin);

  if (state.config.distributed_type == DistributedType::kDeepSpeed) {
    if (overrides.deepspeed_config_file) {
      state.deepspeed_file = locate_deepspeed_file(
          PluginSetting<std::string>{overrides.deepspeed_config_file->value, overrides.deepspeed_config_file->origin},
          base_dir);
    } else if (state.plugin.deepspeed_config_file) {
      state.deepspeed_file = locate_deepspeed_file(*state.plugin.deepspeed_config_file, base_dir);
    }
    if (!state.deepspeed_file.empty()) read_deepspeed_file(state, state.deepspeed_file);
    apply_plugin_values(state);
    // Accelerate's DeepSpeedPlugin without a DeepSpeed file builds the config
    // from the YAML's keys, with ZeRO stage 2 where zero_stage is absent (its
    // ACCELERATE_DEEPSPEED_ZERO_STAGE default); a DeepSpeed JSON's absent stage is 0.
    if (accelerate_shaped && state.deepspeed_file.empty() && !state.plugin.zero_stage &&
        !state.is_explicit("zero_optimization.stage")) {
      state.config.zero.stage = 2;
    }
  } else if (state.plugin.present) {
    state.warn((overrides.deepspeed_config_file ? overrides.deepspeed_config_file->key : std::string("deepspeed_config")) +
               " is ignored because distributed_type is " + to_string(state.config.distributed_type));
  }

  apply_precision_override(state, override_values);
  reconcile_precision(state);
  check_combinations(state);

  if (state.config.strict && !state.unknown_keys.empty()) {
    ST_THROW(ConfigError, "strict: true makes unknown keys errors: ", join(state.unknown_keys, "; "));
  }
  return state;
}

/// parse_document + read_state; what the document itself warned about
/// (duplicate keys) comes first in the warnings.
ParseState read_text_state(const std::string& text, const std::string& format, const std::string& source,
                           const std::string& base_dir, const Overrides& overrides) {
  std::vector<std::string> document_warnings;
  const Node root = parse_document(text, format, source, document_warnings);
  ParseState state = read_state(root, format, source, base_dir, overrides);
  auto& warnings = state.config.warnings;
  warnings.insert(warnings.begin(), document_warnings.begin(), document_warnings.end());
  summarise_repeated_warnings(warnings);
  return state;
}

/// `what` names the file in messages when it cannot be read ("config file").
ParseState read_file_state(const std::string& path, const std::string& what, const Overrides& overrides) {
  const std::string text = read_text_file(path, what);
  const std::string base_dir = fs::absolute(path).parent_path().string();
  ParseState state = read_text_state(text, format_of(path, text), path, base_dir, overrides);
  // The main file comes first in `sources`, before the DeepSpeed JSON it names.
  state.config.sources.insert(state.config.sources.begin(), path);
  return state;
}

/// The one rule for which documents a run reads (read_launch_settings).
std::optional<ParseState> read_run_state(const std::optional<std::string>& config_file, const Overrides& overrides) {
  if (config_file) return read_file_state(*config_file, "config file", overrides);
  if (overrides.deepspeed_config_file) {
    // The DeepSpeed JSON is then the document itself, not one it names.
    Overrides rest = overrides;
    rest.deepspeed_config_file.reset();
    const Override& json = *overrides.deepspeed_config_file;
    ParseState state = read_file_state(json.value, json.key, rest);
    state.deepspeed_file = fs::absolute(json.value).lexically_normal().string();
    return state;
  }
  if (overrides.mixed_precision || overrides.distributed_type) {
    return read_state(Node::map(), "yaml", "the launcher's settings", ".", overrides);
  }
  return std::nullopt;
}

}  // namespace

std::optional<TrainingConfig> read_run_config(const std::optional<std::string>& config_file,
                                              const Overrides& overrides) {
  std::optional<ParseState> state = read_run_state(config_file, overrides);
  if (!state) return std::nullopt;
  return std::move(state->config);
}

LaunchSettings read_launch_settings(const std::optional<std::string>& config_file, const Overrides& overrides) {
  LaunchSettings settings;
  const std::optional<ParseState> state = read_run_state(config_file, overrides);
  if (!state) return settings;
  const TrainingConfig& config = state->config;
  auto from_file = [&](const std::string& key, auto value) {
    using Value = decltype(value);
    const std::string* origin = state->launch_key_origin(key);
    return origin == nullptr ? std::nullopt : std::optional<FileValue<Value>>({value, *origin});
  };
  settings.num_processes = from_file("num_processes", config.num_processes);
  settings.num_machines = from_file("num_machines", config.num_machines);
  settings.machine_rank = from_file("machine_rank", config.machine_rank);
  settings.main_process_ip = from_file("main_process_ip", config.main_process_ip);
  settings.main_process_port = from_file("main_process_port", config.main_process_port);
  settings.mixed_precision = state->accelerate_precision.value_or(MixedPrecision::kNo);
  settings.distributed_type = config.distributed_type;
  settings.deepspeed_config_file = state->deepspeed_file;
  return settings;
}

}  // namespace config_detail

TrainingConfig load_config(const std::string& path) {
  return std::move(config_detail::read_file_state(path, "config file", Overrides{}).config);
}

TrainingConfig parse_config(const std::string& text, const std::string& format, const std::string& base_dir) {
  const std::string normalized = lowercase(format);
  const std::string source = "(" + normalized + " text)";
  return std::move(config_detail::read_text_state(text, normalized, source, base_dir, Overrides{}).config);
}

}  // namespace shardtrain
