#pragma once
/// @file models/llama.h
/// Llama and Mistral decoder-only language models with Hugging Face
/// parameter names, so checkpoints from the Hub load with load_hf_weights()
/// and hf_state_dict() names match the safetensors files one to one.
///
/// The math follows transformers' modeling_llama.py / modeling_mistral.py
/// (eager attention): RMSNorm in fp32, rotate_half RoPE (default, "linear"
/// and "llama3" scaling), grouped-query attention, fp32 softmax, SwiGLU MLP,
/// Mistral's sliding window. Each decoder layer is a shardtrain::Unit named
/// "LlamaDecoderLayer" or "MistralDecoderLayer" (by model_type), which is what
/// `fsdp_transformer_layer_cls_to_wrap` selects.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "shardtrain/nn/linear.h"
#include "shardtrain/unit.h"

namespace shardtrain::models {

/// Activation checkpointing the model does itself, inside each decoder layer.
///
/// FULL checkpointing (recompute a whole decoder layer in backward) belongs to
/// the sharding engine, which owns the units (fsdp_activation_checkpointing,
/// or gradient_checkpointing for ZeRO). SELECTIVE is Megatron-LM's selective
/// recomputation (Korthikanti et al. 2022, "Reducing Activation Recomputation
/// in Large Transformer Models"): only the core attention, whose saved
/// activations (scores/probabilities) are O(B * heads * T^2), is recomputed in
/// backward; projections, norms and the MLP keep their activations. The two
/// compose. Not a config.json field: set it with
/// LlamaForCausalLMImpl::set_activation_checkpointing().
enum class ActivationCheckpointing {
  kNone,       ///< autograd keeps every activation it needs
  kSelective,  ///< recompute the core attention in backward
};

/// "none" or "selective"; throws shardtrain::ConfigError naming the accepted values.
ActivationCheckpointing parse_activation_checkpointing(const std::string& name);
/// "none" or "selective".
std::string to_string(ActivationCheckpointing mode);

/// Sequences packed one after another into a batch's B rows of T tokens (the
/// rows laid end to end, B*T tokens), as FlashAttention's variable-length
/// kernel takes them.
struct PackedSequences {
  /// int32 [count + 1] on the batch's device: sequence s holds tokens
  /// cu_seqlens[s] .. cu_seqlens[s+1]-1.
  at::Tensor cu_seqlens;
  int64_t max_seqlen = 0;  ///< the longest sequence's length
  /// Each query attends at most this many keys, itself included (a sliding
  /// window); none: every earlier key of its sequence.
  std::optional<int64_t> window;
};

/// The sequences of a batch: a new one starts at each row and wherever
/// document_ids [rows, tokens] changes from the token before (undefined
/// document_ids: one sequence per row). cu_seqlens lands on `device`; built
/// on the host, so ids on a GPU cost one synchronisation.
PackedSequences packed_sequences(const at::Tensor& document_ids, int64_t rows, int64_t tokens,
                                 const at::Device& device, std::optional<int64_t> window);

/// Which keys each query may attend to; built once per forward by the model
/// and shared by its layers.
class AttentionMask {
 public:
  /// Query i attends keys 0..i of the same T tokens and nothing else limits
  /// it (no cached keys, packed documents or sliding window shorter than T).
  /// The attention then runs without a mask tensor: the kernels skip the
  /// masked half of the scores, and on a GPU FlashAttention can run.
  static AttentionMask causal() { return AttentionMask(); }
  /// allowed [B,1,T,S] bool (true: may attend), broadcast over the heads.
  AttentionMask(at::Tensor allowed);  // NOLINT(google-explicit-constructor): a mask tensor is an AttentionMask
  bool is_causal() const { return !allowed_.defined() && !packed_; }
  /// The mask tensor (a packed mask's is built on the first call, once for
  /// every copy of it); undefined where is_causal().
  const at::Tensor& allowed() const;

  /// Causal attention within packed sequences (documents, a sliding window,
  /// or both; no cached keys). Where FlashAttention's variable-length kernel
  /// runs (a GPU, 16 bits) the attention takes this form and no mask tensor
  /// is ever made: it would take B*T*T bytes (1 GiB for one row of 32768
  /// tokens), for nothing.
  /// Elsewhere `build_allowed` makes the [B,1,T,T] tensor that says the same.
  static AttentionMask packed(PackedSequences sequences, std::function<at::Tensor()> build_allowed);
  /// The packed form, where the mask has one; nullptr otherwise.
  const PackedSequences* packed_sequences() const;

