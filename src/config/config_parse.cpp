// Reading config files. Every document, YAML or JSON, goes through one reader
// whose top level knows Accelerate's keys and DeepSpeed's keys together: an
// Accelerate YAML, an Accelerate JSON, a DeepSpeed JSON and shardtrain's own
// resolved dumps (to_yaml/to_json) are all the same shape to it. What differs
// is what is inferred when a key is missing, and the merge of an Accelerate
// YAML with the DeepSpeed JSON its deepspeed_config_file names.
#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "config/config_internal.h"
#include "shardtrain/config.h"
#include "shardtrain/error.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;
using config_detail::describe;
using config_detail::join;
using config_detail::lowercase;
using config_detail::nearest;
using config_detail::Node;
using config_detail::uppercase;
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
  std::optional<Node> numeric() const {
    if (node.kind == Kind::kInteger || node.kind == Kind::kFloat) return node;
    if (node.kind != Kind::kString) return std::nullopt;
    const std::string& text = node.text;
    if (text.empty()) return std::nullopt;
    char* end = nullptr;
    errno = 0;
    const long long integer = std::strtoll(text.c_str(), &end, 10);
    if (end == text.c_str() + text.size() && errno == 0) return Node::of(static_cast<int64_t>(integer));
    const double number = std::strtod(text.c_str(), &end);
    if (end == text.c_str() + text.size() && std::isfinite(number)) return Node::of(number);
    return std::nullopt;
  }

  int64_t integer(const std::string& expectation) const {
    const auto value = numeric();
    if (!value) expected(expectation);
    if (value->kind == Kind::kInteger) return value->integer;
    // JSON writes 2e8 as a float; DeepSpeed takes it for an integer key.
    const double number = value->number;
    constexpr double kInt64Limit = 9.2e18;
    if (!std::isfinite(number) || std::floor(number) != number || std::fabs(number) > kInt64Limit) {
      expected(expectation);
    }
    return static_cast<int64_t>(number);
  }

  int64_t integer_in(int64_t low, int64_t high, const std::string& expectation) const {
    const int64_t value = integer(expectation);
    if (value < low || value > high) expected(expectation);
    return value;
  }

  int64_t integer_at_least(int64_t low, const std::string& expectation) const {
    return integer_in(low, std::numeric_limits<int64_t>::max(), expectation);
  }

  double number(const std::string& expectation) const {
    const auto value = numeric();
    if (!value || !std::isfinite(value->number)) expected(expectation);
    return value->number;
  }

  double number_in(double low, bool low_inclusive, double high, const std::string& expectation) const {
    const double value = number(expectation);
    if (value < low || (!low_inclusive && value == low) || value > high) expected(expectation);
    return value;
  }

  bool boolean() const {
    if (node.kind == Kind::kBool) return node.boolean;
    // Accelerate passes settings through environment variables as "true"/"false",
    // and YAML 1.1 (PyYAML, which wrote many of these files) reads yes/no/on/off.
    if (node.kind == Kind::kString) {
      const std::string lower = lowercase(node.text);
      if (lower == "true" || lower == "yes" || lower == "on") return true;
      if (lower == "false" || lower == "no" || lower == "off") return false;
    }
    if (node.kind == Kind::kInteger && (node.integer == 0 || node.integer == 1)) return node.integer == 1;
    expected("true or false");
  }

  std::string text() const {
    if (!node.is_scalar()) expected("a single value");
    return node.text;
  }

  /// A list of names given as a YAML/JSON list or as Accelerate's comma-separated string.
  std::vector<std::string> names() const {
    std::vector<std::string> result;
    auto add = [&](const std::string& part) {
      const auto first = part.find_first_not_of(" \t");
      if (first == std::string::npos) return;
      const auto last = part.find_last_not_of(" \t");
      result.push_back(part.substr(first, last - first + 1));
    };
    if (node.kind == Kind::kList) {
      for (const auto& item : node.items) {
        if (!item.is_scalar()) expected("a comma-separated string or a list of names");
        add(item.text);
      }
      return result;
    }
    std::stringstream parts(text());
    std::string part;
    while (std::getline(parts, part, ',')) add(part);
    return result;
  }
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

/// Environment overrides set by `shardtrain launch` (config_from_environment).
struct Overrides {
  std::optional<std::string> deepspeed_config_file;
  std::optional<std::string> mixed_precision;
  std::optional<std::string> distributed_type;
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
  /// The launcher always exports a precision ("no" when none was asked), so
  /// its "no" losing to the DeepSpeed JSON is not worth a warning.
  bool accelerate_precision_from_environment = false;
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

