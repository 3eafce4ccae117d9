#pragma once
// What the config readers share: one value read from a file (Field), a
// mapping's table of known keys (Section), the state a whole read fills in
// (ParseState), and the functions each reader file offers the others. Private
// to the readers in src/config; resolve_auto and the writers use
// config_internal.h only.
//
// Who defines what: config_keys.cpp (Field, Section, the value readers both
// formats use), accelerate_yaml.cpp (Accelerate's keys), deepspeed_json.cpp
// (DeepSpeed's keys), cli_overrides.cpp (the launcher's overrides) and
// config_load.cpp (files, the merge of the two formats, the public entries).

#include <algorithm>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "config/config_internal.h"
#include "config/launch_settings.h"
#include "shardtrain/config.h"
#include "shardtrain/error.h"

namespace shardtrain::config_detail {

using Kind = Node::Kind;

// ---------------------------------------------------------------- one value

/// A value read from a file, with what the messages need to point at it.
struct Field {
  const std::string& source;
  std::string key;   ///< as the user reads it, e.g. "bfloat16.enabled"
  std::string path;  ///< DeepSpeed's name, for explicit/"auto" bookkeeping, e.g. "bf16.enabled"
  const Node& node;

  std::string where() const {
    return node.line > 0 ? source + ":" + std::to_string(node.line) : source;
  }
  [[noreturn]] void fail(const std::string& message) const { ST_THROW(ConfigError, where(), ": ", message); }
  [[noreturn]] void expected(const std::string& expectation) const {
    fail(key + " must be " + expectation + ", got " + describe(node));
  }
  bool is_auto() const { return node.kind == Kind::kString && lowercase(node.text) == "auto"; }
  /// "key: value (file:line)", for messages that compare two settings.
  std::string origin() const { return key + ": " + node.text + " (" + where() + ")"; }

  /// The value as a number if it is one (numbers written as strings too:
  /// DeepSpeed's pydantic models accept "3" for 3).
  std::optional<Node> numeric() const;
  int64_t integer(const std::string& expectation) const;
  int64_t integer_in(int64_t low, int64_t high, const std::string& expectation) const;
  int64_t integer_at_least(int64_t low, const std::string& expectation) const;
  double number(const std::string& expectation) const;
  double number_in(double low, bool low_inclusive, double high, const std::string& expectation) const;
  bool boolean() const;
  std::string text() const;
  /// A list of names given as a YAML/JSON list or as Accelerate's comma-separated string.
  std::vector<std::string> names() const;
};

/// Picks an enum value by name (case-insensitive); the error lists the
/// canonical names and, when one is close, suggests it.
template <typename E>
E choose(const Field& field, const std::vector<std::pair<std::string, E>>& accepted,
         const std::vector<std::string>& canonical) {
  if (!field.node.is_scalar() || field.node.kind == Kind::kNull) {
    field.expected("one of " + join(canonical, ", "));
  }
  const std::string lower = lowercase(field.node.text);
  for (const auto& [name, value] : accepted) {
    if (lowercase(name) == lower) return value;
  }
  std::string message = field.key + ": " + field.node.text + " is not one of " + join(canonical, ", ");
  if (auto suggestion = nearest(field.node.text, canonical)) message += " (did you mean " + *suggestion + "?)";
  field.fail(message);
}

// ---------------------------------------------------------------- parse state

/// A setting from Accelerate's deepspeed_config block, applied after the
/// DeepSpeed JSON so that the JSON's explicit values win.
template <typename T>
struct PluginSetting {
  T value;
  std::string origin;
};

struct PluginValues {
  bool present = false;
  std::optional<PluginSetting<std::string>> deepspeed_config_file;
  int deepspeed_config_file_line = 0;
  std::optional<PluginSetting<int>> zero_stage;
  std::optional<PluginSetting<OffloadDevice>> offload_optimizer_device;
  std::optional<PluginSetting<OffloadDevice>> offload_param_device;
  std::optional<PluginSetting<std::string>> offload_optimizer_nvme_path;
  std::optional<PluginSetting<std::string>> offload_param_nvme_path;
  std::optional<PluginSetting<int64_t>> gradient_accumulation_steps;
  std::optional<PluginSetting<double>> gradient_clipping;
  std::optional<PluginSetting<bool>> zero3_save_16bit_model;
  std::optional<PluginSetting<bool>> zero3_init_flag;
};

struct ParseState {
  TrainingConfig config;
  /// Unknown-key warnings; `strict: true` turns them into one error.
  std::vector<std::string> unknown_keys;
  /// DeepSpeed keys given a concrete value -> where; such a key is not
  /// replaced by a later "auto" or by Accelerate's deepspeed_config block.
  std::map<std::string, std::string> explicit_keys;