 private:
  /// A packed mask's sequences and its tensor, made on first use; shared by
  /// the copies of the mask (every layer's, autograd's), so it is made once.
  struct Packed;
  AttentionMask() = default;
  at::Tensor allowed_;
  std::shared_ptr<Packed> packed_;
};

/// The core attention: softmax(q k^T / sqrt(d) masked) v, the softmax in fp32
/// and its result cast back to q's dtype. q [B,heads,T,d]; k/v [B,kv_heads,S,d]
/// after RoPE, kv_heads dividing heads (grouped-query attention; the kernel
/// layer repeats them where its kernel needs it). Returns [B,heads,T,d].
at::Tensor core_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionMask& mask);

/// core_attention() as an autograd function that saves only its inputs (q, k,
/// v, the mask) and recomputes the scores and probabilities in backward, then
/// differentiates through them. It has no parameters, so it works unchanged
/// when a sharding engine gathers and frees them. When `recomputations` is
/// given it is incremented once per backward recomputation. Double backward
/// (create_graph) through it is not supported and throws shardtrain::Error.
at::Tensor checkpointed_core_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const AttentionMask& mask,
                                       std::shared_ptr<std::atomic<int64_t>> recomputations = nullptr);

/// config.json's "rope_scaling".
struct RopeScaling {
  /// "linear" or "llama3" ("type" or "rope_type" in the JSON).
  std::string type = "linear";
  double factor = 1.0;
  // llama3 only:
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

/// The fields of a Hugging Face LlamaConfig / MistralConfig that the model uses.
struct LlamaConfig {
  std::string model_type = "llama";  // "llama" or "mistral"
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;
  /// 0: hidden_size / num_attention_heads (config.json's optional "head_dim").
  int64_t head_dim = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  int64_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;
  /// Mistral: a query at position i attends to keys j with i - sliding_window < j <= i.
  std::optional<int64_t> sliding_window;
  std::optional<RopeScaling> rope_scaling;
  int64_t bos_token_id = 1;
  /// First id when config.json lists several.
  int64_t eos_token_id = 2;
  /// The ids after the first when config.json lists several (Llama 3's
  /// instruct models end a turn with one and a text with another); generation
  /// stops at any of them, as transformers' generate() does.
  std::vector<int64_t> other_eos_token_ids;
  /// Standard deviation of the random init (weights not loaded from a checkpoint).
  double initializer_range = 0.02;

  int64_t resolved_head_dim() const { return head_dim > 0 ? head_dim : hidden_size / num_attention_heads; }
  /// "LlamaDecoderLayer" or "MistralDecoderLayer".
  std::string decoder_layer_class_name() const;
  /// Throws shardtrain::ConfigError on inconsistent values (heads not dividing, ...).
  void validate() const;

  /// Parses a Hugging Face config.json; throws shardtrain::ConfigError naming
  /// the file and field on errors. Missing fields take transformers' defaults.
  static LlamaConfig from_json_file(const std::string& path);
  static LlamaConfig from_json_string(const std::string& json, const std::string& source = "<string>");
};

/// The rotary inverse frequencies [head_dim / 2] (fp32) after rope_scaling,
/// as transformers' ROPE_INIT_FUNCTIONS compute them.
at::Tensor rope_inv_freq(const LlamaConfig& config);

struct LlamaRMSNormImpl : torch::nn::Module {
  LlamaRMSNormImpl(int64_t hidden, double eps);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
  double eps;
};
TORCH_MODULE(LlamaRMSNorm);

struct LlamaAttentionImpl : torch::nn::Module {
  explicit LlamaAttentionImpl(const LlamaConfig& config);
  /// x [B,T,H]; cos/sin [B,T,head_dim]; mask over T queries and T keys.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const AttentionMask& mask);
  /// Attention of the new tokens x [B,T,H] over S earlier tokens' keys/values
  /// past_k/past_v [B,num_key_value_heads,S,head_dim] (after RoPE; undefined:
  /// S = 0) and their own; mask over T queries and S+T keys. When k_all/v_all are given they
  /// receive past ++ new keys/values [B,num_key_value_heads,S+T,head_dim].
  at::Tensor forward_with_past(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                               const AttentionMask& mask, const at::Tensor& past_k, const at::Tensor& past_v,
                               at::Tensor* k_all = nullptr, at::Tensor* v_all = nullptr);
  LlamaConfig config;
  shardtrain::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  /// kSelective: while grad mode is on, the core attention goes through
  /// checkpointed_core_attention(); no-grad calls (KV-cached decoding, the
  /// engine's no-grad first pass under full checkpointing) run it plainly.
  ActivationCheckpointing checkpointing = ActivationCheckpointing::kNone;
  /// Backward recomputations of this layer's core attention so far.
  std::shared_ptr<std::atomic<int64_t>> core_attention_recomputations = std::make_shared<std::atomic<int64_t>>(0);
};
TORCH_MODULE(LlamaAttention);

struct LlamaMLPImpl : torch::nn::Module {
  explicit LlamaMLPImpl(const LlamaConfig& config);
  at::Tensor forward(const at::Tensor& x);
  shardtrain::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(LlamaMLP);

/// One pre-norm decoder layer; a sharding unit.
struct LlamaDecoderLayerImpl : torch::nn::Module, shardtrain::Unit {
  explicit LlamaDecoderLayerImpl(const LlamaConfig& config);
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                     const AttentionMask& mask);
  /// The KV-cached form (see KVCache): hidden [B,T,H] are the new tokens,
  /// the mask covers the S cached keys past_k/past_v (undefined
  /// when S = 0) and the new ones. Sets k_all/v_all to the keys/values of all
  /// S+T tokens. Runs through run_unit() like forward(), so a sharding engine
  /// gathers the layer's parameters around it.
  at::Tensor forward_cached(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                            const AttentionMask& mask, const at::Tensor& past_k, const at::Tensor& past_v,
                            at::Tensor& k_all, at::Tensor& v_all);
  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};
  LlamaRMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
};
TORCH_MODULE(LlamaDecoderLayer);

