#pragma once
/// @file kernels.h
/// The kernel layer the engines call: one function per feature, dispatched on
/// the device of the tensors it is given, to the CPU kernels
/// (src/kernels/cpu/cpu_kernels.h) or the CUDA launchers
/// (src/kernels/cuda/cuda_kernels.h), which share their per-element arithmetic
/// (src/kernels/element_math.h).
///
/// Public because a plain training loop that must match an engine bit for bit
/// (examples/tiny/reference_adam.h, the parity tests' reference) steps its
/// parameters with these same functions.
///
/// Every tensor must be defined, contiguous and on one device. CUDA kernels
/// are enqueued on ATen's current stream of that device and never synchronise
/// the host. Results (norms, flags) stay on the tensors' device as 0-dim
/// tensors, so the engines can reduce them over ranks before anything waits
/// for the GPU. Errors throw shardtrain::Error naming the argument and device.

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>

#include <cstdint>

namespace shardtrain::kernels {

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

/// Hyper-parameters of one SGD step (dampening 0), as torch::optim::SGD.
struct SgdParams {
  double lr = 1e-3;
  double momentum = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  /// As AdamParams::grad_scale.
  double grad_scale = 1.0;
  /// The first step initialises the momentum buffer from the gradient, as torch does.
  bool first_step = true;
};

/// The lost-update audit of one step (src/kernels/element_math.h explains the rule and
/// the sampling). The step adds, in its own pass, to `counts`: an int64
/// tensor of 3 elements on the step's device, {audited elements, updates lost
/// in the stored type, updates a bf16 master would have lost}.
struct UpdateAudit {
  at::Tensor counts;
  /// Audit every sample_period-th granule of the audit granule's elements (1: all).
  int64_t sample_period = 1;
};

/// Elements after which the audit's sampling pattern repeats (granule x
/// sample_period). Sampling counts from each call's first element, so a step
/// split into calls that start at multiples of this audits the same elements
/// as one call over the whole partition.
int64_t audit_pattern_elements(int64_t sample_period);

/// One Adam(W) step in place on the fp32 `master`, `exp_avg`, `exp_avg_sq`:
///   g = grad * grad_scale                 (+ wd*master in Adam mode)
///   master *= 1 - lr*wd                   (AdamW mode)
///   m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g
///   master += (-lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps)
/// `grad` may be fp32, bf16 or fp16. When `low_precision_out` is not null (bf16
/// or fp16, same numel) the new master is also written there, rounded to
/// nearest even, in the same pass.
/// `audit` (optional, every step function): count lost updates as it goes.
void adam_step(at::Tensor& master, at::Tensor& exp_avg, at::Tensor& exp_avg_sq, const at::Tensor& grad,
               at::Tensor* low_precision_out, const AdamParams& p, UpdateAudit* audit = nullptr);

/// FSDP's pure low-precision Adam(W): `param` and the moments are all bf16 or
/// all fp16 (`grad` that dtype or fp32); each element is updated in float and
/// stored back rounded.
void adam_step_low_precision(at::Tensor& param, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                             const at::Tensor& grad, const AdamParams& p, UpdateAudit* audit = nullptr);

/// One SGD step in place on the fp32 `master` (see cpu::fused_sgd).
/// `momentum_buffer` is required when p.momentum != 0.
void sgd_step(at::Tensor& master, at::Tensor* momentum_buffer, const at::Tensor& grad,
              at::Tensor* low_precision_out, const SgdParams& p, UpdateAudit* audit = nullptr);

/// Sum of x^2 over an fp32, bf16 or fp16 tensor, in fp64, in element_math.h's
/// fixed order: a 0-dim float64 tensor on t's device, bitwise the same on
/// every run, thread count and device.
at::Tensor sum_of_squares(const at::Tensor& t);

/// A 0-dim float32 tensor on t's device: 1 if t holds any +-inf or NaN, else 0.
at::Tensor non_finite_flag(const at::Tensor& t);

/// dst = src converted to dst's dtype (fp32, bf16, fp16; round to nearest
/// even when narrowing). Same device and shape; dst contiguous, and not over
/// part of src's memory (all of it, in place, is allowed).
void cast_into(at::Tensor& dst, const at::Tensor& src);

/// NF4 (QLoRA's 4-bit NormalFloat with blocksize 64 and double-quantized
/// absmax values, bitsandbytes' quantize_4bit format): the bytes of `weight`
/// (fp32, bf16 or fp16, numel a multiple of 64, finite), as one uint8 buffer
/// on weight's device that holds the codes and the quantization state
/// (src/kernels/nf4_format.h lays it out). Computed on the CPU.
at::Tensor nf4_quantize(const at::Tensor& weight);

/// Bytes of the NF4 buffer of `numel` elements (about numel / 2 * 1.03).
int64_t nf4_buffer_bytes(int64_t numel);

/// Decodes an NF4 buffer into a new tensor of `numel` elements of `dtype`
/// (fp32, bf16, fp16) on the buffer's device; CPU and CUDA kernels give the
/// same bits.
at::Tensor nf4_dequantize(const at::Tensor& buffer, int64_t numel, at::ScalarType dtype);

/// The pieces of an NF4 buffer as bitsandbytes' QuantState names them, for
/// checks and exports: `codes` (the packed bytes), `absmax` (uint8 codes of
/// the absmax values), `nested_absmax` (fp32), `offset` (fp32, 0-dim) and
/// `nested_quant_map` (the 256-entry fp32 map). CPU copies.
struct Nf4State {
  at::Tensor codes, absmax, nested_absmax, offset, nested_quant_map;
};
Nf4State nf4_state(const at::Tensor& buffer, int64_t numel);

/// Whether this build has kernels for `device` (CPU always; CUDA where nvcc
/// compiled the CUDA kernels).
bool has_kernels_for(c10::DeviceType device);

}  // namespace shardtrain::kernels
