// The Llama / Mistral decoder with Hugging Face parameter names, its losses
// and FLOP estimate, and loading Hugging Face weights into it.
//
// One piece: the config, the modules, the losses and the weight loader share
// Hugging Face's parameter naming (modeling_llama.py), kept in one file so
// the mapping can be read in one place.

#include "shardtrain/models/llama.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <type_traits>
#include <utility>

#include <nlohmann/json.hpp>
#include <torch/version.h>

#include "json_depth.h"
#include "kernels/packed_attention.h"
#include "kernels/recompute.h"
#include "models/token_ids_field.h"
#include "shardtrain/device.h"
#include "shardtrain/error.h"
#include "shardtrain/logging.h"
#include "shardtrain/models/hf_weights.h"
#include "shardtrain/nn/attention.h"

namespace shardtrain::models {

using json = nlohmann::json;

// ---- config ---------------------------------------------------------------

namespace {

/// nlohmann converts a float or an oversized unsigned to an integer with a
/// plain cast, undefined when it does not fit (found by tests/fuzz): an
/// integer value is one in range, or a float with an exact integral value in range.
template <typename T>
bool is_integer_in_range(const json& value) {
  return (value.is_number_integer() && !value.is_number_unsigned()) ||
         (value.is_number_unsigned() &&
          value.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max())) ||
         (value.is_number_float() && std::trunc(value.get<double>()) == value.get<double>() &&
          value.get<double>() >= static_cast<double>(std::numeric_limits<T>::min()) &&
          value.get<double>() < static_cast<double>(std::numeric_limits<T>::max()));
}

template <typename T>
T get_or(const json& j, const char* key, T fallback, const std::string& source) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    ST_CHECK_T(ConfigError, is_integer_in_range<T>(*it) || !it->is_number(), source, ": field '", key,
               "' must be an integer in range, got ", it->dump());
  }
  try {
    return it->get<T>();
  } catch (const json::exception& e) {
    ST_THROW(ConfigError, source, ": field '", key, "' has the wrong type: ", e.what());
  }
}

}  // namespace

std::optional<std::vector<int64_t>> token_ids_field(const json& j, const char* key, const std::string& source) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  const json items = it->is_array() ? *it : json::array({*it});
  std::vector<int64_t> ids;
  for (const json& item : items) {
    ST_CHECK_T(ConfigError, is_integer_in_range<int64_t>(item), source, ": field '", key,
               "' must be an integer or a list of integers (in range), got ", it->dump());
    ids.push_back(item.get<int64_t>());
  }
  return ids;
}

std::string LlamaConfig::decoder_layer_class_name() const {
  return model_type == "mistral" ? "MistralDecoderLayer" : "LlamaDecoderLayer";
}

void LlamaConfig::validate() const {
  ST_CHECK_T(ConfigError, model_type == "llama" || model_type == "mistral",
             "model_type '", model_type, "' is not supported (llama, mistral)");
  ST_CHECK_T(ConfigError, vocab_size > 0 && hidden_size > 0 && intermediate_size > 0 && num_hidden_layers >= 0,
             "vocab_size, hidden_size, intermediate_size must be positive");
  ST_CHECK_T(ConfigError, num_attention_heads > 0 && num_key_value_heads > 0 &&
                              num_attention_heads % num_key_value_heads == 0,
             "num_attention_heads (", num_attention_heads, ") must be a multiple of num_key_value_heads (",
             num_key_value_heads, ")");
  ST_CHECK_T(ConfigError, head_dim > 0 || hidden_size % num_attention_heads == 0,
             "hidden_size (", hidden_size, ") is not divisible by num_attention_heads (", num_attention_heads, ")");
  ST_CHECK_T(ConfigError, resolved_head_dim() % 2 == 0, "head_dim must be even for rotary embeddings");
  ST_CHECK_T(ConfigError, !sliding_window || *sliding_window > 0, "sliding_window must be positive");
  if (rope_scaling) {
    ST_CHECK_T(ConfigError, rope_scaling->type == "linear" || rope_scaling->type == "llama3",
               "rope type '", rope_scaling->type,
               "' (rope_scaling or rope_parameters) is not implemented: default, linear and llama3 are");
    ST_CHECK_T(ConfigError, rope_scaling->factor > 0, "rope_scaling.factor must be positive");
    if (rope_scaling->type == "llama3") {
      ST_CHECK_T(ConfigError, rope_scaling->high_freq_factor != rope_scaling->low_freq_factor,
                 "rope_scaling high_freq_factor must differ from low_freq_factor");
    }
  }
}

namespace {

/// A config.json can ask for architecture variants this model does not build
/// (biased projections, another activation). transformers builds them, so
/// training the plain model on such weights would be a different model with
/// no error anywhere: refused by name instead.
void refuse_unimplemented_features(const json& j, const std::string& source) {
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    ST_CHECK_T(ConfigError, !get_or<bool>(j, key, false, source), source, ": '", key,
               "': true (biased projections) is not implemented; shardtrain builds Llama/Mistral without biases");
  }
  // transformers' Llama and Mistral apply attention_dropout while training; shardtrain's attention has none.
  const double attention_dropout = get_or<double>(j, "attention_dropout", 0.0, source);
  ST_CHECK_T(ConfigError, attention_dropout == 0.0, source, ": 'attention_dropout': ", attention_dropout,
             " is not implemented (shardtrain's attention has no dropout); set it to 0.0, as released Llama and "
             "Mistral configs have it");
  for (const char* key : {"hidden_act", "hidden_activation"}) {
    const std::string act = get_or<std::string>(j, key, "silu", source);
    ST_CHECK_T(ConfigError, act == "silu" || act == "swish", source, ": '", key, "': \"", act,
               "\" is not implemented; shardtrain's MLP is SwiGLU (silu)");
  }
}

