#pragma once
// CPU kernels of the shared engine parts: the fused optimizer steps and the
// gradient-norm and overflow reductions. The engines reach them through
// shardtrain/kernels.h, which dispatches on the tensors' device; the CUDA
// launchers (kernels/cuda/cuda_kernels.h) evaluate the same per-element
// arithmetic (kernels/element_math.h).
//
// Every tensor must be a defined, contiguous CPU tensor; violations throw
// shardtrain::Error naming the argument. Work is split with at::parallel_for,
// so the kernels use the intra-op thread pool (at::set_num_threads).
//
// Numerics: the fp32 Adam/AdamW and SGD steps evaluate each element with the
// same operations, in the same order, with the same float-rounded scalar
// coefficients and the same fused multiply-adds as LibTorch's
// torch::optim::{AdamW, Adam, SGD} running on the kernels ATen dispatches on
// this machine (see fuses_multiply_add), so an engine's FP32 run reproduces a
// plain LibTorch loop bit for bit on GCC-built LibTorch (PyPI's).
// Elsewhere the difference stays at rounding level (~1e-7 relative per step).

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "kernels/optimizer_params.h"

namespace shardtrain::kernels::cpu {

using kernels::AdamParams;
using kernels::SgdParams;

/// One Adam(W) step in place on the fp32 `master`, `exp_avg`, `exp_avg_sq`:
///   g = grad * grad_scale                 (+ wd*master in Adam mode)
///   master *= 1 - lr*wd                   (AdamW mode)
///   m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g
///   master += (-lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps)
/// `grad` may be fp32, bf16 or fp16 (widened to float). When
/// `low_precision_out` is not null (bf16 or fp16, same numel) the new master is
/// also written there, rounded to nearest even exactly as at::Tensor::to does,
/// in the same pass: the compute copy the engines all-gather next.
///
/// `audit` (counts == nullptr: off): count lost updates in the same pass into
/// the host counters audit.counts (element_math.h's lost-update audit).
void fused_adam(at::Tensor& master, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                const at::Tensor& grad, at::Tensor* low_precision_out, const AdamParams& p,
                const math::AuditSpec& audit = {});

/// FSDP's pure low-precision Adam(W): `param`, `exp_avg` and `exp_avg_sq` are
/// all bf16 or all fp16 (`grad` that dtype or fp32). Each element is updated in
/// float with fused_adam's arithmetic and stored back rounded, so updates below
/// half an ulp of the parameter are lost. That loss is the behaviour this mode
/// exists to reproduce, not a defect.
void fused_adam_low_precision(at::Tensor& param, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                              const at::Tensor& grad, const AdamParams& p, const math::AuditSpec& audit = {});

/// One SGD step in place on the fp32 `master`, as torch::optim::SGD with
/// dampening 0:
///   d = grad * grad_scale (+ wd*master)
///   buf = d on the first step, else momentum*buf + d;  d = nesterov ? d + momentum*buf : buf
///   master += (-lr) * d
/// `momentum_buffer` (fp32, same numel) is required when momentum != 0 and
/// ignored otherwise; `first_step` initialises it from d as torch does.
/// `grad` and `low_precision_out` as in fused_adam.
void fused_sgd(at::Tensor& master, at::Tensor* momentum_buffer, const at::Tensor& grad,
               at::Tensor* low_precision_out, const SgdParams& params, const math::AuditSpec& audit = {});

/// Whether the optimizer kernels fuse the multiply-adds that LibTorch's own
/// CPU kernels fuse here: true where ATen dispatches its AVX2/AVX-512 kernels
/// (x86 with AVX2 and FMA, unless ATEN_CPU_CAPABILITY=default), false where it
/// runs its DEFAULT ones. Decided once per process.
bool fuses_multiply_add();

/// Sum of x^2 over an fp32, bf16 or fp16 tensor, accumulated in fp64. The
/// result is bitwise reproducible: it follows element_math.h's fixed order of
/// additions, so neither the thread count nor the scheduling changes a bit of
/// it (a resumed run must clip exactly as the uninterrupted one did), and the
/// CUDA kernel, which follows the same order, gives the same bits.
double sum_of_squares(const at::Tensor& t);

/// Whether an fp32, bf16 or fp16 tensor holds any +-inf or NaN: the fp16 loss
/// scaler's overflow check.
bool has_inf_or_nan(const at::Tensor& t);

}  // namespace shardtrain::kernels::cpu
