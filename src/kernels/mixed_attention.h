#pragma once
// The kernel layer's mixed-precision attention: softmax(q k^T / sqrt(d),
// masked) v through LibTorch's scaled_dot_product_attention, except where a
// bf16/fp16 GEMM is widened (widens_gemm: a CPU without native bf16, and fp16
// on every CPU). There LibTorch's low-precision CPU attention kernel runs its
// two products through the generic scalar GEMM (28.5% of the CPU time of a
// bf16 training run of the 58M Llama on an emulated AVX2-only CPU), so the
// attention is computed in fp32 on the widened inputs and its output rounded
// once to the input dtype: the products in fp32 accumulation as a native
// kernel has them, the probabilities unrounded.
// Also decided here, once: causal attention goes to the kernels without a
// mask, and grouped key/value heads are repeated for the kernel unless it
// takes them as they are (mixed_attention.cpp says where).

#include <ATen/core/Tensor.h>

namespace shardtrain::kernels {

/// q [B,heads,T,d]; k and v [B,kv_heads,S,d] of q's dtype, kv_heads dividing
/// heads (grouped-query attention, as Llama groups: key/value head j serves
/// query heads j*g .. j*g+g-1, g = heads / kv_heads). `attend` [B,1,T,S] bool
/// (true: may attend), broadcast over the heads, or undefined for causal
/// attention (T == S, query i attends keys 0..i). Returns [B,heads,T,d].
/// Differentiable. Shapes that do not fit throw shardtrain::Error.
at::Tensor mixed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& attend);

/// The widened path itself, whatever the process chose (tests, benchmarks);
/// the arguments as mixed_attention's.
at::Tensor widened_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& attend);

/// Throws shardtrain::Error unless q, k, v and `attend` have shapes the
/// attention functions take (mixed_attention's contract; an undefined
/// `attend` is causal and needs as many keys as queries).
void check_attention_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& attend);
/// Throws shardtrain::Error, naming `kernel`, unless q, k and v share one dtype.
void check_attention_dtypes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* kernel);

/// Whether mixed_attention hands q's device kernel the grouped key/value
/// heads as they are (SDPA's enable_gqa) rather than repeated to q's heads.
bool attention_takes_grouped_heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& attend);

}  // namespace shardtrain::kernels