/// The rotary settings, where either generation of transformers writes them:
/// before 5.0 a top-level rope_theta and an optional rope_scaling object;
/// from 5.0 one rope_parameters object holding rope_theta, rope_type and the
/// scaling factors (and no top-level rope_theta). transformers' own order of
/// precedence (PreTrainedConfig.convert_rope_params_to_dict): a non-empty
/// rope_scaling, else rope_parameters; rope_theta from that object, else the
/// top-level one, else 10000.
void read_rotary_parameters(const json& j, const std::string& source, LlamaConfig& c) {
  c.rope_theta = get_or<double>(j, "rope_theta", c.rope_theta, source);
  const json* rotary = nullptr;
  bool legacy = false;  // rope_scaling, which always named its type
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) continue;
    ST_CHECK_T(ConfigError, it->is_object(), source, ": field '", key, "' must be an object or null");
    if (it->empty()) continue;
    rotary = &*it;
    legacy = std::string(key) == "rope_scaling";
    break;
  }
  const json no_rotary_object = json::object();
  const json& rs = rotary != nullptr ? *rotary : no_rotary_object;
  const double partial =
      get_or<double>(rs, "partial_rotary_factor", get_or<double>(j, "partial_rotary_factor", 1.0, source), source);
  ST_CHECK_T(ConfigError, partial == 1.0, source, ": partial_rotary_factor ", partial,
             " (rotary embeddings on part of each head) is not implemented; Llama/Mistral rotate the whole head");
  if (rotary == nullptr) return;
  c.rope_theta = get_or<double>(rs, "rope_theta", c.rope_theta, source);
  ST_CHECK_T(ConfigError, !legacy || rs.contains("rope_type") || rs.contains("type"), source,
             ": rope_scaling needs 'type' or 'rope_type' (linear, llama3)");
  RopeScaling r;
  r.type = get_or<std::string>(rs, "rope_type", get_or<std::string>(rs, "type", "default", source), source);
  if (r.type == "default") return;
  r.factor = get_or<double>(rs, "factor", 1.0, source);
  r.low_freq_factor = get_or<double>(rs, "low_freq_factor", r.low_freq_factor, source);
  r.high_freq_factor = get_or<double>(rs, "high_freq_factor", r.high_freq_factor, source);
  r.original_max_position_embeddings =
      get_or<int64_t>(rs, "original_max_position_embeddings", r.original_max_position_embeddings, source);
  c.rope_scaling = r;
}

}  // namespace

LlamaConfig LlamaConfig::from_json_string(const std::string& text, const std::string& source) {
  json j;
  try {
    j = parse_json_within_depth<ConfigError, json>(text, source);
  } catch (const json::exception& e) {
    ST_THROW(ConfigError, source, ": invalid JSON: ", e.what());
  }
  ST_CHECK_T(ConfigError, j.is_object(), source, ": config must be a JSON object");
  // transformers fills these from the 7B model's values when a config.json
  // leaves them out; a file without them is almost always the wrong file, and
  // building a 7B model from it takes minutes and gigabytes before anything
  // says so. Every real config.json has them.
  std::string missing;
  for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"}) {
    if (!j.contains(key)) missing += std::string(missing.empty() ? "" : ", ") + key;
  }
  ST_CHECK_T(ConfigError, missing.empty(), source, ": a model config needs ", missing,
             " (a Hugging Face config.json has them); shardtrain does not fall back to the 7B defaults");
  LlamaConfig c;
  c.model_type = get_or<std::string>(j, "model_type", "llama", source);
  c.vocab_size = get_or<int64_t>(j, "vocab_size", c.vocab_size, source);
  c.hidden_size = get_or<int64_t>(j, "hidden_size", c.hidden_size, source);
  c.intermediate_size = get_or<int64_t>(j, "intermediate_size", c.intermediate_size, source);
  c.num_hidden_layers = get_or<int64_t>(j, "num_hidden_layers", c.num_hidden_layers, source);
  c.num_attention_heads = get_or<int64_t>(j, "num_attention_heads", c.num_attention_heads, source);
  c.num_key_value_heads = get_or<int64_t>(j, "num_key_value_heads", c.num_attention_heads, source);
  c.head_dim = get_or<int64_t>(j, "head_dim", 0, source);
  c.rms_norm_eps = get_or<double>(j, "rms_norm_eps", c.rms_norm_eps, source);
  c.max_position_embeddings = get_or<int64_t>(j, "max_position_embeddings",
                                              c.model_type == "mistral" ? 4096 * 32 : 2048, source);
  c.tie_word_embeddings = get_or<bool>(j, "tie_word_embeddings", false, source);
  c.initializer_range = get_or<double>(j, "initializer_range", c.initializer_range, source);
  c.bos_token_id = get_or<int64_t>(j, "bos_token_id", c.bos_token_id, source);
  if (auto ids = token_ids_field(j, "eos_token_id", source)) {
    ST_CHECK_T(ConfigError, !ids->empty(), source,
               ": field 'eos_token_id' must be an integer or a non-empty list of integers");
    c.eos_token_id = ids->front();
    c.other_eos_token_ids.assign(ids->begin() + 1, ids->end());
  }
  // transformers' MistralConfig defaults sliding_window to 4096; null disables it.
  if (auto it = j.find("sliding_window"); it != j.end()) {
    if (!it->is_null()) c.sliding_window = get_or<int64_t>(j, "sliding_window", 0, source);
  } else if (c.model_type == "mistral") {
    c.sliding_window = 4096;
  }
  refuse_unimplemented_features(j, source);
  read_rotary_parameters(j, source, c);
  try {
    c.validate();
  } catch (const ConfigError& e) {
    throw ConfigError(source + ": " + e.what());
  }
  return c;
}

