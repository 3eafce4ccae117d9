// `shardtrain launch` end to end: the job stops as a whole (worker failure,
// SIGTERM to the launcher), output is prefixed per rank, workers get the
// right environment, and two launchers form one job.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <deque>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "support/multirank.h"
#include "support/scratch_dir.h"
#include "support/contains.h"

namespace {

using namespace std::chrono_literals;
using shardtrain::testing::CommandResult;
using shardtrain::testing::pick_free_port;
using shardtrain::testing::run_command;

const std::string kShardtrain = std::string(SHARDTRAIN_BIN_DIR) + "/shardtrain";
const std::string kSmokeJob = std::string(SHARDTRAIN_BIN_DIR) + "/smoke_collectives";

using shardtrain::testing::ScratchDir;

/// A worker script that records its own pid and the pid of a child it keeps
/// running in the background (so the test can check that the whole process
/// group is stopped, not just the worker), then runs `then`.
std::string recording_worker(const std::string& pid_file, const std::string& then) {
  return "/bin/sh -c 'echo $$ >> " + pid_file + "; sleep 60 & echo $! >> " + pid_file + "; " + then + "'";
}

std::vector<pid_t> read_pids(const std::string& path) {
  std::ifstream in(path);
  std::vector<pid_t> pids;
  pid_t pid = 0;
  while (in >> pid) pids.push_back(pid);
  return pids;
}

/// Alive and not a zombie (a zombie is dead; it only waits to be reaped).
bool process_alive(pid_t pid) {
  if (::kill(pid, 0) != 0) return errno != ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto name_end = text.rfind(')');
  if (name_end == std::string::npos || name_end + 2 >= text.size()) return false;  // gone meanwhile
  return text[name_end + 2] != 'Z';
}

/// Processes are reaped asynchronously by whoever adopted them: allow a moment.
std::vector<pid_t> still_alive_after_settling(const std::vector<pid_t>& pids) {
  std::vector<pid_t> alive;
  const auto deadline = std::chrono::steady_clock::now() + 2s;
  do {
    alive.clear();
    for (pid_t pid : pids) {
      if (process_alive(pid)) alive.push_back(pid);
    }
    if (alive.empty()) break;
    ::usleep(50 * 1000);
  } while (std::chrono::steady_clock::now() < deadline);
  for (pid_t pid : alive) ::kill(pid, SIGKILL);  // do not leave them behind the test either
  return alive;
}

std::string join_pids(const std::vector<pid_t>& pids) {
  std::ostringstream out;
  for (pid_t pid : pids) out << pid << " ";
  return out.str();
}

using shardtrain::testing::contains;

/// Waits (in the shell) until `file` has `lines` lines, at most ~10 s.
std::string wait_for_lines(const std::string& file, int lines) {
  return "n=0; while [ \"$(wc -l < " + file + ")\" -lt " + std::to_string(lines) +
         " ] && [ $n -lt 100 ]; do sleep 0.1; n=$((n+1)); done; ";
}

TEST(FaultLauncher, FailingWorkerStopsTheWholeJob) {
  ScratchDir dir;
  const std::string pids = dir.file("pids");
  // Rank 1 waits until both workers have recorded their pids, then fails.
  const std::string worker = recording_worker(
      pids, "if [ \"$RANK\" = 1 ]; then " + wait_for_lines(pids, 4) + "exit 3; fi; wait");
  const std::string command = "touch " + pids + "; " + kShardtrain + " launch --num_processes 2 --main_process_port " +
                              std::to_string(pick_free_port()) + " " + worker;
  const CommandResult result = run_command(command, 30s);

  EXPECT_FALSE(result.timed_out) << result.output;
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_LT(result.seconds, 10.0) << "stopping the job took too long:\n" << result.output;
  EXPECT_TRUE(contains(result.output, "shardtrain launch: rank 1 (pid ")) << result.output;
  EXPECT_TRUE(contains(result.output, "exited with status 3")) << result.output;
  const std::vector<pid_t> recorded = read_pids(pids);
  EXPECT_EQ(recorded.size(), 4u) << result.output;
  const std::vector<pid_t> alive = still_alive_after_settling(recorded);
  EXPECT_TRUE(alive.empty()) << "left alive: " << join_pids(alive) << "\n" << result.output;
}

TEST(FaultLauncher, WorkerKilledBySignalIsNamed) {
  const std::string command = kShardtrain + " launch --num_processes 2 --grace_period 1 /bin/sh -c " +
                              "'if [ \"$RANK\" = 0 ]; then kill -SEGV $$; fi; sleep 60'";
  const CommandResult result = run_command(command, 30s);
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_LT(result.seconds, 10.0) << result.output;
  EXPECT_TRUE(contains(result.output, "rank 0 (pid ")) << result.output;
  EXPECT_TRUE(contains(result.output, "was killed by signal SIGSEGV (11)")) << result.output;
}

/// Sends `signal` (TERM, HUP, ...) to a launcher of two recording workers:
/// the launcher exits with 128 + its number, and no worker or worker's child is left.
void expect_signal_stops_every_worker(const std::string& signal, int number) {
  ScratchDir dir;
  const std::string pids = dir.file("pids");
  const std::string launcher_pid = dir.file("launcher.pid");
  const std::string command = "touch " + pids + "; " + kShardtrain + " launch --num_processes 2 " +
                              recording_worker(pids, "echo started; wait") + " & L=$!; echo $L > " + launcher_pid +
                              "; " + wait_for_lines(pids, 4) + "kill -" + signal +
                              " $L; wait $L; echo \"launcher exit status: $?\"";
  const CommandResult result = run_command(command, 30s);

  EXPECT_FALSE(result.timed_out) << result.output;
  EXPECT_LT(result.seconds, 10.0) << result.output;
  EXPECT_TRUE(contains(result.output, "received SIG" + signal + ", forwarding SIGTERM")) << result.output;
  EXPECT_TRUE(contains(result.output, "launcher exit status: " + std::to_string(128 + number)))
      << "expected 128 + SIG" << signal << ":\n" << result.output;
  std::vector<pid_t> recorded = read_pids(pids);
  EXPECT_EQ(recorded.size(), 4u) << result.output;
  recorded.push_back(read_pids(launcher_pid).at(0));
  const std::vector<pid_t> alive = still_alive_after_settling(recorded);
  EXPECT_TRUE(alive.empty()) << "left alive: " << join_pids(alive) << "\n" << result.output;
}

TEST(FaultLauncher, SigtermToLauncherStopsEveryWorker) { expect_signal_stops_every_worker("TERM", SIGTERM); }

// A closed ssh session (SIGHUP) or SIGQUIT stops the job as SIGTERM does,
// as torchrun's: the workers' own children are not orphaned.
TEST(FaultLauncher, SighupAndSigquitToLauncherStopEveryWorkerAndTheirChildren) {
  expect_signal_stops_every_worker("HUP", SIGHUP);
  expect_signal_stops_every_worker("QUIT", SIGQUIT);
}

// Each worker's share of the cores the launcher may run on (taskset, a
// cpuset), not of every core the machine has.
TEST(FaultLauncher, OmpThreadsSplitTheCoresTheLauncherMayUse) {
  const CommandResult result = run_command("env -u OMP_NUM_THREADS taskset -c 0 " + kShardtrain +
                                               " launch --num_processes 1 /bin/sh -c 'echo \"threads $OMP_NUM_THREADS\"'",
                                           30s);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_TRUE(contains(result.output, "[rank 0] threads 1\n")) << result.output;
}

TEST(FaultLauncher, WorkersDieWithAKilledLauncher) {
  ScratchDir dir;
  const std::string pids = dir.file("pids");
  // SIGKILL cannot be forwarded; the workers must still not outlive the launcher.
  const std::string command = "touch " + pids + "; " + kShardtrain + " launch --num_processes 2 /bin/sh -c 'echo $$ >> " +
                              pids + "; exec sleep 60' & L=$!; " + wait_for_lines(pids, 2) +
                              "kill -KILL $L; wait $L; echo \"launcher exit status: $?\"";
  const CommandResult result = run_command(command, 30s);
  EXPECT_FALSE(result.timed_out) << result.output;
  EXPECT_TRUE(contains(result.output, "launcher exit status: 137")) << result.output;
  const std::vector<pid_t> recorded = read_pids(pids);
  EXPECT_EQ(recorded.size(), 2u) << result.output;
  const std::vector<pid_t> alive = still_alive_after_settling(recorded);
  EXPECT_TRUE(alive.empty()) << "left alive: " << join_pids(alive) << "\n" << result.output;
}

TEST(FaultLauncher, SigkillAfterGracePeriodForWorkersIgnoringSigterm) {
  ScratchDir dir;
  const std::string pids = dir.file("pids");
  // The worker and its child ignore SIGTERM: only SIGKILL after the grace period stops them.
  const std::string worker = "/bin/sh -c 'trap \"\" TERM; echo $$ >> " + pids + "; sleep 60 & echo $! >> " + pids +
                             "; if [ \"$RANK\" = 1 ]; then " + wait_for_lines(pids, 4) + "exit 4; fi; wait'";
  const std::string command =
      "touch " + pids + "; " + kShardtrain + " launch --num_processes 2 --grace_period 1 " + worker;
  const CommandResult result = run_command(command, 30s);
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_GE(result.seconds, 1.0) << "SIGKILL came before the grace period ended:\n" << result.output;
  EXPECT_LT(result.seconds, 6.0) << result.output;
  EXPECT_TRUE(contains(result.output, "exited with status 4")) << result.output;
  EXPECT_TRUE(contains(result.output, "needed SIGKILL")) << result.output;
  const std::vector<pid_t> alive = still_alive_after_settling(read_pids(pids));
  EXPECT_TRUE(alive.empty()) << "left alive: " << join_pids(alive) << "\n" << result.output;
}

TEST(FaultLauncher, OutputLinesArePrefixedWithRank) {
  const std::string worker =
      "/bin/sh -c 'echo \"out line $RANK\"; echo \"err line $RANK\" >&2; echo \"second $RANK\"; printf \"tail $RANK\"'";
  const std::string launch = kShardtrain + " launch --num_processes 2 " + worker;

  const CommandResult both = run_command(launch, 30s);
  ASSERT_EQ(both.exit_code, 0) << both.output;
  for (int rank : {0, 1}) {
    const std::string prefix = "[rank " + std::to_string(rank) + "] ";
    const std::string id = std::to_string(rank);
    EXPECT_TRUE(contains(both.output, prefix + "out line " + id + "\n")) << both.output;
    EXPECT_TRUE(contains(both.output, prefix + "err line " + id + "\n")) << both.output;
    EXPECT_TRUE(contains(both.output, prefix + "second " + id + "\n")) << both.output;
    // The unterminated last line is flushed at exit, as a line of its own.
    EXPECT_TRUE(contains(both.output, prefix + "tail " + id + "\n")) << both.output;
  }
  std::istringstream lines(both.output);
  std::string line;
  while (std::getline(lines, line)) {
    EXPECT_TRUE(line.rfind("[rank ", 0) == 0) << "unprefixed line: " << line << "\n" << both.output;
  }

  // stdout stays stdout and stderr stays stderr.
  const CommandResult out_only = run_command(launch + " 2>/dev/null", 30s);
  EXPECT_TRUE(contains(out_only.output, "[rank 1] out line 1")) << out_only.output;
  EXPECT_FALSE(contains(out_only.output, "err line")) << out_only.output;
  const CommandResult err_only = run_command(launch + " >/dev/null", 30s);
  EXPECT_TRUE(contains(err_only.output, "[rank 1] err line 1")) << err_only.output;
  EXPECT_FALSE(contains(err_only.output, "out line")) << err_only.output;
}

TEST(FaultLauncher, WorkerEnvironmentOnTwoMachines) {
  const int port = pick_free_port();
  const std::string worker =
      "/bin/sh -c 'echo \"env RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK "
      "LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE GROUP_RANK=$GROUP_RANK MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT\"'";
  std::string output;
  for (int machine_rank : {0, 1}) {
    const CommandResult result = run_command(
        kShardtrain + " launch --num_processes 4 --num_machines 2 --machine_rank " + std::to_string(machine_rank) +
            " --main_process_ip 127.0.0.1 --main_process_port " + std::to_string(port) +
            " --rdzv_token shared-test-token " + worker,
        30s);
    EXPECT_EQ(result.exit_code, 0) << result.output;
    output += result.output;
  }
  for (int rank = 0; rank < 4; ++rank) {
    std::ostringstream expected;
    expected << "[rank " << rank << "] env RANK=" << rank << " WORLD_SIZE=4 LOCAL_RANK=" << rank % 2
             << " LOCAL_WORLD_SIZE=2 GROUP_RANK=" << rank / 2 << " MASTER_ADDR=127.0.0.1 MASTER_PORT=" << port
             << "\n";
    EXPECT_TRUE(contains(output, expected.str())) << "missing: " << expected.str() << "in:\n" << output;
  }
}

TEST(FaultLauncher, WorkersShareAFreshRendezvousToken) {
  const std::string worker = "/bin/sh -c 'echo \"token=$SHARDTRAIN_RDZV_TOKEN.\"'";
  std::vector<std::string> tokens;
  for (int run = 0; run < 2; ++run) {
    const CommandResult result =
        run_command("env -u SHARDTRAIN_RDZV_TOKEN " + kShardtrain + " launch --num_processes 2 " + worker, 30s);
    ASSERT_EQ(result.exit_code, 0) << result.output;
    const std::size_t first = result.output.find("token=");
    ASSERT_NE(first, std::string::npos) << result.output;
    const std::string token = result.output.substr(first + 6, result.output.find('.', first) - first - 6);
    EXPECT_EQ(token.size(), 64u) << result.output;
    EXPECT_EQ(token.find_first_not_of("0123456789abcdef"), std::string::npos) << token;
    EXPECT_TRUE(contains(result.output, "[rank 1] token=" + token + ".")) << "ranks got different tokens:\n"
                                                                           << result.output;
    tokens.push_back(token);
  }
  EXPECT_NE(tokens[0], tokens[1]) << "two jobs got the same token";
}

TEST(FaultLauncher, OtherMachinesNeedTheTokenMachineZeroPrints) {
  const std::string port = std::to_string(pick_free_port());
  const std::string common = "env -u SHARDTRAIN_RDZV_TOKEN " + kShardtrain +
                             " launch --num_processes 4 --num_machines 2 --main_process_ip 127.0.0.1 --main_process_port " +
                             port + " --machine_rank ";
  const CommandResult machine1 = run_command(common + "1 /bin/true", 30s);
  EXPECT_EQ(machine1.exit_code, 2) << machine1.output;
  EXPECT_TRUE(contains(machine1.output, "machine 1 of 2 has no rendezvous token")) << machine1.output;
  EXPECT_TRUE(contains(machine1.output, "--rdzv_token TOKEN")) << machine1.output;
  const CommandResult machine0 = run_command(common + "0 /bin/true", 30s);
  EXPECT_EQ(machine0.exit_code, 0) << machine0.output;
  EXPECT_TRUE(contains(machine0.output, "rendezvous token of this job (pass it to the other machines as --rdzv_token): "))
      << machine0.output;
}

TEST(FaultLauncher, WorkerEnvironmentCarriesRunSettings) {
  ScratchDir dir;
  const std::string config = dir.file("accelerate.yaml");
  std::ofstream(config) << "distributed_type: MULTI_GPU\nmixed_precision: fp16\nnum_processes: 2\n";
  const std::string worker =
      "/bin/sh -c 'echo \"settings $SHARDTRAIN_MIXED_PRECISION $SHARDTRAIN_DISTRIBUTED_TYPE $SHARDTRAIN_CONFIG_FILE "
      "$ACCELERATE_MIXED_PRECISION $ACCELERATE_USE_DEEPSPEED $ACCELERATE_USE_FSDP\"'";
  const CommandResult result = run_command(
      "cd " + dir.file("") + " && " + kShardtrain + " launch --config_file accelerate.yaml --mixed_precision bf16 --use_fsdp " + worker, 30s);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const std::string expected = "settings bf16 FSDP " + config + " bf16 false true\n";
  EXPECT_TRUE(contains(result.output, "[rank 0] " + expected)) << result.output;
  EXPECT_TRUE(contains(result.output, "[rank 1] " + expected)) << result.output;
}

TEST(FaultLauncher, MissingProgramIsAClearError) {
  const CommandResult missing = run_command(kShardtrain + " launch --num_processes 2 no-such-program-xyz", 30s);
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_TRUE(contains(missing.output, "no-such-program-xyz was not found in PATH")) << missing.output;
  ScratchDir dir;
  const std::string script = dir.file("train.sh");
  std::ofstream(script) << "#!/bin/sh\necho should not run\n";  // created without execute permission
  const CommandResult not_executable = run_command(kShardtrain + " launch " + script, 30s);
  EXPECT_EQ(not_executable.exit_code, 2) << not_executable.output;
  EXPECT_TRUE(contains(not_executable.output, "is not executable")) << not_executable.output;
}

TEST(FaultLauncher, HelpListsEveryOption) {
  const CommandResult help = run_command(kShardtrain + " launch --help", 30s);
  EXPECT_EQ(help.exit_code, 0) << help.output;
  for (const char* option :
       {"--num_processes", "--num_machines", "--machine_rank", "--main_process_ip", "--main_process_port",
        "--config_file", "--mixed_precision", "--use_deepspeed", "--use_fsdp", "--deepspeed_config_file",
        "--deepspeed_config", "--grace_period", "--rdzv_token", "--rdzv_token_file", "--rdzv_id",
        "PROGRAM [ARGS...]"}) {
    EXPECT_TRUE(contains(help.output, option)) << option << " missing from:\n" << help.output;
  }
}

TEST(FaultLauncher, TwoLaunchersFormOneFourRankJob) {
  ScratchDir dir;
  const std::string port = std::to_string(pick_free_port());
  auto launch = [&](int machine_rank) {
    return "OMP_NUM_THREADS=1 SHARDTRAIN_COMM_TIMEOUT_S=60 " + kShardtrain +
           " launch --num_processes 4 --num_machines 2 --machine_rank " + std::to_string(machine_rank) +
           " --main_process_ip 127.0.0.1 --main_process_port " + port + " --rdzv_token shared-test-token " + kSmokeJob;
  };
  const std::string log1 = dir.file("machine1.log");
  const std::string command = launch(1) + " > " + log1 + " 2>&1 & M1=$!; " + launch(0) +
                              "; echo \"machine 0 exit status: $?\"; wait $M1; echo \"machine 1 exit status: $?\"; "
                              "cat " + log1;
  const CommandResult result = run_command(command, 90s);
  EXPECT_FALSE(result.timed_out) << result.output;
  EXPECT_TRUE(contains(result.output, "machine 0 exit status: 0")) << result.output;
  EXPECT_TRUE(contains(result.output, "machine 1 exit status: 0")) << result.output;
  // Both launchers share this host, so it works; a real second machine could not reach 127.0.0.1.
  EXPECT_TRUE(contains(result.output, "a loopback address, while ranks on 1 other machine(s) must reach it"))
      << result.output;
  for (int rank = 0; rank < 4; ++rank) {
    const std::string expected = "[rank " + std::to_string(rank) + "] smoke job: rank " + std::to_string(rank) +
                                 " of 4 (torchrun, gloo on cpu), all checks passed";
    EXPECT_TRUE(contains(result.output, expected)) << "missing: " << expected << "\n" << result.output;
  }
}

// Two machines given the same --machine_rank, or started for different
// world sizes: the arrival count alone would complete, and the job wait in
// its first collective until the timeout (60 s here).
TEST(FaultLauncher, ARankClaimedTwiceOrAnotherWorldSizeStopsTheJobNamingIt) {
  ScratchDir dir;
  auto launch = [&](const std::string& port, int processes, int machines, int machine_rank) {
    return "OMP_NUM_THREADS=1 SHARDTRAIN_COMM_TIMEOUT_S=60 " + kShardtrain + " launch --num_processes " +
           std::to_string(processes) + " --num_machines " + std::to_string(machines) + " --machine_rank " +
           std::to_string(machine_rank) + " --main_process_ip 127.0.0.1 --main_process_port " + port +
           " --rdzv_token shared-test-token " + kSmokeJob;
  };
  const std::string twice = std::to_string(pick_free_port());
  const CommandResult repeated = run_command(
      launch(twice, 3, 3, 1) + " > " + dir.file("a.log") + " 2>&1 & A=$!; " + launch(twice, 3, 3, 1) + " > " +
          dir.file("b.log") + " 2>&1 & B=$!; " + launch(twice, 3, 3, 0) + "; echo \"machine 0 exit status: $?\"; wait $A; wait $B; cat " +
          dir.file("a.log") + " " + dir.file("b.log"),
      50s);
  EXPECT_FALSE(repeated.timed_out) << repeated.output;
  EXPECT_LT(repeated.seconds, 30.0) << repeated.output;
  EXPECT_TRUE(contains(repeated.output, "machine 0 exit status: 1")) << repeated.output;
  EXPECT_TRUE(contains(repeated.output, "rank 1 is claimed twice, by ")) << repeated.output;
  EXPECT_TRUE(contains(repeated.output, "give each machine its own --machine_rank")) << repeated.output;

  const std::string other = std::to_string(pick_free_port());
  const CommandResult worlds = run_command(
      launch(other, 4, 2, 1) + " > " + dir.file("c.log") + " 2>&1 & C=$!; " + launch(other, 2, 2, 0) +
          "; echo \"machine 0 exit status: $?\"; wait $C; echo \"machine 1 exit status: $?\"; cat " + dir.file("c.log"),
      50s);
  EXPECT_FALSE(worlds.timed_out) << worlds.output;
  EXPECT_LT(worlds.seconds, 30.0) << worlds.output;
  EXPECT_TRUE(contains(worlds.output, "machine 0 exit status: 1")) << worlds.output;
  EXPECT_TRUE(contains(worlds.output, "machine 1 exit status: 1")) << worlds.output;
  EXPECT_TRUE(contains(worlds.output, "every machine needs the same --num_machines and --num_processes"))
      << worlds.output;
}

TEST(FaultLauncher, AFloodOnTheStorePortDoesNotStopAWorldTwoJob) {
  // One process (this test's flooder thread) opens connections to the port
  // as fast as it can and never speaks, from before the job starts until it
  // has finished; the store used to close every connection past 64 silent
  // ones, the ranks' included, and the job died after the rendezvous timeout.
  const int port = pick_free_port();
  std::atomic<bool> stop{false};
  std::atomic<int64_t> accepted{0};
  std::thread flooder([&] {
    std::deque<int> held;
    while (!stop) {
      const int fd = shardtrain::testing::try_loopback_connection(port);
      if (fd < 0) continue;  // nothing listens yet (or any more)
      ++accepted;
      held.push_back(fd);
      if (held.size() > 300) {  // more than the store keeps pending from one address
        ::close(held.front());
        held.pop_front();
      }
    }
    for (int fd : held) ::close(fd);
  });
  const CommandResult job = run_command("OMP_NUM_THREADS=1 SHARDTRAIN_COMM_TIMEOUT_S=60 " + kShardtrain +
                                            " launch --num_processes 2 --main_process_port " + std::to_string(port) +
                                            " " + kSmokeJob,
                                        120s);
  stop = true;
  flooder.join();
  EXPECT_FALSE(job.timed_out) << job.output;
  EXPECT_EQ(job.exit_code, 0) << job.output;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string expected = "[rank " + std::to_string(rank) + "] smoke job: rank " + std::to_string(rank) +
                                 " of 2 (torchrun, gloo on cpu), all checks passed";
    EXPECT_TRUE(contains(job.output, expected)) << "missing: " << expected << "\n" << job.output;
  }
  // Connections only succeed while the store listens: this many filled the
  // per-address quota (128) twice over while the ranks met.
  EXPECT_GE(accepted.load(), 256) << "the flood did not reach the store while the job ran";
  std::cout << "flood: " << accepted.load() << " silent connections reached the store while the job ran\n";
}

