#pragma once
/// @file nn/attention.h
/// Scaled dot-product attention that trains in bf16/fp16 at fp32 speed on any
/// CPU: the attention counterpart of shardtrain/nn/linear.h, governed by the
/// same per-process choice (`cpu_low_precision_gemm()`).
///
/// Why: LibTorch's CPU attention kernel runs its two matrix products in bf16
/// through the generic scalar GEMM on a CPU without native bf16 (every
/// AVX2-only CPU), where it took 28.5% of the CPU time of a bf16 training run
/// of the 58M Llama (docs/benchmarks.md).
/// Where the GEMM is widened, this computes the attention in fp32 on the
/// widened q, k, v and rounds the output once to their dtype; backward
/// recomputes the fp32 attention from the saved bf16 inputs (no fp32 copies
/// are kept between forward and backward) and rounds each gradient once.
/// Elsewhere (CUDA, a CPU with native bf16, fp32/fp64) it is
/// at::scaled_dot_product_attention itself.

#include <ATen/core/Tensor.h>

namespace shardtrain::nn {

/// softmax(q k^T / sqrt(d), masked) v, as at::scaled_dot_product_attention
/// with `attend` as its boolean mask (true: may attend; [B,1,T,S], broadcast
/// over the heads), no dropout, not causal beyond the mask. q [B,heads,T,d];
/// k and v [B,kv_heads,S,d] of q's dtype, kv_heads dividing heads
/// (grouped-query attention: key/value head j serves query heads j*g ..
/// j*g+g-1, g = heads / kv_heads, as Llama groups them). `attend` must be
/// defined (an undefined one throws shardtrain::Error naming
/// causal_scaled_dot_product_attention); so must shapes that fit. Double
/// backward through the widened path throws shardtrain::Error.
at::Tensor scaled_dot_product_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& attend);

/// The same for causal attention without a mask tensor: k and v have as many
/// tokens as q, and query i attends keys 0..i. Prefer it wherever nothing
/// else restricts the keys (no cached keys, packed documents or sliding
/// window shorter than the sequence): the kernels skip the masked half of
/// the scores, and on a GPU FlashAttention (which takes no mask) can run, on
/// the grouped key/value heads as they are where it does. On the CPU its
/// results are the masked call's, bit for bit.
at::Tensor causal_scaled_dot_product_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

}  // namespace shardtrain::nn
