// The per-test scratch directory (test_scratch.h): made on first use, handed
// to rank processes through the environment, and removed at the end of a
// passing test by a GoogleTest listener.
#include "support/test_scratch.h"

#include <stdlib.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <gtest/gtest.h>

#include "shardtrain/error.h"
#include "support/multirank.h"

namespace fs = std::filesystem;

namespace shardtrain::testing {
namespace {

constexpr const char* kScratchVariable = "SHARDTRAIN_TEST_SCRATCH";

/// The directory made for the running test in this (test) process; empty when none was.
fs::path& current_dir() {
  static fs::path dir;
  return dir;
}

std::string test_label() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string label = info == nullptr ? std::string("no-test")
                                      : std::string(info->test_suite_name()) + "." + info->name();
  // Parameterised names carry '/', and a file name has at most 255 bytes.
  std::replace(label.begin(), label.end(), '/', '_');
  if (label.size() > 120) label.resize(120);
  return label;
}

/// Removes a passing test's directory and names a failing test's.
class ScratchCleaner : public ::testing::EmptyTestEventListener {
  void OnTestEnd(const ::testing::TestInfo& info) override {
    fs::path& dir = current_dir();
    if (dir.empty() || is_rank_process()) return;
    if (info.result()->Failed()) {
      std::fprintf(stderr, "[ scratch  ] kept for the failed test: %s\n", dir.c_str());
    } else {
      std::error_code ignored;
      fs::remove_all(dir, ignored);
    }
    dir.clear();
  }
};

// Registered before main(): gtest_main owns main, and a listener appended
// before RUN_ALL_TESTS sees every test.
[[maybe_unused]] const bool kCleanerRegistered = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new ScratchCleaner);
  return true;
}();

}  // namespace

fs::path test_scratch_dir() {
  if (is_rank_process()) {
    const char* shared = std::getenv(kScratchVariable);
    ST_CHECK(shared != nullptr, "a rank process has no ", kScratchVariable, ": run_on_ranks passes it");
    return shared;
  }
  fs::path& dir = current_dir();
  if (dir.empty()) {
    std::string path_template = (fs::path(::testing::TempDir()) / ("shardtrain-" + test_label() + "-XXXXXX")).string();
    ST_CHECK(mkdtemp(path_template.data()) != nullptr, "mkdtemp failed for ", path_template);
    dir = path_template;
  }
  return dir;
}

fs::path test_scratch_subdir(const std::string& name) {
  const fs::path dir = test_scratch_dir() / name;
  if (!is_rank_process()) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  return dir;
}

}  // namespace shardtrain::testing
