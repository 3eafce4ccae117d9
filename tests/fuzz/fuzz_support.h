#pragma once
// What every fuzz target shares: the rule (an input parses or throws
// shardtrain::Error; anything else -- a crash, a sanitizer report, another
// exception escaping LLVMFuzzerTestOneInput -- is a bug libFuzzer reports)
// and scratch files for parsers that read paths.

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

#include "shardtrain/error.h"

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
class ScratchDirectory {
 public:
  explicit ScratchDirectory(const char* target)
      : path_(std::filesystem::temp_directory_path() /
              (std::string("shardtrain-fuzz-") + target + "-" + std::to_string(::getpid()))) {
    std::filesystem::create_directories(path_);
  }
  ~ScratchDirectory() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDirectory(const ScratchDirectory&) = delete;
  ScratchDirectory& operator=(const ScratchDirectory&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

inline const std::filesystem::path& scratch_dir(const char* target) {
  static const ScratchDirectory dir(target);
  return dir.path();
}

/// Writes the input to `path` byte for byte.
inline void write_input(const std::filesystem::path& path, const uint8_t* data, size_t size) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) __builtin_trap();  // the harness itself is broken, not the parser
  if (size > 0 && std::fwrite(data, 1, size, f) != size) __builtin_trap();
  std::fclose(f);
}

}  // namespace fuzz
