#pragma once
// Pieces shared by the .cu files of the CUDA kernel library (not installed).

#include <atomic>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_kernels.h"

namespace shardtrain::kernels::cuda::detail {

/// Elements per thread per iteration in the vectorised paths: 16-byte loads of
/// fp32 and 8-byte loads of 16-bit types. Elementwise kernels here are bound by
/// memory bandwidth; wide loads cut the number of memory transactions.
constexpr int kVec = 4;
constexpr int kThreads = 256;

/// A group of kVec elements that is loaded and stored as one aligned access.
template <typename T>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

/// True when `p` may be accessed as Pack<T> (the vectorised path's precondition).
template <typename T>
inline bool pack_aligned(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % sizeof(Pack<T>) == 0;
}

// ---- conversions ---------------------------------------------------------------
// All arithmetic happens in fp32; 16-bit values are widened on load (exact) and
// narrowed once, on store, with round-to-nearest-even.

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// ---- launch geometry -----------------------------------------------------------

/// Grid for a grid-stride kernel over `work_items` items of one thread each.
/// Capped at what the device can keep resident (8 blocks of 256 threads per SM
/// = 2048 threads, full occupancy on Volta..Hopper): beyond that extra blocks
/// only add scheduling overhead, the grid-stride loop covers the rest.
/// The SM count is cached per device because cudaDeviceGetAttribute costs
/// microseconds and the optimizer launches these kernels thousands of times per step.
inline cudaError_t grid_size(int64_t work_items, unsigned* blocks) {
  constexpr int kMaxDevices = 64;
  constexpr int kBlocksPerSm = 8;
  static std::atomic<int> sm_count_cache[kMaxDevices] = {};
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  int sms = device < kMaxDevices ? sm_count_cache[device].load(std::memory_order_relaxed) : 0;
  if (sms == 0) {
    status = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (status != cudaSuccess) return status;
    if (device < kMaxDevices) sm_count_cache[device].store(sms, std::memory_order_relaxed);
  }
  const int64_t wanted = (work_items + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sms) * kBlocksPerSm;
  *blocks = static_cast<unsigned>(wanted < 1 ? 1 : (wanted < cap ? wanted : cap));
  return cudaSuccess;
}

/// Number of items a kernel with kVec-wide packs has to cover: one per pack,
/// at least one per tail element (the tail is spread over the first threads).
inline int64_t vector_work_items(int64_t n, bool vectorised) {
  return vectorised ? (n + kVec - 1) / kVec : n;
}

/// Thread index and stride of a grid-stride loop, in 64 bits so that n > 2^31 works.
__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_stride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

/// Sum of `value` over the block, valid in thread 0. Warp shuffles first, then
/// one shared slot per warp: one __syncthreads instead of log2(256).
__device__ __forceinline__ double block_sum(double value) {
  __shared__ double warp_sums[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < static_cast<int>(blockDim.x / 32) ? warp_sums[lane] : 0.0;
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  }
  return value;
}

}  // namespace shardtrain::kernels::cuda::detail