LlamaConfig LlamaConfig::from_json_file(const std::string& path) {
  std::ifstream in(path);
  ST_CHECK_T(ConfigError, in.good(), "cannot open model config '", path, "'");
  std::stringstream buffer;
  buffer << in.rdbuf();
  return from_json_string(buffer.str(), path);
}

// ---- rotary embeddings ------------------------------------------------------

at::Tensor rope_inv_freq(const LlamaConfig& config) {
  const int64_t dim = config.resolved_head_dim();
  // fp32 throughout, like transformers (base ** (arange(0, dim, 2).float() / dim)).
  at::Tensor exponent = at::arange(0, dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) / dim;
  at::Tensor inv_freq = 1.0 / at::pow(config.rope_theta, exponent);
  if (!config.rope_scaling) return inv_freq;
  const RopeScaling& r = *config.rope_scaling;
  if (r.type == "linear") return inv_freq / r.factor;
  // llama3: transformers' _compute_llama3_parameters.
  const double old_len = static_cast<double>(r.original_max_position_embeddings);
  const double low_freq_wavelen = old_len / r.low_freq_factor;
  const double high_freq_wavelen = old_len / r.high_freq_factor;
  at::Tensor wavelen = 2 * M_PI / inv_freq;
  at::Tensor inv_freq_llama = at::where(wavelen > low_freq_wavelen, inv_freq / r.factor, inv_freq);
  at::Tensor smooth = (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  at::Tensor smoothed = (1 - smooth) * inv_freq_llama / r.factor + smooth * inv_freq_llama;
  at::Tensor is_medium = at::logical_not(wavelen < high_freq_wavelen) & at::logical_not(wavelen > low_freq_wavelen);
  return at::where(is_medium, smoothed, inv_freq_llama);
}

namespace {

/// transformers computes norms, softmax and logits in fp32 whatever the model
/// dtype (fp32 for bf16/fp16/fp32 here too). An fp64 model keeps fp64 there
/// instead: it is the rounding-free reference the tests compare against.
at::ScalarType at_least_fp32(at::ScalarType dtype) { return at::promote_types(dtype, at::kFloat); }

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

shardtrain::nn::Linear linear(int64_t in, int64_t out) {
  return shardtrain::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

/// cos/sin [B,T,d] for positions [B,T]: freqs = positions x inv_freq in fp32, emb = cat(freqs, freqs).
/// `inv_freq` lives with the model's activations after the first call.
std::pair<at::Tensor, at::Tensor> rope_cos_sin(const at::Tensor& positions, at::Tensor& inv_freq) {
  inv_freq = to_device_without_waiting(inv_freq, positions.device());
  at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * inv_freq.view({1, 1, -1});
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos(), emb.sin()};
}

}  // namespace

double training_flops_per_token(const LlamaConfig& c, int64_t num_params, int64_t seq_len,
                                int64_t trained_matmul_params) {
  const double embedding = static_cast<double>(c.vocab_size) * c.hidden_size;
  // Input embeddings are a lookup, not a matmul; a tied table is also the LM head.
  const double matmul_params = static_cast<double>(num_params) - (c.tie_word_embeddings ? 0.0 : embedding);
  const double trained = trained_matmul_params < 0 ? matmul_params : static_cast<double>(trained_matmul_params);
  return 4.0 * matmul_params + 2.0 * trained +
         12.0 * c.num_hidden_layers * c.hidden_size * static_cast<double>(seq_len);
}

namespace {

/// [B,T] bool: a document starts at this token, the row's first or one whose
/// id differs from the token before. A document is a run of equal ids, for
/// the positions, the mask and the packed sequences alike.
at::Tensor document_starts(const at::Tensor& document_ids) {
  ST_CHECK(document_ids.dim() == 2, "document_ids must be [B, T], got ", document_ids.sizes());
  const int64_t T = document_ids.size(1);
  at::Tensor is_start = at::ones_like(document_ids, at::kBool);
  if (T > 1) {
    is_start.slice(1, 1).copy_(document_ids.slice(1, 1) != document_ids.slice(1, 0, T - 1));
  }
  return is_start;
}

}  // namespace

at::Tensor positions_from_document_ids(const at::Tensor& document_ids) {
  const at::Tensor is_start = document_starts(document_ids);
  at::Tensor idx = at::arange(document_ids.size(1), document_ids.options().dtype(at::kLong)).expand_as(document_ids);
  at::Tensor start = std::get<0>(at::cummax(at::where(is_start, idx, at::zeros_like(idx)), 1));
  return idx - start;
}

// ---- activation checkpointing ------------------------------------------------

ActivationCheckpointing parse_activation_checkpointing(const std::string& name) {
  if (name == "none") return ActivationCheckpointing::kNone;
  if (name == "selective") return ActivationCheckpointing::kSelective;
  ST_THROW(ConfigError, "activation checkpointing '", name,
           "' is not supported (none, selective; full checkpointing of whole layers is the engine's: "
           "fsdp_activation_checkpointing or gradient_checkpointing)");
}

std::string to_string(ActivationCheckpointing mode) {
  return mode == ActivationCheckpointing::kSelective ? "selective" : "none";
}

PackedSequences packed_sequences(const at::Tensor& document_ids, int64_t rows, int64_t tokens,
                                 const at::Device& device, std::optional<int64_t> window) {
  ST_CHECK(rows > 0 && tokens > 0, "packed_sequences: no tokens (", rows, " rows of ", tokens, ")");
  ST_CHECK(rows * tokens < (int64_t{1} << 31), "packed_sequences: ", rows * tokens,
           " tokens do not fit the kernel's int32 offsets");
  ST_CHECK(!window || *window > 0, "packed_sequences: a window of ", window.value_or(0), " keys");
  // On the host: the offsets are few (one per sequence), and the longest
  // length has to reach the host anyway, as the kernel's launch argument.
  at::Tensor starts;  // [rows * tokens] bool: a sequence starts here
  if (document_ids.defined()) {
    ST_CHECK(document_ids.dim() == 2 && document_ids.size(0) == rows && document_ids.size(1) == tokens,
             "packed_sequences: document_ids ", document_ids.sizes(), " are not [", rows, ", ", tokens, "]");
    starts = document_starts(document_ids.to(at::kCPU)).reshape({-1});
  } else {
    starts = at::zeros({rows, tokens}, at::kBool);
    starts.select(1, 0).fill_(true);
    starts = starts.reshape({-1});
  }
  const at::Tensor offsets =
      at::cat({at::nonzero(starts).reshape({-1}), at::full({1}, rows * tokens, at::kLong)}).to(at::kInt);
  PackedSequences packed;
  packed.max_seqlen = (offsets.slice(0, 1) - offsets.slice(0, 0, -1)).max().item<int64_t>();
  packed.cu_seqlens = to_device_without_waiting(offsets, device);
  packed.window = window;
  return packed;
}

AttentionMask::AttentionMask(at::Tensor allowed) : allowed_(std::move(allowed)) {
  ST_CHECK(allowed_.defined() && allowed_.scalar_type() == at::kBool && allowed_.dim() == 4,
           "an attention mask is a [B, 1, T, S] bool tensor (true: may attend), got ",
           allowed_.defined() ? allowed_.toString() + " of shape " + c10::str(allowed_.sizes()) : "an undefined tensor",
           "; for causal attention without one use AttentionMask::causal()");
}

struct AttentionMask::Packed {
  PackedSequences sequences;
  std::function<at::Tensor()> build_allowed;
  std::once_flag built;
  at::Tensor allowed;
};

AttentionMask AttentionMask::packed(PackedSequences sequences, std::function<at::Tensor()> build_allowed) {
  ST_CHECK(sequences.cu_seqlens.defined() && sequences.cu_seqlens.dim() == 1 && sequences.max_seqlen > 0 &&
               build_allowed,
           "a packed attention mask has sequence offsets and a way to build its mask tensor");
  AttentionMask mask;
  mask.packed_ = std::make_shared<Packed>();
  mask.packed_->sequences = std::move(sequences);
  mask.packed_->build_allowed = std::move(build_allowed);
  return mask;
}

const PackedSequences* AttentionMask::packed_sequences() const { return packed_ ? &packed_->sequences : nullptr; }

const at::Tensor& AttentionMask::allowed() const {
  if (!packed_) return allowed_;
  Packed& p = *packed_;
  std::call_once(p.built, [&p] {
    AttentionMask built(p.build_allowed());
    ST_CHECK(built.allowed_.size(-1) == built.allowed_.size(-2),
             "a packed attention mask covers as many keys as queries (no cached keys), got ",
             built.allowed_.sizes());
    p.allowed = std::move(built.allowed_);
    p.build_allowed = nullptr;  // what it held (the document ids) is no longer needed
  });
  return p.allowed;
}

at::Tensor core_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionMask& mask) {
  // Fused kernels throughout: the T x S scores are never stored, in forward
  // or backward. Packed sequences on a GPU: FlashAttention's variable-length
  // kernel (kernels/packed_attention.h). Otherwise shardtrain::nn's SDPA,
  // LibTorch's widened to fp32 where bf16 GEMMs are (nn/attention.h): causal
  // without a mask tensor where the mask is only the order, else with the
  // boolean mask (true: attend) broadcast over the heads.
  const PackedSequences* packed = mask.packed_sequences();
  // Set once the variable-length kernel refused a call its rules admitted (a
  // LibTorch built without it, a rule of a newer torch): from then on the mask.
  static std::atomic<bool> packed_kernel_refused{false};
  if (packed != nullptr && !packed_kernel_refused.load(std::memory_order_relaxed) &&
      kernels::flash_attention_runs(q, kernels::attention_needs_grad(q, k, v))) {
    try {
      return kernels::packed_attention(q, k, v, packed->cu_seqlens, packed->max_seqlen, packed->window);
    } catch (const c10::OutOfMemoryError&) {
      throw;  // not a refusal: the mask path would need more memory still
    } catch (const c10::Error& refused) {
      if (!packed_kernel_refused.exchange(true)) {
        ST_LOG_WARN("FlashAttention's variable-length kernel refused the packed batch ({}); the attention uses "
                    "the packing mask from now on, which is correct but slower",
                    refused.what_without_backtrace());
      }
    }
  }
  if (mask.is_causal()) return shardtrain::nn::causal_scaled_dot_product_attention(q, k, v);
  return shardtrain::nn::scaled_dot_product_attention(q, k, v, mask.allowed());
}

