#pragma once
// CPU kernels of the shared engine parts: the fused optimizer steps and the
// gradient-norm and overflow reductions. They mirror the CUDA launchers in
// kernels/cuda/cuda_kernels.h, but take ATen tensors (the CPU build has
// LibTorch everywhere, and the checks below are cheaper to express on tensors).
//
// Every tensor must be a defined, contiguous CPU tensor; violations throw
// shardtrain::Error naming the argument. Work is split with at::parallel_for,
// so the kernels use the intra-op thread pool (at::set_num_threads).
//
// Numerics: the fp32 Adam/AdamW and SGD steps evaluate each element with the
// same operations, in the same order, with the same float-rounded scalar
// coefficients and the same fused multiply-adds as LibTorch 1.13's
// torch::optim::{AdamW, Adam, SGD} running on the kernels ATen dispatches on
// this machine (see fuses_multiply_add), so an engine's FP32 run reproduces a
// plain LibTorch loop bit for bit on GCC-built LibTorch (Debian's, PyPI's).
// Elsewhere the difference stays at rounding level (~1e-7 relative per step).

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace shardtrain::kernels::cpu {

/// Hyper-parameters of one Adam/AdamW step.
struct AdamParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  /// 1-based number of this step, counted after the increment (the first step is 1).
  int64_t step = 1;
  /// true: AdamW, decoupled weight decay (master *= 1 - lr*wd), as torch::optim::AdamW.
  /// false: Adam with L2 regularisation (g += wd*master), as torch::optim::Adam.
  bool adam_w_mode = true;
  /// Divide the moments by 1 - beta^step, as torch and DeepSpeed's FusedAdam do.
  bool bias_correction = true;
  /// Multiplies the gradient before anything else. The engines fold loss-scale
  /// unscaling (1/scale) and the clip coefficient into this one factor, so the
  /// gradient is read once per step.
  double grad_scale = 1.0;
};

/// One Adam(W) step in place on the fp32 `master`, `exp_avg`, `exp_avg_sq`:
///   g = grad * grad_scale                 (+ wd*master in Adam mode)
///   master *= 1 - lr*wd                   (AdamW mode)
///   m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g
///   master += (-lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps)
/// `grad` may be fp32, bf16 or fp16 (widened to float). When
/// `low_precision_out` is not null (bf16 or fp16, same numel) the new master is
/// also written there, rounded to nearest even exactly as at::Tensor::to does,
/// in the same pass: the compute copy the engines all-gather next.
void fused_adam(at::Tensor& master, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                const at::Tensor& grad, at::Tensor* low_precision_out, const AdamParams& p);

/// FSDP's pure low-precision Adam(W): `param`, `exp_avg` and `exp_avg_sq` are
/// all bf16 or all fp16 (`grad` that dtype or fp32). Each element is updated in
/// float with fused_adam's arithmetic and stored back rounded, so updates below
/// half an ulp of the parameter are lost. That loss is the behaviour this mode
/// exists to reproduce, not a defect.
void fused_adam_low_precision(at::Tensor& param, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                              const at::Tensor& grad, const AdamParams& p);

/// One SGD step in place on the fp32 `master`, as torch::optim::SGD with
/// dampening 0:
///   d = grad * grad_scale (+ wd*master)
///   buf = d on the first step, else momentum*buf + d;  d = nesterov ? d + momentum*buf : buf
///   master += (-lr) * d
/// `momentum_buffer` (fp32, same numel) is required when momentum != 0 and
/// ignored otherwise; `first_step` initialises it from d as torch does.
/// `grad` and `low_precision_out` as in fused_adam.
void fused_sgd(at::Tensor& master, at::Tensor* momentum_buffer, const at::Tensor& grad,
               at::Tensor* low_precision_out, double lr, double momentum, double weight_decay,
               bool nesterov, double grad_scale, bool first_step);

/// Whether the optimizer kernels fuse the multiply-adds that LibTorch's own
/// CPU kernels fuse here: true where ATen dispatches its AVX2/AVX-512 kernels
/// (x86 with AVX2 and FMA, unless ATEN_CPU_CAPABILITY=default), false where it
/// runs its DEFAULT ones. Decided once per process.
bool fuses_multiply_add();

/// Sum of x^2 over an fp32, bf16 or fp16 tensor, accumulated in fp64. The
/// result is bitwise reproducible: fixed-size blocks are summed independently
/// and their sums added in block order, so neither the thread count nor the
/// scheduling changes a bit of it (a resumed run must clip exactly as the
/// uninterrupted one did).
double sum_of_squares(const at::Tensor& t);

/// Whether an fp32, bf16 or fp16 tensor holds any +-inf or NaN: the fp16 loss
/// scaler's overflow check.
bool has_inf_or_nan(const at::Tensor& t);

}  // namespace shardtrain::kernels::cpu
