// shardtrain::nn: the public face of the kernel layer's mixed-precision GEMM.
#include "shardtrain/nn/linear.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include "kernels/cpu/cpu_gemm_choice.h"
#include "kernels/mixed_gemm.h"
#include "kernels/nf4_format.h"
#include "nn/nf4_linear.h"
#include "shardtrain/error.h"
#include "shardtrain/kernels.h"
#include "shardtrain/weight_loading.h"

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
  at::Tensor result = weight_quantized() ? nf4_linear(input, weight, bias, options.out_features(),
                                                      options.in_features(), quantized_compute_dtype)
                                         : linear(input, weight, bias);
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
  const int64_t in = options.in_features(), out = options.out_features();
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

void LinearImpl::remove_lora() {
  if (!has_lora()) return;
  unregister_module("lora_A");
  unregister_module("lora_B");
  lora_A = nullptr;
  lora_B = nullptr;
  lora_scaling = 0.0;
  lora_dropout = 0.0;
}

std::string LinearImpl::nf4_refusal(at::ScalarType compute_dtype) const {
  if (weight_quantized()) return "the weight is quantized already";
  if (weight.requires_grad()) return "the weight trains; only a frozen weight can be quantized (apply_lora freezes the base)";
  if (weight.numel() == 0) return "the weight has no elements";
  if (weight.numel() % kernels::nf4::kBlock != 0) {
    return "the weight has " + std::to_string(weight.numel()) + " elements, not a multiple of the NF4 block of " +
           std::to_string(kernels::nf4::kBlock) + "; leave the layer out (QuantizationConfig::skip_modules)";
  }
  if (compute_dtype != at::kBFloat16 && compute_dtype != at::kHalf && compute_dtype != at::kFloat) {
    return std::string("the compute dtype must be bf16, fp16 or fp32, got ") + c10::toString(compute_dtype);
  }
  return "";
}

void LinearImpl::quantize_weight_nf4(at::ScalarType compute_dtype) {
  const std::string refusal = nf4_refusal(compute_dtype);
  ST_CHECK_T(ConfigError, refusal.empty(), "quantize_weight_nf4: ", refusal);
  // A weight built without its values (a rank that does not load under
  // rank-0-only loading) becomes its NF4 buffer's shape without values: the
  // engine fills this rank's shard of the bytes from rank 0, which quantized
  // the loaded weight. The buffer's size depends on the element count alone.
  const bool released = is_storage_released(weight);
  const at::TensorOptions bytes = weight.options().dtype(at::kByte);
  at::Tensor buffer = released ? at::empty({kernels::nf4_buffer_bytes(weight.numel())}, bytes)
                               : kernels::nf4_quantize(weight.detach());
  at::NoGradGuard no_grad;
  weight.set_data(buffer);  // the module's parameter and this handle share the TensorImpl
  if (released) release_storage(weight);
  quantized_compute_dtype = compute_dtype;
}

}  // namespace shardtrain::nn