namespace {

/// Carries the recomputation counter through the autograd context.
struct RecomputeCounter : torch::CustomClassHolder {
  explicit RecomputeCounter(std::shared_ptr<std::atomic<int64_t>> c) : count(std::move(c)) {}
  std::shared_ptr<std::atomic<int64_t>> count;
};

/// Carries the attention mask through the autograd context: it has no
/// gradient and is never written in place, so it is kept as it is rather than
/// saved as variables (and a causal mask has no tensor at all).
struct MaskHolder : torch::CustomClassHolder {
  explicit MaskHolder(AttentionMask m) : mask(std::move(m)) {}
  AttentionMask mask;
};

/// Selective recomputation of the core attention. Forward (which autograd
/// runs with grad mode off) records no graph, so the [B,heads,T,S] scores and
/// probabilities die with it; only the inputs are saved. Backward rebuilds the
/// graph from detached copies of the inputs and differentiates it: the same
/// kernels on the same values, so the gradients equal those of the plain path.
struct CoreAttentionFunction : torch::autograd::Function<CoreAttentionFunction> {
  static const AttentionMask& mask_in(const c10::IValue& holder) {
    return c10::static_intrusive_pointer_cast<MaskHolder>(holder.toCapsule())->mask;
  }

  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, c10::IValue mask, c10::IValue counter) {
    ctx->save_for_backward({q, k, v});
    ctx->saved_data["mask"] = mask;
    ctx->saved_data["counter"] = std::move(counter);
    return core_attention(q, k, v, mask_in(mask));
  }

