// LoraConfig: validation, and PEFT's adapter_config.json read and written.
//
// PEFT writes every field of its LoraConfig, most of them at an inactive
// default (null, false, {}, []), and adds fields with each release. A field
// shardtrain implements is read; a field at an inactive value changes
// nothing and is accepted, known or not; a field that would change what
// PEFT computes and that shardtrain does not implement is refused by name,
// so an adapter is never trained or loaded with part of its meaning dropped.

#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "json_depth.h"
#include "shardtrain/error.h"
#include "shardtrain/lora.h"

namespace shardtrain {
namespace {

using json = nlohmann::json;

/// Fields that say where the adapter came from, not what it computes.
const std::set<std::string> kInformational = {
    "base_model_name_or_path", "revision", "task_type", "inference_mode", "peft_version", "auto_mapping",
    // Read by PEFT only when use_qalora / megatron_config turn those on, both refused below when set.
    "qalora_group_size", "megatron_core",
};

/// What PEFT's fields mean when shardtrain refuses them, for the message.
const std::map<std::string, std::string> kNotImplemented = {
    {"use_dora", "DoRA (weight-decomposed LoRA)"},
    {"loftq_config", "LoftQ initialisation"},
    {"rank_pattern", "per-module ranks"},
    {"alpha_pattern", "per-module alphas"},
    {"layers_to_transform", "adapting only some layers"},
    {"layers_pattern", "adapting only some layers"},
    {"exclude_modules", "excluded modules"},
    {"fan_in_fan_out", "Conv1D-style (fan-in, fan-out) weights"},
    {"use_qalora", "QA-LoRA"},
    {"lora_bias", "a bias on lora_B"},
    {"layer_replication", "layer replication"},
    {"target_parameters", "adapters on parameters rather than modules"},
    {"trainable_token_indices", "trainable token embeddings"},
    {"megatron_config", "Megatron layers"},
    {"eva_config", "EVA initialisation"},
    {"corda_config", "CorDA initialisation"},
    {"use_bdlora", "BD-LoRA"},
};

/// null, false, 0-length containers: a field at such a value is off.
bool inactive(const json& value) {
  return value.is_null() || (value.is_boolean() && !value.get<bool>()) ||
         ((value.is_object() || value.is_array() || value.is_string()) && value.empty());
}

std::vector<std::string> string_list(const json& value, const std::string& key, const std::string& origin) {
  ST_CHECK_T(ConfigError, value.is_array(), origin, ": ", key, " must be a list of module names");
  std::vector<std::string> names;
  for (const auto& item : value) {
    ST_CHECK_T(ConfigError, item.is_string() && !item.get<std::string>().empty(), origin, ": ", key,
               " must list module names (non-empty strings)");
    names.push_back(item.get<std::string>());
  }
  return names;
}

double number(const json& value, const std::string& key, const std::string& origin) {
  ST_CHECK_T(ConfigError, value.is_number(), origin, ": ", key, " must be a number, not ", value.dump());
  return value.get<double>();
}

}  // namespace

double LoraConfig::scaling() const {
  return use_rslora ? lora_alpha / std::sqrt(static_cast<double>(r)) : lora_alpha / static_cast<double>(r);
}

std::vector<std::string> LoraConfig::targets() const {
  // PEFT's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING for llama and mistral.
  return target_modules.empty() ? std::vector<std::string>{"q_proj", "v_proj"} : target_modules;
}

void LoraConfig::validate() const {
  ST_CHECK_T(ConfigError, r > 0, "LoRA rank r is ", r, "; it must be at least 1 (PEFT's default is 8)");
  ST_CHECK_T(ConfigError, std::isfinite(lora_alpha) && lora_alpha != 0.0, "LoRA lora_alpha is ", lora_alpha,
             "; it must be a finite non-zero number (PEFT's default is 8)");
  ST_CHECK_T(ConfigError, lora_dropout >= 0.0 && lora_dropout < 1.0, "LoRA lora_dropout is ", lora_dropout,
             "; it must be in [0, 1)");
  ST_CHECK_T(ConfigError, bias == "none" || bias == "lora_only" || bias == "all", "LoRA bias is '", bias,
             "'; it must be none, lora_only or all (PEFT's values)");
}

LoraConfig LoraConfig::from_peft_json_file(const std::string& path) {
  std::ifstream in(path);
  ST_CHECK_T(ConfigError, in.good(), "the PEFT adapter config ", path, " cannot be read");
  std::stringstream text;
  text << in.rdbuf();
  return from_peft_json(text.str(), path);
}

LoraConfig LoraConfig::from_peft_json(const std::string& text, const std::string& origin) {
  json doc;
  try {
    doc = parse_json_within_depth<ConfigError, json>(text, origin);
  } catch (const json::exception& e) {
    ST_THROW(ConfigError, origin, " is not valid JSON (", e.what(), ")");
  }
  ST_CHECK_T(ConfigError, doc.is_object(), origin, " is not a JSON object");
  const json peft_type = doc.value("peft_type", json());
  ST_CHECK_T(ConfigError, peft_type.is_string() && peft_type.get<std::string>() == "LORA", origin,
             " is a PEFT config of type ", peft_type.dump(), "; shardtrain trains LoRA adapters only (peft_type LORA)");
  LoraConfig config;
  for (const auto& [key, value] : doc.items()) {
    if (key == "peft_type" || kInformational.count(key)) continue;
    if (key == "r") {
      ST_CHECK_T(ConfigError, value.is_number_integer(), origin, ": r must be an integer, not ", value.dump());
      config.r = value.get<int64_t>();
    } else if (key == "lora_alpha") {
      config.lora_alpha = number(value, key, origin);
    } else if (key == "lora_dropout") {
      config.lora_dropout = number(value, key, origin);
    } else if (key == "target_modules") {
      if (value.is_string()) {
        if (value.get<std::string>() == "all-linear") {
          config.target_modules = {"all-linear"};
        } else {
          config.target_modules_regex = value.get<std::string>();
        }
      } else if (!value.is_null()) {
        config.target_modules = string_list(value, key, origin);
      }
    } else if (key == "bias") {
      ST_CHECK_T(ConfigError, value.is_string(), origin, ": bias must be a string, not ", value.dump());
      config.bias = value.get<std::string>();
    } else if (key == "modules_to_save") {
      if (!value.is_null()) config.modules_to_save = string_list(value, key, origin);
    } else if (key == "use_rslora") {
      ST_CHECK_T(ConfigError, value.is_boolean(), origin, ": use_rslora must be true or false");
      config.use_rslora = value.get<bool>();
    } else if (key == "init_lora_weights") {
      // true: PEFT's default (Kaiming-uniform A, zero B), what apply_lora does.
      // An adapter loaded from a file brings its own values either way, but
      // training a fresh one with another scheme would not be what was asked.
      ST_CHECK_T(ConfigError, value.is_boolean() && value.get<bool>(), origin, ": init_lora_weights ", value.dump(),
                 " is not implemented; shardtrain initialises adapters as PEFT's default (true)");
    } else if (kNotImplemented.count(key)) {
      ST_CHECK_T(ConfigError, inactive(value), origin, ": ", key, " = ", value.dump(), " asks for ",
                 kNotImplemented.at(key), ", which shardtrain does not implement; remove it (or set it to ",
                 value.is_boolean() ? "false" : "null", ") to train a plain LoRA adapter");
    } else {
      ST_CHECK_T(ConfigError, inactive(value), origin, ": ", key, " = ", value.dump(),
                 " is a PEFT option shardtrain does not know; it is refused rather than ignored");
    }
  }
  if (doc.contains("base_model_name_or_path") && doc["base_model_name_or_path"].is_string()) {
    config.base_model_name_or_path = doc["base_model_name_or_path"].get<std::string>();
  }
  try {
    config.validate();
  } catch (const ConfigError& e) {
    ST_THROW(ConfigError, origin, ": ", e.what());
  }
  return config;
}

std::string LoraConfig::to_peft_json() const {
  json doc = json::object();
  doc["peft_type"] = "LORA";
  doc["task_type"] = "CAUSAL_LM";
  doc["r"] = r;
  doc["lora_alpha"] = lora_alpha;
  doc["lora_dropout"] = lora_dropout;
  if (!target_modules_regex.empty()) {
    doc["target_modules"] = target_modules_regex;
  } else if (target_modules.size() == 1 && target_modules[0] == "all-linear") {
    doc["target_modules"] = "all-linear";
  } else {
    doc["target_modules"] = targets();
  }
  doc["bias"] = bias;
  doc["modules_to_save"] = modules_to_save.empty() ? json() : json(modules_to_save);
  doc["use_rslora"] = use_rslora;
  doc["init_lora_weights"] = true;
  doc["use_dora"] = false;
  doc["fan_in_fan_out"] = false;
  doc["inference_mode"] = true;
  doc["base_model_name_or_path"] = base_model_name_or_path.empty() ? json() : json(base_model_name_or_path);
  return doc.dump(2) + "\n";
}

}  // namespace shardtrain
