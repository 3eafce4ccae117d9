#pragma once
// The per-element arithmetic of the optimizer steps and the gradient-norm
// reduction, written once and compiled for the host (the CPU kernels) and the
// device (the CUDA kernels). Keeping one copy is what makes the two devices
// agree: an element's result depends only on its inputs and on which
// multiply-adds are fused, and that choice is explicit here, never left to the
// compiler.
//
// Plain C++17 with no ATen: nvcc compiles this header too.
//
// Rounding is explicit. Every operation is one IEEE round-to-nearest-even
// operation: on the device through the __f*_rn intrinsics (which nvcc never
// contracts into an fma), on the host through a value barrier that keeps GCC's
// default -ffp-contract=fast from fusing a product into a following add.
// Whether the steps' multiply-adds are fused is a template parameter of the
// ops policy (ScalarOps<kFused>): the CPU kernels follow what LibTorch's own
// CPU kernels do on the running machine; the CUDA kernels always fuse, which is
// what an FMA-capable CPU computes too, so both devices give the same bits there.

#include <cstdint>

#if defined(__CUDACC__)
#define ST_HOST_DEVICE __host__ __device__ __forceinline__
#elif defined(__GNUC__)
// Always inlined: the CPU kernels instantiate the updates with SIMD policies
// inside functions compiled for AVX2, and an out-of-line copy would be
// compiled for the baseline ISA and pass vectors through memory.
#define ST_HOST_DEVICE inline __attribute__((always_inline))
#else
#define ST_HOST_DEVICE inline
#endif

#if !defined(__CUDA_ARCH__)
#include <cmath>
#include <cstring>
#endif

namespace shardtrain::kernels::math {

// ---- per-step constants --------------------------------------------------------------

/// Adam/AdamW constants for one step, each rounded to float from a double
/// expression exactly where torch::optim rounds its Scalar arguments. Computed
/// once on the host (adam_scalars() in optimizer_params.h) and passed by value
/// to every kernel, CPU or CUDA, so both use the same bits.
struct AdamScalars {
  float grad_scale;
  float l2;             ///< wd, Adam mode only
  float decay;          ///< 1 - lr*wd, AdamW mode only
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float sqrt_bc2;       ///< sqrt(1 - beta2^step)
  float eps;
  float neg_step_size;  ///< -lr / (1 - beta1^step)
  // torch skips these terms when wd == 0; skipping too keeps 0*inf from
  // turning an inf parameter into NaN where torch would not.
  bool use_l2;
  bool use_decay;
};

/// SGD constants (dampening 0) for one step.
struct SgdScalars {
  float grad_scale;
  float weight_decay;
  float momentum;
  float neg_lr;  ///< -1 * lr, torch's add_(d_p, -1 * lr)
  bool use_wd;
  bool use_momentum;
  bool nesterov;
  bool first_step;
};

// ---- scalar ops policy ----------------------------------------------------------------

#if !defined(__CUDA_ARCH__)
/// The host's rounding barrier: the value must be materialised here, so a
/// product that went through it cannot be contracted with a later add.
/// T is float or double.
template <typename T>
inline T rounded(T x) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  asm volatile("" : "+x"(x));
#elif defined(__GNUC__)
  asm volatile("" : "+w"(x));
#else
  volatile T v = x;
  x = v;
#endif
  return x;
}
#endif

/// One float lane: the policy the CUDA kernels instantiate the updates with,
/// and the host reference the CPU kernels' vector policies are tested against.
/// kFused: whether madd() is one fused multiply-add (true) or a rounded
/// product followed by a rounded add.
template <bool kFused>
struct ScalarOps {
  using V = float;
  ST_HOST_DEVICE static float set1(float x) { return x; }
  /// Defined after the bf16 conversions below.
  ST_HOST_DEVICE static float round_bf16(float x);
#if defined(__CUDA_ARCH__)
  __device__ __forceinline__ static float add(float a, float b) { return __fadd_rn(a, b); }
  __device__ __forceinline__ static float mul(float a, float b) { return __fmul_rn(a, b); }
  __device__ __forceinline__ static float div(float a, float b) { return __fdiv_rn(a, b); }
  __device__ __forceinline__ static float sqrt(float a) { return __fsqrt_rn(a); }
  __device__ __forceinline__ static float mul_then_add(float a, float b, float c) {
    return __fadd_rn(__fmul_rn(a, b), c);
  }
  __device__ __forceinline__ static float madd(float a, float b, float c) {
    if constexpr (kFused) {
      return __fmaf_rn(a, b, c);
    } else {
      return __fadd_rn(__fmul_rn(a, b), c);
    }
  }
#else
  static float add(float a, float b) { return rounded(a + b); }
  static float mul(float a, float b) { return rounded(a * b); }
  static float div(float a, float b) { return rounded(a / b); }
  static float sqrt(float a) { return rounded(std::sqrt(a)); }
  static float mul_then_add(float a, float b, float c) { return rounded(rounded(a * b) + c); }
  static float madd(float a, float b, float c) {
    if constexpr (kFused) {
      return rounded(std::fma(a, b, c));
    } else {
      return mul_then_add(a, b, c);
    }
  }
#endif
};

