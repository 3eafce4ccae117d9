#pragma once
// Where a test writes its files: one directory per test, shared with the
// test's rank processes, removed when the test passes and kept (its path
// printed) when it fails. Every test that writes files takes its directory
// from here, so no test leaves files behind and none has to pass a path to
// its ranks by hand.

#include <filesystem>
#include <string>

namespace shardtrain::testing {

/// The running test's scratch directory.
/// - In the test process: made, empty, on first use under ::testing::TempDir();
///   removed when the test ends, or kept and named on stderr when it failed
///   (what a failed run left is the evidence).
/// - In a rank process of run_on_ranks: the test process's directory, which
///   the harness passes in SHARDTRAIN_TEST_SCRATCH; nothing is made.
std::filesystem::path test_scratch_dir();

/// test_scratch_dir() / name. The test process makes it empty (a second call
/// with the same name starts over); a rank process only names it.
std::filesystem::path test_scratch_subdir(const std::string& name);

}  // namespace shardtrain::testing
