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
/// with `attend` as its boolean mask (true: may attend; broadcast over the
/// heads), no dropout, not causal beyond the mask. q/k/v [B,heads,T|S,d] of
/// one dtype (k and v with as many heads as q). Double backward through the
/// widened path throws shardtrain::Error.
at::Tensor scaled_dot_product_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& attend);

}  // namespace shardtrain::nn
