#pragma once
// The Python interpreter that has the pinned peers (torch, transformers,
// PEFT: scripts/setup's .venv), and how a test runs a peer script with it.

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

#include "build_config.h"
#include "support/multirank.h"  // run_command

namespace shardtrain::testing {

/// SHARDTRAIN_TEST_PYTHON when set, else the project's .venv.
inline std::string peer_python() {
  if (const char* python = std::getenv("SHARDTRAIN_TEST_PYTHON")) return python;
  return std::string(SHARDTRAIN_SOURCE_DIR) + "/.venv/bin/python3";
}

/// How a peer run ended.
struct PeerRun {
  CommandResult result;  ///< the last run: its exit code (0: it succeeded), output, whether it timed out
  int runs = 0;          ///< 1, or 2 after a rerun
};

/// Runs the shell `command` (run_command: its output kept, killed after
/// `timeout`), its output also written to `log`, and once more when it
/// failed because a process of it died by a signal (torch's spawn then says
/// "terminated with signal"): a native crash of the reference itself, not a
/// result of what the test compares. The crashed run's output is printed;
/// any other failure, a timeout and a second crash are the result.
inline PeerRun run_peer_command(const std::string& command, const std::filesystem::path& log,
                                std::chrono::seconds timeout) {
  PeerRun run;
  auto run_once = [&] {
    run.result = run_command(command, timeout);
    std::ofstream(log) << run.result.output;
    ++run.runs;
  };
  run_once();
  if (run.result.exit_code != 0 && !run.result.timed_out &&
      run.result.output.find("terminated with signal") != std::string::npos) {
    std::cout << "a process of the peer crashed; running it once more. Its output:\n" << run.result.output << std::endl;
    run_once();
  }
  return run;
}

}  // namespace shardtrain::testing
