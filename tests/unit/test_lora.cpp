// LoRA with PEFT's semantics (shardtrain/lora.h) in one process: the
// adapter_config.json reader (PEFT's own output, refusals by name), which
// layers get adapters and what freezes, the forward formula, and the bad
// input the issue names (a target that matches nothing, r <= 0, an adapter
// for another base).

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "build_config.h"
#include "engine/activation_recompute.h"
#include "shardtrain/error.h"
#include "shardtrain/lora.h"
#include "shardtrain/precision_plan.h"
#include "shardtrain/config.h"
#include "shardtrain/models/llama.h"
#include "shardtrain/nn/linear.h"
#include "shardtrain/safetensors.h"
#include "shardtrain/weight_loading.h"
#include "support/llama_golden.h"
#include "support/scratch_dir.h"

namespace {

namespace fs = std::filesystem;
using shardtrain::ConfigError;
using shardtrain::LoraConfig;
using shardtrain::models::LlamaForCausalLM;

/// What PEFT 0.21.2's save_pretrained wrote for LoraConfig(r=4, lora_alpha=8,
/// target_modules=["q_proj","v_proj"], modules_to_save=["lm_head"],
/// bias="lora_only"), field for field.
const char* const kPeftWritten = R"({"alora_invocation_tokens": null, "alpha_pattern": {}, "arrow_config": null,
 "auto_mapping": {"base_model_class": "LlamaForCausalLM", "parent_library": "transformers.models.llama.modeling_llama"},
 "base_model_name_or_path": null, "bias": "lora_only", "corda_config": null, "ensure_weight_tying": false,
 "eva_config": null, "exclude_modules": null, "fan_in_fan_out": false, "inference_mode": true,
 "init_lora_weights": true, "kasa_config": null, "layer_replication": null, "layers_pattern": null,
 "layers_to_transform": null, "loftq_config": {}, "lora_alpha": 8, "lora_bias": false, "lora_dropout": 0.0,
 "lora_ga_config": null, "megatron_config": null, "megatron_core": "megatron.core", "modules_to_save": ["lm_head"],
 "monteclora_config": null, "peft_type": "LORA", "peft_version": "0.21.2", "qalora_group_size": 16, "r": 4,
 "rank_pattern": {}, "revision": null, "target_modules": ["v_proj", "q_proj"], "target_parameters": null,
 "task_type": null, "trainable_token_indices": null, "use_bdlora": null, "use_dora": false, "use_qalora": false,
 "use_rslora": false, "velora_config": null})";

/// kPeftWritten with one field replaced.
std::string with_field(const std::string& key, const std::string& value) {
  std::string text = kPeftWritten;
  const std::string marker = "\"" + key + "\": ";
  const std::size_t at = text.find(marker);
  EXPECT_NE(at, std::string::npos) << key;
  const std::size_t start = at + marker.size();
  std::size_t end = start;
  int depth = 0;
  while (end < text.size() && !(depth == 0 && (text[end] == ',' || text[end] == '}'))) {
    if (text[end] == '{' || text[end] == '[') ++depth;
    if (text[end] == '}' || text[end] == ']') --depth;
    ++end;
  }
  return text.replace(start, end - start, value);
}

