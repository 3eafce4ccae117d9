// Applying LoRA to a model (PEFT's get_peft_model) and loading a PEFT
// adapter into one (PeftModel.from_pretrained), before prepare().

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iomanip>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "lora/lora_common.h"
#include "shardtrain/error.h"
#include "shardtrain/lora.h"
#include "shardtrain/nn/linear.h"
#include "shardtrain/safetensors.h"
#include "shardtrain/weight_loading.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;

using lora_detail::inside_module;
using lora_detail::names_module;
using lora_detail::with_thousands;

/// PEFT's "all-linear" leaves out the output layer.
bool is_output_layer(const std::string& path) { return names_module(path, "lm_head"); }

std::string join(const std::vector<std::string>& items, std::size_t at_most) {
  std::ostringstream out;
  for (std::size_t i = 0; i < items.size() && i < at_most; ++i) out << (i ? ", " : "") << items[i];
  if (items.size() > at_most) out << ", ... (" << items.size() << " in all)";
  return out.str();
}

/// The last component of each path, once each: "q_proj, k_proj, ..., lm_head".
std::vector<std::string> distinct_leaf_names(const std::vector<std::string>& paths) {
  std::vector<std::string> names;
  for (const auto& path : paths) {
    const std::string leaf = path.substr(path.rfind('.') + 1);
    if (std::find(names.begin(), names.end(), leaf) == names.end()) names.push_back(leaf);
  }
  return names;
}

}  // namespace

std::string peft_adapter_key(const std::string& parameter_name) { return "base_model.model." + parameter_name; }

std::vector<std::pair<std::string, const nn::LinearImpl*>> lora_layers(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, const nn::LinearImpl*>> layers;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    const auto* linear = dynamic_cast<const nn::LinearImpl*>(item.value().get());
    if (linear != nullptr && linear->has_lora()) layers.emplace_back(item.key(), linear);
  }
  return layers;
}

std::string LoraSummary::describe() const {
  std::ostringstream out;
  out << "trainable params: " << with_thousands(trainable_parameters)
      << " || all params: " << with_thousands(total_parameters) << " || trainable%: " << std::fixed
      << std::setprecision(4)
      << (total_parameters > 0 ? 100.0 * static_cast<double>(trainable_parameters) / static_cast<double>(total_parameters)
                               : 0.0);
  return out.str();
}

std::string LoraSummary::describe_unmatched() const {
  if (unmatched_targets.empty()) return "";
  return "LoRA target module(s) " + join(unmatched_targets, 16) +
         " match no Linear layer of this model and are passed over, as PEFT passes them over (a slip of a name?)";
}

at::Tensor merged_lora_weight(const at::Tensor& weight, const at::Tensor& lora_A, const at::Tensor& lora_B,
                              double scaling) {
  ST_CHECK(lora_A.dim() == 2 && lora_B.dim() == 2 && lora_B.size(1) == lora_A.size(0) &&
               weight.size(0) == lora_B.size(0) && weight.size(1) == lora_A.size(1),
           "merging LoRA: weight ", weight.sizes(), " does not fit lora_B ", lora_B.sizes(), " @ lora_A ",
           lora_A.sizes());
  return weight.to(at::kFloat) + at::matmul(lora_B.to(at::kFloat), lora_A.to(at::kFloat)) * scaling;
}

