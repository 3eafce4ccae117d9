// shardtrain::nn: the public face of the kernel layer's mixed-precision GEMM.
#include "shardtrain/nn/linear.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

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

at::Tensor LinearImpl::forward(const at::Tensor& input) {
  at::Tensor result = linear(input, weight, bias);
  if (!has_lora()) return result;
  // PEFT's LoRA layer (peft/tuners/lora/layer.py, Linear.forward): the input
  // in the adapter's dtype, dropout only while training, the update added to
  // the base result in the promoted dtype, then cast back to the result's.
  at::Tensor x = input.to(lora_A->weight.scalar_type());
  if (lora_dropout > 0.0) x = at::dropout(x, lora_dropout, is_training());
  const at::Tensor update = nn::linear(nn::linear(x, lora_A->weight), lora_B->weight) * lora_scaling;
  return (result + update).to(result.scalar_type());
}

void LinearImpl::add_lora(int64_t r, double scaling, double dropout) {
  const int64_t in = weight.size(1), out = weight.size(0);
  // torch::nn::Linear's default weight initialisation is PEFT's for lora_A:
  // kaiming_uniform_(a = sqrt(5)).
  lora_A = register_module("lora_A", torch::nn::Linear(torch::nn::LinearOptions(in, r).bias(false)));
  lora_B = register_module("lora_B", torch::nn::Linear(torch::nn::LinearOptions(r, out).bias(false)));
  {
    at::NoGradGuard no_grad;
    lora_B->weight.zero_();
  }
  lora_A->to(weight.device());
  lora_B->to(weight.device());
  lora_scaling = scaling;
  lora_dropout = dropout;
}

}  // namespace shardtrain::nn
