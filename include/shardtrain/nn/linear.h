#pragma once
/// @file nn/linear.h
/// Matrix products that train in bf16/fp16 at fp32 speed on any CPU, and the
/// drop-in `shardtrain::nn::Linear` built on them (the building block the
/// bundled Llama/Mistral and train_tiny models use; use it in your own modules
/// in place of torch::nn::Linear).
///
/// Why: LibTorch 2.11 sends a bf16 CPU matmul to oneDNN only on CPUs with
/// AVX-512 or AMX; elsewhere (every AVX2-only CPU, e.g. AMD Zen 1-3) it runs
/// a generic loop, measured 63x slower than fp32. These functions keep the
/// semantics of a native bf16 GEMM (bf16/fp16 inputs, fp32 accumulation, one
/// rounding of the result to the input dtype) and pick per process how to get
/// them, from the CPU's flags alone (never a timing: the two paths round
/// differently, and every rank must take the same one):
///  - native: LibTorch's own kernel (CUDA always; a CPU with native bf16
///    instructions, AVX-512 BF16 or AMX). On CUDA, cuBLAS accumulates in
///    fp32, but with torch's default (allow_bf16_reduced_precision_reduction,
///    and its fp16 twin, on) a split-K GEMM may round its partial sums to
///    the input dtype: turn those off (at::globalContext()
///    .setAllowBF16ReductionCuBLAS(false)) for the one rounding. This library
///    leaves them as the program set them, as PyTorch does;
///  - widened: the operands are widened to fp32, the fp32 GEMM (MKL/OpenBLAS)
///    runs, and the result is rounded once. fp16 on a CPU is always widened.
/// Backward follows the same rule for both gradient products. fp32/fp64
/// tensors go straight to at::linear / at::matmul. The attention of
/// shardtrain/nn/attention.h follows the same choice.
///
/// The choice is printed by `shardtrain env` and in the precision plan.
/// SHARDTRAIN_CPU_GEMM=native|widened|auto (default auto) overrides it.
/// SHARDTRAIN_CPU_DISABLE_ONEDNN=1 turns LibTorch's oneDNN off, so a CPU
/// with AVX-512 runs bf16 GEMMs as an AVX2-only one does (for reproducing
/// that machine's behaviour; it also makes the choice "widened").

#include <string>

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

namespace shardtrain::nn {

/// y = input @ weight^T + bias, as at::linear (bias may be undefined).
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias = at::Tensor());

/// a @ b, as at::matmul (broadcasting included).
at::Tensor matmul(const at::Tensor& a, const at::Tensor& b);

/// How this process runs bf16 GEMMs on the CPU: decided once, on first use.
struct CpuLowPrecisionGemm {
  bool widened = true;       ///< true: widen to fp32; false: LibTorch's native bf16 kernel
  bool native_bf16_cpu = false;  ///< the CPU reports avx512_bf16 or amx_bf16
  std::string reason;        ///< one line: why this path (CPU feature, failure or override)
  /// "widened to fp32" or "native (LibTorch)", plus the reason.
  std::string describe() const;
};
const CpuLowPrecisionGemm& cpu_low_precision_gemm();

/// torch::nn::Linear with its forward through shardtrain::nn::linear. Same
/// options, parameter names ("weight", "bias") and initialisation, so it
/// replaces torch::nn::Linear one for one (state dicts and checkpoints included).
///
/// With a LoRA adapter (shardtrain/lora.h, apply_lora) the forward is PEFT's
/// LoRA layer: result = linear(x) + scaling * lora_B(lora_A(dropout(x))),
/// x cast to the adapter's dtype and the sum cast back to the result's.
class LinearImpl : public torch::nn::LinearImpl {
 public:
  using torch::nn::LinearImpl::LinearImpl;
  at::Tensor forward(const at::Tensor& input);

  /// Gives this layer a rank-`r` adapter, initialised as PEFT's default
  /// (lora_A Kaiming-uniform with a = sqrt(5), lora_B zero), in fp32.
  void add_lora(int64_t r, double scaling, double dropout);
  bool has_lora() const { return !lora_A.is_empty(); }
  /// Takes the adapter off again (a refused load_lora_adapter).
  void remove_lora();
  /// Set by add_lora; registered as submodules "lora_A" and "lora_B", so the
  /// parameters are named as PEFT names them ("q_proj.lora_A.weight").
  torch::nn::Linear lora_A{nullptr}, lora_B{nullptr};
  double lora_scaling = 0.0;
  double lora_dropout = 0.0;

  /// QLoRA (shardtrain/quantization.h, quantize_frozen_base): replaces the
  /// frozen weight by its NF4 bytes, as bitsandbytes' Linear4bit holds it:
  /// the parameter "weight" becomes a 1-D uint8 tensor (the sharding engines
  /// keep, gather and checkpoint-skip it as bytes). The forward decodes it
  /// into `compute_dtype` and multiplies there, the input cast to
  /// `compute_dtype` and the result back to the input's dtype; backward decodes
  /// it again rather than keeping the decoded matrix alive. A weight built
  /// without its values (release_parameter_storage) becomes a byte buffer of
  /// the right size without values, for the engine to fill from rank 0.
  /// Throws ConfigError when nf4_refusal() gives a reason.
  void quantize_weight_nf4(at::ScalarType compute_dtype);
  /// Why quantize_weight_nf4 would refuse (quantized already, a weight that
  /// trains or has no elements, a size not whole NF4 blocks, a compute dtype
  /// other than bf16/fp16/fp32), or "" when it would not.
  std::string nf4_refusal(at::ScalarType compute_dtype) const;
  bool weight_quantized() const { return quantized_compute_dtype != at::ScalarType::Undefined; }
  at::ScalarType quantized_compute_dtype = at::ScalarType::Undefined;
};
TORCH_MODULE(Linear);

}  // namespace shardtrain::nn