LoraSummary apply_lora(torch::nn::Module& model, const LoraConfig& config) {
  config.validate();
  std::vector<std::pair<std::string, nn::LinearImpl*>> linears;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (auto* linear = dynamic_cast<nn::LinearImpl*>(item.value().get())) {
      ST_CHECK_T(ConfigError, !linear->has_lora(), "the model already has LoRA adapters (", item.key(),
                 "); apply_lora or load_lora_adapter once per model");
      linears.emplace_back(item.key(), linear);
    }
  }
  std::vector<std::string> linear_paths;
  for (const auto& [path, linear] : linears) linear_paths.push_back(path);
  ST_CHECK_T(ConfigError, !linears.empty(), "apply_lora: the model has no shardtrain::nn::Linear layer to adapt");

  const std::vector<std::string> targets = config.targets();
  const bool all_linear = config.target_modules_regex.empty() && targets.size() == 1 && targets[0] == "all-linear";
  std::regex pattern;
  if (!config.target_modules_regex.empty()) {
    try {
      pattern = std::regex(config.target_modules_regex);
    } catch (const std::regex_error& e) {
      ST_THROW(ConfigError, "LoRA target_modules '", config.target_modules_regex, "' is not a valid regular expression (",
               e.what(), ")");
    }
  }
  // PEFT never puts an adapter inside a module of modules_to_save (its
  // check_target_module_exists): the module trains whole instead, and an
  // adapter saved beside it would be dropped silently when PEFT loads it.
  auto saved_whole = [&](const std::string& path) {
    return std::any_of(config.modules_to_save.begin(), config.modules_to_save.end(),
                       [&](const std::string& name) { return inside_module(path, name); });
  };
  if (!config.target_modules_regex.empty()) {
    // PEFT full-matches the pattern against every module and refuses one it cannot adapt.
    for (const auto& item : model.named_modules("", /*include_self=*/false)) {
      if (saved_whole(item.key()) || !std::regex_match(item.key(), pattern)) continue;
      ST_CHECK_T(ConfigError, dynamic_cast<nn::LinearImpl*>(item.value().get()) != nullptr, "LoRA target_modules '",
                 config.target_modules_regex, "' matches ", item.key(), " (", item.value()->name(),
                 "), which is not a Linear layer: shardtrain adapts Linear layers only (PEFT refuses such a pattern "
                 "too, unless the module is an Embedding). Narrow it to the Linear layers, e.g. "
                 "'.*\\.(q_proj|v_proj)'");
    }
  }
  std::map<std::string, int> matches;
  for (const auto& name : targets) matches[name] = 0;
  std::vector<nn::LinearImpl*> adapted;
  std::vector<std::string> left_to_modules_to_save;
  LoraSummary summary;
  for (const auto& [path, linear] : linears) {
    bool chosen = false;
    if (!config.target_modules_regex.empty()) {
      chosen = std::regex_match(path, pattern);
    } else if (all_linear) {
      chosen = !is_output_layer(path);
    } else {
      for (const auto& name : targets) {
        if (names_module(path, name)) {
          ++matches[name];
          chosen = true;
        }
      }
    }
    if (chosen && saved_whole(path)) {
      left_to_modules_to_save.push_back(path);
    } else if (chosen) {
      adapted.push_back(linear);
      summary.adapted_modules.push_back(path);
    }
  }
  if (!config.target_modules_regex.empty()) {
    ST_CHECK_T(ConfigError, !adapted.empty() || !left_to_modules_to_save.empty(), "LoRA target_modules '",
               config.target_modules_regex, "' matches no Linear layer of the model; its layers are ",
               join(linear_paths, 8));
  } else if (!all_linear) {
    // As PEFT: a name that matches nothing is passed over while another
    // matches (one target list serves several architectures: q_proj, c_attn);
    // nothing matching at all is an error.
    std::vector<std::string> unmatched;
    for (const auto& [name, count] : matches) {
      if (count == 0) unmatched.push_back(name);
    }
    ST_CHECK_T(ConfigError, unmatched.size() < matches.size(), "LoRA target_modules ", join(unmatched, 16),
               " match no Linear layer of the model; the names there are ",
               join(distinct_leaf_names(linear_paths), 16));
    summary.unmatched_targets = unmatched;
  }
  ST_CHECK_T(ConfigError, !adapted.empty(), "LoRA: every layer target_modules names is in modules_to_save (",
             join(left_to_modules_to_save, 8), "), which trains whole and gets no adapter, as in PEFT; leave it out "
             "of one of the two");

  // Everything is resolved before the model changes, so a refused config
  // leaves it as it was (and a corrected one can be applied).
  std::vector<std::shared_ptr<torch::nn::Module>> saved_modules;
  for (const auto& name : config.modules_to_save) {
    bool found = false;
    for (const auto& item : model.named_modules("", /*include_self=*/false)) {
      if (!names_module(item.key(), name)) continue;
      found = true;
      saved_modules.push_back(item.value());
    }
    ST_CHECK_T(ConfigError, found, "LoRA modules_to_save names '", name, "', which matches no module of the model");
  }

  // Freeze everything, then let the adapters (and what the config asks for) train.
  for (auto& p : model.parameters()) p.set_requires_grad(false);
  for (nn::LinearImpl* linear : adapted) {
    linear->add_lora(config.r, config.scaling(), config.lora_dropout);
    if (config.bias == "lora_only" && linear->bias.defined()) linear->bias.set_requires_grad(true);
  }
  if (config.bias == "all") {
    for (auto& item : model.named_parameters()) {
      const std::string& name = item.key();
      if (name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0) item.value().set_requires_grad(true);
    }
  }
  for (const auto& module : saved_modules) {
    for (auto& p : module->parameters()) p.set_requires_grad(true);
  }
  for (const auto& p : model.parameters()) {
    summary.total_parameters += p.numel();
    if (p.requires_grad()) summary.trainable_parameters += p.numel();
  }
  // PEFT trains a copy of each module to save beside the frozen original, and
  // its print_trainable_parameters counts both under "all params".
  for (const auto& module : saved_modules) {
    for (const auto& p : module->parameters()) summary.total_parameters += p.numel();
  }
  return summary;
}