std::string refusal_of(const std::string& text) {
  try {
    LoraConfig::from_peft_json(text, "adapter_config.json");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "accepted";
}

LlamaForCausalLM golden_llama() { return shardtrain::testing::load_golden_case("llama"); }

LoraConfig attention_lora() {
  LoraConfig config;
  config.r = 4;
  config.lora_alpha = 8;
  config.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj"};
  return config;
}

TEST(UnitLora, ReadsWhatPeftWritesAndWritesWhatItReads) {
  const LoraConfig config = LoraConfig::from_peft_json(kPeftWritten);
  EXPECT_EQ(config.r, 4);
  EXPECT_DOUBLE_EQ(config.lora_alpha, 8.0);
  EXPECT_DOUBLE_EQ(config.scaling(), 2.0);
  EXPECT_EQ(config.target_modules, (std::vector<std::string>{"v_proj", "q_proj"}));
  EXPECT_EQ(config.bias, "lora_only");
  EXPECT_EQ(config.modules_to_save, (std::vector<std::string>{"lm_head"}));
  EXPECT_FALSE(config.use_rslora);
  const LoraConfig again = LoraConfig::from_peft_json(config.to_peft_json());
  EXPECT_EQ(again.r, config.r);
  EXPECT_EQ(again.target_modules, config.target_modules);
  EXPECT_EQ(again.modules_to_save, config.modules_to_save);
  EXPECT_EQ(again.bias, config.bias);
  // PEFT's "all-linear" string and a regular expression.
  EXPECT_EQ(LoraConfig::from_peft_json(with_field("target_modules", "\"all-linear\"")).target_modules,
            (std::vector<std::string>{"all-linear"}));
  EXPECT_EQ(LoraConfig::from_peft_json(with_field("target_modules", "\".*\\\\.(q|v)_proj\"")).target_modules_regex,
            ".*\\.(q|v)_proj");
  // rsLoRA: alpha / sqrt(r).
  EXPECT_DOUBLE_EQ(LoraConfig::from_peft_json(with_field("use_rslora", "true")).scaling(), 8.0 / 2.0);
  // No target_modules at all: PEFT's default for Llama and Mistral.
  EXPECT_EQ(LoraConfig::from_peft_json(with_field("target_modules", "null")).targets(),
            (std::vector<std::string>{"q_proj", "v_proj"}));
}

TEST(UnitLora, OptionsShardtrainDoesNotImplementAreRefusedByName) {
  for (const auto& [key, value, named] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"use_dora", "true", "DoRA"},
           {"loftq_config", "{\"loftq_bits\": 4}", "LoftQ"},
           {"rank_pattern", "{\"q_proj\": 16}", "per-module ranks"},
           {"init_lora_weights", "\"pissa\"", "init_lora_weights \"pissa\" is not implemented"},
           {"layers_to_transform", "[0]", "only some layers"},
           {"kasa_config", "{\"x\": 1}", "a PEFT option shardtrain does not know"},
       }) {
    const std::string refusal = refusal_of(with_field(key, value));
    EXPECT_NE(refusal.find(key), std::string::npos) << key << ": " << refusal;
    EXPECT_NE(refusal.find(named), std::string::npos) << key << ": " << refusal;
  }
  // A field PEFT may add later, left at an inactive value, changes nothing.
  std::string future = kPeftWritten;
  future.insert(1, "\"some_future_option\": null, ");
  EXPECT_EQ(refusal_of(future), "accepted");
  EXPECT_NE(refusal_of(with_field("r", "0")).find("at least 1"), std::string::npos);
  EXPECT_NE(refusal_of(with_field("r", "-4")).find("at least 1"), std::string::npos);
  EXPECT_NE(refusal_of(with_field("lora_dropout", "1.5")).find("[0, 1)"), std::string::npos);
  EXPECT_NE(refusal_of(with_field("bias", "\"some\"")).find("none, lora_only or all"), std::string::npos);
  EXPECT_NE(refusal_of(with_field("peft_type", "\"IA3\"")).find("LoRA adapters only"), std::string::npos);
}