  std::optional<DistributedType> distributed_type;
  std::string distributed_type_origin;
  std::optional<MixedPrecision> accelerate_precision;
  std::string accelerate_precision_origin;
  /// The precision came from the launcher (its flag, or what it exports to
  /// its workers, "no" when none was asked): its "no" losing to the DeepSpeed
  /// JSON's fp16/bf16 is not worth a warning.
  bool accelerate_precision_from_override = false;
  std::optional<bool> fp16_enabled;
  std::string fp16_origin;
  std::optional<bool> bf16_enabled;
  std::string bf16_origin;
  std::optional<bool> optimizer_pin_memory;
  std::optional<bool> param_pin_memory;

  bool has_fsdp_config = false;
  bool fsdp_policy_given = false;
  bool fsdp_min_num_params_given = false;
  std::optional<ShardingStrategy> sharding_from_strategy_key;
  std::optional<ShardingStrategy> sharding_from_reshard_key;
  PluginValues plugin;
  /// Where the launch keys (num_processes, main_process_ip, ...) were set,
  /// by key ("num_processes: 4 (cfg.yaml:9)"): what the launcher's and the
  /// cross-key checks' messages quote.
  std::map<std::string, std::string> launch_key_origins;
  /// The DeepSpeed JSON the run reads: the one the main document or the
  /// override names, or the main document itself when it is that override;
  /// empty if none (a DeepSpeed JSON given as the config file is not named).
  std::string deepspeed_file;

  void warn(std::string message) { config.warnings.push_back(std::move(message)); }

  void note_launch_key(const Field& field) { launch_key_origins[field.key] = field.origin(); }
  /// nullptr when the file did not set the key.
  const std::string* launch_key_origin(const std::string& key) const {
    const auto found = launch_key_origins.find(key);
    return found == launch_key_origins.end() ? nullptr : &found->second;
  }

  bool is_explicit(const std::string& path) const { return explicit_keys.count(path) != 0; }

  void claim(const std::string& path, const std::string& where) {
    explicit_keys[path] = where;
    auto& autos = config.auto_keys;
    autos.erase(std::remove(autos.begin(), autos.end(), path), autos.end());
  }
  void set_explicit(const Field& field) { claim(field.path, field.where()); }

  /// Records an "auto"; false when another file already gave a concrete value.
  bool take_auto(const Field& field) {
    if (is_explicit(field.path)) return false;
    if (!config.is_auto(field.path)) config.auto_keys.push_back(field.path);
    return true;
  }
};

/// "auto" leaves an optional unset (resolve_auto fills it).
template <typename T, typename Read>
void assign(ParseState& state, const Field& field, std::optional<T>& target, Read read) {
  if (field.is_auto()) {
    if (state.take_auto(field)) target.reset();
    return;
  }
  target = read();
  state.set_explicit(field);
}

/// "auto" keeps the default of a setting that is never derived from the run.
template <typename T, typename Read>
void assign(ParseState& state, const Field& field, T& target, Read read) {
  if (field.is_auto()) {
    state.take_auto(field);
    return;
  }
  target = read();
  state.set_explicit(field);
}

// ---------------------------------------------------------------- sections

/// The keys one mapping may hold and what to do with each. Members are
/// handled in file order; a key no entry claims is reported with the nearest
/// known key at the same level.
class Section {
 public:
  using Handler = std::function<void(const Field&)>;

  Section(ParseState& state, const std::string& source, std::string key_prefix, std::string path_prefix)
      : state_(state), source_(source), key_prefix_(std::move(key_prefix)), path_prefix_(std::move(path_prefix)) {}
  Section(ParseState& state, const std::string& source, const std::string& prefix)
      : Section(state, source, prefix, prefix) {}

