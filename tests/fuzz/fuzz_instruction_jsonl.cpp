// libFuzzer target for the instruction-data JSONL reader ({"prompt",
// "response"}, {"text"}, {"messages"}, pre-tokenized {"input_ids","labels"}),
// with the tiny Llama's vocabulary size bounding token ids.
#include "fuzz_support.h"
#include "shardtrain/models/instruction_data.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto path = fuzz::scratch_dir() / "data.jsonl";
  fuzz::write_input(path, data, size);
  return fuzz::parses_or_rejects([&] { (void)shardtrain::models::read_instruction_jsonl(path.string(), 384); });
}