  static std::vector<at::Tensor> backward(torch::autograd::AutogradContext* ctx, std::vector<at::Tensor> grads) {
    auto saved = ctx->get_saved_variables();
    const AttentionMask& mask = mask_in(ctx->saved_data["mask"]);
    const c10::IValue& counter = ctx->saved_data["counter"];
    std::vector<at::Tensor> result = kernels::recomputed_gradients(
        {saved[0], saved[1], saved[2]},
        [&](const std::vector<at::Tensor>& qkv) {
          if (counter.isCapsule()) {
            c10::static_intrusive_pointer_cast<RecomputeCounter>(counter.toCapsule())->count->fetch_add(1);
          }
          return core_attention(qkv[0], qkv[1], qkv[2], mask);
        },
        grads[0], "selectively checkpointed attention");
    result.resize(5);  // q, k, v, then the mask and the counter: no gradient
    return result;
  }
};

}  // namespace

at::Tensor checkpointed_core_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const AttentionMask& mask,
                                       std::shared_ptr<std::atomic<int64_t>> recomputations) {
  c10::IValue counter;  // None without a counter
  if (recomputations) {
    counter = c10::IValue::make_capsule(c10::make_intrusive<RecomputeCounter>(std::move(recomputations)));
  }
  return CoreAttentionFunction::apply(q, k, v, c10::IValue::make_capsule(c10::make_intrusive<MaskHolder>(mask)),
                                      std::move(counter));
}

// ---- modules --------------------------------------------------------------

LlamaRMSNormImpl::LlamaRMSNormImpl(int64_t hidden, double eps_)
    : weight(register_parameter("weight", torch::ones({hidden}))), eps(eps_) {}

at::Tensor LlamaRMSNormImpl::forward(const at::Tensor& x) {
  const auto input_dtype = x.scalar_type();
  at::Tensor h = x.to(at_least_fp32(input_dtype));
  at::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(variance + eps);
  return weight * h.to(input_dtype);
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& c) : config(c) {
  const int64_t d = c.resolved_head_dim();
  q_proj = register_module("q_proj", linear(c.hidden_size, c.num_attention_heads * d));
  k_proj = register_module("k_proj", linear(c.hidden_size, c.num_key_value_heads * d));
  v_proj = register_module("v_proj", linear(c.hidden_size, c.num_key_value_heads * d));
  o_proj = register_module("o_proj", linear(c.num_attention_heads * d, c.hidden_size));
}

at::Tensor LlamaAttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                       const AttentionMask& mask) {
  return forward_with_past(x, cos, sin, mask, at::Tensor(), at::Tensor());
}

at::Tensor LlamaAttentionImpl::forward_with_past(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                                 const AttentionMask& mask, const at::Tensor& past_k,
                                                 const at::Tensor& past_v, at::Tensor* k_all, at::Tensor* v_all) {
  const int64_t B = x.size(0), T = x.size(1), d = config.resolved_head_dim();
  const int64_t nh = config.num_attention_heads, nkv = config.num_key_value_heads;
  at::Tensor q = q_proj(x).view({B, T, nh, d}).transpose(1, 2);
  at::Tensor k = k_proj(x).view({B, T, nkv, d}).transpose(1, 2);
  at::Tensor v = v_proj(x).view({B, T, nkv, d}).transpose(1, 2);
  at::Tensor c = cos.unsqueeze(1).to(x.scalar_type());
  at::Tensor s = sin.unsqueeze(1).to(x.scalar_type());
  q = q * c + rotate_half(q) * s;
  k = k * c + rotate_half(k) * s;
  if (past_k.defined()) {
    ST_CHECK(past_k.dim() == 4 && past_k.size(0) == B && past_k.size(1) == nkv && past_k.size(3) == d &&
                 past_v.defined() && past_v.sizes() == past_k.sizes(),
             "cached keys ", past_k.sizes(), " do not fit new keys ", k.sizes());
    // Cached in the compute dtype of the call that produced them; a model
    // whose dtype changed since would mix dtypes in the matmul below.
    k = at::cat({past_k.to(k.scalar_type()), k}, 2);
    v = at::cat({past_v.to(v.scalar_type()), v}, 2);
  }
  if (k_all != nullptr) *k_all = k;
  if (v_all != nullptr) *v_all = v;
  // k and v keep their nkv heads: the kernel layer repeats them to nh only
  // where its kernel needs that, and checks that the mask covers the T
  // queries over the cached and new keys (kernels/mixed_attention.h).
  // Selective checkpointing only where there is a backward to recompute for:
  // under no-grad (KV-cached decoding, the engine's no-grad first pass with
  // full checkpointing) nothing is saved anyway and the plain path runs.
  const bool selective = checkpointing == ActivationCheckpointing::kSelective && at::GradMode::is_enabled() &&
                         kernels::attention_needs_grad(q, k, v);
  at::Tensor attn = selective ? checkpointed_core_attention(q, k, v, mask, core_attention_recomputations)
                              : core_attention(q, k, v, mask);
  at::Tensor out = attn.transpose(1, 2).reshape({B, T, nh * d});
  return o_proj(out);
}

