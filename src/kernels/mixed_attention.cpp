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

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "kernels/mixed_gemm.h"
#include "kernels/recompute.h"
#include "shardtrain/error.h"

namespace shardtrain::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor fp32_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& attend) {
  return at::scaled_dot_product_attention(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), attend,
                                          /*dropout_p=*/0.0, /*is_causal=*/false);
}

struct WidenedAttention : torch::autograd::Function<WidenedAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& attend) {
    ctx->save_for_backward({q, k, v, attend});
    return fp32_attention(q, k, v, attend).to(q.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, const variable_list& grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor attend = saved[3];
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
  return WidenedAttention::apply(q, k, v, attend);
}

}  // namespace

at::Tensor widened_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& attend) {
  ST_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
           "widened_attention: q, k and v must share one dtype, got ", q.scalar_type(), ", ", k.scalar_type(),
           ", ", v.scalar_type());
  return widened(q, k, v, attend);
}

at::Tensor mixed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& attend) {
  if (!widens_gemm(q) || k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type()) {
    return at::scaled_dot_product_attention(q, k, v, attend, /*dropout_p=*/0.0, /*is_causal=*/false);
  }
  return widened(q, k, v, attend);
}

}  // namespace shardtrain::kernels
