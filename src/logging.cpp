// The process's spdlog logger: its level from SHARDTRAIN_LOG_LEVEL (rank 0
// info, the others warn) and its rank prefix (logging.h).
#include "shardtrain/logging.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>

#include <spdlog/sinks/stdout_color_sinks.h>

#include "shardtrain/error.h"

namespace shardtrain {
namespace {

int rank_from_environment() {
  for (const char* name : {"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"}) {
    if (const char* value = std::getenv(name)) {
      char* end = nullptr;
      long parsed = std::strtol(value, &end, 10);
      if (end != value && *end == '\0' && parsed >= 0) return static_cast<int>(parsed);
    }
  }
  return 0;
}

struct LoggerState {
  std::mutex mutex;
  std::shared_ptr<spdlog::logger> logger;
  int rank = -1;
};

LoggerState& state() {
  static LoggerState instance;
  return instance;
}

void configure(LoggerState& s, int rank) {
  s.rank = rank;
  // Under `shardtrain launch` every line already arrives prefixed with the rank.
  const char* prefixed = std::getenv("SHARDTRAIN_OUTPUT_PREFIXED");
  const bool launcher_prefixes = prefixed != nullptr && std::string(prefixed) == "1";
  s.logger->set_pattern(launcher_prefixes ? std::string("[%^%l%$] %v")
                                          : "[rank " + std::to_string(rank) + "] [%^%l%$] %v");
  spdlog::level::level_enum level = rank == 0 ? spdlog::level::info : spdlog::level::warn;
  if (const char* env = std::getenv("SHARDTRAIN_LOG_LEVEL"); env && *env) {
    level = parse_log_level(env);
  }
  s.logger->set_level(level);
}

}  // namespace

spdlog::level::level_enum parse_log_level(const std::string& name) {
  std::string lowered = name;
  std::transform(lowered.begin(), lowered.end(), lowered.begin(), ::tolower);
  static const std::pair<const char*, spdlog::level::level_enum> kLevels[] = {
      {"trace", spdlog::level::trace}, {"debug", spdlog::level::debug},
      {"info", spdlog::level::info},   {"warn", spdlog::level::warn},
      {"warning", spdlog::level::warn}, {"error", spdlog::level::err},
      {"critical", spdlog::level::critical}, {"off", spdlog::level::off}};
  for (const auto& [level_name, level] : kLevels) {
    if (lowered == level_name) return level;
  }
  ST_THROW(ConfigError, "SHARDTRAIN_LOG_LEVEL='", name,
           "' is not a log level; use one of trace, debug, info, warn, error, critical, off");
}

spdlog::logger& logger() {
  LoggerState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.logger) {
    // stderr, so worker stdout stays clean for program output.
    s.logger = spdlog::stderr_color_mt("shardtrain");
    configure(s, rank_from_environment());
  }
  return *s.logger;
}

void set_log_rank(int rank) {
  logger();
  LoggerState& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.rank != rank) configure(s, rank);
}

}  // namespace shardtrain
