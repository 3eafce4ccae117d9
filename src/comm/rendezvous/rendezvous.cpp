// Which rank and world a process is, read from the environment that
// torchrun-style launchers, shardtrain launch, Slurm or Open MPI set, with an
// error naming the missing or inconsistent variable and the fix (rendezvous.h).
#include "shardtrain/comm/rendezvous.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <sstream>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/gloo/gloo_factory.h"
#include "comm/nccl/nccl_factory.h"
#include "comm/rendezvous/protocol.h"
#include "comm/rendezvous/server.h"
#include "comm/rendezvous/store.h"
#include "comm/rendezvous/token_file.h"
#include "comm/work_util.h"
#include "comm/c10d.h"
#include "torch_cuda.h"
#include "shardtrain/error.h"
#include "shardtrain/logging.h"

namespace shardtrain {
namespace {

using Lookup = std::function<const char*(const char*)>;

std::optional<std::string> get(const Lookup& lookup, const char* name) {
  const char* value = lookup(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

int parse_int(const char* name, const std::string& value, const char* fix) {
  errno = 0;
  char* end = nullptr;
  long parsed = std::strtol(value.c_str(), &end, 10);
  if (end == value.c_str() || *end != '\0' || errno == ERANGE || parsed < INT32_MIN ||
      parsed > INT32_MAX) {
    ST_THROW(ConfigError, name, "='", value, "' is not an integer. ", fix);
  }
  return static_cast<int>(parsed);
}

int require_int(const Lookup& lookup, const char* name, const char* launcher, const char* fix) {
  auto value = get(lookup, name);
  if (!value) ST_THROW(ConfigError, name, " is not set, but this looks like a ", launcher, " launch. ", fix);
  return parse_int(name, *value, fix);
}

/// Slurm's SLURM_TASKS_PER_NODE looks like "4(x2)" or "4,4" or "4"; every machine must run
/// the same number of tasks, so the first count is the local world size.
int leading_count(const std::string& text) {
  std::size_t end = 0;
  while (end < text.size() && std::isdigit(static_cast<unsigned char>(text[end]))) ++end;
  if (end == 0) return -1;
  return std::stoi(text.substr(0, end));
}

void require_master(const Lookup& lookup, DistEnv& env, const char* launcher) {
  auto addr = get(lookup, "MASTER_ADDR");
  auto port = get(lookup, "MASTER_PORT");
  if (env.world_size > 1) {
    if (!addr) {
      ST_THROW(ConfigError, "MASTER_ADDR is not set: ", launcher,
               " does not say where rank 0 listens. Export MASTER_ADDR=<hostname or IP of the "
               "machine running rank 0> (and MASTER_PORT) in the job script.");
    }
    if (!port) {
      ST_THROW(ConfigError, "MASTER_PORT is not set: export MASTER_PORT=<a free TCP port on the "
               "machine of rank 0>, e.g. 29500, on every rank.");
    }
  }
  if (addr) env.master_addr = *addr;
  if (port) {
    env.master_port = parse_int("MASTER_PORT", *port, "Set MASTER_PORT to a TCP port number (1-65535).");
    if (env.master_port < 1 || env.master_port > 65535) {
      ST_THROW(ConfigError, "MASTER_PORT=", env.master_port, " is not a TCP port; use 1-65535.");
    }
  }
}

void validate(const DistEnv& env, const char* rank_var, const char* world_var, const char* local_rank_var,
              const char* local_world_var) {
  if (env.world_size < 1) {
    ST_THROW(ConfigError, world_var, "=", env.world_size, " must be at least 1.");
  }
  if (env.rank < 0 || env.rank >= env.world_size) {
    ST_THROW(ConfigError, rank_var, "=", env.rank, " is outside 0..", env.world_size - 1, " (", world_var,
             "=", env.world_size, "); every process needs a distinct rank below the world size.");
  }
  if (env.local_world_size < 1 || env.local_world_size > env.world_size) {
    ST_THROW(ConfigError, local_world_var, "=", env.local_world_size, " must be between 1 and ",
             world_var, "=", env.world_size, ".");
  }
  if (env.local_rank < 0 || env.local_rank >= env.local_world_size) {
    ST_THROW(ConfigError, local_rank_var, "=", env.local_rank, " is outside 0..",
             env.local_world_size - 1, " (", local_world_var, "=", env.local_world_size, ").");
  }
  if (env.world_size % env.local_world_size != 0) {
    ST_THROW(ConfigError, world_var, "=", env.world_size, " is not a multiple of ", local_world_var, "=",
             env.local_world_size,
             ": every machine must run the same number of processes (num_processes = num_machines x "
             "processes per machine).");
  }
}

/// Rank, world and rendezvous address from whichever launcher started this process.
DistEnv detect_launcher_env(const Lookup& lookup) {
  DistEnv env;
  if (get(lookup, "RANK") || get(lookup, "WORLD_SIZE")) {
    const char* fix =
        "torchrun-style launches set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and "
        "MASTER_PORT together; use `shardtrain launch --num_processes N PROGRAM` to have them set.";
    env.source = "torchrun";
    env.rank = require_int(lookup, "RANK", "torchrun-style", fix);
    env.world_size = require_int(lookup, "WORLD_SIZE", "torchrun-style", fix);
    auto local_rank = get(lookup, "LOCAL_RANK");
    auto local_world = get(lookup, "LOCAL_WORLD_SIZE");
    if (local_rank && !local_world) {
      ST_THROW(ConfigError, "LOCAL_RANK is set but LOCAL_WORLD_SIZE is not: set LOCAL_WORLD_SIZE to the "
               "number of processes on this machine. ", fix);
    }
    if (local_world && !local_rank) {
      ST_THROW(ConfigError, "LOCAL_WORLD_SIZE is set but LOCAL_RANK is not: set LOCAL_RANK to this "
               "process's index on its machine. ", fix);
    }
    // Neither set: one machine holds every rank.
    env.local_rank = local_rank ? parse_int("LOCAL_RANK", *local_rank, fix) : env.rank;
    env.local_world_size = local_world ? parse_int("LOCAL_WORLD_SIZE", *local_world, fix) : env.world_size;
    validate(env, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
    require_master(lookup, env, "the launcher");
    return env;
  }
  if (get(lookup, "SLURM_PROCID")) {
    const char* fix = "Run under srun (which sets SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID).";
    env.source = "slurm";
    env.rank = require_int(lookup, "SLURM_PROCID", "Slurm", fix);
    env.world_size = require_int(lookup, "SLURM_NTASKS", "Slurm", fix);
    env.local_rank = require_int(lookup, "SLURM_LOCALID", "Slurm", fix);
    if (auto per_node = get(lookup, "SLURM_NTASKS_PER_NODE")) {
      env.local_world_size = leading_count(*per_node);
    } else if (auto tasks = get(lookup, "SLURM_TASKS_PER_NODE")) {
      env.local_world_size = leading_count(*tasks);
    } else if (auto nodes = get(lookup, "SLURM_NNODES")) {
      int n = parse_int("SLURM_NNODES", *nodes, fix);
      env.local_world_size = n > 0 ? env.world_size / n : -1;
    } else {
      ST_THROW(ConfigError, "Slurm launch without SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE or "
               "SLURM_NNODES: cannot tell how many processes run per machine; pass --ntasks-per-node to sbatch/srun.");
    }
    validate(env, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE");
    require_master(lookup, env, "Slurm");
    return env;
  }
  if (get(lookup, "OMPI_COMM_WORLD_RANK")) {
    const char* fix = "Run under Open MPI's mpirun, which sets the OMPI_COMM_WORLD_* variables.";
    env.source = "openmpi";
    env.rank = require_int(lookup, "OMPI_COMM_WORLD_RANK", "Open MPI", fix);
    env.world_size = require_int(lookup, "OMPI_COMM_WORLD_SIZE", "Open MPI", fix);
    env.local_rank = require_int(lookup, "OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI", fix);
    auto local_world = get(lookup, "OMPI_COMM_WORLD_LOCAL_SIZE");
    env.local_world_size = local_world ? parse_int("OMPI_COMM_WORLD_LOCAL_SIZE", *local_world, fix) : env.world_size;
    validate(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE");
    require_master(lookup, env, "mpirun");
    return env;
  }
  env.source = "single";
  require_master(lookup, env, "a single process");
  return env;
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

std::vector<uint8_t> as_bytes(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }
std::string as_text(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }

/// Claims this process's rank and world size in the store: two processes
/// given one rank (a --machine_rank repeated on two machines, a process left
/// from an earlier attempt) or machines started for different world sizes
/// would otherwise complete the arrival count between them and wait in the
/// first collective until its timeout. The message of the first conflict, or
/// empty.
std::string claim_rank(comm::rendezvous::RendezvousStore& store, const DistEnv& env) {
  char host[256] = {0};
  if (::gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  const std::string me = std::string(host[0] != '\0' ? host : "?") + " (pid " + std::to_string(::getpid()) + ")";
  const std::string world = std::to_string(env.world_size);
  const std::string agreed = as_text(store.compareSet("shardtrain/rdzv/world", {}, as_bytes(world)));
  if (agreed != world) {
    return "rank " + std::to_string(env.rank) + " on " + me + " was started for a world of " + world +
           " ranks, and other ranks for a world of " + agreed +
           ": every machine needs the same --num_machines and --num_processes (WORLD_SIZE)";
  }
  const std::string holder =
      as_text(store.compareSet("shardtrain/rdzv/rank/" + std::to_string(env.rank), {}, as_bytes(me)));
  if (holder != me) {
    return "rank " + std::to_string(env.rank) + " is claimed twice, by " + holder + " and by " + me +
           ": give each machine its own --machine_rank (0 to num_machines - 1), and stop processes left from "
           "an earlier attempt";
  }
  return "";
}

/// rank 0 hosts the store; every rank connects, authenticates, claims its
/// rank and waits until all world_size ranks have arrived.
comm::StorePtr connect_rendezvous(const DistEnv& env, std::chrono::milliseconds timeout) {
  namespace rdzv = comm::rendezvous;
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
  if (!env.rdzv_token.empty()) {
    ST_CHECK_T(ConfigError, rdzv::authentication_available(), "SHARDTRAIN_RDZV_TOKEN is set, but this "
               "shardtrain was built without OpenSSL's libcrypto and cannot check it. Install libssl-dev and "
               "rebuild, or unset SHARDTRAIN_RDZV_TOKEN to run an unauthenticated rendezvous");
  } else if (env.rank == 0) {
    ST_LOG_WARN("the rendezvous at {} is not authenticated: SHARDTRAIN_RDZV_TOKEN is not set, so any process "
                "that reaches the port can join. `shardtrain launch` sets one; with torchrun, srun or mpirun "
                "export the same secret on every rank, e.g. SHARDTRAIN_RDZV_TOKEN=$(openssl rand -hex 32)",
                where);
  }
  std::shared_ptr<rdzv::RendezvousServer> server;
  if (env.rank == 0) {
    const std::string bind = env.rdzv_bind.empty() ? env.master_addr : env.rdzv_bind;
    try {
      server = std::make_shared<rdzv::RendezvousServer>(bind, env.master_port, env.rdzv_token, env.rdzv_job_id);
    } catch (const Error& failure) {
      const std::string what = failure.what();
      if (what.find("in use") != std::string::npos) {
        ST_THROW(Error, "rank 0 could not listen on ", where, " (", what,
                 "): the port is taken; choose another MASTER_PORT / --main_process_port");
      }
      ST_THROW(Error, "rank 0 could not listen on ", bind, ":", env.master_port, " (", what,
               "). MASTER_ADDR must be an address of rank 0's machine; behind NAT set SHARDTRAIN_RDZV_BIND to "
               "the local address (0.0.0.0 listens on every interface)");
    }
    ST_LOG_DEBUG("rendezvous store listening on {}", server->bound_address());
    // A host name often resolves to a loopback address (127.0.1.1 on Debian
    // and Ubuntu): the other machines would then time out connecting.
    const std::string& bound = server->bound_address();  // "host:port" or "[host]:port"
    std::string bound_host = bound.substr(0, bound.rfind(':'));
    if (bound_host.size() > 1 && bound_host.front() == '[') bound_host = bound_host.substr(1, bound_host.size() - 2);
    const int machines = env.local_world_size > 0 ? env.world_size / env.local_world_size : 1;
    if (machines > 1 && is_loopback(bound_host)) {
      ST_LOG_WARN("the rendezvous listens on {}, a loopback address, while ranks on {} other machine(s) must "
                  "reach it: set --main_process_ip (MASTER_ADDR) to an address of this machine they can reach, or "
                  "SHARDTRAIN_RDZV_BIND=0.0.0.0 to listen on every interface",
                  bound, machines - 1);
    }
  }
  const auto start = std::chrono::steady_clock::now();
  c10::intrusive_ptr<rdzv::RendezvousStore> store;
  try {
    store = c10::make_intrusive<rdzv::RendezvousStore>(rdzv::Endpoint{env.master_addr, env.master_port, env.rdzv_token, env.rdzv_job_id},
                                                       timeout, server);
  } catch (const TimeoutError& failure) {
    const std::string why = failure.what();
    // A store that answered and closed is up: asking whether rank 0 runs would point the wrong way.
    const bool answered = why.find("accepted this process's connection") != std::string::npos;
    ST_THROW(TimeoutError, "rank ", env.rank, " could not join the rendezvous at ", where, " within ",
             timeout.count(), " ms: ",
             answered ? "" : "is rank 0 running, and is MASTER_ADDR reachable from this machine? ", why);
  }
  // Everyone has arrived when the counter reaches the world size; the rank
  // that completes it says so for the others. A rank that finds its claim
  // taken says that instead, and every rank stops with its message.
  const std::string kComplete = "shardtrain/rdzv/complete";
  const std::string conflict = claim_rank(*store, env);
  if (!conflict.empty()) {
    store->compareSet(kComplete, {}, as_bytes(conflict));
    ST_THROW(ConfigError, "the rendezvous at ", where, " failed: ", conflict);
  }
  const int64_t arrived = store->add("shardtrain/rdzv/arrived", 1);
  if (arrived == env.world_size) store->compareSet(kComplete, {}, std::vector<uint8_t>{1});
  const auto left = timeout - std::chrono::duration_cast<std::chrono::milliseconds>(
                                  std::chrono::steady_clock::now() - start);
  try {
    store->wait({kComplete}, std::max(left, std::chrono::milliseconds(1)));
  } catch (const TimeoutError& failure) {
    // The time really waited, not the limit: a wait cut short (the store
    // closed the connection) must not read as a full timeout.
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
    const int64_t now_arrived = store->add("shardtrain/rdzv/arrived", 0);
    if (env.rank == 0) {
      ST_THROW(TimeoutError, "rank 0 waited ", waited.count(), " ms (limit ", timeout.count(), " ms) at ", where,
               " for all ", env.world_size, " ranks to arrive and only ", now_arrived,
               " did: check that every machine started its processes (num_machines, machine_rank, num_processes), "
               "with the same token and job id (", failure.what(), ")");
    }
    ST_THROW(TimeoutError, "rank ", env.rank, " joined the rendezvous at ", where, " but only ", now_arrived, " of ",
             env.world_size, " ranks arrived in ", waited.count(), " ms (limit ", timeout.count(),
             " ms): check that every machine started its processes (num_machines, machine_rank, num_processes)");
  }
  const std::vector<uint8_t> verdict = store->get(kComplete);
  if (verdict != std::vector<uint8_t>{1}) {
    ST_THROW(ConfigError, "the rendezvous at ", where, " failed for rank ", env.rank, ": ", as_text(verdict));
  }
  return store;
}

}  // namespace

DistEnv detect_dist_env() {
  return detect_dist_env([](const char* name) { return std::getenv(name); });
}

DistEnv detect_dist_env(const Lookup& lookup) {
  DistEnv env = detect_launcher_env(lookup);
  if (auto token = comm::rendezvous::token_from_environment(lookup)) env.rdzv_token = *token;
  if (auto bind = get(lookup, "SHARDTRAIN_RDZV_BIND")) env.rdzv_bind = *bind;
  for (const char* name : {"SHARDTRAIN_RDZV_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"}) {
    if (auto id = get(lookup, name)) {
      env.rdzv_job_id = *id;
      break;
    }
  }
  comm::rendezvous::check_job_id(env.rdzv_job_id);
  return env;
}

std::chrono::milliseconds default_comm_timeout() {
  if (const char* text = std::getenv("SHARDTRAIN_COMM_TIMEOUT_S"); text && *text) {
    char* end = nullptr;
    double seconds = std::strtod(text, &end);
    if (end == text || *end != '\0' || !(seconds > 0)) {
      ST_THROW(ConfigError, "SHARDTRAIN_COMM_TIMEOUT_S='", text,
               "' is not a positive number of seconds (e.g. 600).");
    }
    return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
  }
  return std::chrono::minutes(10);
}

comm::CommunicatorPtr init_distributed(const DistEnv& env, const InitOptions& options) {
  set_log_rank(env.rank);
  comm::CommOptions comm_options;
  comm_options.timeout = options.timeout ? *options.timeout : default_comm_timeout();
  if (options.inject_max_delay_ms) {
    comm_options.inject_max_delay_ms = *options.inject_max_delay_ms;
  } else if (const char* delay = std::getenv("SHARDTRAIN_COMM_INJECT_DELAY_MS"); delay && *delay) {
    comm_options.inject_max_delay_ms =
        parse_int("SHARDTRAIN_COMM_INJECT_DELAY_MS", delay, "Use a whole number of milliseconds.");
  }

  std::string backend = options.backend;
  if (backend == "auto") {
    if (comm::nccl_usable()) {
      backend = "nccl";
    } else if (torch_cuda::cuda_device_count() > 0) {
      // Silently training a GPU node's job over Gloo on the CPU is never what was meant.
      ST_THROW(ConfigError, "backend 'auto': this process sees ", torch_cuda::cuda_device_count(),
               " GPU(s) but cannot use NCCL (", comm::nccl_unavailable_reason(),
               "). Build shardtrain with NCCL (cmake -DSHARDTRAIN_CUDA=ON, with NCCL's headers and library "
               "installed, e.g. Debian's libnccl-dev or the nvidia-nccl wheel), or choose backend 'gloo' "
               "to train on the CPU");
    } else {
      backend = "gloo";
    }
  }
  if (backend != "gloo" && backend != "nccl") {
    ST_THROW(ConfigError, "unknown communication backend '", options.backend, "'; use auto, gloo or nccl");
  }
  if (backend == "nccl" && !comm::nccl_usable()) {
    ST_THROW(ConfigError, "backend 'nccl' requested, but ", comm::nccl_unavailable_reason(),
             "; use backend 'gloo' for CPU training");
  }

  // Before any rendezvous: the other ranks would wait for a store in vain.
  ST_CHECK_T(ConfigError, backend != "gloo" || env.world_size == 1 || comm::gloo_available(), "backend 'gloo': ",
             comm::gloo_unavailable_reason(), ", and this job has ", env.world_size,
             " ranks. Train on GPUs (backend nccl), or rebuild with the gloo headers of this LibTorch "
             "(libgloo-dev for Debian's)");
  comm::StorePtr store;
  if (env.world_size == 1) {
    store = c10::make_intrusive<c10d::HashStore>();
  } else {
    store = connect_rendezvous(env, comm_options.timeout);
  }

  std::vector<int> global_ranks(env.world_size);
  for (int r = 0; r < env.world_size; ++r) global_ranks[r] = r;
  if (backend == "nccl") {
    return comm::make_nccl_communicator(store, env.rank, env.world_size, global_ranks, comm_options,
                                        env.local_rank);
  }
  std::string device_host = is_loopback(env.master_addr) ? "127.0.0.1" : "";
  if (env.world_size == 1) device_host = "127.0.0.1";
  auto communicator = comm::make_gloo_communicator(store, env.rank, env.world_size, std::move(global_ranks),
                                                   comm_options, device_host, "shardtrain/");
  ST_LOG_INFO("initialised {} communicator: {} ranks ({} machines x {}), rendezvous {}:{} via {}",
              backend, env.world_size, env.num_machines(), env.local_world_size, env.master_addr,
              env.master_port, env.source);
  return communicator;
}

}  // namespace shardtrain
