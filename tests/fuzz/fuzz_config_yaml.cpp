// libFuzzer target for the Accelerate YAML config loader (yaml-cpp underneath:
// its exceptions must come out as shardtrain::ConfigError), then "auto"
// resolution of whatever loaded.
#include <string>

#include "fuzz_support.h"
#include "shardtrain/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  return fuzz::parses_or_rejects([&] {
    shardtrain::TrainingConfig config = shardtrain::parse_config(text, "yaml", fuzz::scratch_dir().string());
    shardtrain::AutoContext context;
    context.world_size = 2;
    context.micro_batch_size = 4;
    context.hidden_size = 64;
    context.total_steps = 10;
    shardtrain::resolve_auto(config, context);
    (void)shardtrain::to_yaml(config);
  });
}
