// Decoding NF4 buffers (kernels/nf4_format.h) on the GPU: the CUDA half of
// the dequantizing matmul (the bf16 GEMM that follows is cuBLAS's, through
// ATen). A grid-stride loop over the bytes, two elements each (the grid is
// the elementwise launch plan's for numel/2 items); each product and sum is
// rounded on its own (__fmul_rn, __fadd_rn: nvcc would otherwise fuse them),
// so the values are the CPU kernel's bits.

#include "kernels/cuda/kernel_common.cuh"
#include "kernels/nf4_format.h"

namespace shardtrain::kernels::cuda {
namespace {

__device__ __forceinline__ float load_f32(const uint8_t* p) {
  // Byte loads: a gathered buffer may start at any byte.
  const uint32_t bits = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
                        (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
  return __uint_as_float(bits);
}

template <class Out>
__global__ void __launch_bounds__(kThreads)
    nf4_dequantize_kernel(const uint8_t* __restrict__ buffer, nf4::Layout l, const float* __restrict__ code8,
                          typename Out::Storage* __restrict__ out) {
  const float offset = load_f32(buffer + l.offset);
  for (int64_t byte = detail::global_thread(); byte < l.numel / 2; byte += detail::grid_stride()) {
    const int64_t block = 2 * byte / nf4::kBlock;
    const float scale = load_f32(buffer + l.absmax_scales + 4 * (block / nf4::kAbsmaxBlock));
    const float absmax = __fadd_rn(__fmul_rn(code8[buffer[l.absmax_codes + block]], scale), offset);
    const uint8_t codes = buffer[l.codes + byte];
    out[2 * byte] = Out::store(__fmul_rn(nf4::value(codes >> 4), absmax));
    out[2 * byte + 1] = Out::store(__fmul_rn(nf4::value(codes & 15), absmax));
  }
}

}  // namespace

cudaError_t launch_nf4_dequantize(const uint8_t* buffer, const float* absmax_code, void* out, DType out_type,
                                  int64_t numel, cudaStream_t stream) {
  if (numel < 0 || numel % nf4::kBlock != 0 || !detail::valid(out_type)) return cudaErrorInvalidValue;
  if (numel == 0) return cudaSuccess;
  if (buffer == nullptr || absmax_code == nullptr || out == nullptr) return cudaErrorInvalidValue;
  ElementwisePlan plan;
  cudaError_t status = detail::plan_for(numel / 2, 0, &plan);
  if (status != cudaSuccess) return status;
  const nf4::Layout layout = nf4::Layout::of(numel);
  return detail::with_type(out_type, [&](auto tag) -> cudaError_t {
    using Out = decltype(tag);
    nf4_dequantize_kernel<Out><<<plan.blocks, plan.threads, 0, stream>>>(
        buffer, layout, absmax_code, static_cast<typename Out::Storage*>(out));
    return cudaGetLastError();
  });
}

}  // namespace shardtrain::kernels::cuda
