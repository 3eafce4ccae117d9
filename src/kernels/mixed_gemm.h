#pragma once
// The kernel layer's mixed-precision GEMM: bf16/fp16 operands, fp32
// accumulation, one rounding of the result (on CUDA, where torch's cuBLAS
// reduced-precision-reduction flags allow it: include/shardtrain/nn/linear.h).
// On CUDA and on CPUs with fast native bf16 it is LibTorch's kernel; elsewhere the operands
// are widened to fp32 (see include/shardtrain/nn/linear.h for the contract
// users see). Autograd: both gradient products follow the same rule, and
// only the low-precision inputs are saved for backward, so an engine that
// frees and refills a unit's parameter storage (FSDP's trick) sees no copy.

#include <ATen/core/Tensor.h>

namespace shardtrain::kernels {

/// y = x @ w^T + b (b may be undefined), differentiable.
at::Tensor mixed_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b);

/// a @ b with at::matmul's broadcasting, differentiable.
at::Tensor mixed_matmul(const at::Tensor& a, const at::Tensor& b);

/// The widened path itself, whatever the process chose (tests, benchmarks):
/// bf16/fp16 operands of one dtype, widened to fp32, the result rounded once.
at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b);
at::Tensor widened_matmul(const at::Tensor& a, const at::Tensor& b);

/// Whether a GEMM over tensors of this dtype on this device is widened to fp32.
bool widens_gemm(const at::Tensor& t);

}  // namespace shardtrain::kernels