LlamaMLPImpl::LlamaMLPImpl(const LlamaConfig& c) {
  gate_proj = register_module("gate_proj", linear(c.hidden_size, c.intermediate_size));
  up_proj = register_module("up_proj", linear(c.hidden_size, c.intermediate_size));
  down_proj = register_module("down_proj", linear(c.intermediate_size, c.hidden_size));
}

at::Tensor LlamaMLPImpl::forward(const at::Tensor& x) {
  return down_proj(at::silu(gate_proj(x)) * up_proj(x));
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaConfig& c) : Unit(c.decoder_layer_class_name()) {
  self_attn = register_module("self_attn", LlamaAttention(c));
  mlp = register_module("mlp", LlamaMLP(c));
  input_layernorm = register_module("input_layernorm", LlamaRMSNorm(c.hidden_size, c.rms_norm_eps));
  post_attention_layernorm = register_module("post_attention_layernorm", LlamaRMSNorm(c.hidden_size, c.rms_norm_eps));
}

at::Tensor LlamaDecoderLayerImpl::forward(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                                          const AttentionMask& mask) {
  // By value: with activation checkpointing the body runs again in backward.
  return run_unit(hidden, [this, cos, sin, mask](const at::Tensor& h) {
    at::Tensor x = h + self_attn(input_layernorm(h), cos, sin, mask);
    return x + mlp(post_attention_layernorm(x));
  });
}

at::Tensor LlamaDecoderLayerImpl::forward_cached(const at::Tensor& hidden, const at::Tensor& cos,
                                                 const at::Tensor& sin, const AttentionMask& mask,
                                                 const at::Tensor& past_k, const at::Tensor& past_v,
                                                 at::Tensor& k_all, at::Tensor& v_all) {
  // The body may run twice (activation checkpointing recomputes it in a
  // backward), so it does not touch the cache: it reads the past by value and
  // leaves the joined keys/values in `slot`, which a second run overwrites
  // with the same values. The caller commits them to the cache afterwards.
  auto slot = std::make_shared<std::pair<at::Tensor, at::Tensor>>();
  at::Tensor out = run_unit(hidden, [this, cos, sin, mask, past_k, past_v, slot](const at::Tensor& h) {
    at::Tensor x = h + self_attn->forward_with_past(input_layernorm(h), cos, sin, mask, past_k, past_v,
                                                    &slot->first, &slot->second);
    return x + mlp(post_attention_layernorm(x));
  });
  k_all = slot->first;
  v_all = slot->second;
  return out;
}

LlamaEmbeddingImpl::LlamaEmbeddingImpl(const LlamaConfig& c)
    : torch::nn::EmbeddingImpl(torch::nn::EmbeddingOptions(c.vocab_size, c.hidden_size)),
      Unit("Embedding", c.tie_word_embeddings ? Unit::Kind::kShared : Unit::Kind::kEdge) {}

at::Tensor LlamaEmbeddingImpl::forward(const at::Tensor& input_ids) {
  return run_unit(input_ids, [this](const at::Tensor& ids) { return torch::nn::EmbeddingImpl::forward(ids); });
}

LlamaLMHeadImpl::LlamaLMHeadImpl(const LlamaConfig& c)
    : shardtrain::nn::LinearImpl(torch::nn::LinearOptions(c.hidden_size, c.vocab_size).bias(false)),
      Unit("Linear", Unit::Kind::kEdge) {}

at::Tensor LlamaLMHeadImpl::forward(const at::Tensor& hidden) {
  return run_unit(hidden, [this](const at::Tensor& h) { return shardtrain::nn::LinearImpl::forward(h); });
}

