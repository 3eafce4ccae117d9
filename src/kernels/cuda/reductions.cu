// Reductions the engines run over gradient shards every step: the sum of
// squares behind the global gradient norm (clipping) and the inf/NaN check
// behind fp16 dynamic loss scaling.

#include "kernels/cuda/kernel_common.cuh"

namespace shardtrain::kernels::cuda {
namespace {

/// One CUDA block per math::kSumBlock elements, one thread per lane, in
/// element_math.h's order; the block's sum goes to block_sums[blockIdx.x].
/// No atomics: an fp64 atomicAdd would make the last bits depend on which
/// block finished first.
template <class E>
__global__ void __launch_bounds__(math::kSumLanes)
    block_sum_of_squares_kernel(const typename E::Storage* __restrict__ data, int64_t n,
                                double* __restrict__ block_sums) {
  __shared__ double lanes[math::kSumLanes];
  const int lane = static_cast<int>(threadIdx.x);
  double acc = 0.0;
  // Consecutive lanes read consecutive elements: coalesced without packs.
  for_each_lane_element(n, blockIdx.x, lane, [&](int64_t i) { acc = math::add_square(acc, E::load(data[i])); });
  lanes[lane] = acc;
  __syncthreads();
  for (int s = math::kSumLanes / 2; s > 0; s /= 2) {
    if (lane < s) lanes[lane] = math::add_rn(lanes[lane], lanes[lane + s]);
    __syncthreads();
  }
  if (lane == 0) block_sums[blockIdx.x] = lanes[0];
}

/// The block sums added in block order by thread 0, as the CPU adds them.
/// The order is the contract; the other threads stage the sums into shared
/// memory in coalesced chunks, so thread 0 never waits on global memory one
/// load at a time (a 7B-element shard has ~430K blocks).
__global__ void __launch_bounds__(math::kSumLanes)
    sum_blocks_in_order_kernel(const double* __restrict__ block_sums, int64_t blocks, double* __restrict__ out) {
  __shared__ double chunk[math::kSumLanes];
  double total = 0.0;  // meaningful in thread 0
  for (int64_t first = 0; first < blocks; first += math::kSumLanes) {
    const int64_t i = first + threadIdx.x;
    chunk[threadIdx.x] = i < blocks ? block_sums[i] : 0.0;
    __syncthreads();
    if (threadIdx.x == 0) {
      const int64_t n = blocks - first < math::kSumLanes ? blocks - first : math::kSumLanes;
      for (int64_t k = 0; k < n; ++k) total = math::add_rn(total, chunk[k]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = total;
}

template <class E>
__global__ void __launch_bounds__(kThreads)
    non_finite_kernel(const typename E::Storage* __restrict__ data, ElementwisePlan plan, float* __restrict__ flag) {
  using S = typename E::Storage;
  // Widening a 16-bit inf/NaN keeps it inf/NaN, so one test covers all dtypes.
  bool bad = false;
  auto element = [&](int64_t i) { bad |= !isfinite(E::load(data[i])); };
  auto pack = [&](int64_t first) {
    const detail::Pack<S> p = *reinterpret_cast<const detail::Pack<S>*>(data + first);
#pragma unroll
    for (int k = 0; k < kVec; ++k) bad |= !isfinite(E::load(p.v[k]));
  };
  for_each_plan_item(plan, detail::global_thread(), detail::grid_stride(), element, pack);
  // Every writer stores the same value, so plain stores need no atomics.
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1.0f;
}

}  // namespace

cudaError_t launch_sum_of_squares(const void* data, DType dtype, int64_t n, double* block_sums, double* out,
                                  cudaStream_t stream) {
  if (n < 0 || out == nullptr || !detail::valid(dtype)) return cudaErrorInvalidValue;
  if (n == 0) return cudaMemsetAsync(out, 0, sizeof(double), stream);
  if (data == nullptr || block_sums == nullptr) return cudaErrorInvalidValue;
  const int64_t blocks = math::sum_blocks(n);
  // gridDim.x is at most 2^31 - 1 blocks of 16K elements: 3.5e13 elements.
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const cudaError_t status = detail::with_type(dtype, [&](auto tag) -> cudaError_t {
    using E = decltype(tag);
    block_sum_of_squares_kernel<E><<<static_cast<unsigned>(blocks), math::kSumLanes, 0, stream>>>(
        static_cast<const typename E::Storage*>(data), n, block_sums);
    return cudaGetLastError();
  });
  if (status != cudaSuccess) return status;
  sum_blocks_in_order_kernel<<<1, math::kSumLanes, 0, stream>>>(block_sums, blocks, out);
  return cudaGetLastError();
}

cudaError_t launch_non_finite_flag(const void* data, DType dtype, int64_t n, float* out_flag,
                                   cudaStream_t stream) {
  if (n < 0 || out_flag == nullptr || !detail::valid(dtype)) return cudaErrorInvalidValue;
  // Zeroed on the stream, not the host, so it stays ordered with the kernel.
  cudaError_t status = cudaMemsetAsync(out_flag, 0, sizeof(float), stream);
  if (status != cudaSuccess || n == 0) return status;
  if (data == nullptr) return cudaErrorInvalidValue;
  ElementwisePlan plan;
  status = detail::plan_for(n, elements_to_pack_alignment(data, detail::element_size(dtype)), &plan);
  if (status != cudaSuccess) return status;
  return detail::with_type(dtype, [&](auto tag) -> cudaError_t {
    using E = decltype(tag);
    non_finite_kernel<E><<<plan.blocks, plan.threads, 0, stream>>>(static_cast<const typename E::Storage*>(data),
                                                                    plan, out_flag);
    return cudaGetLastError();
  });
}

}  // namespace shardtrain::kernels::cuda
