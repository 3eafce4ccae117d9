#pragma once
// Runs a GoogleTest body on N ranks, each in its own process.
//
// The parent re-executes this test binary once per rank with
// --gtest_filter=<the current test> and SHARDTRAIN_TEST_* variables; in a child
// the same test body reaches run_on_ranks() again, which then runs `body` for
// its rank and exits. Each call gets a fresh TCP port, so every run has its own
// store. A failure (assertion, exception, crash, non-zero exit) on any rank
// fails the test with that rank's output; a run longer than the timeout is
// killed and fails the test. The ranks share the test's scratch directory
// (test_scratch.h): the harness passes its path to them.
//
// Re-executing instead of fork() keeps children free of the parent's OpenMP
// and Gloo threads (fork after threads have started is undefined behaviour
// for libgomp).

#include <chrono>
#include <functional>
#include <map>
#include <string>

#include "build_config.h"  // SHARDTRAIN_BIN_DIR, SHARDTRAIN_SOURCE_DIR
#include "shardtrain/comm/communicator.h"
#include "shardtrain/comm/rendezvous.h"

namespace shardtrain::testing {

struct RankContext {
  DistEnv env;
  /// Connected world communicator (gloo), created before the body runs.
  comm::CommunicatorPtr comm;
  int rank() const { return env.rank; }
  int world_size() const { return env.world_size; }
};

struct MultiRankOptions {
  /// Whole-run bound enforced by the parent.
  std::chrono::seconds timeout{120};
  /// Communicator timeout inside the ranks.
  std::chrono::milliseconds comm_timeout{std::chrono::seconds(60)};
  /// Local ranks per machine (LOCAL_WORLD_SIZE); 0 = all on one machine.
  int local_world_size = 0;
  /// Extra environment for every rank.
  std::map<std::string, std::string> env;
  /// Do not create the communicator (tests of rendezvous itself).
  bool skip_init = false;
};

/// Runs `body` on `world_size` ranks. Call it from a TEST body, at most
/// several times per test (each call is numbered). Returns normally in the parent;
/// failures are reported through GoogleTest.
void run_on_ranks(int world_size, const std::function<void(RankContext&)>& body,
                  const MultiRankOptions& options = {});

/// Records that this rank ran its body; call it before a deliberate _Exit in a
/// body (a rank that simulates dying), since the harness checks for it.
void mark_rank_body_ran();

/// True inside a rank process.
bool is_rank_process();

/// A TCP port on 127.0.0.1 that is free now and stays this process's until it
/// exits: below the kernel's ephemeral range (so no connection or bind(0)
/// takes it meanwhile) and locked against every other test process.
int pick_free_port();

/// The file whose flock() reserves `port` for the test process that holds it.
std::string test_port_lock_path(int port);

/// A plain TCP connection to 127.0.0.1:`port`, as any process on the machine
/// could open (a stranger, a flood); -1 when the connect fails.
int try_loopback_connection(int port);

/// The IPv4 address the socket listening on `port` is bound to, in
/// /proc/net/tcp's hex form ("0100007F" is 127.0.0.1, "00000000" every
/// interface); empty when nothing listens there.
std::string listening_ipv4_address(int port);

/// Runs a command line (through /bin/sh) with a timeout; captures stdout+stderr.
struct CommandResult {
  int exit_code = -1;     ///< exit status, or 128+signal
  bool timed_out = false;
  double seconds = 0;
  std::string output;
};
CommandResult run_command(const std::string& command, std::chrono::seconds timeout);

}  // namespace shardtrain::testing
