// libFuzzer target for the safetensors reader: every tensor of an input that
// opens is read in full and as a slice.
#include <ATen/ATen.h>

#include "fuzz_support.h"
#include "shardtrain/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto path = fuzz::scratch_dir() / "input.safetensors";
  fuzz::write_input(path, data, size);
  return fuzz::parses_or_rejects([&] {
    shardtrain::safetensors::Reader reader(path.string());
    for (const auto& name : reader.names()) {
      const auto& info = reader.info(name);
      at::Tensor t = reader.read(name);
      if (t.numel() != info.numel()) __builtin_trap();
      if (info.numel() > 1) reader.read_slice(name, 1, info.numel() - 1);
    }
  });
}
