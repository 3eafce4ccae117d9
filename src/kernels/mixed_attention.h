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

#include <ATen/core/Tensor.h>

namespace shardtrain::kernels {

/// q/k/v [B,heads,T|S,d] of one dtype, `attend` [B,1,T,S] bool (true: may
/// attend), broadcast over the heads; returns [B,heads,T,d]. Differentiable.
at::Tensor mixed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& attend);

/// The widened path itself, whatever the process chose (tests, benchmarks).
at::Tensor widened_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& attend);

}  // namespace shardtrain::kernels
