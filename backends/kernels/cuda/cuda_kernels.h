#pragma once
// CUDA kernels of the shared engine parts: the fused optimizer step, the
// gradient-norm and overflow reductions, and dtype casts.
//
// This header is plain C++ on purpose: the engines and the NCCL backend are
// compiled by the host compiler against LibTorch, the kernels by nvcc without
// it (nvcc parsing ATen is slow and breaks between LibTorch versions). So the
// interface speaks raw device pointers and this header's own dtype enums,
// never at::Tensor or at::ScalarType.
//
// Error model: every launcher only enqueues work on `stream` (it never
// synchronises) and returns the cudaError_t of the launch; the caller checks
// it. Invalid arguments (negative sizes, null pointers, unknown dtypes) give
// cudaErrorInvalidValue without launching anything. A fault while a kernel
// runs surfaces later, at the next synchronising call, as with any CUDA launch.
// Kernels run on the current CUDA device: the pointers and `stream` must
// belong to it. Pointers need no particular alignment (views into flat
// buffers start anywhere); aligned ones get 16-byte vector accesses.
//
// All sizes are int64_t element counts: a 7B-parameter flat buffer has more
// than 2^31 elements.

#include <cstdint>

#include <cuda_runtime.h>

namespace shardtrain::kernels::cuda {

/// Element types the kernels read. float16 and bfloat16 are the IEEE half and
/// the brain float (upper 16 bits of an fp32).
enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

/// The optional low-precision copy written by the fused optimizer step.
enum class LowPrecision : int { kNone = 0, kBF16 = 1, kF16 = 2 };

/// Hyper-parameters of one Adam/AdamW step.
struct AdamWParams {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  /// 1-based number of this step (the first step is 1). Drives bias correction.
  int64_t step = 1;
  /// Divide the moments by (1 - beta^step), as torch.optim.Adam(W) and
  /// DeepSpeed's FusedAdam(bias_correction=True) do.
  bool bias_correction = true;
  /// true: AdamW, decoupled weight decay (master *= 1 - lr*wd).
  /// false: Adam with L2 regularisation (wd * master added to the gradient),
  /// DeepSpeed FusedAdam's adam_w_mode=False.
  bool adam_w_mode = true;
  /// Multiplies the gradient before anything else. The engines fold the
  /// loss-scale unscaling (1/scale) and the clip coefficient into this one
  /// factor, so the fp32 gradient is read exactly once per step.
  float grad_scale = 1.0f;
};

/// One Adam(W) step over `n` fp32 elements, in place on `master`, `exp_avg`
/// and `exp_avg_sq`, reading `grad`:
///   g = grad * grad_scale            (+ wd * master when !adam_w_mode)
///   master *= 1 - lr * wd            (only when adam_w_mode)
///   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
///   master -= lr * (m / bc1) / (sqrt(v / bc2) + eps)
/// with bc = 1 - beta^step (1 without bias correction); the denominator is
/// evaluated as sqrt(v) / sqrt(bc2) + eps, in torch.optim.AdamW's order.
/// When `low_precision_out` is not null, the updated master is also written
/// there as `kind` (bf16 or fp16, round-to-nearest-even) in the same pass,
/// which is the compute copy the engines all-gather next.
cudaError_t launch_fused_adamw(float* master, float* exp_avg, float* exp_avg_sq, const float* grad,
                               void* low_precision_out, LowPrecision kind, int64_t n,
                               const AdamWParams& p, cudaStream_t stream);

/// Sum of x^2 over `n` elements of `data`, accumulated in fp64, into the device
/// scalar `*out_device_scalar`. Overwrites it unless `accumulate` is true (then
/// adds to it, so one scalar can collect a norm over many buffers before a
/// single device-to-host copy). Blocks add their partial sums atomically, so
/// the order of additions, and thus the last bits of the fp64 result, may vary
/// between runs; that is ~1e-16 relative, far below the fp32 in which the norm
/// is used.
cudaError_t launch_sum_of_squares(const void* data, DType dtype, int64_t n,
                                  double* out_device_scalar, cudaStream_t stream,
                                  bool accumulate = false);

/// Sets the device int `*out_flag` to 1 if any of the `n` elements is +-inf or
/// NaN, else to 0 (with `accumulate`, only ever sets it to 1, so one flag can
/// cover many buffers). The fp16 loss scaler's overflow check.
cudaError_t launch_has_inf_or_nan(const void* data, DType dtype, int64_t n, int* out_flag,
                                  cudaStream_t stream, bool accumulate = false);

/// Converts `n` elements from `src_type` to `dst_type` (round-to-nearest-even
/// when narrowing). Same types: a device-to-device copy. `src` and `dst` must
/// not overlap unless they are the same pointer with the same type.
cudaError_t launch_cast(const void* src, DType src_type, void* dst, DType dst_type, int64_t n,
                        cudaStream_t stream);

/// "float32", "bfloat16" or "float16".
const char* to_string(DType dtype);

}  // namespace shardtrain::kernels::cuda