namespace {

/// The mask of T new tokens at absolute positions first_query .. first_query
/// + T - 1 over the keys from position first_key on (cached ones, then the
/// new ones): key j is allowed to query i when it is not after it, within the
/// sliding window, and (document_ids [B,T] given, on any device) in the same
/// document: the same run of equal ids.
/// Causal, without a tensor, where nothing but the order limits the keys
/// (on a GPU where flash runs, also rows that each hold one document); as
/// packed sequences, whose tensor is built only if a kernel asks for it,
/// where FlashAttention's variable-length kernel will take them (no cached
/// keys, `compute` on a GPU in 16 bits).
AttentionMask attention_mask(const LlamaConfig& config, int64_t B, int64_t first_key, int64_t first_query, int64_t T,
                             const at::Tensor& document_ids, const at::TensorOptions& long_opts,
                             const at::Tensor& compute) {
  const bool window_limits = config.sliding_window && *config.sliding_window < T;
  const bool no_cached_keys = first_key == first_query;
  if (no_cached_keys && !window_limits && !document_ids.defined()) return AttentionMask::causal();
  std::optional<PackedSequences> packed;
  if (no_cached_keys && kernels::flash_attention_runs(compute.device(), compute.scalar_type(),
                                                      config.resolved_head_dim(), at::GradMode::is_enabled())) {
    const std::optional<int64_t> window =
        window_limits ? std::optional<int64_t>(*config.sliding_window) : std::nullopt;
    packed = packed_sequences(document_ids, B, T, compute.device(), window);
    // One document filling each row, no window: plain causal attention, which
    // SDPA's FlashAttention runs without offsets or a mask tensor.
    if (!window_limits && packed->cu_seqlens.size(0) == B + 1) return AttentionMask::causal();
  }
  // The documents' run numbers now (B x T, cheap): the mask may be built after
  // the caller has reused its ids buffer, and must agree with the offsets.
  const at::Tensor runs = document_ids.defined()
                              ? to_device_without_waiting(document_starts(document_ids).cumsum(1), long_opts.device())
                              : at::Tensor();
  auto build_allowed = [window = config.sliding_window, B, first_key, first_query, T, runs, long_opts] {
    const at::Tensor query_pos = at::arange(first_query, first_query + T, long_opts);
    const at::Tensor key_pos = at::arange(first_key, first_query + T, long_opts);
    const at::Tensor diff = query_pos.unsqueeze(1) - key_pos.unsqueeze(0);  // i - j in positions
    at::Tensor allowed = diff >= 0;
    if (window) allowed = allowed & (diff < *window);
    allowed = allowed.view({1, 1, T, key_pos.size(0)});
    if (!runs.defined()) return allowed.expand({B, 1, T, key_pos.size(0)});
    return allowed & (runs.unsqueeze(2) == runs.unsqueeze(1)).unsqueeze(1);
  };
  if (!packed) return AttentionMask(build_allowed());
  return AttentionMask::packed(std::move(*packed), std::move(build_allowed));
}

}  // namespace

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& c) : config(c) {
  c.validate();
  embed_tokens = register_module("embed_tokens", LlamaEmbedding(c));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers->push_back(LlamaDecoderLayer(c));
  norm = register_module("norm", LlamaRMSNorm(c.hidden_size, c.rms_norm_eps));
  inv_freq = rope_inv_freq(c);
}

void LlamaModelImpl::set_activation_checkpointing(ActivationCheckpointing mode) {
  for (auto& layer : *layers) layer->as<LlamaDecoderLayerImpl>()->self_attn->checkpointing = mode;
  checkpointing_ = mode;
}

int64_t LlamaModelImpl::core_attention_recomputations() const {
  int64_t total = 0;
  for (const auto& layer : *layers) {
    total += layer->as<LlamaDecoderLayerImpl>()->self_attn->core_attention_recomputations->load();
  }
  return total;
}

at::Tensor LlamaModelImpl::forward(const at::Tensor& input_ids, const at::Tensor& position_ids,
                                   const at::Tensor& document_ids) {
  ST_CHECK(input_ids.dim() == 2, "input_ids must be [B, T], got ", input_ids.sizes());
  const int64_t B = input_ids.size(0), T = input_ids.size(1);
  const auto long_opts = input_ids.options().dtype(at::kLong);
  if (document_ids.defined()) {
    ST_CHECK(document_ids.sizes() == input_ids.sizes(), "document_ids ", document_ids.sizes(),
             " must match input_ids ", input_ids.sizes());
  }
  at::Tensor positions;
  if (position_ids.defined()) {
    ST_CHECK(position_ids.sizes() == input_ids.sizes(), "position_ids ", position_ids.sizes(),
             " must match input_ids ", input_ids.sizes());
    positions = to_device_without_waiting(position_ids.to(at::kLong), input_ids.device());
  } else if (document_ids.defined()) {
    // Where the ids are, then moved: host ids never wait for the GPU.
    positions = to_device_without_waiting(positions_from_document_ids(document_ids), input_ids.device());
  } else {
    positions = at::arange(T, long_opts).unsqueeze(0).expand({B, T});
  }
  auto [cos, sin] = rope_cos_sin(positions, inv_freq);

  at::Tensor h = embed_tokens(input_ids);
  // document_ids as given: where they are on the host, the packed sequences
  // are found there without a round trip through the GPU.
  const AttentionMask mask = attention_mask(config, B, 0, 0, T, document_ids, long_opts, h);
  for (auto& layer : *layers) h = layer->as<LlamaDecoderLayerImpl>()->forward(h, cos, sin, mask);
  return norm(h);
}

