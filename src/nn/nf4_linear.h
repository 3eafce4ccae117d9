#pragma once
// The dequantizing matmul of an NF4-quantized frozen weight (QLoRA's base
// layers): y = x @ decode(W)^T + b, computed in a 16-bit compute dtype, with
// a gradient for x only (the weight is frozen).

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace shardtrain::nn {

/// `buffer`: the NF4 bytes of an out_features x in_features weight
/// (kernels::nf4_quantize). `input` is cast to `compute_dtype`, the product
/// (and bias) computed there, the result cast back to input's dtype, as
/// bitsandbytes' Linear4bit does. The decoded weight lives only during the
/// forward's and the backward's product.
at::Tensor nf4_linear(const at::Tensor& input, const at::Tensor& buffer, const at::Tensor& bias, int64_t out_features,
                      int64_t in_features, at::ScalarType compute_dtype);

}  // namespace shardtrain::nn