LoraConfig load_lora_adapter(torch::nn::Module& model, const std::string& dir, LoraSummary* summary_out) {
  const fs::path config_path = fs::path(dir) / "adapter_config.json";
  const fs::path weights_path = fs::path(dir) / "adapter_model.safetensors";
  ST_CHECK_T(ConfigError, fs::is_regular_file(config_path), "no PEFT adapter in ", dir, ": ",
             config_path.filename().string(), " is missing (a PEFT adapter directory holds adapter_config.json and "
             "adapter_model.safetensors)");
  ST_CHECK_T(ConfigError, fs::is_regular_file(weights_path), "the PEFT adapter in ", dir,
             " has no adapter_model.safetensors (adapter_model.bin, PyTorch's pickle, is not read: convert it with "
             "PEFT's save_pretrained(safe_serialization=True))");
  const LoraConfig config = LoraConfig::from_peft_json_file(config_path.string());
  const safetensors::Reader reader(weights_path.string());
  // What apply_lora changes, to put back if the adapter does not fit: the
  // model is left as it was on every refusal.
  std::map<std::string, bool> trained_before;
  for (const auto& item : model.named_parameters()) trained_before[item.key()] = item.value().requires_grad();
  const LoraSummary summary = apply_lora(model, config);
  std::vector<std::pair<at::Tensor, at::Tensor>> assignments;  // (parameter, the adapter's value)
  try {
    std::set<std::string> unused;
    for (const auto& key : reader.names()) unused.insert(key);
    for (auto& item : model.named_parameters()) {
      if (!item.value().requires_grad()) continue;  // the base: the model's own weights
      const std::string key = peft_adapter_key(item.key());
      ST_CHECK_T(ConfigError, reader.contains(key), "the PEFT adapter in ", dir, " has no tensor ", key,
                 ", which this model's LoRA layers need: the adapter was trained with another config or for another "
                 "model");
      const at::Tensor value = reader.read(key);
      ST_CHECK_T(ConfigError, value.sizes() == item.value().sizes(), "the PEFT adapter in ", dir, " has ", key,
                 " of shape ", value.sizes(), " but this model's is ", item.value().sizes(),
                 ": the adapter was trained for a base model of another size");
      assignments.emplace_back(item.value(), value);
      unused.erase(key);
    }
    if (!unused.empty()) {
      std::vector<std::string> names(unused.begin(), unused.end());
      ST_THROW(ConfigError, "the PEFT adapter in ", dir, " has tensors this model has no place for: ",
               join(names, 4), "; its base model has other module names (another architecture?)");
    }
    at::NoGradGuard no_grad;
    for (auto& [param, value] : assignments) {
      at::Tensor target = param;
      if (is_storage_released(target)) {
        // A model built without its weights (the engine fills those from the
        // weight source): a parameter the adapter trains (modules_to_save, a
        // bias) takes the adapter's values instead, so it gets storage here and
        // prepare() keeps what it holds.
        target.set_data(at::empty(target.sizes(), target.options()));
      }
      target.copy_(value);
    }
  } catch (...) {
    for (const auto& item : model.named_modules("", /*include_self=*/false)) {
      if (auto* linear = dynamic_cast<nn::LinearImpl*>(item.value().get())) linear->remove_lora();
    }
    for (auto& item : model.named_parameters()) {
      if (trained_before.count(item.key())) item.value().set_requires_grad(trained_before.at(item.key()));
    }
    throw;
  }
  if (summary_out) *summary_out = summary;
  return config;
}

}  // namespace shardtrain
