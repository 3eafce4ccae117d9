// A Hugging Face model directory's safetensors files, by tensor name: which
// file holds each tensor and reading any slice of one (hf_weights.h).
#include "shardtrain/models/hf_weights.h"

#include <filesystem>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "shardtrain/error.h"
#include "shardtrain/logging.h"

namespace shardtrain::models {

namespace fs = std::filesystem;
using json = nlohmann::json;

HfCheckpoint::HfCheckpoint(const std::string& model_dir) : dir_(model_dir) {
  const fs::path dir(model_dir);
  const fs::path single = dir / "model.safetensors";
  const fs::path index = dir / "model.safetensors.index.json";
  if (fs::exists(single)) {
    where_ = single.string();
    auto reader = std::make_unique<safetensors::Reader>(where_);
    for (const auto& name : reader->names()) by_tensor_[name] = reader.get();
    readers_[where_] = std::move(reader);
    return;
  }
  ST_CHECK(fs::exists(index), "no model.safetensors or model.safetensors.index.json in '", model_dir, "'");
  where_ = index.string();
  std::ifstream in(index);
  ST_CHECK(in.good(), "cannot open '", where_, "'");
  json j;
  try {
    in >> j;
  } catch (const json::exception& e) {
    ST_THROW(Error, where_, ": invalid JSON: ", e.what());
  }
  auto map = j.find("weight_map");
  ST_CHECK(map != j.end() && map->is_object(), where_, ": no \"weight_map\" object");
  for (auto& [name, file] : map->items()) {
    ST_CHECK(file.is_string(), where_, ": weight_map entry '", name, "' is not a file name");
    const std::string path = (dir / file.get<std::string>()).string();
    auto& reader = readers_[path];
    if (!reader) reader = std::make_unique<safetensors::Reader>(path);
    ST_CHECK(reader->contains(name), where_, " maps '", name, "' to ", path, ", which has no such tensor");
    by_tensor_[name] = reader.get();
  }
}

bool HfCheckpoint::contains(const std::string& name) const { return by_tensor_.count(name) != 0; }

const safetensors::TensorInfo& HfCheckpoint::info(const std::string& name) const {
  auto it = by_tensor_.find(name);
  ST_CHECK(it != by_tensor_.end(), "missing parameter '", name, "': not in ", where_);
  return it->second->info(name);
}

const std::string& HfCheckpoint::file_of(const std::string& name) const {
  auto it = by_tensor_.find(name);
  ST_CHECK(it != by_tensor_.end(), "missing parameter '", name, "': not in ", where_);
  return it->second->path();
}

std::vector<std::string> HfCheckpoint::names() const {
  std::vector<std::string> out;
  for (const auto& item : by_tensor_) out.push_back(item.first);
  return out;
}

void HfCheckpoint::read_slice(const std::string& name, int64_t begin, int64_t length, const at::Tensor& out) const {
  auto it = by_tensor_.find(name);
  ST_CHECK(it != by_tensor_.end(), "missing parameter '", name, "': not in ", where_);
  ST_CHECK(out.defined() && out.numel() == length, "read_slice '", name, "': the output holds ",
           out.defined() ? out.numel() : 0, " elements, the slice ", length);
  at::Tensor slice = it->second->read_slice(name, begin, length);
  bytes_read_ += slice.numel() * static_cast<int64_t>(slice.element_size());
  out.copy_(slice.view(out.sizes()));
}

void HfCheckpoint::check_against(torch::nn::Module& model, bool warn_unexpected) const {
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const safetensors::TensorInfo& tensor = info(item.key());
    ST_CHECK(at::IntArrayRef(tensor.shape) == item.value().sizes(), "parameter '", item.key(), "' in ",
             file_of(item.key()), " has shape ", at::IntArrayRef(tensor.shape), ", the model expects ",
             item.value().sizes());
  }
  if (warn_unexpected) warn_of_unexpected_tensors(model);
}

void HfCheckpoint::warn_of_unexpected_tensors(torch::nn::Module& model) const {
  std::set<std::string> expected;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) expected.insert(item.key());
  std::vector<std::string> unexpected;
  // transformers ignores both as well: the rotary table is recomputed from
  // the config, and a tied model's head is its embedding.
  const std::string rotary_suffix = "rotary_emb.inv_freq";
  for (const auto& [name, reader] : by_tensor_) {
    const bool rotary_table =
        name.size() >= rotary_suffix.size() &&
        name.compare(name.size() - rotary_suffix.size(), rotary_suffix.size(), rotary_suffix) == 0;
    const bool tied_head = name == "lm_head.weight";
    if (expected.count(name) == 0 && !rotary_table && !tied_head) unexpected.push_back(name);
  }
  if (unexpected.empty()) return;
  std::string listed;
  for (size_t i = 0; i < unexpected.size() && i < 4; ++i) listed += (i == 0 ? "" : ", ") + unexpected[i];
  if (unexpected.size() > 4) listed += ", ...";
  // A warning, as transformers' load report lists UNEXPECTED keys and goes on;
  // the usual cause is a config.json that describes a smaller model.
  ST_LOG_WARN("{} holds {} tensor(s) the model has no parameter for ({}); they are not loaded. Does config.json "
              "(num_hidden_layers, tie_word_embeddings) describe the model these weights come from?",
              where_, unexpected.size(), listed);
}

int64_t HfCheckpoint::total_tensor_bytes() const {
  int64_t total = 0;
  for (const auto& [name, reader] : by_tensor_) total += static_cast<int64_t>(reader->info(name).nbytes());
  return total;
}

WeightSource hf_weight_source(std::shared_ptr<const HfCheckpoint> checkpoint) {
  ST_CHECK(checkpoint != nullptr, "hf_weight_source: the checkpoint is null");
  return [checkpoint](const std::string& name, int64_t begin, int64_t length, at::Tensor out) {
    checkpoint->read_slice(name, begin, length, out);
  };
}

namespace {

/// Moves a module just built to `device` and `dtype` and frees its parameters' storage.
template <typename Holder>
Holder without_weights(Holder module, at::ScalarType dtype, const at::Device& device) {
  if (dtype != at::kFloat || !device.is_cpu()) module->to(device, dtype);
  release_parameter_storage(*module);
  return module;
}

}  // namespace

LlamaForCausalLM make_llama_without_weights(const LlamaConfig& config, at::ScalarType dtype, at::Device device) {
  config.validate();
  ST_CHECK_T(ConfigError, at::isFloatingType(dtype), "make_llama_without_weights: dtype ", c10::toString(dtype),
             " is not a floating-point type");
  // LlamaForCausalLM's constructor allocates and initialises every layer at
  // once; built with no layers and a one-token vocabulary it allocates almost
  // nothing. The embedding, the layers and the head are then built one at a
  // time, each released before the next exists.
  LlamaConfig skeleton = config;
  skeleton.num_hidden_layers = 0;
  skeleton.vocab_size = 1;
  LlamaForCausalLM model = without_weights(LlamaForCausalLM(skeleton), dtype, device);
  model->config = config;
  model->model->config = config;
  // replace_module keeps the child's place, so parameters come in the same order as a normally built model's.
  model->model->embed_tokens = LlamaEmbedding(
      model->model->replace_module("embed_tokens", without_weights(LlamaEmbedding(config), dtype, device)));
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    model->model->layers->push_back(without_weights(LlamaDecoderLayer(config), dtype, device));
  }
  if (!config.tie_word_embeddings) {
    model->lm_head = LlamaLMHead(model->replace_module("lm_head", without_weights(LlamaLMHead(config), dtype, device)));
  }
  return model;
}

}  // namespace shardtrain::models