  void warn(std::string message) { config.warnings.push_back(std::move(message)); }

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

  Section& on(const std::string& key, Handler handler) {
    entries_.push_back({key, Entry::kHandle, "", std::move(handler)});
    return *this;
  }
  /// Known keys that do not concern shardtrain (Accelerate's TPU settings, ...).
  Section& accept(std::initializer_list<const char*> keys) {
    for (const char* key : keys) entries_.push_back({key, Entry::kAccept, "", nullptr});
    return *this;
  }
  Section& accept_prefix(const std::string& prefix) {
    accepted_prefixes_.push_back(prefix);
    return *this;
  }
  /// Known keys whose feature shardtrain does not have: warned, then ignored.
  Section& not_implemented(std::initializer_list<const char*> keys) {
    for (const char* key : keys) entries_.push_back({key, Entry::kNotImplemented, "", nullptr});
    return *this;
  }
  Section& deprecated(const std::string& key, const std::string& replacement, Handler handler) {
    entries_.push_back({key, Entry::kDeprecated, replacement, std::move(handler)});
    return *this;
  }

  void read(const Node& map) {
    for (const auto& [key, value] : map.members) {
      // "_comment", "_note": JSON has no comments, so configs carry them as keys.
      if (!key.empty() && key[0] == '_') continue;
      const Entry* entry = find(key);
      Field field{source_, key_prefix_ + key, path_prefix_ + key, value};
      if (entry == nullptr) {
        if (!accepted_by_prefix(key)) report_unknown(key, value);
        continue;
      }
      // Accelerate writes `key: null` for settings it did not ask about.
      if (value.kind == Kind::kNull) continue;
      switch (entry->kind) {
        case Entry::kHandle: entry->handler(field); break;
        case Entry::kAccept: break;
        case Entry::kNotImplemented:
          // `wall_clock_breakdown: false` asks for nothing shardtrain lacks.
          if (!switched_off(value)) {
            state_.warn(field.key + " is recognised but not implemented by shardtrain; it is ignored (" +
                        field.where() + ")");
          }
          break;
        case Entry::kDeprecated:
          state_.warn(field.key + " is deprecated; use " + key_prefix_ + entry->replacement + " (" + field.where() +
                      ")");
          entry->handler(field);
          break;
      }
    }
  }

 private:
  /// A feature switch left off: false, "false", "none", 0, or an empty block
  /// (older `accelerate config` files carry fp8_config: {} and the like).
  static bool switched_off(const Node& value) {
    if (value.kind == Kind::kMap) return value.members.empty();
    if (value.kind == Kind::kBool) return !value.boolean;
    if (value.kind == Kind::kInteger) return value.integer == 0;
    if (value.kind == Kind::kString) {
      const std::string lower = lowercase(value.text);
      return lower == "false" || lower == "none" || lower == "no";
    }
    return false;
  }

  struct Entry {
    std::string key;
    enum Kind { kHandle, kAccept, kNotImplemented, kDeprecated } kind;
    std::string replacement;
    Handler handler;
  };

  const Entry* find(const std::string& key) const {
    for (const auto& entry : entries_) {
      if (entry.key == key) return &entry;
    }
    return nullptr;
  }

  bool accepted_by_prefix(const std::string& key) const {
    for (const auto& prefix : accepted_prefixes_) {
      if (key.rfind(prefix, 0) == 0) return true;
    }
    return false;
  }

  void report_unknown(const std::string& key, const Node& value) {
    std::vector<std::string> known;
    for (const auto& entry : entries_) known.push_back(entry.key);
    std::string message = "unknown key '" + key_prefix_ + key + "' in " + source_;
    if (auto suggestion = nearest(key, known)) {
      message += "; did you mean '" + key_prefix_ + *suggestion + "'?";
    } else {
      message += "; it is ignored";
    }
    if (value.line > 0) message += " (line " + std::to_string(value.line) + ")";
    state_.unknown_keys.push_back(message);
    state_.warn(message);
  }

  ParseState& state_;
  const std::string& source_;
  std::string key_prefix_;
  std::string path_prefix_;
  std::vector<Entry> entries_;
  std::vector<std::string> accepted_prefixes_;
};

void require_map(const Field& field, const std::string& example) {
  if (field.node.kind != Kind::kMap) field.expected("a mapping such as " + example);
}

// ---------------------------------------------------------------- enums

