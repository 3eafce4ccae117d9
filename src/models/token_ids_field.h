#pragma once
// A Hugging Face config's token-id field (eos_token_id in config.json and in
// generation_config.json): read by one rule for both files.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace shardtrain::models {

/// `key` of `j` as transformers writes it, one integer or a list of them
/// (Llama 3 lists several end ids); nullopt when absent or null. An integer
/// follows config.json's integer rule (in range, a float only with an
/// integral value). Throws shardtrain::ConfigError naming `source` and `key`
/// on another value.
std::optional<std::vector<int64_t>> token_ids_field(const nlohmann::json& j, const char* key,
                                                    const std::string& source);

}  // namespace shardtrain::models
