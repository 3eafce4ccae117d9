#pragma once
// What `shardtrain launch` takes from the config files, read by the config
// reader itself: the same key readers, cross-key checks, engine decision and
// DeepSpeed JSON lookup its workers apply when they read the same files with
// the same overrides (config_from_environment). So the launcher and every
// rank cannot disagree on how a key is read, and a config a worker would
// refuse is refused before any worker starts. Private to src/config and the
// launcher.

#include <optional>
#include <string>

#include "shardtrain/config.h"

namespace shardtrain::config_detail {

/// A value `shardtrain launch` sets over what the config files say: from its
/// flags in the launcher, from the environment it exports in the workers.
struct Override {
  std::string value;
  /// The name messages use: "--mixed_precision" or "SHARDTRAIN_MIXED_PRECISION".
  std::string key;
  /// Where the value stands, for messages: "the command line" or "environment".
  std::string source;
  /// "--mixed_precision bf16" or "SHARDTRAIN_MIXED_PRECISION=bf16".
  std::string origin;

  static Override from_environment(const std::string& variable, const std::string& value) {
    return Override{value, variable, "environment", variable + "=" + value};
  }
  /// `origin` defaults to "FLAG VALUE"; a switch (--use_fsdp) passes its own.
  static Override from_flag(const std::string& flag, const std::string& value, std::string origin = "") {
    return Override{value, flag, "the command line", origin.empty() ? flag + " " + value : std::move(origin)};
  }
};

/// The overrides one run has (each optional).
struct Overrides {
  /// A DeepSpeed JSON that replaces the one the config file names.
  std::optional<Override> deepspeed_config_file;
  /// Accelerate's mixed_precision spelling: no, fp16, bf16.
  std::optional<Override> mixed_precision;
  /// Accelerate's distributed_type spelling: NO, MULTI_CPU, DEEPSPEED, FSDP, ...
  std::optional<Override> distributed_type;
};

/// A launch setting a config file gave, with where: "num_processes: 4 (cfg.yaml:9)".
template <typename T>
struct FileValue {
  T value;
  std::string origin;
};

struct LaunchSettings {
  std::optional<FileValue<int>> num_processes;
  std::optional<FileValue<int>> num_machines;
  std::optional<FileValue<int>> machine_rank;
  std::optional<FileValue<std::string>> main_process_ip;
  std::optional<FileValue<int>> main_process_port;
  /// Accelerate's mixed_precision as the override or the file says it, else
  /// kNo; a DeepSpeed JSON's fp16/bf16 blocks are reconciled with it by the
  /// worker's reading, as by Accelerate's.
  MixedPrecision mixed_precision = MixedPrecision::kNo;
  /// The engine, decided as the workers decide it (named, or inferred from a
  /// deepspeed_config / fsdp_config block or DeepSpeed keys).
  DistributedType distributed_type = DistributedType::kNo;
  /// The DeepSpeed JSON the workers read besides the config file (or alone),
  /// absolute; empty when there is none, and when the config file is itself a
  /// DeepSpeed JSON.
  std::string deepspeed_config_file;
};

/// Reads what a run reads: `config_file` (with the DeepSpeed JSON it or the
/// override names), else the overriding DeepSpeed JSON alone, else only the
/// overrides. Throws ConfigError as the workers' reading would.
LaunchSettings read_launch_settings(const std::optional<std::string>& config_file, const Overrides& overrides);

}  // namespace shardtrain::config_detail
