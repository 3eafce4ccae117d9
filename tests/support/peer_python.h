#pragma once
// The Python interpreter that has the pinned peers (torch, transformers,
// PEFT: scripts/setup's .venv), and how a test runs a peer script with it.

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>

#include "build_config.h"

namespace shardtrain::testing {

/// SHARDTRAIN_TEST_PYTHON when set, else the project's .venv.
inline std::string peer_python() {
  if (const char* python = std::getenv("SHARDTRAIN_TEST_PYTHON")) return python;
  return std::string(SHARDTRAIN_SOURCE_DIR) + "/.venv/bin/python3";
}

/// How a peer run ended.
struct PeerRun {
  int status = -1;     ///< std::system's status of the last run: 0 when it succeeded
  std::string output;  ///< the last run's stdout and stderr
  int runs = 0;        ///< 1, or 2 after a rerun
};

/// Runs the shell `command` with its output in `log`, and once more when it
/// failed because a process of it died by a signal (torch's spawn then says
/// "terminated with signal"): a native crash of the reference itself, not a
/// result of what the test compares. The crashed run's output is printed;
/// any other failure, and a second crash, is the result.
inline PeerRun run_peer_command(const std::string& command, const std::filesystem::path& log) {
  PeerRun run;
  auto run_once = [&] {
    run.status = std::system((command + " > '" + log.string() + "' 2>&1").c_str());
    std::ifstream in(log);
    run.output.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    ++run.runs;
  };
  run_once();
  if (run.status != 0 && run.output.find("terminated with signal") != std::string::npos) {
    std::cout << "a process of the peer crashed; running it once more. Its output:\n" << run.output << std::endl;
    run_once();
  }
  return run;
}

}  // namespace shardtrain::testing