at::Tensor LlamaModelImpl::forward_cached(const at::Tensor& input_ids, KVCache& cache) {
  ST_CHECK(input_ids.dim() == 2 && input_ids.size(1) > 0, "input_ids must be [B, T] with T > 0, got ",
           input_ids.sizes());
  const int64_t B = input_ids.size(0), T = input_ids.size(1);
  const int64_t L = static_cast<int64_t>(layers->size());
  const int64_t S = cache.cached_tokens();
  ST_CHECK(cache.start >= 0 && S >= 0, "KVCache: start ", cache.start, " is past length ", cache.length);
  if (cache.length == 0) {
    cache.keys.assign(static_cast<std::size_t>(L), at::Tensor());
    cache.values.assign(static_cast<std::size_t>(L), at::Tensor());
  }
  ST_CHECK(static_cast<int64_t>(cache.keys.size()) == L && static_cast<int64_t>(cache.values.size()) == L,
           "KVCache holds ", cache.keys.size(), " layers, the model has ", L, " (a cache of another model?)");
  if (S > 0 && L > 0) {
    ST_CHECK(cache.keys[0].defined() && cache.keys[0].size(2) == S, "KVCache: ", S,
             " tokens should be cached, the keys hold ", cache.keys[0].defined() ? cache.keys[0].size(2) : 0);
    ST_CHECK(cache.keys[0].size(0) == B, "KVCache was filled with batch size ", cache.keys[0].size(0),
             ", this call has ", B);
  }
  const auto long_opts = input_ids.options().dtype(at::kLong);
  // Positions continue after the cached tokens.
  at::Tensor query_pos = at::arange(cache.length, cache.length + T, long_opts);
  auto [cos, sin] = rope_cos_sin(query_pos.unsqueeze(0).expand({B, T}), inv_freq);
  std::vector<at::Tensor> keys(static_cast<std::size_t>(L)), values(static_cast<std::size_t>(L));
  at::Tensor h = embed_tokens(input_ids);
  const AttentionMask mask = attention_mask(config, B, cache.start, cache.length, T, at::Tensor(), long_opts, h);
  for (int64_t l = 0; l < L; ++l) {
    const auto i = static_cast<std::size_t>(l);
    h = (*layers)[i]->as<LlamaDecoderLayerImpl>()->forward_cached(h, cos, sin, mask, cache.keys[i],
                                                                   cache.values[i], keys[i], values[i]);
  }
  at::Tensor out = norm(h);

  // Commit. With a sliding window W the next query (position length + T)
  // sees only keys after length + T - W: keep the last W - 1.
  const int64_t total = S + T;
  const int64_t keep = config.sliding_window ? std::min<int64_t>(total, *config.sliding_window - 1) : total;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    cache.keys[i] = keep == total ? keys[i] : keys[i].slice(2, total - keep).contiguous();
    cache.values[i] = keep == total ? values[i] : values[i].slice(2, total - keep).contiguous();
  }
  cache.length += T;
  cache.start = cache.length - keep;
  return out;
}

LlamaForCausalLMImpl::LlamaForCausalLMImpl(const LlamaConfig& c) : config(c) {
  model = register_module("model", LlamaModel(c));
  if (!c.tie_word_embeddings) lm_head = register_module("lm_head", LlamaLMHead(c));
  // transformers' _init_weights: normal(0, initializer_range) for matrices, ones for norms.
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters()) {
    at::Tensor p = item.value();
    if (p.dim() >= 2) p.normal_(0.0, c.initializer_range);
    else p.fill_(1.0);
  }
}

at::Tensor LlamaForCausalLMImpl::forward(const at::Tensor& input_ids, const at::Tensor& position_ids,
                                         const at::Tensor& document_ids) {
  at::Tensor h = model(input_ids, position_ids, document_ids);
  at::Tensor logits = lm_head ? lm_head(h) : shardtrain::nn::linear(h, model->embed_tokens->weight);
  return logits.to(at_least_fp32(logits.scalar_type()));
}

at::Tensor LlamaForCausalLMImpl::forward_cached(const at::Tensor& input_ids, KVCache& cache) {
  at::Tensor h = model->forward_cached(input_ids, cache);
  at::Tensor logits = lm_head ? lm_head(h) : shardtrain::nn::linear(h, model->embed_tokens->weight);
  return logits.to(at_least_fp32(logits.scalar_type()));
}

namespace {

at::Tensor next_token_cross_entropy(const at::Tensor& logits, const at::Tensor& input_ids, int64_t ignore_index,
                                    at::Reduction::Reduction reduction) {
  ST_CHECK(logits.dim() == 3 && input_ids.dim() == 2 && logits.size(0) == input_ids.size(0) &&
               logits.size(1) == input_ids.size(1),
           "causal_lm_loss: logits ", logits.sizes(), " do not match input_ids ", input_ids.sizes());
  const int64_t V = logits.size(2), T = logits.size(1);
  at::Tensor shifted = logits.slice(1, 0, T - 1).to(at_least_fp32(logits.scalar_type())).reshape({-1, V});
  at::Tensor targets = input_ids.slice(1, 1).reshape({-1}).to(at::kLong);
  return at::cross_entropy_loss(shifted, targets, /*weight=*/{}, reduction, ignore_index);
}

}  // namespace

at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& input_ids, int64_t ignore_index) {
  return next_token_cross_entropy(logits, input_ids, ignore_index, at::Reduction::Mean);
}

at::Tensor causal_lm_loss_sum(const at::Tensor& logits, const at::Tensor& input_ids, int64_t ignore_index) {
  return next_token_cross_entropy(logits, input_ids, ignore_index, at::Reduction::Sum);
}

int64_t count_loss_tokens(const at::Tensor& labels, int64_t ignore_index) {
  ST_CHECK(labels.dim() == 2, "count_loss_tokens: labels must be [batch, seq], got ", labels.sizes());
  return labels.slice(1, 1).ne(ignore_index).sum().item<int64_t>();
}

// ---- Hugging Face weights ---------------------------------------------------

std::vector<std::pair<std::string, at::Tensor>> hf_state_dict(LlamaForCausalLM& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& item : model->named_parameters(/*recurse=*/true)) {
    if (item.value().defined()) out.emplace_back(item.key(), item.value());
  }
  return out;
}

void load_hf_weights(LlamaForCausalLM& model, const std::string& model_dir) {
  // The same reader as sliced loading: one parser of model.safetensors.index.json.
  const HfCheckpoint checkpoint(model_dir);
  checkpoint.check_against(*model);  // every parameter present with its shape, before anything changes
  torch::NoGradGuard no_grad;
  for (auto& [name, param] : hf_state_dict(model)) {
    checkpoint.read_slice(name, 0, param.numel(), param.view({-1}));  // converted to the parameter's dtype
  }
}

}  // namespace shardtrain::models
