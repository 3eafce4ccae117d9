// Reductions the engines run over gradient shards every step: the sum of
// squares behind the global gradient norm (clipping) and the inf/NaN check
// behind fp16 dynamic loss scaling.

#include "kernels/cuda/kernel_common.cuh"

namespace shardtrain::kernels::cuda {
namespace {

using detail::kVec;
using detail::Pack;

template <typename T, bool kVectorised>
__global__ void __launch_bounds__(detail::kThreads)
    sum_of_squares_kernel(const T* __restrict__ data, int64_t n, double* __restrict__ out) {
  // fp64 per thread: squares of fp32 values are exact in fp64 (48 significant
  // bits), and an fp32 running sum over 10^9 elements would lose the small
  // gradients entirely; the norm then decides the clip coefficient.
  double acc = 0.0;
  const int64_t stride = detail::grid_stride();
  const int64_t n_packs = kVectorised ? n / kVec : 0;
  for (int64_t i = detail::global_thread(); i < n_packs; i += stride) {
    const Pack<T> p = reinterpret_cast<const Pack<T>*>(data)[i];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const double x = detail::to_float(p.v[k]);
      acc += x * x;
    }
  }
  for (int64_t i = n_packs * kVec + detail::global_thread(); i < n; i += stride) {
    const double x = detail::to_float(data[i]);
    acc += x * x;
  }
  acc = detail::block_sum(acc);
  // One atomic per block (a few hundred per launch) instead of a second
  // kernel and a scratch buffer the caller would have to provide.
  if (threadIdx.x == 0) atomicAdd(out, acc);
}

template <typename T, bool kVectorised>
__global__ void __launch_bounds__(detail::kThreads)
    has_inf_or_nan_kernel(const T* __restrict__ data, int64_t n, int* __restrict__ flag) {
  bool bad = false;
  const int64_t stride = detail::grid_stride();
  const int64_t n_packs = kVectorised ? n / kVec : 0;
  for (int64_t i = detail::global_thread(); i < n_packs; i += stride) {
    const Pack<T> p = reinterpret_cast<const Pack<T>*>(data)[i];
#pragma unroll
    for (int k = 0; k < kVec; ++k) bad |= !isfinite(detail::to_float(p.v[k]));
  }
  for (int64_t i = n_packs * kVec + detail::global_thread(); i < n; i += stride) {
    bad |= !isfinite(detail::to_float(data[i]));
  }
  // Widening a 16-bit inf/NaN to fp32 keeps it inf/NaN, so one test covers all dtypes.
  // Every writer stores the same value, so plain stores need no atomics.
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;
}

template <typename T>
cudaError_t launch_sum_of_squares_typed(const T* data, int64_t n, double* out, cudaStream_t stream) {
  const bool vectorised = detail::pack_aligned<T>(data);
  unsigned blocks = 0;
  cudaError_t status = detail::grid_size(detail::vector_work_items(n, vectorised), &blocks);
  if (status != cudaSuccess) return status;
  if (vectorised) {
    sum_of_squares_kernel<T, true><<<blocks, detail::kThreads, 0, stream>>>(data, n, out);
  } else {
    sum_of_squares_kernel<T, false><<<blocks, detail::kThreads, 0, stream>>>(data, n, out);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_has_inf_or_nan_typed(const T* data, int64_t n, int* flag, cudaStream_t stream) {
  const bool vectorised = detail::pack_aligned<T>(data);
  unsigned blocks = 0;
  cudaError_t status = detail::grid_size(detail::vector_work_items(n, vectorised), &blocks);
  if (status != cudaSuccess) return status;
  if (vectorised) {
    has_inf_or_nan_kernel<T, true><<<blocks, detail::kThreads, 0, stream>>>(data, n, flag);
  } else {
    has_inf_or_nan_kernel<T, false><<<blocks, detail::kThreads, 0, stream>>>(data, n, flag);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_sum_of_squares(const void* data, DType dtype, int64_t n, double* out_device_scalar,
                                  cudaStream_t stream, bool accumulate) {
  if (n < 0 || out_device_scalar == nullptr || (n > 0 && data == nullptr)) return cudaErrorInvalidValue;
  if (!accumulate) {
    // Zeroed on the stream, not the host, so it stays ordered with the kernel.
    cudaError_t status = cudaMemsetAsync(out_device_scalar, 0, sizeof(double), stream);
    if (status != cudaSuccess) return status;
  }
  if (n == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kF32:
      return launch_sum_of_squares_typed(static_cast<const float*>(data), n, out_device_scalar, stream);
    case DType::kBF16:
      return launch_sum_of_squares_typed(static_cast<const __nv_bfloat16*>(data), n, out_device_scalar,
                                         stream);
    case DType::kF16:
      return launch_sum_of_squares_typed(static_cast<const __half*>(data), n, out_device_scalar, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_has_inf_or_nan(const void* data, DType dtype, int64_t n, int* out_flag,
                                  cudaStream_t stream, bool accumulate) {
  if (n < 0 || out_flag == nullptr || (n > 0 && data == nullptr)) return cudaErrorInvalidValue;
  if (!accumulate) {
    cudaError_t status = cudaMemsetAsync(out_flag, 0, sizeof(int), stream);
    if (status != cudaSuccess) return status;
  }
  if (n == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kF32:
      return launch_has_inf_or_nan_typed(static_cast<const float*>(data), n, out_flag, stream);
    case DType::kBF16:
      return launch_has_inf_or_nan_typed(static_cast<const __nv_bfloat16*>(data), n, out_flag, stream);
    case DType::kF16:
      return launch_has_inf_or_nan_typed(static_cast<const __half*>(data), n, out_flag, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace shardtrain::kernels::cuda