TEST(UnitLora, AdaptersAreAddedNamedAsPeftAndOnlyTheyTrain) {
  LlamaForCausalLM model = golden_llama();
  const at::Tensor ids = torch::tensor({{1, 5, 9, 3, 7, 2}}, torch::kLong);
  const at::Tensor before = model(ids);
  const auto summary = shardtrain::apply_lora(*model, attention_lora());
  EXPECT_EQ(summary.adapted_modules.size(), 8u);  // 2 layers x q, k, v, o
  // Each adapted layer: A is r x in, B is out x r.
  int64_t expected_trainable = 0;
  for (const auto& item : model->named_parameters()) {
    const std::string& name = item.key();
    const bool adapter = name.find(".lora_A.weight") != std::string::npos || name.find(".lora_B.weight") != std::string::npos;
    EXPECT_EQ(item.value().requires_grad(), adapter) << name;
    if (adapter) expected_trainable += item.value().numel();
  }
  EXPECT_EQ(summary.trainable_parameters, expected_trainable);
  const auto params = model->named_parameters();
  EXPECT_EQ(params["model.layers.0.self_attn.q_proj.lora_A.weight"].sizes(), (std::vector<int64_t>{4, 24}));
  EXPECT_EQ(params["model.layers.0.self_attn.k_proj.lora_B.weight"].sizes(), (std::vector<int64_t>{12, 4}));
  EXPECT_TRUE(params["model.layers.1.self_attn.o_proj.lora_B.weight"].eq(0).all().item<bool>());
  EXPECT_FALSE(params["model.layers.1.self_attn.o_proj.lora_A.weight"].eq(0).all().item<bool>());
  EXPECT_EQ(summary.describe().rfind("trainable params: ", 0), 0u) << summary.describe();
  // lora_B starts at zero, so the adapted model computes what the base did, exactly.
  EXPECT_TRUE(at::equal(model(ids), before));
  // A second application is refused.
  EXPECT_THROW(shardtrain::apply_lora(*model, attention_lora()), ConfigError);
}

/// PEFT's LoRA output, x W^T + b + s (x A^T) B^T, in fp64 from the layer's
/// fp32 values, and how far an fp32 evaluation may be from it. Each output is
/// a chain of roundings: a sum over `in` products (and the bias) for the base,
/// sums over `in` then `r` products for the update, the scaling and the add.
/// A sum of n terms in fp32 is within n * u * sum|terms| of exact (u = 2^-24),
/// so in + r + 3 roundings of the magnitudes |x||W|^T + |b| + s (|x||A|^T)|B|^T
/// bound the whole chain (first order).
struct LoraReference {
  at::Tensor value, bound;
};
LoraReference lora_reference(const shardtrain::nn::Linear& layer, const at::Tensor& x, double scaling) {
  const auto d = [](const at::Tensor& t) { return t.detach().to(at::kDouble); };
  const at::Tensor W = d(layer->weight), A = d(layer->lora_A->weight), B = d(layer->lora_B->weight);
  const at::Tensor b = layer->bias.defined() ? d(layer->bias) : at::zeros({W.size(0)}, at::kDouble);
  const at::Tensor X = d(x);
  const double roundings = static_cast<double>(W.size(1) + A.size(0) + 3);
  return {at::matmul(X, W.t()) + b + at::matmul(at::matmul(X, A.t()), B.t()) * scaling,
          roundings * std::ldexp(1.0, -24) *
              (at::matmul(X.abs(), W.abs().t()) + b.abs() +
               at::matmul(at::matmul(X.abs(), A.abs().t()), B.abs().t()) * std::abs(scaling))};
}

bool within(const at::Tensor& ours, const LoraReference& reference) {
  return (ours.to(at::kDouble) - reference.value).abs().le(reference.bound).all().item<bool>();
}

TEST(UnitLora, TheForwardIsPeftsFormula) {
  torch::manual_seed(3);
  shardtrain::nn::Linear layer(torch::nn::LinearOptions(6, 5).bias(true));
  const at::Tensor x = torch::randn({3, 6});
  layer->add_lora(2, /*scaling=*/2.5, /*dropout=*/0.0);
  {
    at::NoGradGuard no_grad;
    layer->lora_B->weight.normal_();
  }
  const at::Tensor ours = layer->forward(x);
  const LoraReference reference = lora_reference(layer, x, 2.5);
  EXPECT_TRUE(within(ours, reference)) << (ours.to(at::kDouble) - reference.value).abs().max();
}

