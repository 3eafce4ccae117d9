#pragma once
/// @file rendezvous.h
/// Finding this process's place in the job from the environment, and
/// connecting the ranks.
///
/// Recognised launchers, first match wins:
///  * torchrun / `shardtrain launch`: RANK, WORLD_SIZE, LOCAL_RANK,
///    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
///  * Slurm (srun): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID (+
///    SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE), with MASTER_ADDR/MASTER_PORT
///  * Open MPI (mpirun): OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE,
///    OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_SIZE, with MASTER_ADDR/MASTER_PORT
/// None of them: a single process (rank 0 of 1).
///
/// Every launcher: SHARDTRAIN_RDZV_TOKEN, the job's secret. Each rank proves
/// it holds it before the rendezvous store (hosted by rank 0, listening on
/// MASTER_ADDR only) lets it read or write a key. `shardtrain launch` makes
/// one per job; other launchers export the same value on every rank.

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "shardtrain/comm/communicator.h"

namespace shardtrain {

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  /// "torchrun", "slurm", "openmpi" or "single".
  std::string source = "single";
  /// SHARDTRAIN_RDZV_TOKEN; empty: the rendezvous is not authenticated (a warning says so).
  std::string rdzv_token;
  /// SHARDTRAIN_RDZV_BIND: where rank 0's store listens when that is not
  /// MASTER_ADDR (behind NAT MASTER_ADDR may not be a local address;
  /// "0.0.0.0" listens everywhere). Empty: MASTER_ADDR.
  std::string rdzv_bind;
  /// The job's name in the rendezvous handshake: a rank of another job that
  /// shares the port (and the token) is refused by name. SHARDTRAIN_RDZV_ID
  /// (`shardtrain launch` sets one), else torchrun's TORCHELASTIC_RUN_ID,
  /// else Slurm's SLURM_JOB_ID, else empty.
  std::string rdzv_job_id;

  int num_machines() const { return world_size / local_world_size; }
  int machine_rank() const { return rank / local_world_size; }
};

/// Reads the environment. Throws ConfigError naming the missing or
/// inconsistent variable and how to fix it.
DistEnv detect_dist_env();

/// Same, with an injectable lookup (tests); `lookup` returns nullptr for unset.
DistEnv detect_dist_env(const std::function<const char*(const char*)>& lookup);

struct InitOptions {
  /// "auto" (nccl when LibTorch has CUDA and a GPU is visible, else gloo), "gloo" or "nccl".
  std::string backend = "auto";
  /// Rendezvous and collective timeout. Unset: SHARDTRAIN_COMM_TIMEOUT_S, else 10 minutes.
  std::optional<std::chrono::milliseconds> timeout;
  /// See CommOptions::inject_max_delay_ms. Unset: SHARDTRAIN_COMM_INJECT_DELAY_MS, else 0.
  std::optional<int> inject_max_delay_ms;
};

/// Connects all ranks of `env` through the authenticated store rank 0 hosts
/// at MASTER_ADDR:MASTER_PORT and returns the world communicator. Throws
/// TimeoutError when not every rank arrives within the timeout, and
/// ConfigError when the store refuses this process's token.
comm::CommunicatorPtr init_distributed(const DistEnv& env, const InitOptions& options = {});

/// The timeout InitOptions resolves to when none is given.
std::chrono::milliseconds default_comm_timeout();

}  // namespace shardtrain
