#pragma once
// The Python interpreter that has the pinned peers (torch, transformers,
// PEFT: scripts/setup's .venv), for the tests that run them side by side.

#include <cstdlib>
#include <string>

#include "build_config.h"

namespace shardtrain::testing {

/// SHARDTRAIN_TEST_PYTHON when set, else the project's .venv.
inline std::string peer_python() {
  if (const char* python = std::getenv("SHARDTRAIN_TEST_PYTHON")) return python;
  return std::string(SHARDTRAIN_SOURCE_DIR) + "/.venv/bin/python3";
}

}  // namespace shardtrain::testing