// ---- the updates ----------------------------------------------------------------------

/// One Adam(W) update, in torch::optim's order:
///   AdamW: p.mul_(1 - lr*wd)          Adam: grad = grad.add(p, wd)  -> madd(p, wd, g)
///   m.mul_(b1).add_(g, 1 - b1)        -> madd(g, 1-b1, m*b1)
///   v.mul_(b2).addcmul_(g, g, 1 - b2) -> madd((1-b2)*g, g, v*b2)
///   denom = (v.sqrt() / sqrt(bc2)).add_(eps)
///   p.addcdiv_(m, denom, -step_size)  -> p + ((-step_size)*m) / denom
/// Ops is a vector-ops policy (ScalarOps here, the CPU kernels' SIMD ones);
/// V is one lane or a vector of lanes. Returns the update term
/// (-step_size)*m/denom, which the lost-update audit needs.
template <class Ops>
ST_HOST_DEVICE typename Ops::V adam_update(typename Ops::V& p, typename Ops::V& m, typename Ops::V& v,
                                const typename Ops::V& grad, const AdamScalars& c) {
  using V = typename Ops::V;
  V g = Ops::mul(grad, Ops::set1(c.grad_scale));
  if (c.use_l2) g = Ops::madd(p, Ops::set1(c.l2), g);
  if (c.use_decay) p = Ops::mul(p, Ops::set1(c.decay));
  m = Ops::madd(g, Ops::set1(c.one_minus_beta1), Ops::mul(m, Ops::set1(c.beta1)));
  v = Ops::madd(Ops::mul(Ops::set1(c.one_minus_beta2), g), g, Ops::mul(v, Ops::set1(c.beta2)));
  const V denom = Ops::add(Ops::div(Ops::sqrt(v), Ops::set1(c.sqrt_bc2)), Ops::set1(c.eps));
  const V update = Ops::div(Ops::mul(Ops::set1(c.neg_step_size), m), denom);
  p = Ops::add(p, update);
  return update;
}

/// torch::optim::SGD's order (dampening 0):
///   d = grad.add(p, wd)                     -> madd(p, wd, g)
///   buf = clone(d) on the first step, else buf.mul_(mom).add_(d, 1)
///                                           -> round(buf*mom) + d (d*1 is exact,
///                                              so fused or not it rounds twice)
///   nesterov: d = d.add(buf, mom)           -> madd(buf, mom, d); else d = buf
///   p.add_(d, -lr)                          -> madd(d, -lr, p)
/// `buf` is read only when momentum is on and this is not the first step.
/// Returns the direction d (the update is d * -lr).
template <class Ops>
ST_HOST_DEVICE typename Ops::V sgd_update(typename Ops::V& p, typename Ops::V& buf, const typename Ops::V& grad,
                               const SgdScalars& c) {
  using V = typename Ops::V;
  V d = Ops::mul(grad, Ops::set1(c.grad_scale));
  if (c.use_wd) d = Ops::madd(p, Ops::set1(c.weight_decay), d);
  if (c.use_momentum) {
    buf = c.first_step ? d : Ops::mul_then_add(buf, Ops::set1(c.momentum), d);
    d = c.nesterov ? Ops::madd(buf, Ops::set1(c.momentum), d) : buf;
  }
  p = Ops::madd(d, Ops::set1(c.neg_lr), p);
  return d;
}

// ---- 16-bit conversions ---------------------------------------------------------------

/// bf16 bits of `x`, rounded to nearest even, NaN -> 0x7fc0: c10::BFloat16's
/// conversion (what at::Tensor::to does), on either device.
ST_HOST_DEVICE uint16_t bf16_bits_from_float(float x) {
  uint32_t bits;
#if defined(__CUDA_ARCH__)
  bits = __float_as_uint(x);
#else
  std::memcpy(&bits, &x, sizeof(bits));
#endif
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  const uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7fffu + lsb) >> 16);
}

/// The float a bf16 bit pattern stands for (exact).
ST_HOST_DEVICE float float_from_bf16_bits(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
#endif
}

/// A value rounded to bf16 and widened back (exact): what a bf16 store keeps.
ST_HOST_DEVICE float bf16_round(float x) { return float_from_bf16_bits(bf16_bits_from_float(x)); }

