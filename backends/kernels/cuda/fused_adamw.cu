// Fused Adam/AdamW step on the fp32 master partition.
//
// One kernel reads grad, master, m, v once and writes master, m, v and the
// low-precision compute copy once: the optimizer step is bound by memory
// traffic (16-18 bytes per parameter), so fusing the unscale/clip multiply,
// the update and the downcast into one pass is the whole optimisation.

#include <cmath>

#include "kernels/cuda/kernel_common.cuh"

namespace shardtrain::kernels::cuda {
namespace {

using detail::kVec;
using detail::Pack;

/// Step constants, folded on the host in double so the kernel does no pow().
struct AdamConstants {
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float step_size;     ///< lr / bias_correction1
  float sqrt_bc2;      ///< sqrt(bias_correction2)
  float decay_factor;  ///< 1 - lr * wd (AdamW), 1 otherwise
  float l2;            ///< wd (Adam with L2), 0 otherwise
  float grad_scale;
};

/// The per-element update, shared by the vector and the tail paths so the two
/// cannot drift apart. Same operation order as torch.optim.AdamW
/// (decay, moments, denom = sqrt(v)/sqrt(bc2) + eps, p -= step_size * m/denom).
__device__ __forceinline__ void adam_element(float& p, float& m, float& v, float grad,
                                             const AdamConstants& c) {
  float g = grad * c.grad_scale;
  g = fmaf(c.l2, p, g);  // l2 == 0 in AdamW mode: the branch-free form keeps the loop uniform
  p *= c.decay_factor;   // decay_factor == 1 in Adam mode
  m = c.beta1 * m + c.one_minus_beta1 * g;
  v = c.beta2 * v + c.one_minus_beta2 * g * g;
  const float denom = sqrtf(v) / c.sqrt_bc2 + c.eps;
  p -= c.step_size * (m / denom);
}

/// OutT is float when no low-precision copy is written (`out` is then null and
/// never touched; the float instantiation only exists to keep one kernel body).
template <typename OutT, bool kWriteOut, bool kVectorised>
__global__ void __launch_bounds__(detail::kThreads)
    fused_adam_kernel(float* __restrict__ master, float* __restrict__ exp_avg,
                      float* __restrict__ exp_avg_sq, const float* __restrict__ grad,
                      OutT* __restrict__ out, int64_t n, AdamConstants c) {
  const int64_t stride = detail::grid_stride();
  const int64_t n_packs = kVectorised ? n / kVec : 0;
  for (int64_t i = detail::global_thread(); i < n_packs; i += stride) {
    Pack<float> p = reinterpret_cast<const Pack<float>*>(master)[i];
    Pack<float> m = reinterpret_cast<const Pack<float>*>(exp_avg)[i];
    Pack<float> v = reinterpret_cast<const Pack<float>*>(exp_avg_sq)[i];
    const Pack<float> g = reinterpret_cast<const Pack<float>*>(grad)[i];
#pragma unroll
    for (int k = 0; k < kVec; ++k) adam_element(p.v[k], m.v[k], v.v[k], g.v[k], c);
    reinterpret_cast<Pack<float>*>(master)[i] = p;
    reinterpret_cast<Pack<float>*>(exp_avg)[i] = m;
    reinterpret_cast<Pack<float>*>(exp_avg_sq)[i] = v;
    if constexpr (kWriteOut) {
      Pack<OutT> o;
#pragma unroll
      for (int k = 0; k < kVec; ++k) o.v[k] = detail::from_float<OutT>(p.v[k]);
      reinterpret_cast<Pack<OutT>*>(out)[i] = o;
    }
  }
  // Tail (or everything, on the unaligned path), one element per thread.
  for (int64_t i = n_packs * kVec + detail::global_thread(); i < n; i += stride) {
    float p = master[i];
    float m = exp_avg[i];
    float v = exp_avg_sq[i];
    adam_element(p, m, v, grad[i], c);
    master[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if constexpr (kWriteOut) out[i] = detail::from_float<OutT>(p);
  }
}

template <typename OutT, bool kWriteOut>
cudaError_t launch_typed(float* master, float* exp_avg, float* exp_avg_sq, const float* grad,
                         void* out, int64_t n, const AdamConstants& c, cudaStream_t stream) {
  // Views into a flat buffer can start at any element; only take the wide
  // path when every stream is aligned for it.
  const bool vectorised = detail::pack_aligned<float>(master) && detail::pack_aligned<float>(exp_avg) &&
                          detail::pack_aligned<float>(exp_avg_sq) && detail::pack_aligned<float>(grad) &&
                          (!kWriteOut || detail::pack_aligned<OutT>(out));
  unsigned blocks = 0;
  cudaError_t status = detail::grid_size(detail::vector_work_items(n, vectorised), &blocks);
  if (status != cudaSuccess) return status;
  OutT* typed_out = static_cast<OutT*>(out);
  if (vectorised) {
    fused_adam_kernel<OutT, kWriteOut, true>
        <<<blocks, detail::kThreads, 0, stream>>>(master, exp_avg, exp_avg_sq, grad, typed_out, n, c);
  } else {
    fused_adam_kernel<OutT, kWriteOut, false>
        <<<blocks, detail::kThreads, 0, stream>>>(master, exp_avg, exp_avg_sq, grad, typed_out, n, c);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_fused_adamw(float* master, float* exp_avg, float* exp_avg_sq, const float* grad,
                               void* low_precision_out, LowPrecision kind, int64_t n,
                               const AdamWParams& p, cudaStream_t stream) {
  if (n < 0 || p.step < 1) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (master == nullptr || exp_avg == nullptr || exp_avg_sq == nullptr || grad == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (low_precision_out != nullptr && kind == LowPrecision::kNone) return cudaErrorInvalidValue;

  // Bias corrections in double: beta2^step for beta2 = 0.999 loses most of its
  // digits in fp32 once 1 - beta2^step is small (early steps), which is
  // exactly where the correction matters most.
  const double step = static_cast<double>(p.step);
  const double bc1 = p.bias_correction ? 1.0 - std::pow(static_cast<double>(p.beta1), step) : 1.0;
  const double bc2 = p.bias_correction ? 1.0 - std::pow(static_cast<double>(p.beta2), step) : 1.0;
  if (!(bc1 > 0.0) || !(bc2 > 0.0)) return cudaErrorInvalidValue;  // beta >= 1: no valid update
  AdamConstants c{};
  c.beta1 = p.beta1;
  c.beta2 = p.beta2;
  c.one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(p.beta1));
  c.one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(p.beta2));
  c.eps = p.eps;
  c.step_size = static_cast<float>(static_cast<double>(p.lr) / bc1);
  c.sqrt_bc2 = static_cast<float>(std::sqrt(bc2));
  c.decay_factor = p.adam_w_mode ? static_cast<float>(1.0 - static_cast<double>(p.lr) * p.weight_decay) : 1.0f;
  c.l2 = p.adam_w_mode ? 0.0f : p.weight_decay;
  c.grad_scale = p.grad_scale;

  if (low_precision_out == nullptr) {
    return launch_typed<float, false>(master, exp_avg, exp_avg_sq, grad, nullptr, n, c, stream);
  }
  switch (kind) {
    case LowPrecision::kBF16:
      return launch_typed<__nv_bfloat16, true>(master, exp_avg, exp_avg_sq, grad, low_precision_out, n, c,
                                               stream);
    case LowPrecision::kF16:
      return launch_typed<__half, true>(master, exp_avg, exp_avg_sq, grad, low_precision_out, n, c, stream);
    case LowPrecision::kNone:
      break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace shardtrain::kernels::cuda
