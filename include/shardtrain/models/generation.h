#pragma once
/// @file models/generation.h
/// Autoregressive generation with a KV cache: greedy decoding, temperature
/// and nucleus (top-p) sampling with a seeded generator of its own, stop ids.
///
/// The model is reached through a step callback, so the same loop drives a
/// plain model and one prepared by an Accelerator (ZeRO-3 / FSDP):
///
///     models::LlamaForCausalLM model(config);
///     models::load_hf_weights(model, dir);
///     torch::NoGradGuard no_grad;
///     auto result = models::generate(models::cached_step(model), prompt_ids, options);
///
///     auto prepared = accelerator.prepare(model);              // sharded
///     options.agree_on_token = [&](int64_t t) { ...broadcast rank 0's t... };
///     auto result = models::generate(models::prepared_cached_step(prepared), prompt_ids, options);
///
/// Distributed use: under ZeRO-3 or FSDP every forward is collective (each
/// decoder layer all-gathers its parameters), so every rank must run the
/// same number of steps. Either give `agree_on_token` (all ranks then
/// continue with the same token and stop at the same step), or set
/// `fixed_steps` (every rank runs exactly max_new_tokens steps whatever it
/// samples). Sampling itself is reproducible: the same seed and logits give
/// the same tokens on every rank.
///
/// Batch size 1: one prompt at a time.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include "shardtrain/models/llama.h"

namespace shardtrain::models {

struct GenerationOptions {
  /// Tokens to generate at most (0: none; the model is not called).
  int64_t max_new_tokens = 32;
  /// 0: greedy (argmax, the first of equal maxima). Otherwise the logits are
  /// divided by it before sampling.
  double temperature = 0.0;
  /// Sampling draws among the top_k most probable tokens only (0: all), as
  /// transformers' generate() does with its default of 50. Ignored when greedy.
  int64_t top_k = 50;
  /// Nucleus sampling: sample among the most probable tokens whose
  /// probabilities (renormalised over the top_k) add up to top_p (at least
  /// one token). (0, 1]; 1: all. Ignored when greedy.
  double top_p = 1.0;
  /// Seed of the sampler's own generator (the global torch seed is untouched).
  uint64_t seed = 0;
  /// Generation ends after producing any of these (e.g. the config's EOS);
  /// the stop id is part of the result, as in transformers' generate().
  std::vector<int64_t> stop_ids;
  /// Run exactly max_new_tokens steps even after a stop id (the result still
  /// ends at the stop id): keeps ranks in lockstep without communication.
  bool fixed_steps = false;
  /// > 0: ids at or above it are never produced. The rows a padded embedding
  /// has beyond its tokenizer's vocabulary (sizes rounded up to 64 or 128)
  /// are untrained and could not be decoded; pass the tokenizer's vocab_size().
  int64_t vocab_limit = 0;
  /// Called with every sampled token; generation continues with what it
  /// returns. A distributed caller returns rank 0's token (a broadcast), so
  /// all ranks see the same sequence and stop at the same step.
  std::function<int64_t(int64_t)> agree_on_token;
};

struct GenerationResult {
  /// The new tokens (not the prompt), ending with the stop id if one came.
  std::vector<int64_t> tokens;
  /// True when a stop id ended the generation.
  bool stopped = false;
  /// How many times the step callback ran.
  int64_t forward_calls = 0;
};

/// Runs the model on `new_ids` [1, T_new] (int64, CPU) after the tokens
/// `cache` holds, appends them to it and returns their logits [1, T_new, V]
/// (only the last row is used).
using StepFunction = std::function<at::Tensor(const at::Tensor& new_ids, KVCache& cache)>;

/// What a model directory's generation_config.json (transformers'
/// GenerationConfig, saved beside config.json) sets for generation: its stop
/// ids and sampling defaults, which transformers' generate() applies unless
/// the call overrides them. Fields the file leaves out stay unset.
struct GenerationConfigFile {
  std::vector<int64_t> eos_token_ids;  ///< empty: the file names none
  bool do_sample = false;
  std::optional<double> temperature;
  std::optional<int64_t> top_k;
  std::optional<double> top_p;
};
/// Reads MODEL_DIR/generation_config.json; nullopt when there is none.
/// Throws shardtrain::ConfigError naming the file and the field when a value
/// has the wrong type.
std::optional<GenerationConfigFile> read_generation_config(const std::string& model_dir);

/// Picks the next token from logits: greedy, or sampled as transformers'
/// logits warpers in their order (temperature, then top-k, then top-p).
/// Throws shardtrain::ConfigError for a temperature below 0, a top_k below 0
/// or a top_p outside (0, 1].
class Sampler {
 public:
  Sampler(double temperature, int64_t top_k, double top_p, uint64_t seed);
  /// logits [V] (any floating dtype and device; sampled on the CPU in fp32).
  int64_t next(const at::Tensor& logits);
  bool greedy() const { return temperature_ == 0.0; }

 private:
  double temperature_;
  int64_t top_k_;
  double top_p_;
  at::Generator generator_;
};

/// Generates up to options.max_new_tokens tokens after `prompt` (non-empty):
/// one step over the whole prompt (prefill), then one step per new token, with
/// a fresh KVCache. N new tokens take N steps (the last token is not fed back).
GenerationResult generate(const StepFunction& step, const std::vector<int64_t>& prompt,
                          const GenerationOptions& options);

/// The step of a plain model: model->forward_cached on the model's device.
StepFunction cached_step(LlamaForCausalLM model);

/// The step of a model prepared by an Accelerator (a PreparedModel of a
/// LlamaForCausalLM): forward_cached between the engine's begin_forward and
/// end_forward, so the root unit's parameters (those outside every selected
/// unit: the final norm, and the embeddings and LM head unless they are units)
/// are gathered too. `prepared` must outlive the returned function. Collective
/// under ZeRO-3 / FSDP: see the file comment.
template <typename Prepared>
StepFunction prepared_cached_step(Prepared& prepared) {
  return [&prepared](const at::Tensor& new_ids, KVCache& cache) {
    return prepared.run([&](auto& module) {
      return module->forward_cached(new_ids.to(module->model->embed_tokens->weight.device()), cache);
    });
  };
}

}  // namespace shardtrain::models