TEST(FaultLauncher, TwoJobsThatShareAPortAndATokenDoNotMix) {
  // A token exported in the shell is shared by every job started from it.
  // Job one's machine 0 holds the store and waits for its machine 1; job
  // two's machine 1 comes to the same port with the same token and must be
  // refused by name at once, and job one must then finish unharmed.
  ScratchDir dir;
  const std::string port = std::to_string(pick_free_port());
  auto launch = [&](int machine_rank, const std::string& job) {
    return "SHARDTRAIN_RDZV_TOKEN=exported-in-the-shell OMP_NUM_THREADS=1 SHARDTRAIN_COMM_TIMEOUT_S=60 " +
           kShardtrain + " launch --num_processes 2 --num_machines 2 --machine_rank " + std::to_string(machine_rank) +
           " --main_process_ip 127.0.0.1 --main_process_port " + port + " --rdzv_id " + job + " " + kSmokeJob;
  };
  const std::string log0 = dir.file("job_one_machine0.log");
  const std::string command =
      launch(0, "job-one") + " > " + log0 + " 2>&1 & M0=$!; " +
      "for i in $(seq 300); do grep -q ':" + [&] {
        char hex[8];
        std::snprintf(hex, sizeof(hex), "%04X", std::stoi(port));
        return std::string(hex);
      }() + " 00000000:0000 0A' /proc/net/tcp && break; sleep 0.1; done; " +
      "start=$(date +%s%N); " + launch(1, "job-two") + "; echo \"job two exit status: $?\"; " +
      "echo \"job two stopped after $(( ($(date +%s%N) - start) / 1000000 )) ms\"; " + launch(1, "job-one") +
      "; echo \"job one machine 1 exit status: $?\"; wait $M0; echo \"job one machine 0 exit status: $?\"; cat " +
      log0;
  const CommandResult result = run_command(command, 120s);
  EXPECT_FALSE(result.timed_out) << result.output;
  EXPECT_TRUE(contains(result.output, "belongs to job 'job-two' and this store to job 'job-one'")) << result.output;
  EXPECT_FALSE(contains(result.output, "job two exit status: 0")) << result.output;
  const std::size_t took = result.output.find("job two stopped after ");
  ASSERT_NE(took, std::string::npos) << result.output;
  // Refused in the handshake, not after the 60 s rendezvous timeout.
  EXPECT_LT(std::stol(result.output.substr(took + 22)), 30000) << result.output;
  EXPECT_TRUE(contains(result.output, "job one machine 1 exit status: 0")) << result.output;
  EXPECT_TRUE(contains(result.output, "job one machine 0 exit status: 0")) << result.output;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string expected = "[rank " + std::to_string(rank) + "] smoke job: rank " + std::to_string(rank) +
                                 " of 2 (torchrun, gloo on cpu), all checks passed";
    EXPECT_TRUE(contains(result.output, expected)) << "missing: " << expected << "\n" << result.output;
  }
}

}  // namespace
