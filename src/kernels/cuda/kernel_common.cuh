#pragma once
// Pieces shared by the .cu files of the CUDA kernel library (not installed):
// element types, packs and the grid for a launch plan.

#include <atomic>
#include <cstdint>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/launch_plan.h"
#include "kernels/element_math.h"

namespace shardtrain::kernels::cuda::detail {

// ---- element types -------------------------------------------------------------
// 16-bit values travel as their bits (uint16_t) and are widened (exactly) to
// float on load and narrowed once, on store, with round-to-nearest-even. bf16
// uses element_math.h's conversion, so it matches the CPU kernels bit for bit
// (NaN included); fp16 uses the hardware conversion, which differs from
// c10::Half only in the NaN payload it writes.

struct F32 {
  using Storage = float;
  __device__ __forceinline__ static float load(float x) { return x; }
  __device__ __forceinline__ static float store(float x) { return x; }
};
struct BF16 {
  using Storage = uint16_t;
  __device__ __forceinline__ static float load(uint16_t b) { return math::float_from_bf16_bits(b); }
  __device__ __forceinline__ static uint16_t store(float x) { return math::bf16_bits_from_float(x); }
};
struct F16 {
  using Storage = uint16_t;
  __device__ __forceinline__ static float load(uint16_t b) { return __half2float(__ushort_as_half(b)); }
  __device__ __forceinline__ static uint16_t store(float x) { return __half_as_ushort(__float2half_rn(x)); }
};

inline std::size_t element_size(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }
inline bool valid(DType dtype) { return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16; }

/// Calls f(Type{}) with the element type behind `dtype`.
template <class F>
cudaError_t with_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF32: return f(F32{});
    case DType::kBF16: return f(BF16{});
    case DType::kF16: return f(F16{});
  }
  return cudaErrorInvalidValue;
}

/// kVec elements loaded and stored as one aligned access.
template <typename T>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

template <class E>
__device__ __forceinline__ void load_pack(const typename E::Storage* base, int64_t first, float (&out)[kVec]) {
  const Pack<typename E::Storage> p = *reinterpret_cast<const Pack<typename E::Storage>*>(base + first);
#pragma unroll
  for (int k = 0; k < kVec; ++k) out[k] = E::load(p.v[k]);
}

template <class E>
__device__ __forceinline__ void store_pack(typename E::Storage* base, int64_t first, const float (&in)[kVec]) {
  Pack<typename E::Storage> p;
#pragma unroll
  for (int k = 0; k < kVec; ++k) p.v[k] = E::store(in[k]);
  *reinterpret_cast<Pack<typename E::Storage>*>(base + first) = p;
}

// ---- launch geometry -----------------------------------------------------------

/// Multiprocessors of the current device, cached per device: cudaDeviceGetAttribute
/// costs microseconds and the optimizer launches per parameter group.
inline cudaError_t current_sm_count(int* sms) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  int count = device < kMaxDevices ? cache[device].load(std::memory_order_relaxed) : 0;
  if (count == 0) {
    status = cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
    if (status != cudaSuccess) return status;
    if (device < kMaxDevices) cache[device].store(count, std::memory_order_relaxed);
  }
  *sms = count;
  return cudaSuccess;
}

/// The plan for n elements over streams whose packs start after `head` elements.
inline cudaError_t plan_for(int64_t n, int64_t head, ElementwisePlan* plan) {
  int sms = 0;
  const cudaError_t status = current_sm_count(&sms);
  if (status != cudaSuccess) return status;
  *plan = make_elementwise_plan(n, head, sms);
  return cudaSuccess;
}

/// Thread index and stride of a grid-stride loop, in 64 bits so that n > 2^31 works.
__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// ---- the lost-update audit -------------------------------------------------------
// element_math.h's rules on one element per call; each thread keeps its own
// counts and the block's warps add theirs to the device counters once, at the
// end of the kernel (integer sums: the order of the atomics does not matter).

struct AuditTally {
  unsigned long long audited = 0, lost = 0, lost_if_bf16 = 0;
};

/// Counts one Adam update: `before` the stored value widened, `stored_after`
/// the value stored now, widened.
__device__ __forceinline__ void audit_adam(AuditTally& tally, float before, float stored_after, float update,
                                           const math::AdamScalars& c) {
  using Ops = math::ScalarOps<true>;
  const float bf16_before = math::bf16_round(before);
  tally.audited += 1;
  tally.lost += math::update_lost(before, stored_after, update);
  tally.lost_if_bf16 +=
      math::update_lost(bf16_before, math::adam_bf16_master_after<Ops>(bf16_before, update, c), update);
}

/// Counts one SGD update along `direction` on an fp32 master.
__device__ __forceinline__ void audit_sgd(AuditTally& tally, float before, float after, float direction,
                                          const math::SgdScalars& c) {
  using Ops = math::ScalarOps<true>;
  const float bf16_before = math::bf16_round(before);
  const float update = Ops::mul(direction, c.neg_lr);
  tally.audited += 1;
  tally.lost += math::update_lost(before, after, update);
  tally.lost_if_bf16 +=
      math::update_lost(bf16_before, math::sgd_bf16_master_after<Ops>(bf16_before, direction, c), update);
}

/// Adds the block's counts to audit.counts. Every thread of the block must
/// call it (warp shuffles over full warps; the blocks are whole warps).
__device__ __forceinline__ void flush_audit(const math::AuditSpec& audit, AuditTally tally) {
  for (int offset = 16; offset > 0; offset /= 2) {
    tally.audited += __shfl_down_sync(0xffffffffu, tally.audited, offset);
    tally.lost += __shfl_down_sync(0xffffffffu, tally.lost, offset);
    tally.lost_if_bf16 += __shfl_down_sync(0xffffffffu, tally.lost_if_bf16, offset);
  }
  if ((threadIdx.x & 31u) == 0 && tally.audited != 0) {
    atomicAdd(audit.counts + 0, tally.audited);
    atomicAdd(audit.counts + 1, tally.lost);
    atomicAdd(audit.counts + 2, tally.lost_if_bf16);
  }
}

}  // namespace shardtrain::kernels::cuda::detail
