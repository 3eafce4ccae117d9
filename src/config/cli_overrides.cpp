// The overrides `shardtrain launch` passes to its workers: its command line
// (--config_file, --deepspeed_config_file, --mixed_precision,
// --distributed_type) reaches them as SHARDTRAIN_* environment variables,
// which win over what the config files say. config_load.cpp calls these at
// their points in the merge.
#include <cstdlib>
#include <optional>
#include <string>

#include "config/config_keys.h"

namespace shardtrain {
namespace config_detail {

OverrideValues read_overrides(const Overrides& overrides) {
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
  return OverrideValues{override_precision, override_type, precision_origin, type_origin};
}

void apply_precision_override(ParseState& state, const OverrideValues& values) {
  if (values.precision) {
    if (state.accelerate_precision && *state.accelerate_precision != *values.precision) {
      state.warn(state.accelerate_precision_origin + " is overridden by " + values.precision_origin);
    }
    state.accelerate_precision = values.precision;
    state.accelerate_precision_origin = values.precision_origin;
    state.accelerate_precision_from_environment = true;
  }
}

}  // namespace config_detail

namespace {

using config_detail::load_with_overrides;
using config_detail::Node;
using config_detail::Overrides;
using config_detail::read_config;

std::optional<std::string> environment_value(const char* name) {
  const char* value = std::getenv(name);
  // The launcher sets empty values to clear what an outer launch left behind.
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

}  // namespace

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
