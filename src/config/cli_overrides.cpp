// The overrides of `shardtrain launch`, which win over what the config files
// say: the launcher reads the files with its flags (--mixed_precision,
// --use_deepspeed / --use_fsdp, --deepspeed_config_file) as the overrides,
// and its workers with the SHARDTRAIN_* environment variables it exports
// (config_from_environment). config_load.cpp calls these at their points in
// the merge.
#include <cstdlib>
#include <optional>
#include <string>

#include "config/config_keys.h"

namespace shardtrain {
namespace config_detail {

OverrideValues read_overrides(const Overrides& overrides) {
  OverrideValues values;
  // Read as the Accelerate keys they stand for, so a bad value fails with the same words.
  if (const auto& precision = overrides.mixed_precision) {
    values.precision = read_mixed_precision(Field{precision->source, precision->key, "", Node::of(precision->value)});
    values.precision_origin = precision->origin;
  }
  if (const auto& type = overrides.distributed_type) {
    values.type = read_distributed_type(Field{type->source, type->key, "", Node::of(type->value)});
    values.type_origin = type->origin;
  }
  return values;
}

void apply_precision_override(ParseState& state, const OverrideValues& values) {
  if (values.precision) {
    if (state.accelerate_precision && *state.accelerate_precision != *values.precision) {
      state.warn(state.accelerate_precision_origin + " is overridden by " + values.precision_origin);
    }
    state.accelerate_precision = values.precision;
    state.accelerate_precision_origin = values.precision_origin;
    state.accelerate_precision_from_override = true;
  }
}

}  // namespace config_detail

namespace {

using config_detail::Override;
using config_detail::Overrides;

std::optional<std::string> environment_value(const char* name) {
  const char* value = std::getenv(name);
  // The launcher sets empty values to clear what an outer launch left behind.
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

std::optional<Override> environment_override(const char* name) {
  const auto value = environment_value(name);
  if (!value) return std::nullopt;
  return Override::from_environment(name, *value);
}

}  // namespace

std::optional<TrainingConfig> config_from_environment() {
  Overrides overrides;
  overrides.deepspeed_config_file = environment_override("SHARDTRAIN_DEEPSPEED_CONFIG_FILE");
  overrides.mixed_precision = environment_override("SHARDTRAIN_MIXED_PRECISION");
  overrides.distributed_type = environment_override("SHARDTRAIN_DISTRIBUTED_TYPE");
  // The launcher read these same files with its flags as the overrides, and
  // exported what it read (launch_settings.h): every worker reaches its result.
  return config_detail::read_run_config(environment_value("SHARDTRAIN_CONFIG_FILE"), overrides);
}

}  // namespace shardtrain
