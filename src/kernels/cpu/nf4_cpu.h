#pragma once
// The CPU kernels of NF4 (kernels/nf4_format.h): quantizing a weight as
// bitsandbytes' quantize_4bit does (blocksize 64, double quantization), and
// decoding it into a bf16/fp16/fp32 tensor for the dequantizing matmul.

#include <ATen/core/Tensor.h>

namespace shardtrain::kernels::cpu {

/// The signed 8-bit dynamic map the absmax values are coded with: 256 fp32
/// values, sorted (bitsandbytes' create_dynamic_map(signed=True,
/// max_exponent_bits=7)). Built once with the same ATen operations
/// bitsandbytes builds it with, so it is the same bits.
const at::Tensor& nf4_absmax_code();

/// The NF4 buffer of `weight` (a CPU fp32/bf16/fp16 tensor whose numel is a
/// multiple of 64): a 1-D uint8 tensor of nf4::Layout::of(numel).bytes.
at::Tensor nf4_quantize(const at::Tensor& weight);

/// Decodes `buffer` (contiguous CPU uint8 of nf4::Layout::of(out.numel()).bytes,
/// which kernels::nf4_dequantize checked) into `out` (contiguous CPU fp32,
/// bf16 or fp16), rounding to nearest even.
void nf4_dequantize(const at::Tensor& buffer, at::Tensor& out);

}  // namespace shardtrain::kernels::cpu
