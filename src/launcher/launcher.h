#pragma once
// `shardtrain launch`: starts this machine's workers of a job and supervises
// them the way torchrun / `accelerate launch` do.
//
// Each worker is PROGRAM ARGS... (found through PATH) in its own process
// group, with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
// MASTER_ADDR, MASTER_PORT and the run settings (SHARDTRAIN_* and the
// familiar ACCELERATE_* variables) in its environment. Its stdout and stderr
// are re-emitted line by line with a "[rank N] " prefix.
//
// The job stops as a whole: when a worker fails, or when the launcher gets
// SIGINT/SIGTERM, every worker's process group gets SIGTERM (or the signal
// received), then SIGKILL after the grace period.

#include <map>
#include <string>

#include "launcher/launch_options.h"

namespace shardtrain::launcher {

/// Runs the job's local workers until they all exit, and returns the
/// launcher's exit status: 0 when every worker exited 0; 1 when one failed
/// (exited non-zero or was killed by a signal); 128+signal when the launcher
/// was interrupted by SIGINT or SIGTERM. Throws ConfigError when PROGRAM
/// cannot be found or executed, Error for system failures (the workers
/// started so far are killed first). Installs its own SIGINT, SIGTERM, SIGCHLD
/// and SIGPIPE handling for the duration of the call and restores the previous
/// one; not reentrant.
int run_launch(const LaunchOptions& options);

/// The variables the launcher sets (or overrides) for the worker with this
/// local rank. An empty value means "remove the inherited variable".
std::map<std::string, std::string> worker_environment(const LaunchOptions& options, int local_rank);

/// Full path of PROGRAM as execvp would find it. Throws ConfigError naming
/// PROGRAM and the fix when it does not exist or is not executable.
std::string find_program(const std::string& program);

}  // namespace shardtrain::launcher