TEST(UnitLora, DropoutActsOnTheAdapterPathWhileTrainingOnly) {
  torch::manual_seed(5);
  shardtrain::nn::Linear layer(torch::nn::LinearOptions(8, 8).bias(false));
  layer->add_lora(4, 1.0, /*dropout=*/0.5);
  {
    at::NoGradGuard no_grad;
    layer->lora_B->weight.normal_();
  }
  const at::Tensor x = torch::randn({16, 8});
  const LoraReference reference = lora_reference(layer, x, 1.0);
  layer->eval();
  EXPECT_TRUE(within(layer->forward(x), reference));
  layer->train();
  // Training: half the adapter's inputs dropped, the rest doubled: far outside rounding.
  EXPECT_FALSE(within(layer->forward(x), reference));
}

TEST(UnitLora, BadTargetsAreRefusedNamingWhatThereIs) {
  {
    LlamaForCausalLM model = golden_llama();
    LoraConfig config = attention_lora();
    config.target_modules = {"c_attn", "qkv_proj"};
    try {
      shardtrain::apply_lora(*model, config);
      ADD_FAILURE() << "targets that match nothing were accepted";
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("target_modules c_attn, qkv_proj match no Linear layer"), std::string::npos) << what;
      EXPECT_NE(what.find("q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head"), std::string::npos)
          << what;
    }
  }
  {
    // One name matching nothing beside one that matches is passed over with a warning, as PEFT passes it
    // over (one target list serving several architectures): PEFT's adapters made so must load.
    LlamaForCausalLM model = golden_llama();
    LoraConfig config = attention_lora();
    config.target_modules = {"q_proj", "c_attn"};
    const auto summary = shardtrain::apply_lora(*model, config);
    EXPECT_EQ(summary.adapted_modules.size(), 2u);
    EXPECT_EQ(summary.unmatched_targets, std::vector<std::string>{"c_attn"});
    EXPECT_NE(summary.describe_unmatched().find("LoRA target module(s) c_attn match no Linear layer of this model and "
                                                "are passed over"),
              std::string::npos)
        << summary.describe_unmatched();
  }
  {
    // PEFT full-matches a pattern against every module and refuses one that is not a Linear layer.
    LlamaForCausalLM model = golden_llama();
    LoraConfig config = attention_lora();
    config.target_modules.clear();
    config.target_modules_regex = ".*layers\\.0\\..*";
    try {
      shardtrain::apply_lora(*model, config);
      ADD_FAILURE() << "a pattern matching an attention module was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("matches model.layers.0.self_attn ("), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("which is not a Linear layer"), std::string::npos) << e.what();
    }
    config.target_modules_regex = ".*layers\\.0\\..*_proj";
    EXPECT_EQ(shardtrain::apply_lora(*model, config).adapted_modules.size(), 7u);
  }
  {
    // A refused config leaves the model as it was: the corrected one applies.
    LlamaForCausalLM model = golden_llama();
    LoraConfig config = attention_lora();
    config.modules_to_save = {"score"};
    EXPECT_THROW(shardtrain::apply_lora(*model, config), ConfigError);
    for (const auto& p : model->parameters()) EXPECT_TRUE(p.requires_grad());
    config.modules_to_save = {"lm_head"};
    EXPECT_EQ(shardtrain::apply_lora(*model, config).adapted_modules.size(), 8u);
  }
  {
    LlamaForCausalLM model = golden_llama();
    LoraConfig config = attention_lora();
    config.r = 0;
    EXPECT_THROW(shardtrain::apply_lora(*model, config), ConfigError);
  }
}

