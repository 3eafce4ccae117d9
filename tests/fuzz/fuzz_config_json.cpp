// libFuzzer target for the DeepSpeed JSON config loader, then "auto"
// resolution and both conversions of whatever loaded.
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "shardtrain/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  return fuzz::parses_or_rejects([&] {
    shardtrain::TrainingConfig config = shardtrain::parse_config(text, "json", fuzz::scratch_dir().string());
    shardtrain::AutoContext context;
    context.world_size = 2;
    context.micro_batch_size = 4;
    context.hidden_size = 64;
    context.total_steps = 10;
    const shardtrain::TrainingConfig resolved = shardtrain::resolve_auto(config, context);
    std::vector<std::string> notes;
    (void)shardtrain::convert_config(resolved, "fsdp", notes);
    (void)shardtrain::convert_config(resolved, "deepspeed", notes);
  });
}
