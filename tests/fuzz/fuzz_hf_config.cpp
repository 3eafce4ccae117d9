// libFuzzer target for the Hugging Face config.json reader (Llama/Mistral).
#include <string>

#include "fuzz_support.h"
#include "shardtrain/models/llama.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  return fuzz::parses_or_rejects([&] { (void)shardtrain::models::LlamaConfig::from_json_string(text, "config.json"); });
}