TEST(UnitLora, AModuleToSaveGetsNoAdapterAndTrainsWholeAsInPeft) {
  // PEFT keeps adapters out of modules_to_save; an adapter beside the whole
  // module would be dropped without a word when PEFT loads the file.
  LlamaForCausalLM model = golden_llama();
  LoraConfig config = attention_lora();
  config.target_modules = {"q_proj", "o_proj"};
  config.modules_to_save = {"o_proj"};
  const auto summary = shardtrain::apply_lora(*model, config);
  EXPECT_EQ(summary.adapted_modules,
            (std::vector<std::string>{"model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"}));
  auto params = model->named_parameters();
  EXPECT_TRUE(params["model.layers.0.self_attn.o_proj.weight"].requires_grad());
  EXPECT_FALSE(params.contains("model.layers.0.self_attn.o_proj.lora_A.weight"));
  // As print_trainable_parameters: the copy PEFT trains is counted under "all params" beside the original.
  int64_t base = 0, o_proj = 0, adapters = 0;
  for (const auto& item : params) {
    const bool adapter = item.key().find("lora_") != std::string::npos;
    (adapter ? adapters : base) += item.value().numel();
    if (item.key().find("o_proj") != std::string::npos) o_proj += item.value().numel();
  }
  EXPECT_EQ(summary.total_parameters, base + adapters + o_proj);
  EXPECT_EQ(summary.trainable_parameters, adapters + o_proj);
  const std::string described = summary.describe();
  EXPECT_NE(described.find(" || trainable%: "), std::string::npos) << described;
  EXPECT_EQ(described.size() - described.find('.', described.find("trainable%")), 5u) << described;  // ".dddd"

  LlamaForCausalLM other = golden_llama();
  config.target_modules = {"o_proj"};
  try {
    shardtrain::apply_lora(*other, config);
    ADD_FAILURE() << "a config adapting only modules to save was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("every layer target_modules names is in modules_to_save"), std::string::npos)
        << e.what();
  }
}

TEST(UnitLora, AllLinearLeavesOutTheOutputLayerAndBiasAndModulesToSaveTrain) {
  LlamaForCausalLM model = golden_llama();
  LoraConfig config;
  config.target_modules = {"all-linear"};
  config.modules_to_save = {"lm_head"};
  const auto summary = shardtrain::apply_lora(*model, config);
  EXPECT_EQ(summary.adapted_modules.size(), 14u);  // 2 layers x 7 Linear layers; lm_head is left out
  for (const auto& path : summary.adapted_modules) EXPECT_EQ(path.find("lm_head"), std::string::npos) << path;
  const auto params = model->named_parameters();
  EXPECT_TRUE(params["lm_head.weight"].requires_grad());
  EXPECT_FALSE(params["model.embed_tokens.weight"].requires_grad());
  EXPECT_FALSE(params["model.layers.0.mlp.down_proj.weight"].requires_grad());
}

TEST(UnitLora, AnAdapterIsLoadedAndOneForAnotherBaseIsRefused) {
  shardtrain::testing::ScratchDir dir;
  // An adapter for the golden llama, written as PEFT lays it out.
  LlamaForCausalLM source = golden_llama();
  LoraConfig config = attention_lora();
  shardtrain::apply_lora(*source, config);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  torch::manual_seed(11);
  for (const auto& item : source->named_parameters()) {
    if (!item.value().requires_grad()) continue;
    tensors.emplace_back(shardtrain::peft_adapter_key(item.key()), torch::randn(item.value().sizes()));
  }
  shardtrain::safetensors::write_file(dir.path() + "/adapter_model.safetensors", tensors);
  std::ofstream(dir.path() + "/adapter_config.json") << config.to_peft_json();

  LlamaForCausalLM target = golden_llama();
  shardtrain::LoraSummary summary;
  const LoraConfig loaded = shardtrain::load_lora_adapter(*target, dir.path(), &summary);
  EXPECT_EQ(loaded.r, 4);
  EXPECT_EQ(summary.adapted_modules.size(), 8u);
  const auto params = target->named_parameters();
  for (const auto& [key, value] : tensors) {
    const std::string name = key.substr(std::string("base_model.model.").size());
    EXPECT_TRUE(at::equal(params[name], value)) << name;
  }

  // The same adapter against a model of another width: refused, naming the tensor and both shapes.
  auto other_config = shardtrain::models::LlamaConfig::from_json_file(shardtrain::testing::golden_dir("llama") +
                                                                       "/config.json");
  other_config.hidden_size = 32;
  other_config.num_attention_heads = 4;
  LlamaForCausalLM wider(other_config);
  const std::vector<std::string> names_before = wider->named_parameters().keys();
  try {
    shardtrain::load_lora_adapter(*wider, dir.path());
    ADD_FAILURE() << "an adapter for another base was loaded";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("lora_A.weight of shape [4, 24]"), std::string::npos) << what;
    EXPECT_NE(what.find("base model of another size"), std::string::npos) << what;
  }
  // The refusal left the model as it was: no adapters, everything still trains.
  EXPECT_EQ(wider->named_parameters().keys(), names_before);
  EXPECT_TRUE(shardtrain::lora_layers(*wider).empty());
  for (const auto& p : wider->parameters()) EXPECT_TRUE(p.requires_grad());
  // A directory without an adapter.
  EXPECT_THROW(shardtrain::load_lora_adapter(*golden_llama(), dir.path() + "/nothing"), ConfigError);
}

