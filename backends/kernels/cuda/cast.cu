// Elementwise dtype conversion between fp32, bf16 and fp16.
//
// The NCCL backend uses it on its own stream to widen bf16/fp16 buffers to
// fp32 before a reduction and to narrow the result afterwards, where an ATen
// .to() would run on the caller's stream instead (and needs a CUDA LibTorch).

#include "kernels/cuda/kernel_common.cuh"

namespace shardtrain::kernels::cuda {
namespace {

using detail::kVec;
using detail::Pack;

template <typename Src, typename Dst, bool kVectorised>
__global__ void __launch_bounds__(detail::kThreads)
    cast_kernel(const Src* __restrict__ src, Dst* __restrict__ dst, int64_t n) {
  const int64_t stride = detail::grid_stride();
  const int64_t n_packs = kVectorised ? n / kVec : 0;
  for (int64_t i = detail::global_thread(); i < n_packs; i += stride) {
    const Pack<Src> in = reinterpret_cast<const Pack<Src>*>(src)[i];
    Pack<Dst> out;
#pragma unroll
    for (int k = 0; k < kVec; ++k) out.v[k] = detail::from_float<Dst>(detail::to_float(in.v[k]));
    reinterpret_cast<Pack<Dst>*>(dst)[i] = out;
  }
  // bf16 <-> fp16 goes through fp32, which holds both exactly, so there is
  // still exactly one rounding (on the narrowing store).
  for (int64_t i = n_packs * kVec + detail::global_thread(); i < n; i += stride) {
    dst[i] = detail::from_float<Dst>(detail::to_float(src[i]));
  }
}

template <typename Src, typename Dst>
cudaError_t launch_cast_typed(const void* src, void* dst, int64_t n, cudaStream_t stream) {
  const bool vectorised = detail::pack_aligned<Src>(src) && detail::pack_aligned<Dst>(dst);
  unsigned blocks = 0;
  cudaError_t status = detail::grid_size(detail::vector_work_items(n, vectorised), &blocks);
  if (status != cudaSuccess) return status;
  const Src* typed_src = static_cast<const Src*>(src);
  Dst* typed_dst = static_cast<Dst*>(dst);
  if (vectorised) {
    cast_kernel<Src, Dst, true><<<blocks, detail::kThreads, 0, stream>>>(typed_src, typed_dst, n);
  } else {
    cast_kernel<Src, Dst, false><<<blocks, detail::kThreads, 0, stream>>>(typed_src, typed_dst, n);
  }
  return cudaGetLastError();
}

template <typename Src>
cudaError_t launch_cast_from(const void* src, void* dst, DType dst_type, int64_t n, cudaStream_t stream) {
  switch (dst_type) {
    case DType::kF32: return launch_cast_typed<Src, float>(src, dst, n, stream);
    case DType::kBF16: return launch_cast_typed<Src, __nv_bfloat16>(src, dst, n, stream);
    case DType::kF16: return launch_cast_typed<Src, __half>(src, dst, n, stream);
  }
  return cudaErrorInvalidValue;
}

bool valid(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
}

std::size_t element_size(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

}  // namespace

const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
  }
  return "unknown dtype";
}

cudaError_t launch_cast(const void* src, DType src_type, void* dst, DType dst_type, int64_t n,
                        cudaStream_t stream) {
  if (n < 0 || !valid(src_type) || !valid(dst_type)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (src == nullptr || dst == nullptr) return cudaErrorInvalidValue;
  if (src_type == dst_type) {
    if (src == dst) return cudaSuccess;
    // Nothing to convert: let the runtime pick its fastest device-to-device copy.
    return cudaMemcpyAsync(dst, src, static_cast<std::size_t>(n) * element_size(src_type),
                           cudaMemcpyDeviceToDevice, stream);
  }
  switch (src_type) {
    case DType::kF32: return launch_cast_from<float>(src, dst, dst_type, n, stream);
    case DType::kBF16: return launch_cast_from<__nv_bfloat16>(src, dst, dst_type, n, stream);
    case DType::kF16: return launch_cast_from<__half>(src, dst, dst_type, n, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace shardtrain::kernels::cuda
