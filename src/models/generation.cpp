// Greedy and sampled generation over a step function, the KV-cached step of a
// LlamaForCausalLM, and a model directory's generation_config.json (generation.h).
#include "shardtrain/models/generation.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include "json_depth.h"
#include "models/token_ids_field.h"
#include "shardtrain/error.h"

namespace shardtrain::models {

Sampler::Sampler(double temperature, int64_t top_k, double top_p, uint64_t seed)
    : temperature_(temperature),
      top_k_(top_k),
      top_p_(top_p),
      generator_(at::make_generator<at::CPUGeneratorImpl>(seed)) {
  ST_CHECK_T(ConfigError, std::isfinite(temperature) && temperature >= 0.0,
             "temperature must be >= 0 (0: greedy), got ", temperature);
  ST_CHECK_T(ConfigError, top_k >= 0, "top_k must be >= 0 (0: all tokens), got ", top_k);
  ST_CHECK_T(ConfigError, top_p > 0.0 && top_p <= 1.0, "top_p must be in (0, 1], got ", top_p);
}

int64_t Sampler::next(const at::Tensor& logits) {
  ST_CHECK(logits.dim() == 1 && logits.size(0) > 0, "Sampler: logits must be [V], got ", logits.sizes());
  at::Tensor l = logits.detach().to(at::kCPU, at::kFloat);
  // NaN or +inf logits would leave no token to sample (and make argmax arbitrary): a broken model, said as such.
  ST_CHECK(!l.isnan().any().item<bool>() && !l.isposinf().any().item<bool>(),
           "Sampler: the logits hold NaN or +inf (the model's forward overflowed or its weights are broken)");
  if (greedy()) return l.argmax().item<int64_t>();
  at::Tensor probs = at::softmax(l / temperature_, -1);
  // Sorted descending; stable so equal probabilities keep index order and the
  // draw is the same on every run and rank.
  auto [sorted, order] = probs.sort(/*stable=*/true, /*dim=*/0, /*descending=*/true);
  if (top_k_ > 0 && top_k_ < sorted.size(0)) {
    // transformers' TopKLogitsWarper (tokens tied with the k-th stay), then
    // TopPLogitsWarper on the softmax of what it kept: the nucleus is
    // measured in the renormalised top-k mass.
    const int64_t kept = sorted.ge(sorted[top_k_ - 1]).sum().item<int64_t>();
    sorted = sorted.narrow(0, 0, kept);
    sorted = sorted / sorted.sum();
  }
  if (top_p_ < 1.0) {
    // Keep a token while the tokens before it add up to less than top_p: the
    // smallest prefix reaching top_p, and always the most probable token.
    at::Tensor before = sorted.cumsum(0) - sorted;
    sorted = sorted.masked_fill(before >= top_p_, 0.0);
  }
  // multinomial normalizes the kept mass itself.
  const int64_t pick = at::multinomial(sorted, 1, /*replacement=*/false, generator_).item<int64_t>();
  return order[pick].item<int64_t>();
}

GenerationResult generate(const StepFunction& step, const std::vector<int64_t>& prompt,
                          const GenerationOptions& options) {
  ST_CHECK(static_cast<bool>(step), "generate: no step function");
  ST_CHECK(!prompt.empty(), "generate: the prompt is empty (prepend BOS at least)");
  ST_CHECK_T(ConfigError, options.max_new_tokens >= 0, "max_new_tokens must be >= 0, got ", options.max_new_tokens);
  Sampler sampler(options.temperature, options.top_k, options.top_p, options.seed);
  GenerationResult result;
  KVCache cache;
  const auto long_cpu = at::TensorOptions().dtype(at::kLong);
  at::Tensor next_ids = at::tensor(prompt, long_cpu).view({1, -1});
  for (int64_t produced = 0; produced < options.max_new_tokens; ++produced) {
    at::Tensor logits = step(next_ids, cache);
    ++result.forward_calls;
    ST_CHECK(logits.dim() == 3 && logits.size(0) == 1 && logits.size(1) == next_ids.size(1), "generate: the step ",
             "returned logits ", logits.sizes(), " for input ids ", next_ids.sizes(), " (expected [1, T, V])");
    at::Tensor last = logits[0][logits.size(1) - 1];
    if (options.vocab_limit > 0 && options.vocab_limit < last.size(0)) last = last.narrow(0, 0, options.vocab_limit);
    int64_t token = sampler.next(last);
    if (options.agree_on_token) token = options.agree_on_token(token);
    if (!result.stopped) {
      result.tokens.push_back(token);
      if (std::find(options.stop_ids.begin(), options.stop_ids.end(), token) != options.stop_ids.end()) {
        result.stopped = true;
      }
    }
    if (result.stopped && !options.fixed_steps) break;
    next_ids = at::full({1, 1}, token, long_cpu);
  }
  return result;
}

std::optional<GenerationConfigFile> read_generation_config(const std::string& model_dir) {
  using json = nlohmann::json;
  const std::filesystem::path path = std::filesystem::path(model_dir) / "generation_config.json";
  if (!std::filesystem::exists(path)) return std::nullopt;
  std::ifstream in(path);
  ST_CHECK_T(ConfigError, in.good(), "cannot read ", path.string());
  json j;
  try {
    j = parse_json_within_depth<ConfigError, json>(in, path.string());
  } catch (const json::exception& e) {
    ST_THROW(ConfigError, path.string(), ": invalid JSON: ", e.what());
  }
  ST_CHECK_T(ConfigError, j.is_object(), path.string(), ": must be a JSON object");
  auto field = [&](const char* key, auto is_type, const char* expected) -> const json* {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return nullptr;
    ST_CHECK_T(ConfigError, is_type(*it), path.string(), ": field '", key, "' must be ", expected, ", got ",
               it->dump());
    return &*it;
  };
  GenerationConfigFile file;
  auto is_integer = [](const json& v) { return v.is_number_integer(); };
  auto is_number = [](const json& v) { return v.is_number(); };
  if (auto ids = token_ids_field(j, "eos_token_id", path.string())) file.eos_token_ids = *ids;
  if (auto* v = field("do_sample", [](const json& x) { return x.is_boolean(); }, "true or false")) {
    file.do_sample = v->get<bool>();
  }
  if (auto* v = field("temperature", is_number, "a number")) file.temperature = v->get<double>();
  if (auto* v = field("top_k", is_integer, "an integer")) file.top_k = v->get<int64_t>();
  if (auto* v = field("top_p", is_number, "a number")) file.top_p = v->get<double>();
  return file;
}

StepFunction cached_step(LlamaForCausalLM model) {
  return [model](const at::Tensor& new_ids, KVCache& cache) mutable {
    return model->forward_cached(new_ids.to(model->model->embed_tokens->weight.device()), cache);
  };
}

}  // namespace shardtrain::models