TEST(UnitLora, AnAdapterWithModulesToSaveLoadsIntoAModelBuiltWithoutItsWeights) {
  // The fine-tune's --model-dir path builds the model without storage (the
  // engine reads the base from the files); what the adapter trains in full
  // (lm_head here) must take the adapter's values, not the base's.
  shardtrain::testing::ScratchDir dir;
  LlamaForCausalLM source = golden_llama();
  LoraConfig config = attention_lora();
  config.modules_to_save = {"lm_head"};
  shardtrain::apply_lora(*source, config);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  torch::manual_seed(13);
  for (const auto& item : source->named_parameters()) {
    if (item.value().requires_grad()) {
      tensors.emplace_back(shardtrain::peft_adapter_key(item.key()), torch::randn(item.value().sizes()));
    }
  }
  shardtrain::safetensors::write_file(dir.path() + "/adapter_model.safetensors", tensors);
  std::ofstream(dir.path() + "/adapter_config.json") << config.to_peft_json();

  LlamaForCausalLM target = golden_llama();
  shardtrain::release_parameter_storage(*target);
  shardtrain::load_lora_adapter(*target, dir.path());
  const auto params = target->named_parameters();
  EXPECT_FALSE(shardtrain::is_storage_released(params["lm_head.weight"]));
  EXPECT_TRUE(shardtrain::is_storage_released(params["model.layers.0.mlp.up_proj.weight"]));  // still the engine's to fill
  for (const auto& [key, value] : tensors) {
    EXPECT_TRUE(at::equal(params[key.substr(std::string("base_model.model.").size())], value)) << key;
  }
}

TEST(UnitLora, DropoutDrawsTheSameMaskWhenFullRecomputationReplaysTheForward) {
  // Full activation checkpointing runs a unit's forward again in backward; a
  // LoRA dropout there must draw the forward's mask, or the gradients belong
  // to another forward than the loss (torch.utils.checkpoint's preserve_rng_state).
  torch::manual_seed(21);
  const at::Tensor x = torch::randn({64, 8}).requires_grad_(true);
  const at::Tensor w = torch::randn({8}).requires_grad_(true);
  const at::Tensor y = shardtrain::engine::run_with_recompute(
      [&w](const at::Tensor& in) { return at::dropout(in * w, 0.5, /*train=*/true); }, x, {w});
  y.sum().backward();
  // Where the forward dropped an element its gradient is zero; where it kept
  // one the gradient is w / (1 - p).
  const at::Tensor kept = y.ne(0);
  const at::Tensor expected = at::where(kept, (w * 2).expand_as(x), at::zeros_like(x));
  // Exact: the gradient is 1 * 2 * w where kept (scaling by 2 rounds nothing).
  EXPECT_TRUE(at::equal(x.grad(), expected)) << "the recomputation drew another dropout mask";
  // And the random stream after backward is where it would be without the replay.
  torch::manual_seed(21);
  (void)torch::randn({64, 8});
  (void)torch::randn({8});
  (void)at::dropout(torch::ones({64, 8}), 0.5, true);
  const at::Tensor next_without_replay = torch::rand({4});
  torch::manual_seed(21);
  const at::Tensor x2 = torch::randn({64, 8}).requires_grad_(true);
  const at::Tensor w2 = torch::randn({8}).requires_grad_(true);
  shardtrain::engine::run_with_recompute(
      [&w2](const at::Tensor& in) { return at::dropout(in * w2, 0.5, /*train=*/true); }, x2, {w2})
      .sum()
      .backward();
  EXPECT_TRUE(at::equal(torch::rand({4}), next_without_replay));
}