/// Keys and values of the tokens a model has consumed, per decoder layer, for
/// incremental decoding with LlamaForCausalLMImpl::forward_cached().
///
/// A fresh (default) cache is empty; the first forward_cached() call sizes it
/// to the model's layers and batch. Each call appends the new tokens: their
/// RoPE positions continue at `length`, and they attend causally to every
/// cached key and to each other.
///
/// Mistral's sliding window W (a query at position i sees keys j with
/// i - W < j <= i) is kept by DROPPING keys: after each call only the last
/// W - 1 positions stay cached (the next query, at position `length`, sees no
/// older key), so a window model's cache never grows past W - 1 + T_new
/// entries. Within one call the window is also masked, so a prefill longer
/// than W computes exactly what the full forward does.
struct KVCache {
  /// Per layer [B, num_key_value_heads, S, head_dim] (after RoPE, before the
  /// grouped-query repeat); empty before the first call.
  std::vector<at::Tensor> keys, values;
  /// Tokens consumed so far: the position of the next token.
  int64_t length = 0;
  /// Position of the first cached key (0 unless a sliding window dropped some).
  int64_t start = 0;

  /// S: keys held per layer (length - start).
  int64_t cached_tokens() const { return length - start; }
  void reset() {
    keys.clear();
    values.clear();
    length = 0;
    start = 0;
  }
};

/// The token embeddings (`model.embed_tokens`), a sharding unit of their own,
/// so that an engine gathers the vocabulary-sized table only around its
/// forward rather than for the whole step, as DeepSpeed's ZeRO-3 and FSDP2
/// users' `fully_shard(model.embed_tokens)` do (they gather it for the
/// backward too, which reads only the ids). The unit class name
/// is "Embedding", Hugging Face's (nn.Embedding), so one wrap list means the
/// same in Accelerate and here. Tied to the output head it is
/// Unit::Kind::kShared and stays in the root unit.
struct LlamaEmbeddingImpl : torch::nn::EmbeddingImpl, shardtrain::Unit {
  explicit LlamaEmbeddingImpl(const LlamaConfig& config);
  /// input_ids [B,T] int64 -> [B,T,H].
  at::Tensor forward(const at::Tensor& input_ids);
  /// A lookup: its backward needs the ids and the table's shape, not its values.
  bool backward_reads_parameters() const override { return false; }
};
TORCH_MODULE(LlamaEmbedding);

/// The output head (`lm_head`, untied models only), a sharding unit for the
/// same reason. Unit class name "Linear", Hugging Face's (nn.Linear); the
/// decoder layers' Linear layers are no units, they belong to their layer's.
struct LlamaLMHeadImpl : shardtrain::nn::LinearImpl, shardtrain::Unit {
  explicit LlamaLMHeadImpl(const LlamaConfig& config);
  /// hidden [B,T,H] -> logits [B,T,vocab] in hidden's dtype.
  at::Tensor forward(const at::Tensor& hidden);
};
TORCH_MODULE(LlamaLMHead);

/// Embeddings, decoder layers and the final norm ("model." in HF names).
struct LlamaModelImpl : torch::nn::Module {
  explicit LlamaModelImpl(const LlamaConfig& config);
  /// Returns the final normed hidden states [B,T,H]. See LlamaForCausalLMImpl::forward.
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& position_ids = {},
                     const at::Tensor& document_ids = {});
  /// Final normed hidden states [B,T_new,H] of the new tokens; appends them to `cache`.
  at::Tensor forward_cached(const at::Tensor& input_ids, KVCache& cache);
  /// Sets every decoder layer's mode (see ActivationCheckpointing).
  void set_activation_checkpointing(ActivationCheckpointing mode);
  ActivationCheckpointing activation_checkpointing() const { return checkpointing_; }
  /// Core-attention recomputations in backward, summed over the layers, since construction.
  int64_t core_attention_recomputations() const;
  LlamaConfig config;
  LlamaEmbedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  LlamaRMSNorm norm{nullptr};
  at::Tensor inv_freq;  // buffer-like, not a parameter and not in the state dict

 private:
  ActivationCheckpointing checkpointing_ = ActivationCheckpointing::kNone;
};
TORCH_MODULE(LlamaModel);