  Section& on(const std::string& key, Handler handler);
  /// Known keys that do not concern shardtrain (Accelerate's TPU settings, ...).
  Section& accept(std::initializer_list<const char*> keys);
  Section& accept_prefix(const std::string& prefix);
  /// Known keys whose feature shardtrain does not have: warned, then ignored.
  Section& not_implemented(std::initializer_list<const char*> keys);
  Section& deprecated(const std::string& key, const std::string& replacement, Handler handler);

  void read(const Node& map);

 private:
  /// A feature switch left off: false, "false", "none", 0, or an empty block
  /// (older `accelerate config` files carry fp8_config: {} and the like).
  static bool switched_off(const Node& value);

  struct Entry {
    std::string key;
    enum Kind { kHandle, kAccept, kNotImplemented, kDeprecated } kind;
    std::string replacement;
    Handler handler;
  };

  const Entry* find(const std::string& key) const;
  bool accepted_by_prefix(const std::string& key) const;
  void report_unknown(const std::string& key, const Node& value);

  ParseState& state_;
  const std::string& source_;
  std::string key_prefix_;
  std::string path_prefix_;
  std::vector<Entry> entries_;
  std::vector<std::string> accepted_prefixes_;
};

void require_map(const Field& field, const std::string& example);

// ---------------------------------------------------------------- values both formats read (config_keys.cpp)

/// none / cpu / nvme: DeepSpeed's offload_*.device and Accelerate's offload_*_device.
OffloadDevice read_offload_device(const Field& field);
/// DeepSpeed's communication_data_type and data_types, fsdp_config's fsdp_*_dtype.
DType read_dtype(const Field& field);
/// A parallelism degree above 1 for a kind shardtrain does not implement:
/// fails naming it and `fix`.
void refuse_parallelism(const Field& f, int64_t size, const std::string& kind, const std::string& fix);

// ---------------------------------------------------------------- accelerate_yaml.cpp

/// Accelerate's top-level keys, fsdp_config, deepspeed_config and parallelism_config.
void add_accelerate_keys(Section& section, ParseState& state);
/// Keys only an Accelerate config has at its top level.
extern const std::set<std::string> kAccelerateMarkerKeys;
/// Accelerate's plugin_to_config_mapping: deepspeed_config.* fill the
/// DeepSpeed keys the JSON left out or set to "auto".
void apply_plugin_values(ParseState& state);
/// distributed_type and mixed_precision, which the launcher's overrides spell the same way.
DistributedType read_distributed_type(const Field& field);
MixedPrecision read_mixed_precision(const Field& field);

// ---------------------------------------------------------------- deepspeed_json.cpp

/// DeepSpeed's top-level keys, plus the non-DeepSpeed extras shardtrain
/// honours in any file (gradient_checkpointing, zero3_init_flag, strict,
/// precision_audit).
void add_deepspeed_keys(Section& section, ParseState& state);
/// Keys only a DeepSpeed config has at its top level.
extern const std::set<std::string> kDeepSpeedMarkerKeys;

// ---------------------------------------------------------------- cli_overrides.cpp

/// The launcher's overrides (its flags in the launcher, the SHARDTRAIN_*
/// variables in its workers) read as the Accelerate values they stand for; an
/// origin ("SHARDTRAIN_MIXED_PRECISION=bf16", "--mixed_precision bf16") is
/// empty where none was given.
struct OverrideValues {
  std::optional<MixedPrecision> precision;
  std::optional<DistributedType> type;
  std::string precision_origin;
  std::string type_origin;
};
/// Reads the precision override, then the distributed_type one; a bad value
/// fails as the Accelerate key would.
OverrideValues read_overrides(const Overrides& overrides);
/// The launcher's precision replaces the file's mixed_precision (saying so
/// when they differ); runs before reconcile_precision.
void apply_precision_override(ParseState& state, const OverrideValues& values);

// ---------------------------------------------------------------- config_load.cpp

/// What a run reads, as read_launch_settings describes; nullopt when there
/// is neither a file nor an override to read.
std::optional<TrainingConfig> read_run_config(const std::optional<std::string>& config_file,
                                              const Overrides& overrides);

}  // namespace shardtrain::config_detail