template <bool kFused>
ST_HOST_DEVICE float ScalarOps<kFused>::round_bf16(float x) {
  return bf16_round(x);
}

// ---- the lost-update audit ------------------------------------------------------------
//
// An element's update is lost when the optimizer computed a non-zero update
// for it and the value stored afterwards equals the value stored before: the
// update was smaller than half an ulp of the stored type and rounding threw it
// away (FSDP's pure bf16 mode at small learning rates, the seeds' flat loss).
// The steps count, in the same pass:
//   audited       elements looked at;
//   lost          of those, lost in the type the step stores (fp32 master, or
//                 the bf16/fp16 parameter of pure low precision);
//   lost_if_bf16  of those, the ones a bf16 master would have lost: the old
//                 value rounded to bf16, moved by the same update (and decay),
//                 rounded to bf16 again, unchanged. It answers "what would pure
//                 bf16 do with this run's updates" inside an fp32-master run.
// Sampling: elements are grouped in granules of kAuditGranule consecutive
// elements of one kernel call's buffer; with sample period k only granules
// g with g % k == 0 are audited. The subset is fixed, so the fraction is
// comparable from step to step, and identical on CPU and GPU.

constexpr int64_t kAuditGranule = 256;

/// Where a step adds its audit counts: 3 counters {audited, lost,
/// lost_if_bf16} in the step's memory (host for the CPU kernels, device for
/// the CUDA ones). counts == nullptr: no audit.
struct AuditSpec {
  unsigned long long* counts = nullptr;
  int64_t sample_period = 1;
};

ST_HOST_DEVICE bool audited_element(int64_t i, int64_t sample_period) {
  return sample_period <= 1 || (i / kAuditGranule) % sample_period == 0;
}

/// The rule itself, on one lane: a non-zero update and an unchanged stored value.
ST_HOST_DEVICE bool update_lost(float stored_before, float stored_after, float update) {
  return update != 0.0f && stored_after == stored_before;
}

/// What a bf16 master holding `bf16_before` (a bf16 value) would hold after
/// this Adam update: AdamW's decay and the add in adam_update's order, then a
/// bf16 store. Ops needs round_bf16().
template <class Ops>
ST_HOST_DEVICE typename Ops::V adam_bf16_master_after(const typename Ops::V& bf16_before,
                                                      const typename Ops::V& update, const AdamScalars& c) {
  typename Ops::V x = bf16_before;
  if (c.use_decay) x = Ops::mul(x, Ops::set1(c.decay));
  return Ops::round_bf16(Ops::add(x, update));
}

/// The same for an SGD update along `direction` (p += direction * -lr, fused as sgd_update does).
template <class Ops>
ST_HOST_DEVICE typename Ops::V sgd_bf16_master_after(const typename Ops::V& bf16_before,
                                                     const typename Ops::V& direction, const SgdScalars& c) {
  return Ops::round_bf16(Ops::madd(direction, Ops::set1(c.neg_lr), bf16_before));
}

// ---- the gradient-norm reduction ------------------------------------------------------
//
// sum(x^2) in fp64 with one fixed order of additions, whatever the device or
// the thread count: a resumed run must clip exactly as the uninterrupted one
// did, and a CPU run and a GPU run of the same shard must agree.
//   * The input is cut into blocks of kSumBlock elements (the last may be short).
//   * Within a block, lane l (of kSumLanes) adds the squares of elements
//     l, l + kSumLanes, l + 2*kSumLanes, ... in that order, from 0.
//   * The lanes are folded pairwise: lane[l] += lane[l + s] for s = kSumLanes/2,
//     ..., 1, which leaves the block's sum in lane 0.
//   * The block sums are added in block order, from 0.
// On the GPU one CUDA block of kSumLanes threads sums one block, one thread per
// lane; the CPU kernel runs the same lanes in a loop.

constexpr int64_t kSumBlock = 16384;
constexpr int kSumLanes = 256;

/// Adds one element's square to a lane. The square of an fp32 value is exact
/// in fp64 (48 significant bits), so only the add rounds; no fma may fuse them.
ST_HOST_DEVICE double add_square(double lane, float x) {
  const double d = static_cast<double>(x);
#if defined(__CUDA_ARCH__)
  return __dadd_rn(lane, __dmul_rn(d, d));
#else
  return rounded(lane + rounded(d * d));
#endif
}

ST_HOST_DEVICE double add_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return rounded(a + b);
#endif
}

/// Number of kSumBlock blocks covering n elements.
ST_HOST_DEVICE int64_t sum_blocks(int64_t n) { return (n + kSumBlock - 1) / kSumBlock; }

}  // namespace shardtrain::kernels::math
