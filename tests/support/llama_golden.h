#pragma once
// The golden Llama/Mistral cases: their inputs in tests/data/golden (made once
// by scripts/make_llama_golden.py: configs, random weights, input ids,
// prompts) and the reference outputs Hugging Face transformers computes from
// them at build time on this machine's torch (scripts/hf_golden.py, into the
// build directory's golden-hf/).

#include <algorithm>
#include <cmath>
#include <string>

#include "build_config.h"
#include "shardtrain/models/llama.h"

namespace shardtrain::testing {

/// A small Llama built in code: grouped-query attention (4 heads, 2 KV
/// heads), untied head, hidden 64, every projection a whole number of
/// 64-element blocks (NF4 quantizes all of them). Quick to write and read.
inline models::LlamaConfig small_gqa_llama_config(int64_t vocab_size) {
  models::LlamaConfig c;
  c.vocab_size = vocab_size;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  return c;
}

inline std::string golden_dir(const std::string& name) {
  return std::string(SHARDTRAIN_SOURCE_DIR) + "/tests/data/golden/" + name;
}

/// Where transformers' outputs for the case are: golden.safetensors (input_ids,
/// logits, loss, and their fp64 twins) and, for cases with a prompt, greedy.json.
inline std::string golden_reference_dir(const std::string& name) {
  return std::string(SHARDTRAIN_BIN_DIR) + "/../golden-hf/" + name;
}

/// The case's model with its committed weights, in eval mode.
inline models::LlamaForCausalLM load_golden_case(const std::string& name) {
  auto config = models::LlamaConfig::from_json_file(golden_dir(name) + "/config.json");
  models::LlamaForCausalLM model(config);
  models::load_hf_weights(model, golden_dir(name));
  model->eval();
  return model;
}

/// How far apart two fp64 evaluations of the same Llama forward may be when
/// they only order their sums differently (cached vs full, packed vs
/// separate, this implementation vs the Python one), for logits of magnitude
/// up to `max_abs_logit`. Tests that must tell a correct forward from a wrong
/// one compare in fp64: there rounding is ~1e-15, while any mask, position or
/// weight error moves logits by more than 1e-3 (each test has a control that
/// shows it), so a generous bound separates the two by orders of magnitude on
/// any CPU, whatever BLAS kernel or summation order it uses.
///
/// The arithmetic: each logit lies at the end of a chain of reductions. Per
/// layer: the RMSNorm mean (H terms), the q/k/v products (H), the scores
/// (head_dim), the softmax sum and the probabilities times values (T each),
/// the output projection (H), the second norm (H), gate/up (H), down (I), and
/// about ten element-wise steps; then the final norm (H), the head (H). A sum
/// of n terms evaluated in any order is within n * 2^-53 * sum|terms| of the
/// exact value, so two orders differ by at most twice that. G = 1e4 bounds,
/// generously, the product of sum|terms| / |result| and the gain of the
/// layers after the rounding (both O(10) for these small models with
/// renormalising norms); it is a ceiling argued from the model, not a value
/// measured anywhere.
inline double fp64_logit_tolerance(const models::LlamaConfig& c, int64_t seq_len, double max_abs_logit) {
  const double H = static_cast<double>(c.hidden_size);
  const double per_layer = 6 * H + static_cast<double>(c.resolved_head_dim()) + 2.0 * static_cast<double>(seq_len) +
                           static_cast<double>(c.intermediate_size) + 10;
  const double reductions = static_cast<double>(c.num_hidden_layers) * per_layer + 2 * H + 10;
  const double unit_roundoff = std::ldexp(1.0, -53);
  const double gain = 1e4;
  return 2 * reductions * unit_roundoff * gain * std::max(1.0, max_abs_logit);
}

/// The same for a mean next-token cross entropy over those logits: the loss
/// moves by at most 2 * max|logit change| (its gradient in the logits,
/// softmax - one_hot, has an L1 norm <= 2), plus the rounding of its own
/// log-sum-exp and mean (`terms` summands of magnitude <= the loss).
inline double fp64_loss_tolerance(const models::LlamaConfig& c, int64_t seq_len, double max_abs_logit,
                                  double loss, int64_t terms) {
  const double unit_roundoff = std::ldexp(1.0, -53);
  return 2 * fp64_logit_tolerance(c, seq_len, max_abs_logit) +
         2 * static_cast<double>(terms + c.vocab_size) * unit_roundoff * std::abs(loss);
}

}  // namespace shardtrain::testing