TEST(UnitLora, ThePlanListsTheFrozenBaseAndTheFlopsCountNoWeightGradientForIt) {
  shardtrain::TrainingConfig config = shardtrain::load_config(std::string(SHARDTRAIN_SOURCE_DIR) +
                                                              "/configs/zero3_bf16.json");
  shardtrain::PrecisionPlan plan = shardtrain::plan_precision(config, 57344, 2, /*on_cuda=*/false);
  const std::string trained_only = plan.to_string();
  EXPECT_EQ(trained_only.find("frozen"), std::string::npos) << trained_only;
  plan.frozen_params = 3098880;
  const std::string text = plan.to_string();
  EXPECT_NE(text.find("57344 parameters trained, 3098880 frozen"), std::string::npos) << text;
  // A frozen parameter is its bf16 shard at rest: 2 bytes over 2 ranks.
  EXPECT_NE(text.find("frozen (shard)           1.000 B/param/rank  = 3.10 MB per rank"), std::string::npos) << text;
  // ZeRO holds it in bf16 alone, as DeepSpeed does; FSDP standard keeps an
  // fp32 copy of an fp32-loaded base (2 of its 4 bytes per rank), none of a bf16 one.
  EXPECT_EQ(text.find("frozen fp32 copy"), std::string::npos) << text;
  EXPECT_NE(text.find("the frozen base is held in bf16 only"), std::string::npos) << text;
  const shardtrain::TrainingConfig fsdp = shardtrain::load_config(std::string(SHARDTRAIN_SOURCE_DIR) +
                                                                  "/configs/llama/fsdp_standard_bf16.yaml");
  for (const std::string load : {"fp32", "bf16"}) {
    shardtrain::PrecisionPlan fsdp_plan = shardtrain::plan_precision(fsdp, 57344, 2, /*on_cuda=*/false, load);
    fsdp_plan.frozen_params = 3098880;
    const std::string fsdp_text = fsdp_plan.to_string();
    EXPECT_EQ(fsdp_text.find("frozen fp32 copy         2.000 B/param/rank  = 6.20 MB per rank") != std::string::npos,
              load == "fp32") << fsdp_text;
    EXPECT_EQ(fsdp_text.find("the frozen base is held in bf16 only") != std::string::npos, load == "bf16")
        << fsdp_text;
  }

  const auto c = shardtrain::models::LlamaConfig::from_json_file(shardtrain::testing::golden_dir("llama") +
                                                                  "/config.json");
  const int64_t all = 10000, trained = 100, T = 16;
  const double embedding = static_cast<double>(c.vocab_size * c.hidden_size);  // untied: a lookup, no matmul
  const double attention = 12.0 * c.num_hidden_layers * c.hidden_size * T;
  EXPECT_DOUBLE_EQ(shardtrain::models::training_flops_per_token(c, all, T), 6 * (all - embedding) + attention);
  EXPECT_DOUBLE_EQ(shardtrain::models::training_flops_per_token(c, all, T, trained),
                   4 * (all - embedding) + 2 * trained + attention);
}

}  // namespace
