#pragma once
/// @file logging.h
/// Rank-aware logging through spdlog.
///
/// Every line carries "[rank N]". Rank 0 logs at `info` by default, the other
/// ranks at `warn` (so a 64-rank job does not print everything 64 times).
/// `SHARDTRAIN_LOG_LEVEL` (trace|debug|info|warn|error|critical|off) sets the
/// level of every rank.

#include <memory>
#include <string>

#include <spdlog/spdlog.h>

namespace shardtrain {

/// The library's logger. Safe to call before set_log_rank(); then the rank is
/// taken from RANK / SLURM_PROCID / OMPI_COMM_WORLD_RANK if set, else 0.
spdlog::logger& logger();

/// Tells the logger which rank this process is; re-applies the level rules.
void set_log_rank(int rank);

/// Parses a level name as SHARDTRAIN_LOG_LEVEL accepts it; throws ConfigError naming the allowed values.
spdlog::level::level_enum parse_log_level(const std::string& name);

}  // namespace shardtrain

#define ST_LOG_TRACE(...) ::shardtrain::logger().trace(__VA_ARGS__)
#define ST_LOG_DEBUG(...) ::shardtrain::logger().debug(__VA_ARGS__)
#define ST_LOG_INFO(...) ::shardtrain::logger().info(__VA_ARGS__)
#define ST_LOG_WARN(...) ::shardtrain::logger().warn(__VA_ARGS__)
#define ST_LOG_ERROR(...) ::shardtrain::logger().error(__VA_ARGS__)
