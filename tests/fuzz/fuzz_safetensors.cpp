// libFuzzer target for the safetensors reader: any byte string must either
// open and read cleanly or throw shardtrain::Error -- never crash, hang, leak
// or throw anything else. Not part of the default build; see README.md.
#include <unistd.h>

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "shardtrain/error.h"
#include "shardtrain/safetensors.h"

namespace {
// Reader takes a path (it preads), so each input goes through one scratch file
// per fuzzing process.
const std::string& scratch_path() {
  static const std::string path =
      "/tmp/fuzz_safetensors_" + std::to_string(::getpid()) + ".safetensors";
  return path;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = scratch_path();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return 0;
  if (size > 0) std::fwrite(data, 1, size, f);
  std::fclose(f);
  try {
    shardtrain::safetensors::Reader reader(path);
    for (const auto& name : reader.names()) {
      const auto& info = reader.info(name);
      at::Tensor t = reader.read(name);
      if (t.numel() != info.numel()) __builtin_trap();
      if (info.numel() > 1) reader.read_slice(name, 1, info.numel() - 1);
    }
  } catch (const shardtrain::Error&) {
    // Rejecting malformed input is the expected outcome.
  }
  return 0;
}
