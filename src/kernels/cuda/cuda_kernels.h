#pragma once
// CUDA kernels of the shared engine parts: the fused optimizer steps, the
// gradient-norm and non-finite reductions, and dtype casts. The engines reach
// them through shardtrain/kernels.h, which dispatches on the tensors' device.
//
// This header is plain C++ on purpose: the dispatch and the NCCL backend are
// compiled by the host compiler against LibTorch, the kernels by nvcc without
// it (nvcc parsing ATen is slow and breaks between LibTorch versions). So the
// interface speaks raw device pointers and this header's own dtype enum.
//
// Error model: every launcher only enqueues work on `stream` (it never
// synchronises) and returns the cudaError_t of the launch; the caller checks
// it. Invalid arguments (negative sizes, null pointers, unknown dtypes) give
// cudaErrorInvalidValue without launching anything. Kernels run on the
// current CUDA device: the pointers and `stream` must belong to it. Pointers
// need no alignment beyond their element size (views into flat buffers start
// at any element; cuda_dispatch.cpp refuses anything else, which would
// fault); see launch_plan.h for how aligned stretches get vector accesses.
//
// Numerics: the steps evaluate kernels/element_math.h's updates with every
// multiply-add fused, from constants the host computed (math::AdamScalars,
// math::SgdScalars), so they give the bits the CPU kernels give on an
// FMA-capable CPU. All sizes are int64_t element counts (a 7B flat buffer has
// more than 2^31 elements).

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/element_math.h"

namespace shardtrain::kernels::cuda {

/// Element types the kernels read and write: IEEE fp32, bfloat16 (the upper
/// 16 bits of an fp32) and IEEE half.
enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

/// Optional second output of a step: the updated master rounded to a 16-bit
/// type, written in the same pass (the compute copy the engines gather next).
struct LowPrecisionOut {
  void* data = nullptr;  ///< null: none
  DType dtype = DType::kBF16;
};

/// One Adam(W) step over `n` fp32 elements in place on `master`, `exp_avg`,
/// `exp_avg_sq`, reading `grad` (fp32, bf16 or fp16, widened exactly).
/// Every step takes an `audit`: with audit.counts (3 device counters) set, it
/// also counts lost updates (element_math.h's audit) in the same pass.
cudaError_t launch_adam(float* master, float* exp_avg, float* exp_avg_sq, const void* grad, DType grad_type,
                        LowPrecisionOut out, int64_t n, const math::AdamScalars& c, const math::AuditSpec& audit,
                        cudaStream_t stream);

/// Pure low-precision Adam(W): `param`, `exp_avg`, `exp_avg_sq` are all
/// `state_type` (bf16 or fp16); `grad` is that type or fp32. Each element is
/// updated in float and stored back rounded to nearest even.
cudaError_t launch_adam_low_precision(void* param, void* exp_avg, void* exp_avg_sq, DType state_type,
                                      const void* grad, DType grad_type, int64_t n, const math::AdamScalars& c,
                                      const math::AuditSpec& audit, cudaStream_t stream);

/// One SGD step over `n` fp32 elements in place on `master` (and on
/// `momentum_buffer`, fp32, required when c.use_momentum).
cudaError_t launch_sgd(float* master, float* momentum_buffer, const void* grad, DType grad_type,
                       LowPrecisionOut out, int64_t n, const math::SgdScalars& c, const math::AuditSpec& audit,
                       cudaStream_t stream);

/// Scratch `launch_sum_of_squares` needs: one double per math::kSumBlock elements.
inline int64_t sum_of_squares_scratch(int64_t n) { return n <= 0 ? 0 : math::sum_blocks(n); }

/// Sum of x^2 over `n` elements into the device scalar `*out`, in fp64, in
/// element_math.h's fixed order: bitwise the same on every run and the same
/// as the CPU kernel. `block_sums` is device scratch of
/// sum_of_squares_scratch(n) doubles (unused when n == 0).
cudaError_t launch_sum_of_squares(const void* data, DType dtype, int64_t n, double* block_sums, double* out,
                                  cudaStream_t stream);

/// Sets the device float `*out_flag` to 1 if any of the `n` elements is +-inf
/// or NaN, else to 0: the fp16 loss scaler's overflow check. A float, so the
/// engines can max-reduce it over ranks without a cast.
cudaError_t launch_non_finite_flag(const void* data, DType dtype, int64_t n, float* out_flag,
                                   cudaStream_t stream);

/// Converts `n` elements from `src_type` to `dst_type` (round-to-nearest-even
/// when narrowing). Same types: a device-to-device copy. `src` and `dst` must
/// not overlap unless they are the same pointer with the same type.
cudaError_t launch_cast(const void* src, DType src_type, void* dst, DType dst_type, int64_t n,
                        cudaStream_t stream);

/// "float32", "bfloat16" or "float16".
const char* to_string(DType dtype);

/// Decodes the NF4 buffer of `numel` elements (kernels/nf4_format.h;
/// numel a multiple of 64) into `out` (`out_type`), each value
/// nf4[code] * (absmax_code[absmax_byte] * scale + offset) rounded as the CPU
/// kernel rounds it. `absmax_code`: the 256-entry map on the device.
cudaError_t launch_nf4_dequantize(const uint8_t* buffer, const float* absmax_code, void* out, DType out_type,
                                  int64_t numel, cudaStream_t stream);


}  // namespace shardtrain::kernels::cuda