/// The model with its LM head: LlamaForCausalLM / MistralForCausalLM.
struct LlamaForCausalLMImpl : torch::nn::Module {
  explicit LlamaForCausalLMImpl(const LlamaConfig& config);
  /// input_ids [B,T] int64 -> logits [B,T,vocab] fp32.
  /// position_ids [B,T] (default: 0..T-1, or restarting at each document when
  /// document_ids is given). document_ids [B,T] int64: packed sequences; a
  /// document is a run of equal ids (an id that recurs after another starts a
  /// new document), and a token attends only to earlier tokens of its own.
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& position_ids = {},
                     const at::Tensor& document_ids = {});
  /// Incremental decoding: input_ids [B,T_new] int64 are the tokens after the
  /// ones `cache` holds (a whole prompt, or one token at a time); returns their
  /// logits [B,T_new,vocab] fp32, equal to the matching rows of forward() over
  /// the whole sequence, and appends them to `cache` (see KVCache). B must
  /// stay the same for one cache. The cache is changed only when the call
  /// succeeds. Meant for inference (torch::NoGradGuard); each decoder layer
  /// still runs through run_unit(), so a model prepared by an Accelerator
  /// works: call it through PreparedModel::run().
  at::Tensor forward_cached(const at::Tensor& input_ids, KVCache& cache);
  /// Selective activation checkpointing per decoder layer (default kNone).
  /// Independent of, and composable with, the engine's full checkpointing.
  void set_activation_checkpointing(ActivationCheckpointing mode) { model->set_activation_checkpointing(mode); }
  ActivationCheckpointing activation_checkpointing() const { return model->activation_checkpointing(); }
  /// Core-attention recomputations in backward so far (all layers).
  int64_t core_attention_recomputations() const { return model->core_attention_recomputations(); }
  LlamaConfig config;
  LlamaModel model{nullptr};
  /// Null when config.tie_word_embeddings (logits then use model->embed_tokens).
  LlamaLMHead lm_head{nullptr};
};
TORCH_MODULE(LlamaForCausalLM);

/// Mean next-token cross entropy: logits[:, :-1] against input_ids[:, 1:]
/// (targets equal to ignore_index are skipped), computed in fp32.
at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& input_ids, int64_t ignore_index = -100);

/// The same cross entropy summed over the counted targets instead of averaged:
/// the numerator of a loss normalised over a global token count
/// (Accelerator::backward with LossNormalization::kGlobalTokens).
at::Tensor causal_lm_loss_sum(const at::Tensor& logits, const at::Tensor& input_ids, int64_t ignore_index = -100);

/// How many targets causal_lm_loss counts in `labels`: positions 1.. that are
/// not ignore_index.
int64_t count_loss_tokens(const at::Tensor& labels, int64_t ignore_index = -100);

/// FLOPs of one trained token (forward + backward), PaLM's estimate:
/// 6 x (matmul parameters) + 12 x layers x hidden x sequence (attention
/// scores); recomputation is not counted. `num_params`: all parameters.
/// `trained_matmul_params` (>= 0: a LoRA run, the adapters' parameters):
/// frozen weights get no weight gradient, so a matmul parameter costs 4
/// (forward, input gradient) and only a trained one 2 more.
double training_flops_per_token(const LlamaConfig& config, int64_t num_params, int64_t seq_len,
                                int64_t trained_matmul_params = -1);

/// Positions restarting at 0 at every change of document id along dim 1 (a
/// document is a run of equal ids).
at::Tensor positions_from_document_ids(const at::Tensor& document_ids);

/// Parameters under their Hugging Face names, in registration order.
std::vector<std::pair<std::string, at::Tensor>> hf_state_dict(LlamaForCausalLM& model);

/// Loads model_dir/model.safetensors, or the shards that
/// model_dir/model.safetensors.index.json maps. Every parameter must be present
/// with the right shape (shardtrain::Error names the parameter and the file
/// otherwise); values are converted to each parameter's dtype. Extra tensors
/// in the files (e.g. rotary inv_freq) are ignored.
void load_hf_weights(LlamaForCausalLM& model, const std::string& model_dir);

}  // namespace shardtrain::models
