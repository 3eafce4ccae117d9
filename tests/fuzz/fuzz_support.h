#pragma once
// What every fuzz target shares: the rule (an input parses or throws
// shardtrain::Error; anything else -- a crash, a sanitizer report, another
// exception escaping LLVMFuzzerTestOneInput -- is a bug libFuzzer reports)
// and scratch files for parsers that read paths.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

#include "shardtrain/error.h"
#include "support/scratch_dir.h"

namespace fuzz {

/// Runs `parse`; a shardtrain::Error is the expected rejection of bad input.
template <class Parse>
int parses_or_rejects(Parse&& parse) {
  try {
    parse();
  } catch (const shardtrain::Error&) {
  }
  return 0;
}

/// A directory of this fuzzing process's own, made once and removed when the
/// process exits normally (libFuzzer calls exit() at the end of a run; a
/// crash leaves it, beside the crash input, to be read).
inline const std::filesystem::path& scratch_dir() {
  static const shardtrain::testing::ScratchDir dir;
  static const std::filesystem::path path = dir.path();
  return path;
}

/// Writes the input to `path` byte for byte.
inline void write_input(const std::filesystem::path& path, const uint8_t* data, size_t size) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) __builtin_trap();  // the harness itself is broken, not the parser
  if (size > 0 && std::fwrite(data, 1, size, f) != size) __builtin_trap();
  std::fclose(f);
}

}  // namespace fuzz
