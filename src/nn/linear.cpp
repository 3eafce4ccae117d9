// shardtrain::nn: the public face of the kernel layer's mixed-precision GEMM.
#include "shardtrain/nn/linear.h"

#include "kernels/cpu/cpu_gemm_choice.h"
#include "kernels/mixed_gemm.h"

namespace shardtrain::nn {

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias) {
  return kernels::mixed_linear(input, weight, bias);
}

at::Tensor matmul(const at::Tensor& a, const at::Tensor& b) { return kernels::mixed_matmul(a, b); }

const CpuLowPrecisionGemm& cpu_low_precision_gemm() { return kernels::cpu::low_precision_gemm_choice(); }

std::string CpuLowPrecisionGemm::describe() const {
  return std::string(widened ? "widened to fp32 (fp32 GEMM, one rounding)" : "native (LibTorch's bf16 kernel)") +
         ": " + reason;
}

at::Tensor LinearImpl::forward(const at::Tensor& input) { return linear(input, weight, bias); }

}  // namespace shardtrain::nn