const std::vector<std::string> kDistributedTypeNames = {"NO", "MULTI_CPU", "MULTI_GPU", "DEEPSPEED", "FSDP"};

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

OffloadDevice read_offload_device(const Field& field) {
  return choose<OffloadDevice>(
      field, {{"none", OffloadDevice::kNone}, {"cpu", OffloadDevice::kCpu}, {"nvme", OffloadDevice::kNvme}},
      {"none", "cpu", "nvme"});
}

DType read_dtype(const Field& field) {
  if (field.node.is_scalar() && field.node.kind != Kind::kNull) {
    if (auto dtype = config_detail::dtype_from_name(field.node.text)) return *dtype;
  }
  const std::vector<std::string> canonical = {"fp32", "bf16", "fp16"};
  std::string message = field.key + ": " + describe(field.node) +
                        " is not one of fp32, bf16, fp16 (also float32, bfloat16, float16)";
  if (field.node.is_scalar()) {
    if (auto suggestion = nearest(field.node.text, canonical)) message += " (did you mean " + *suggestion + "?)";
  }
  field.fail(message);
}

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
            assign(state, f, scheduler.warmup_num_steps,
                   [&] { return f.integer_at_least(0, "an integer >= 0 or \"auto\""); });
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

/// A parallelism degree above 1 for a kind shardtrain does not implement:
/// fails naming it and `fix`.
void refuse_parallelism(const Field& f, int64_t size, const std::string& kind, const std::string& fix) {
  if (size > 1) {
    f.fail(f.key + ": " + std::to_string(size) + " asks for " + kind +
           ", which shardtrain recognises but does not implement; " + fix);
  }
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

/// DeepSpeed's top-level keys, plus the non-DeepSpeed extras shardtrain
/// honours in any file (gradient_checkpointing, zero3_init_flag, strict,
/// precision_audit).
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
          })
      .on("num_machines",
          [&](const Field& f) {
            config.num_machines =
                static_cast<int>(f.integer_in(1, std::numeric_limits<int>::max(), "a positive integer"));
          })
      .on("machine_rank",
          [&](const Field& f) {
            config.machine_rank = static_cast<int>(f.integer_in(0, std::numeric_limits<int>::max(), "an integer >= 0"));
          })
      .on("main_process_ip", [&](const Field& f) { config.main_process_ip = f.text(); })
      .on("main_process_port",
          [&](const Field& f) {
            config.main_process_port = static_cast<int>(f.integer_in(1, 65535, "a port 1-65535"));
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

// ---------------------------------------------------------------- files

std::string read_text_file(const std::string& path, const std::string& what) {
  std::error_code ignored;
  if (!fs::exists(path, ignored)) ST_THROW(ConfigError, what, " ", path, " not found");
  if (fs::is_directory(path, ignored)) ST_THROW(ConfigError, what, " ", path, " is a directory, not a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) ST_THROW(ConfigError, what, " ", path, " cannot be read (permissions?)");
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

/// Accelerate's plugin_to_config_mapping: deepspeed_config.* fill the
/// DeepSpeed keys the JSON left out or set to "auto".
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
    if (state.accelerate_precision && !state.accelerate_precision_from_environment) {
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
      // The launcher reads only distributed_type from the YAML, so a file that
      // configures an engine without naming it reaches the worker as plain DP.
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
    ST_THROW(ConfigError, "machine_rank ", config.machine_rank, " is out of range for num_machines ",
             config.num_machines, "; use 0 .. ", config.num_machines - 1);
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
  // FSDP engine likewise wraps every shardtrain::Unit the model marks.

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

/// Reads the main document (and the DeepSpeed JSON it names), then merges,
/// infers and checks. `source` names the document in messages.
TrainingConfig read_config(const Node& root, const std::string& format, const std::string& source,
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

  std::optional<MixedPrecision> override_precision;
  std::optional<DistributedType> override_type;
  const std::string precision_origin =
      overrides.mixed_precision ? "SHARDTRAIN_MIXED_PRECISION=" + *overrides.mixed_precision : "";
  const std::string type_origin =
      overrides.distributed_type ? "SHARDTRAIN_DISTRIBUTED_TYPE=" + *overrides.distributed_type : "";
  if (overrides.mixed_precision) {
    override_precision = read_mixed_precision(Field{"environment", "SHARDTRAIN_MIXED_PRECISION", "",
                                                    Node::of(*overrides.mixed_precision)});
  }
  if (overrides.distributed_type) {
    override_type = read_distributed_type(Field{"environment", "SHARDTRAIN_DISTRIBUTED_TYPE", "",
                                                Node::of(*overrides.distributed_type)});
  }
  if (overrides.deepspeed_config_file) state.plugin.present = true;

  decide_distributed_type(state, accelerate_shaped, deepspeed_shaped, source, override_type, type_origin);

  if (state.config.distributed_type == DistributedType::kDeepSpeed) {
    std::optional<std::string> deepspeed_file;
    if (overrides.deepspeed_config_file) {
      deepspeed_file = locate_deepspeed_file(
          PluginSetting<std::string>{*overrides.deepspeed_config_file,
                                     "SHARDTRAIN_DEEPSPEED_CONFIG_FILE=" + *overrides.deepspeed_config_file},
          base_dir);
    } else if (state.plugin.deepspeed_config_file) {
      deepspeed_file = locate_deepspeed_file(*state.plugin.deepspeed_config_file, base_dir);
    }
    if (deepspeed_file) read_deepspeed_file(state, *deepspeed_file);
    apply_plugin_values(state);
  } else if (state.plugin.present) {
    state.warn(std::string(overrides.deepspeed_config_file ? "SHARDTRAIN_DEEPSPEED_CONFIG_FILE" : "deepspeed_config") +
               " is ignored because distributed_type is " + to_string(state.config.distributed_type));
  }

  if (override_precision) {
    if (state.accelerate_precision && *state.accelerate_precision != *override_precision) {
      state.warn(state.accelerate_precision_origin + " is overridden by " + precision_origin);
    }
    state.accelerate_precision = override_precision;
    state.accelerate_precision_origin = precision_origin;
    state.accelerate_precision_from_environment = true;
  }
  reconcile_precision(state);
  check_combinations(state);

  if (state.config.strict && !state.unknown_keys.empty()) {
    ST_THROW(ConfigError, "strict: true makes unknown keys errors: ", join(state.unknown_keys, "; "));
  }
  return std::move(state.config);
}

/// parse_document + read_config; what the document itself warned about
/// (duplicate keys) comes first in the warnings.
TrainingConfig read_text(const std::string& text, const std::string& format, const std::string& source,
                         const std::string& base_dir, const Overrides& overrides) {
  std::vector<std::string> document_warnings;
  const Node root = parse_document(text, format, source, document_warnings);
  TrainingConfig config = read_config(root, format, source, base_dir, overrides);
  config.warnings.insert(config.warnings.begin(), document_warnings.begin(), document_warnings.end());
  return config;
}

TrainingConfig load_with_overrides(const std::string& path, const Overrides& overrides) {
  const std::string text = read_text_file(path, "config file");
  const std::string format = format_of(path, text);
  const std::string base_dir = fs::absolute(path).parent_path().string();
  // The main file comes first in `sources`, before the DeepSpeed JSON it names.
  TrainingConfig config = read_text(text, format, path, base_dir, overrides);
  config.sources.insert(config.sources.begin(), path);
  return config;
}

std::optional<std::string> environment_value(const char* name) {
  const char* value = std::getenv(name);
  // The launcher sets empty values to clear what an outer launch left behind.
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

}  // namespace

TrainingConfig load_config(const std::string& path) { return load_with_overrides(path, Overrides{}); }

TrainingConfig parse_config(const std::string& text, const std::string& format, const std::string& base_dir) {
  const std::string normalized = lowercase(format);
  const std::string source = "(" + normalized + " text)";
  return read_text(text, normalized, source, base_dir, Overrides{});
}

std::optional<TrainingConfig> config_from_environment() {
  const auto config_file = environment_value("SHARDTRAIN_CONFIG_FILE");
  const auto deepspeed_file = environment_value("SHARDTRAIN_DEEPSPEED_CONFIG_FILE");
  Overrides overrides;
  overrides.mixed_precision = environment_value("SHARDTRAIN_MIXED_PRECISION");
  overrides.distributed_type = environment_value("SHARDTRAIN_DISTRIBUTED_TYPE");
  if (!config_file && !deepspeed_file && !overrides.mixed_precision && !overrides.distributed_type) {
    return std::nullopt;
  }
  if (config_file) {
    overrides.deepspeed_config_file = deepspeed_file;
    return load_with_overrides(*config_file, overrides);
  }
  if (deepspeed_file) return load_with_overrides(*deepspeed_file, overrides);
  return read_config(Node::map(), "yaml", "environment", ".", overrides);
}

}  // namespace shardtrain
