// Mixed-precision attention (mixed_attention.h). The widened path is an
// autograd function that saves only its low-precision inputs and, in
// backward, recomputes the fp32 attention from them and differentiates it
// (recompute.h): autograd through the casts would save fp32 copies of q, k,
// v and the output instead, twice the bytes of the bf16 activations a native
// kernel keeps.
// The recomputed forward costs one fp32 attention forward per step, at fp32
// GEMM speed. Inside a recomputation (selective activation checkpointing
// reruns the core attention in backward) the graph is differentiated at once,
// so there the attention goes through the casts by plain autograd: the same
// bits (UnitMixedAttention), without recomputing it a second time.
#include "kernels/mixed_attention.h"

#include <optional>

#include <ATen/ATen.h>
#include <ATen/SDPBackend.h>
#include <torch/autograd.h>

#include "kernels/mixed_gemm.h"
#include "kernels/recompute.h"
#include "shardtrain/error.h"

namespace shardtrain::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

/// LibTorch's attention; an undefined `attend` is causal, without a mask
/// tensor: SDPA's kernels then skip the masked half of the scores (on the CPU
/// the same bits as the masked call, 2 to 4% less time at T 256 by
/// scripts/bench_causal_attention.py) and a GPU may run
/// FlashAttention, which takes no mask. k/v with fewer heads than q are
/// passed as grouped (enable_gqa).
at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& attend) {
  const bool causal = !attend.defined();
  return at::scaled_dot_product_attention(q, k, v, causal ? std::nullopt : std::optional<at::Tensor>(attend),
                                          /*dropout_p=*/0.0, /*is_causal=*/causal, /*scale=*/std::nullopt,
                                          /*enable_gqa=*/k.size(1) != q.size(1));
}

at::Tensor fp32_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& attend) {
  return sdpa(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), attend);
}

/// k or v [B,kv_heads,S,d] repeated to `heads`, each key/value head serving
/// its consecutive group of query heads.
at::Tensor repeat_kv_heads(const at::Tensor& kv, int64_t heads) {
  const int64_t B = kv.size(0), kv_heads = kv.size(1), S = kv.size(2), d = kv.size(3);
  if (kv_heads == heads) return kv;
  return kv.unsqueeze(2).expand({B, kv_heads, heads / kv_heads, S, d}).reshape({B, heads, S, d});
}

}  // namespace

void check_attention_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& attend) {
  ST_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attention: q, k and v must be [B, heads, tokens, d], got ",
           q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  ST_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(3) == q.size(3) && k.size(1) > 0 &&
               q.size(1) % k.size(1) == 0,
           "attention: k ", k.sizes(), " and v ", v.sizes(), " must match each other and q ", q.sizes(),
           " in batch and head size, with a number of heads that divides q's");
  if (attend.defined()) {
    ST_CHECK(attend.dim() == 4 && attend.size(-2) == q.size(2) && attend.size(-1) == k.size(2),
             "attention mask ", attend.sizes(), " does not cover ", q.size(2), " queries over ", k.size(2), " keys");
  } else {
    ST_CHECK(q.size(2) == k.size(2), "causal attention needs as many keys as queries, got ", q.size(2),
             " queries over ", k.size(2), " keys; pass a mask for cached keys");
  }
}

void check_attention_dtypes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* kernel) {
  ST_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), kernel,
           ": q, k and v must share one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type());
}

namespace {

struct WidenedAttention : torch::autograd::Function<WidenedAttention> {
  /// `attend` is optional where it is causal: autograd takes an undefined
  /// tensor argument for a variable and refuses it.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& attend) {
    ctx->save_for_backward({q, k, v});
    ctx->saved_data["attend"] = attend;  // a bool mask: no gradient, never written in place
    return fp32_attention(q, k, v, attend.value_or(at::Tensor())).to(q.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, const variable_list& grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor attend = ctx->saved_data["attend"].toOptional<at::Tensor>().value_or(at::Tensor());
    // The gradients arrive through the casts' backward: fp32 products, each
    // rounded once to its input's dtype.
    variable_list result = recomputed_gradients(
        {saved[0], saved[1], saved[2]},
        [&](const std::vector<at::Tensor>& qkv) { return fp32_attention(qkv[0], qkv[1], qkv[2], attend); },
        grads[0].defined() ? grads[0].to(at::kFloat) : at::Tensor(), "shardtrain's widened bf16/fp16 attention");
    result.emplace_back();  // attend
    return result;
  }
};

/// The widened path: the saving autograd function, or inside a recomputation
/// plain autograd through the casts.
at::Tensor widened(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& attend) {
  if (in_recomputation()) return fp32_attention(q, k, v, attend).to(q.scalar_type());
  return WidenedAttention::apply(q, k, v, attend.defined() ? std::optional<at::Tensor>(attend) : std::nullopt);
}

}  // namespace

bool attention_takes_grouped_heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& attend) {
  // FlashAttention (and cuDNN's attention) read each key/value head once for
  // its group of query heads, where repeating them first would copy K and V
  // and keep the copies for backward. Causal attention on a GPU asks SDPA
  // which kernel it would pick for the grouped heads: any fused one takes
  // them as they are. Where only the math kernel would (no flash for this
  // GPU, dtype or head size: the memory-efficient kernel takes no grouped
  // heads in torch 2.11), or with a mask, the heads are repeated, so the
  // memory-efficient kernel runs instead of one that stores every score.
  // The CPU repeats them too: its kernels give the same bits on repeated
  // heads (measured with this torch) but sum a grouped head's key/value
  // gradients in another order.
  if (!q.is_cuda() || attend.defined() || k.size(1) == q.size(1)) return false;
  const int64_t choice = at::_fused_sdp_choice(q, k, v, std::nullopt, /*dropout_p=*/0.0, /*is_causal=*/true,
                                               /*scale=*/std::nullopt, /*enable_gqa=*/true);
  return choice != static_cast<int64_t>(at::SDPBackend::math) &&
         choice != static_cast<int64_t>(at::SDPBackend::error);
}

at::Tensor widened_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& attend) {
  check_attention_shapes(q, k, v, attend);
  check_attention_dtypes(q, k, v, "widened_attention");
  const int64_t heads = q.size(1);
  return widened(q, repeat_kv_heads(k, heads), repeat_kv_heads(v, heads), attend);
}

at::Tensor mixed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& attend) {
  check_attention_shapes(q, k, v, attend);
  if (!widens_gemm(q) || k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type()) {
    if (attention_takes_grouped_heads(q, k, v, attend)) return sdpa(q, k, v, attend);
    return sdpa(q, repeat_kv_heads(k, q.size(1)), repeat_kv_heads(v, q.size(1)), attend);
  }
  return widened_attention(q, k, v, attend);
}

}  // namespace shardtrain::kernels
