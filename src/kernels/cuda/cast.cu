// Elementwise dtype conversion between fp32, bf16 and fp16.
//
// The dispatch uses it for casts of CUDA tensors, and the NCCL backend on its
// own stream to widen bf16/fp16 buffers to fp32 before a reduction and to
// narrow the result afterwards, where an ATen .to() would run on the caller's
// stream instead (and needs a CUDA LibTorch).

#include "kernels/cuda/kernel_common.cuh"

namespace shardtrain::kernels::cuda {
namespace {

// bf16 <-> fp16 goes through fp32, which holds both exactly, so there is
// still exactly one rounding (on the narrowing store).
template <class Src, class Dst>
__global__ void __launch_bounds__(kThreads)
    cast_kernel(const typename Src::Storage* __restrict__ src, typename Dst::Storage* __restrict__ dst,
                ElementwisePlan plan) {
  auto element = [&](int64_t i) { dst[i] = Dst::store(Src::load(src[i])); };
  auto pack = [&](int64_t first) {
    float x[kVec];
    detail::load_pack<Src>(src, first, x);
    detail::store_pack<Dst>(dst, first, x);
  };
  for_each_plan_item(plan, detail::global_thread(), detail::grid_stride(), element, pack);
}

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
  if (n < 0 || !detail::valid(src_type) || !detail::valid(dst_type)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (src == nullptr || dst == nullptr) return cudaErrorInvalidValue;
  if (src_type == dst_type) {
    if (src == dst) return cudaSuccess;
    // Nothing to convert: let the runtime pick its fastest device-to-device copy.
    return cudaMemcpyAsync(dst, src, static_cast<std::size_t>(n) * detail::element_size(src_type),
                           cudaMemcpyDeviceToDevice, stream);
  }
  ElementwisePlan plan;
  const int64_t head = common_head({elements_to_pack_alignment(src, detail::element_size(src_type)),
                                    elements_to_pack_alignment(dst, detail::element_size(dst_type))});
  cudaError_t status = detail::plan_for(n, head, &plan);
  if (status != cudaSuccess) return status;
  return detail::with_type(src_type, [&](auto src_tag) -> cudaError_t {
    using Src = decltype(src_tag);
    return detail::with_type(dst_type, [&](auto dst_tag) -> cudaError_t {
      using Dst = decltype(dst_tag);
      cast_kernel<Src, Dst><<<plan.blocks, plan.threads, 0, stream>>>(
          static_cast<const typename Src::Storage*>(src), static_cast<typename Dst::Storage*>(dst), plan);
      return cudaGetLastError();
    });
  });
}

}  // namespace shardtrain::kernels::cuda
