#pragma once
/// @file lora.h
/// LoRA fine-tuning with PEFT's semantics and files.
///
/// apply_lora() turns a model built from shardtrain::nn::Linear layers (the
/// bundled Llama and Mistral) into a LoRA model before Accelerator::prepare():
/// each targeted Linear gains `lora_A` (r x in) and `lora_B` (out x r), its
/// forward adds `scaling * lora_B(lora_A(dropout(x)))` exactly as PEFT's LoRA
/// layer does, and every other parameter is frozen, so the engines compute,
/// reduce and keep optimizer state for the adapters only (plus the biases and
/// `modules_to_save` the config asks for). Parameter names follow PEFT's, so
/// the adapters save as PEFT's `adapter_model.safetensors` +
/// `adapter_config.json` (Accelerator::save_lora_adapter) and a PEFT adapter
/// trained elsewhere loads here (load_lora_adapter).
///
///     shardtrain::LoraConfig lora;            // PEFT's defaults: r 8, alpha 8
///     lora.r = 16;
///     lora.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj"};
///     auto summary = shardtrain::apply_lora(*model, lora);
///     accelerator.prepare(model, ...);        // trains the adapters
///     accelerator.save_lora_adapter("out/adapter", lora);

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

namespace shardtrain {

namespace nn {
class LinearImpl;
}

/// PEFT's LoraConfig, the fields shardtrain implements. Options PEFT has and
/// shardtrain does not (DoRA, LoftQ or PiSSA initialisation, rank patterns,
/// ...) are refused by name when an adapter_config.json sets them.
struct LoraConfig {
  /// Rank of the update; > 0.
  int64_t r = 8;
  /// The update is scaled by lora_alpha / r (lora_alpha / sqrt(r) with use_rslora).
  double lora_alpha = 8;
  /// Dropout on the adapter's input while training, in [0, 1).
  double lora_dropout = 0.0;
  /// Module names (a module matches when its path equals one or ends with
  /// "." + one), or {"all-linear"}: every Linear but the output layer.
  /// Empty: PEFT's default for Llama and Mistral, q_proj and v_proj.
  std::vector<std::string> target_modules;
  /// When non-empty, a regular expression the whole module path must match
  /// (PEFT's target_modules given as one string); replaces target_modules.
  std::string target_modules_regex;
  /// "none", "lora_only" (the biases of adapted layers train) or "all".
  std::string bias = "none";
  /// Modules trained in full and saved with the adapter (e.g. "lm_head").
  std::vector<std::string> modules_to_save;
  /// Rank-stabilised scaling, lora_alpha / sqrt(r).
  bool use_rslora = false;
  /// Written to adapter_config.json for the reader's information.
  std::string base_model_name_or_path;

  /// The factor the update is multiplied by.
  double scaling() const;
  /// The target names in effect: target_modules, else PEFT's default for
  /// Llama and Mistral ({"q_proj", "v_proj"}).
  std::vector<std::string> targets() const;
  /// Throws ConfigError naming a bad field (r <= 0, a dropout outside [0, 1), an unknown bias).
  void validate() const;
  /// Reads a PEFT adapter_config.json. Throws ConfigError for a file that is
  /// not a LoRA config, a bad value, or an option shardtrain does not
  /// implement (named, e.g. `use_dora`), never ignoring one silently.
  static LoraConfig from_peft_json_file(const std::string& path);
  /// Same, from the file's text; `origin` names it in errors.
  static LoraConfig from_peft_json(const std::string& text, const std::string& origin = "adapter_config.json");
  /// PEFT's adapter_config.json for this config (peft_type LORA, task_type CAUSAL_LM).
  std::string to_peft_json() const;
};

/// What apply_lora did.
struct LoraSummary {
  int64_t trainable_parameters = 0;
  int64_t total_parameters = 0;
  /// Paths of the Linear layers that gained an adapter.
  std::vector<std::string> adapted_modules;
  /// target_modules names that matched no Linear layer while others did:
  /// passed over, as PEFT passes them over (a program says so once).
  std::vector<std::string> unmatched_targets;
  /// "trainable params: 1,024 || all params: 58,000,000 || trainable%: 0.0018", as PEFT prints it.
  std::string describe() const;
  /// The warning unmatched_targets deserves ("" when there are none).
  std::string describe_unmatched() const;
};

/// Adds adapters to `model` and freezes the rest, as PEFT's get_peft_model.
/// Call before Accelerator::prepare(). Throws ConfigError when no target
/// module matches (naming them and listing the Linear layers there are),
/// when a pattern matches a module that is not a Linear layer, when every
/// target lies inside modules_to_save, when a module_to_save matches nothing,
/// or when the model already has adapters.
LoraSummary apply_lora(torch::nn::Module& model, const LoraConfig& config);

/// Applies the adapter in `dir` (a PEFT adapter_config.json and
/// adapter_model.safetensors, from shardtrain or from PEFT) to `model` and
/// loads its values, before prepare(). Throws ConfigError when the adapter's
/// base differs from the model (a name it does not have, another shape),
/// when the files are missing, or when the config is refused. Returns the
/// config it read (for saving again).
LoraConfig load_lora_adapter(torch::nn::Module& model, const std::string& dir, LoraSummary* summary = nullptr);

/// The layers of `model` that carry an adapter, with their paths, in the
/// order of named_modules().
std::vector<std::pair<std::string, const nn::LinearImpl*>> lora_layers(const torch::nn::Module& model);

/// PEFT's key for a parameter of the model in adapter_model.safetensors:
/// "base_model.model." + name.
std::string peft_adapter_key(const std::string& parameter_name);

/// The base weight with its adapter folded in, W + scaling * B @ A, in fp32
/// (what PEFT's merge_and_unload computes); the merged export uses it.
at::Tensor merged_lora_weight(const at::Tensor& weight, const at::Tensor& lora_A, const at::Tensor& lora_B,
                              double scaling);

}  // namespace shardtrain
