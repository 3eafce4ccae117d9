#pragma once
// The golden Llama/Mistral cases of tests/data/golden (made by
// scripts/make_llama_golden.py, an independent plain-torch implementation).

#include <string>

#include "build_config.h"
#include "shardtrain/models/llama.h"

namespace shardtrain::testing {

inline std::string golden_dir(const std::string& name) {
  return std::string(SHARDTRAIN_SOURCE_DIR) + "/tests/data/golden/" + name;
}

/// The case's model with its committed weights, in eval mode.
inline models::LlamaForCausalLM load_golden_case(const std::string& name) {
  auto config = models::LlamaConfig::from_json_file(golden_dir(name) + "/config.json");
  models::LlamaForCausalLM model(config);
  models::load_hf_weights(model, golden_dir(name));
  model->eval();
  return model;
}

}  // namespace shardtrain::testing
