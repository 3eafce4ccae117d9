#pragma once
// What the LoRA and QLoRA code (lora_model.cpp, quantize_base.cpp) share:
// PEFT's rules for naming a module, and how their summaries write counts.

#include <cstdint>
#include <string>

namespace shardtrain::lora_detail {

/// PEFT's rule for a name in target_modules (and transformers' for
/// llm_int8_skip_modules): the whole path, or its tail after a dot ("q_proj"
/// matches "model.layers.0.self_attn.q_proj"). Also used for modules_to_save,
/// where PEFT tests a plain suffix ("head" would wrap "lm_head"): the dot is
/// kept there, so such a name is refused as matching nothing rather than
/// wrapping a module it does not name.
inline bool names_module(const std::string& path, const std::string& name) {
  return path == name ||
         (path.size() > name.size() && path.compare(path.size() - name.size(), name.size(), name) == 0 &&
          path[path.size() - name.size() - 1] == '.');
}

/// `path` is the module `name` names or lies inside it: PEFT's
/// "(^|.*\.)NAME($|\..*)", which keeps adapters out of modules_to_save.
inline bool inside_module(const std::string& path, const std::string& name) {
  for (std::size_t at = path.find(name); at != std::string::npos; at = path.find(name, at + 1)) {
    const std::size_t end = at + name.size();
    if ((at == 0 || path[at - 1] == '.') && (end == path.size() || path[end] == '.')) return true;
  }
  return false;
}

/// 1234567 -> "1,234,567", as PEFT prints parameter counts.
inline std::string with_thousands(int64_t n) {
  std::string digits = std::to_string(n);
  for (int i = static_cast<int>(digits.size()) - 3; i > 0; i -= 3) digits.insert(static_cast<std::size_t>(i), ",");
  return digits;
}

}  // namespace shardtrain::lora_detail
