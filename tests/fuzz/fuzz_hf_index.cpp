// libFuzzer target for a Hugging Face model directory's
// model.safetensors.index.json: the checkpoint opens it and the shard files
// it names (absent here, so a valid index is rejected for its missing files).
#include "fuzz_support.h"
#include "shardtrain/models/hf_weights.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto dir = fuzz::scratch_dir();
  fuzz::write_input(dir / "model.safetensors.index.json", data, size);
  return fuzz::parses_or_rejects([&] { shardtrain::models::HfCheckpoint checkpoint(dir.string()); });
}
