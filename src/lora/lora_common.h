#pragma once
// What the LoRA and QLoRA code (lora_model.cpp, quantize_base.cpp) share:
// PEFT's rule for naming a module, and how their summaries write counts.

#include <cstdint>
#include <string>

namespace shardtrain::lora_detail {

/// PEFT's rule for a name in target_modules or modules_to_save (and
/// transformers' for llm_int8_skip_modules): the whole path, or its tail after
/// a dot ("q_proj" matches "model.layers.0.self_attn.q_proj").
inline bool names_module(const std::string& path, const std::string& name) {
  return path == name ||
         (path.size() > name.size() && path.compare(path.size() - name.size(), name.size(), name) == 0 &&
          path[path.size() - name.size() - 1] == '.');
}

/// 1234567 -> "1,234,567", as PEFT prints parameter counts.
inline std::string with_thousands(int64_t n) {
  std::string digits = std::to_string(n);
  for (int i = static_cast<int>(digits.size()) - 3; i > 0; i -= 3) digits.insert(static_cast<std::size_t>(i), ",");
  return digits;
}

}  // namespace shardtrain::lora_detail
