// libFuzzer target for the checkpoint index (index.json): `checkpoint verify`
// and `checkpoint inspect` of a checkpoint directory holding the input as its
// index (and no rank files, so every file it lists is missing or damaged).
#include "checkpoint/export.h"
#include "fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto dir = fuzz::scratch_dir() / "step_1";
  std::filesystem::create_directories(dir);
  fuzz::write_input(dir / "index.json", data, size);
  return fuzz::parses_or_rejects([&] {
    (void)shardtrain::checkpoint::verify(dir.string());
    (void)shardtrain::checkpoint::inspect(dir.string());
  });
}
