// CPU versions of the shared kernels (see cpu_kernels.h for the contract).
//
// Each optimizer kernel walks its buffers once, one vector of floats at a
// time, inside at::parallel_for chunks. The per-element arithmetic is
// element_math.h's (adam_update, sgd_update, shared with the CUDA kernels),
// instantiated with a vector-ops policy:
//  * GenericOps: at::vec::Vectorized<float>, compiled for the baseline ISA,
//    with every multiply-add rounded twice, as LibTorch's DEFAULT kernels do;
//  * Avx2Ops (x86): raw AVX2 registers with the multiply-adds LibTorch's
//    AVX2/AVX-512 kernels fuse done as fma, chosen at run time where ATen
//    dispatches those kernels.
// Either way an element's result depends only on its inputs, never on where
// chunk or vector boundaries fell.
//
// One piece: the vector-ops policies and the audit tally are always_inline
// templates instantiated inside every kernel's element loop; split over
// files they would become one header of templates included by each kernel,
// with the ABI-warning pragmas below repeated in each.

#if defined(__GNUC__)
// The element loops are templates compiled for the baseline target but
// instantiated with Avx2Ops, whose functions pass __m256 by value; GCC warns
// about that ABI on the template body. The body is always_inline and only
// ever lands inside an ST_AVX2_TARGET function, so no call with the baseline
// ABI is emitted.
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#include "kernels/cpu/cpu_kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "kernels/element_math.h"
#include "shardtrain/error.h"

// The AVX2 path needs GCC: clang type-checks the shared element templates
// (instantiated with __m256 lanes) outside the AVX2 target and rejects their
// vector ABI. A clang build (the fuzz build, tests/fuzz) runs the generic
// lanes, and fuses_multiply_add() says so.
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#include <cpuid.h>
#include <immintrin.h>
#define ST_HAVE_AVX2_PATH 1
#else
#define ST_HAVE_AVX2_PATH 0
#endif

#if defined(__GNUC__)
#define ST_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define ST_ALWAYS_INLINE inline
#endif


namespace shardtrain::kernels::cpu {
namespace {

// ~32K elements per task: big enough that the pool's dispatch cost is noise
// next to streaming 4-5 buffers, small enough to spread a 1M-element shard
// over every core.
constexpr int64_t kGrain = 32768;

template <typename T>
constexpr bool kIsLowPrecision = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;

// ---- vector-ops policies ----------------------------------------------------------
//
// Why two: LibTorch's AVX2/AVX-512 kernels are compiled with FMA enabled and
// GCC contracts their multiply-adds (add_(x, alpha) is vec::fmadd(x, alpha,
// self); addcmul_'s self + value*t1*t2 becomes fma(value*t1, t2, self)),
// while its DEFAULT kernels round every product. madd() reproduces whichever
// applies, so the steps below match torch::optim bit for bit.
// mul_then_add() is a product that LibTorch rounds on its own (a separate
// mul_ pass); the empty asm keeps GCC, whose C++ default is
// -ffp-contract=fast, from contracting it into an fma where FMA exists.

struct GenericOps {
  using V = at::vec::Vectorized<float>;
  static constexpr int64_t kWidth = V::size();

  static V set1(float x) { return V(x); }
  static V add(const V& a, const V& b) { return a + b; }
  static V mul(const V& a, const V& b) { return a * b; }
  static V div(const V& a, const V& b) { return a / b; }
  static V mul_then_add(const V& a, const V& b, const V& c) {
    V product = a * b;
#if defined(__GNUC__)
    asm volatile("" : "+m"(product));
#endif
    return product + c;
  }
  static V madd(const V& a, const V& b, const V& c) { return mul_then_add(a, b, c); }
  static V sqrt(const V& a) {
#if ST_HAVE_AVX2_PATH
    // Vectorized's generic sqrt() maps std::sqrt, which with errno semantics
    // compiles to scalar roots and branches; SSE (baseline x86-64) has the
    // packed, equally correctly rounded instruction.
    alignas(64) float x[kWidth];
    a.store(x);
    for (int64_t k = 0; k < kWidth; k += 4) _mm_store_ps(x + k, _mm_sqrt_ps(_mm_load_ps(x + k)));
    return V::loadu(x);
#else
    return a.sqrt();
#endif
  }

  // The lost-update audit's lanes. This policy is the fallback for CPUs and
  // settings without ATen's vector kernels, so it goes through memory and
  // element_math.h's scalar conversions rather than per-ISA tricks.
  static V round_bf16(const V& a) {
    alignas(64) float x[kWidth];
    a.store(x);
    for (int64_t k = 0; k < kWidth; ++k) x[k] = math::bf16_round(x[k]);
    return V::loadu(x);
  }
  template <typename T>
  static V round_to(const V& a) {
    if constexpr (std::is_same_v<T, float>) {
      return a;
    } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
      return round_bf16(a);
    } else {
      alignas(64) float x[kWidth];
      a.store(x);
      for (int64_t k = 0; k < kWidth; ++k) x[k] = static_cast<float>(c10::Half(x[k]));
      return V::loadu(x);
    }
  }
  /// Lanes (a bit mask) where math::update_lost holds.
  static int count_lost(const V& before, const V& after, const V& update, uint32_t lanes) {
    alignas(64) float b[kWidth], a[kWidth], u[kWidth];
    before.store(b);
    after.store(a);
    update.store(u);
    int lost = 0;
    for (int64_t k = 0; k < kWidth; ++k) lost += ((lanes >> k) & 1u) != 0 && math::update_lost(b[k], a[k], u[k]);
    return lost;
  }

  template <typename T>
  static V load(const T* src, int64_t count) {
    if constexpr (std::is_same_v<T, float>) {
      return count == kWidth ? V::loadu(src) : V::loadu(src, count);
    } else {
      alignas(64) float tmp[kWidth] = {};
      for (int64_t k = 0; k < count; ++k) tmp[k] = static_cast<float>(src[k]);
      return V::loadu(tmp);
    }
  }

  // The c10::BFloat16 / c10::Half constructors round to nearest even, the same
  // conversion at::Tensor::to applies, so a compute copy equals master.to(dtype).
  template <typename T>
  static void store(T* dst, const V& v, int64_t count) {
    if constexpr (std::is_same_v<T, float>) {
      if (count == kWidth) {
        v.store(dst);
      } else {
        v.store(dst, static_cast<int>(count));
      }
    } else {
      alignas(64) float tmp[kWidth];
      v.store(tmp);
      for (int64_t k = 0; k < count; ++k) dst[k] = T(tmp[k]);
    }
  }
};

#if ST_HAVE_AVX2_PATH
// Every Avx2Ops function and every function that instantiates the element
// loops with it carries this target, so the library itself still builds for
// baseline x86-64; they only run where fuses_multiply_add() found the ISA.
#define ST_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

struct Avx2Ops {
  using V = __m256;
  static constexpr int64_t kWidth = 8;

  ST_AVX2_TARGET static V set1(float x) { return _mm256_set1_ps(x); }
  ST_AVX2_TARGET static V add(V a, V b) { return _mm256_add_ps(a, b); }
  // GCC treats these intrinsics as plain vector arithmetic, which its default
  // -ffp-contract=fast may fuse with a following add; the barrier keeps every
  // product rounded on its own, as element_math.h's lanes and the CUDA
  // kernels round it. Only madd() fuses.
  ST_AVX2_TARGET static V mul(V a, V b) {
    V product = _mm256_mul_ps(a, b);
    asm volatile("" : "+x"(product));
    return product;
  }
  ST_AVX2_TARGET static V div(V a, V b) { return _mm256_div_ps(a, b); }
  ST_AVX2_TARGET static V sqrt(V a) { return _mm256_sqrt_ps(a); }
  ST_AVX2_TARGET static V madd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  ST_AVX2_TARGET static V mul_then_add(V a, V b, V c) {
    V product = _mm256_mul_ps(a, b);
    asm volatile("" : "+x"(product));
    return _mm256_add_ps(product, c);
  }

  /// c10::detail::round_to_nearest_even on eight lanes, widened back:
  /// (bits + 0x7fff + lsb) & 0xffff0000, NaN -> 0x7fc00000.
  ST_AVX2_TARGET static V round_bf16(V v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
                                       _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc00000), nan);
    return _mm256_castsi256_ps(rounded);
  }
  template <typename T>
  ST_AVX2_TARGET static V round_to(V v) {
    if constexpr (std::is_same_v<T, float>) {
      return v;
    } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
      return round_bf16(v);
    } else {
      // F16C's conversion rounds to nearest even, as c10::Half does.
      return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
  /// Lanes in `lanes` where math::update_lost holds: an ordered equality (NaN
  /// never equals) and an unordered inequality with 0 (a NaN update counts as
  /// non-zero), as the scalar comparisons.
  ST_AVX2_TARGET static int count_lost(V before, V after, V update, uint32_t lanes) {
    const V unchanged = _mm256_cmp_ps(after, before, _CMP_EQ_OQ);
    const V nonzero = _mm256_cmp_ps(update, _mm256_setzero_ps(), _CMP_NEQ_UQ);
    const auto mask = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_and_ps(unchanged, nonzero)));
    return __builtin_popcount(mask & lanes);
  }

  template <typename T>
  ST_AVX2_TARGET static V load(const T* src, int64_t count) {
    if constexpr (std::is_same_v<T, float>) {
      if (count == kWidth) return _mm256_loadu_ps(src);
      alignas(32) float tmp[kWidth] = {};
      std::memcpy(tmp, src, static_cast<size_t>(count) * sizeof(float));
      return _mm256_load_ps(tmp);
    } else {
      __m128i bits;
      if (count == kWidth) {
        bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      } else {
        alignas(16) uint16_t tmp[kWidth] = {};
        std::memcpy(tmp, src, static_cast<size_t>(count) * sizeof(uint16_t));
        bits = _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
      }
      // Both widenings are exact: bf16 is the top half of an fp32, and every
      // fp16 value is representable in fp32.
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
      } else {
        return _mm256_cvtph_ps(bits);
      }
    }
  }

  template <typename T>
  ST_AVX2_TARGET static void store(T* dst, V v, int64_t count) {
    if constexpr (std::is_same_v<T, float>) {
      if (count == kWidth) {
        _mm256_storeu_ps(dst, v);
        return;
      }
      alignas(32) float tmp[kWidth];
      _mm256_store_ps(tmp, v);
      std::memcpy(dst, tmp, static_cast<size_t>(count) * sizeof(float));
    } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
      // c10::detail::round_to_nearest_even, eight lanes at once:
      // (bits + 0x7fff + lsb) >> 16, NaN -> 0x7fc0.
      const __m256i bits = _mm256_castps_si256(v);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
      __m256i rounded =
          _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
      const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
      // packus works per 128-bit half: [r0..r3 r0..r3 | r4..r7 r4..r7]; gather qwords 0 and 2.
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
      const __m128i out = _mm256_castsi256_si128(packed);
      if (count == kWidth) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), out);
      } else {
        alignas(16) uint16_t tmp[kWidth];
        _mm_store_si128(reinterpret_cast<__m128i*>(tmp), out);
        std::memcpy(dst, tmp, static_cast<size_t>(count) * sizeof(uint16_t));
      }
    } else {
      // fp16 copies go through c10::Half so NaN encodings match at::Tensor::to too.
      alignas(32) float tmp[kWidth];
      _mm256_store_ps(tmp, v);
      for (int64_t k = 0; k < count; ++k) dst[k] = c10::Half(tmp[k]);
    }
  }
};
#endif  // ST_HAVE_AVX2_PATH

bool detect_torch_fuses_multiply_add() {
#if ST_HAVE_AVX2_PATH
  // LibTorch's own rule (DispatchStub.cpp, compute_cpu_capability):
  // ATEN_CPU_CAPABILITY=default forces the DEFAULT kernels; otherwise AVX2 (or
  // AVX-512) runs when the CPU has AVX2 and FMA3. F16C (present on every such
  // CPU) is required too, for Avx2Ops' fp16 loads.
  if (const char* forced = std::getenv("ATEN_CPU_CAPABILITY")) {
    if (std::strcmp(forced, "default") == 0) return false;
  }
  __builtin_cpu_init();
  // F16C through CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports
  // does not know "f16c".
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 29)) != 0;
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
#else
  return false;
#endif
}

/// Calls f with a value of the C++ type behind `type` (fp32, bf16 or fp16).
template <typename F>
void dispatch_float_types(at::ScalarType type, const char* what, F&& f) {
  switch (type) {
    case at::kFloat:
      f(float{});
      return;
    case at::kBFloat16:
      f(c10::BFloat16{});
      return;
    case at::kHalf:
      f(c10::Half{});
      return;
    default:
      ST_THROW(Error, what, " must be float32, bfloat16 or float16, got ", type);
  }
}

void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  ST_CHECK(t.defined(), name, " is an undefined tensor");
  ST_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device());
  ST_CHECK(t.layout() == at::kStrided, name, " must be a dense (strided) tensor");
  ST_CHECK(t.is_contiguous(), name, " must be contiguous (these kernels stream flat buffers)");
}

void check_same_numel(const at::Tensor& t, const char* name, int64_t numel) {
  ST_CHECK(t.numel() == numel, name, " has ", t.numel(), " elements, expected ", numel);
}

void check_low_precision_out(const at::Tensor* out, int64_t numel) {
  if (out == nullptr) return;
  check_cpu_contiguous(*out, "low_precision_out");
  ST_CHECK(out->scalar_type() == at::kBFloat16 || out->scalar_type() == at::kHalf,
           "low_precision_out must be bfloat16 or float16, got ", out->scalar_type());
  check_same_numel(*out, "low_precision_out", numel);
}

// ---- Adam ----------------------------------------------------------------------

/// One task's lost-update counts (element_math.h's audit).
struct AuditTally {
  int64_t audited = 0, lost = 0, lost_if_bf16 = 0;
};

/// Bit k set: element i + k (k < count) is audited at this sample period.
ST_ALWAYS_INLINE uint32_t audit_lanes(int64_t i, int64_t count, int64_t period) {
  const uint32_t all = count >= 32 ? ~0u : (1u << count) - 1u;
  if (period <= 1) return all;
  const int64_t first = i / math::kAuditGranule;
  if (first == (i + count - 1) / math::kAuditGranule) return first % period == 0 ? all : 0u;
  uint32_t lanes = 0;
  for (int64_t k = 0; k < count; ++k) lanes |= static_cast<uint32_t>(math::audited_element(i + k, period)) << k;
  return lanes;
}

/// Counts one vector of updates: `before` the stored value widened,
/// `stored_after` the value stored now, `hypothetical_after` what a bf16
/// master starting from `bf16_before` would store.
template <class Ops>
ST_ALWAYS_INLINE void tally_lanes(const typename Ops::V& before, const typename Ops::V& stored_after,
                                  const typename Ops::V& bf16_before, const typename Ops::V& hypothetical_after,
                                  const typename Ops::V& update, uint32_t lanes, AuditTally& tally) {
  tally.audited += __builtin_popcount(lanes);
  tally.lost += Ops::count_lost(before, stored_after, update, lanes);
  tally.lost_if_bf16 += Ops::count_lost(bf16_before, hypothetical_after, update, lanes);
}

/// StateT: what param/m/v are stored in (float, or bf16/fp16 in pure low
/// precision mode). OutT: the optional compute copy's type (unused unless
/// kWriteOut). kAudit: count lost updates into `tally` (period: sample period).
template <class Ops, typename StateT, typename GradT, typename OutT, bool kWriteOut, bool kAudit>
ST_ALWAYS_INLINE void adam_range(StateT* param, StateT* exp_avg, StateT* exp_avg_sq, const GradT* grad,
                                 OutT* out, int64_t begin, int64_t end, const math::AdamScalars& c,
                                 int64_t period, AuditTally* tally) {
  using V = typename Ops::V;
  for (int64_t i = begin; i < end; i += Ops::kWidth) {
    const int64_t count = std::min(Ops::kWidth, end - i);
    V p = Ops::load(param + i, count);
    const V before = p;
    V m = Ops::load(exp_avg + i, count);
    V v = Ops::load(exp_avg_sq + i, count);
    const V update = math::adam_update<Ops>(p, m, v, Ops::load(grad + i, count), c);
    Ops::store(param + i, p, count);
    Ops::store(exp_avg + i, m, count);
    Ops::store(exp_avg_sq + i, v, count);
    if constexpr (kWriteOut) Ops::store(out + i, p, count);
    if constexpr (kAudit) {
      const uint32_t lanes = audit_lanes(i, count, period);
      if constexpr (std::is_same_v<StateT, c10::BFloat16>) {
        // A bf16 state is the bf16 master: the hypothetical rounds the same
        // values through the same operations, so it is the real count.
        if (lanes != 0) {
          const int lost = Ops::count_lost(before, Ops::template round_to<StateT>(p), update, lanes);
          tally->audited += __builtin_popcount(lanes);
          tally->lost += lost;
          tally->lost_if_bf16 += lost;
        }
      } else if (lanes != 0) {
        const V bf16_before = Ops::round_bf16(before);
        tally_lanes<Ops>(before, Ops::template round_to<StateT>(p), bf16_before,
                         math::adam_bf16_master_after<Ops>(bf16_before, update, c), update, lanes, *tally);
      }
    }
  }
}

template <typename StateT, typename GradT, typename OutT, bool kWriteOut, bool kAudit>
void adam_range_generic(StateT* param, StateT* exp_avg, StateT* exp_avg_sq, const GradT* grad, OutT* out,
                        int64_t begin, int64_t end, const math::AdamScalars& c, int64_t period,
                        AuditTally* tally) {
  adam_range<GenericOps, StateT, GradT, OutT, kWriteOut, kAudit>(param, exp_avg, exp_avg_sq, grad, out, begin,
                                                                 end, c, period, tally);
}

#if ST_HAVE_AVX2_PATH
template <typename StateT, typename GradT, typename OutT, bool kWriteOut, bool kAudit>
ST_AVX2_TARGET void adam_range_avx2(StateT* param, StateT* exp_avg, StateT* exp_avg_sq, const GradT* grad,
                                    OutT* out, int64_t begin, int64_t end, const math::AdamScalars& c,
                                    int64_t period, AuditTally* tally) {
  adam_range<Avx2Ops, StateT, GradT, OutT, kWriteOut, kAudit>(param, exp_avg, exp_avg_sq, grad, out, begin, end,
                                                              c, period, tally);
}
#endif

/// Runs `range(begin, end, tally)` over [0, n) on the intra-op pool and adds
/// the tasks' audit counts to `audit.counts` (integer sums: the order the
/// tasks finish in does not matter).
template <class Range>
void parallel_with_audit(int64_t n, const math::AuditSpec& audit, Range&& range) {
  std::atomic<int64_t> audited{0}, lost{0}, lost_if_bf16{0};
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    AuditTally tally;
    range(begin, end, &tally);
    audited.fetch_add(tally.audited, std::memory_order_relaxed);
    lost.fetch_add(tally.lost, std::memory_order_relaxed);
    lost_if_bf16.fetch_add(tally.lost_if_bf16, std::memory_order_relaxed);
  });
  if (audit.counts != nullptr) {
    audit.counts[0] += static_cast<unsigned long long>(audited.load());
    audit.counts[1] += static_cast<unsigned long long>(lost.load());
    audit.counts[2] += static_cast<unsigned long long>(lost_if_bf16.load());
  }
}

/// Runs the Adam element loop over [0, n) on the intra-op pool, with the
/// multiply-add flavour LibTorch uses on this machine.
template <typename StateT, typename GradT, typename OutT, bool kWriteOut, bool kAudit>
void adam_parallel(StateT* param, StateT* exp_avg, StateT* exp_avg_sq, const GradT* grad, OutT* out,
                   int64_t n, const math::AdamScalars& c, const math::AuditSpec& audit) {
  const int64_t period = audit.sample_period;
#if ST_HAVE_AVX2_PATH
  if (fuses_multiply_add()) {
    parallel_with_audit(n, audit, [&](int64_t begin, int64_t end, AuditTally* tally) {
      adam_range_avx2<StateT, GradT, OutT, kWriteOut, kAudit>(param, exp_avg, exp_avg_sq, grad, out, begin, end, c,
                                                              period, tally);
    });
    return;
  }
#endif
  parallel_with_audit(n, audit, [&](int64_t begin, int64_t end, AuditTally* tally) {
    adam_range_generic<StateT, GradT, OutT, kWriteOut, kAudit>(param, exp_avg, exp_avg_sq, grad, out, begin, end,
                                                               c, period, tally);
  });
}

/// Calls f(std::bool_constant<audit.counts != nullptr>{}): the audit is a
/// template switch, so a step without it has no extra instructions.
template <class F>
void with_audit(const math::AuditSpec& audit, F&& f) {
  if (audit.counts != nullptr) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// ---- SGD ----------------------------------------------------------------------

template <class Ops, typename GradT, typename OutT, bool kWriteOut, bool kAudit>
ST_ALWAYS_INLINE void sgd_range(float* param, float* buffer, const GradT* grad, OutT* out, int64_t begin,
                                int64_t end, const math::SgdScalars& c, int64_t period, AuditTally* tally) {
  using V = typename Ops::V;
  const bool read_buffer = c.use_momentum && !c.first_step;
  for (int64_t i = begin; i < end; i += Ops::kWidth) {
    const int64_t count = std::min(Ops::kWidth, end - i);
    V p = Ops::load(param + i, count);
    const V before = p;
    V buf = read_buffer ? Ops::load(buffer + i, count) : Ops::set1(0.0f);
    const V direction = math::sgd_update<Ops>(p, buf, Ops::load(grad + i, count), c);
    Ops::store(param + i, p, count);
    if (c.use_momentum) Ops::store(buffer + i, buf, count);
    if constexpr (kWriteOut) Ops::store(out + i, p, count);
    if constexpr (kAudit) {
      const uint32_t lanes = audit_lanes(i, count, period);
      if (lanes != 0) {
        const V bf16_before = Ops::round_bf16(before);
        tally_lanes<Ops>(before, p, bf16_before, math::sgd_bf16_master_after<Ops>(bf16_before, direction, c),
                         Ops::mul(direction, Ops::set1(c.neg_lr)), lanes, *tally);
      }
    }
  }
}

template <typename GradT, typename OutT, bool kWriteOut, bool kAudit>
void sgd_range_generic(float* param, float* buffer, const GradT* grad, OutT* out, int64_t begin,
                       int64_t end, const math::SgdScalars& c, int64_t period, AuditTally* tally) {
  sgd_range<GenericOps, GradT, OutT, kWriteOut, kAudit>(param, buffer, grad, out, begin, end, c, period, tally);
}

#if ST_HAVE_AVX2_PATH
template <typename GradT, typename OutT, bool kWriteOut, bool kAudit>
ST_AVX2_TARGET void sgd_range_avx2(float* param, float* buffer, const GradT* grad, OutT* out, int64_t begin,
                                   int64_t end, const math::SgdScalars& c, int64_t period, AuditTally* tally) {
  sgd_range<Avx2Ops, GradT, OutT, kWriteOut, kAudit>(param, buffer, grad, out, begin, end, c, period, tally);
}
#endif

template <typename GradT, typename OutT, bool kWriteOut, bool kAudit>
void sgd_parallel(float* param, float* buffer, const GradT* grad, OutT* out, int64_t n,
                  const math::SgdScalars& c, const math::AuditSpec& audit) {
  const int64_t period = audit.sample_period;
#if ST_HAVE_AVX2_PATH
  if (fuses_multiply_add()) {
    parallel_with_audit(n, audit, [&](int64_t begin, int64_t end, AuditTally* tally) {
      sgd_range_avx2<GradT, OutT, kWriteOut, kAudit>(param, buffer, grad, out, begin, end, c, period, tally);
    });
    return;
  }
#endif
  parallel_with_audit(n, audit, [&](int64_t begin, int64_t end, AuditTally* tally) {
    sgd_range_generic<GradT, OutT, kWriteOut, kAudit>(param, buffer, grad, out, begin, end, c, period, tally);
  });
}

// ---- reductions -----------------------------------------------------------------

using math::kSumBlock;
using math::kSumLanes;

/// One block of element_math.h's gradient-norm order: lane l adds elements
/// l, l + kSumLanes, ... and the lanes fold pairwise, as the CUDA kernel's
/// threads do. The lane loop is independent across lanes, so the compiler
/// vectorises it.
template <typename T>
double block_sum_of_squares(const T* x, int64_t n) {
  alignas(64) double lanes[kSumLanes] = {};
  int64_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    for (int l = 0; l < kSumLanes; ++l) {
#if defined(__FP_FAST_FMA)
      // The ISA has fma, so GCC's default contraction could fuse the square
      // into the add; add_square keeps them two roundings.
      lanes[l] = math::add_square(lanes[l], static_cast<float>(x[i + l]));
#else
      // No fma in this ISA: nothing can fuse, and the plain form vectorises.
      const double d = static_cast<float>(x[i + l]);
      lanes[l] += d * d;
#endif
    }
  }
  for (int l = 0; i + l < n; ++l) lanes[l] = math::add_square(lanes[l], static_cast<float>(x[i + l]));
  for (int s = kSumLanes / 2; s > 0; s /= 2) {
    for (int l = 0; l < s; ++l) lanes[l] += lanes[l + s];
  }
  return lanes[0];
}

// Inf and NaN are the values whose exponent bits are all ones, in every IEEE
// format, so the check works on the raw bits (no conversion of 16-bit values)
// and counts matches in integer lanes, which the compiler vectorises.
template <typename T>
struct ExponentMask;
template <>
struct ExponentMask<float> {
  using Bits = uint32_t;
  static constexpr Bits kMask = 0x7f800000u;
};
template <>
struct ExponentMask<c10::BFloat16> {
  using Bits = uint16_t;
  static constexpr Bits kMask = 0x7f80u;
};
template <>
struct ExponentMask<c10::Half> {
  using Bits = uint16_t;
  static constexpr Bits kMask = 0x7c00u;
};

template <typename T>
int64_t count_non_finite(const T* data, int64_t n) {
  using Bits = typename ExponentMask<T>::Bits;
  constexpr Bits kMask = ExponentMask<T>::kMask;
  static_assert(sizeof(Bits) == sizeof(T), "the mask must cover the whole value");
  Bits count = 0;  // at most kPiece (4096) per call: no overflow even in 16 bits
  for (int64_t i = 0; i < n; ++i) {
    Bits bits;
    std::memcpy(&bits, data + i, sizeof(Bits));  // well-defined type punning; compiles to a load
    count += static_cast<Bits>((bits & kMask) == kMask);
  }
  return count;
}

}  // namespace

bool fuses_multiply_add() {
  static const bool fused = detect_torch_fuses_multiply_add();
  return fused;
}

void fused_adam(at::Tensor& master, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                const at::Tensor& grad, at::Tensor* low_precision_out, const AdamParams& p,
                const math::AuditSpec& audit) {
  check_cpu_contiguous(master, "master");
  check_cpu_contiguous(exp_avg, "exp_avg");
  check_cpu_contiguous(exp_avg_sq, "exp_avg_sq");
  check_cpu_contiguous(grad, "grad");
  ST_CHECK(master.scalar_type() == at::kFloat && exp_avg.scalar_type() == at::kFloat &&
               exp_avg_sq.scalar_type() == at::kFloat,
           "fused_adam keeps master and moments in float32, got master ", master.scalar_type(),
           ", exp_avg ", exp_avg.scalar_type(), ", exp_avg_sq ", exp_avg_sq.scalar_type(),
           " (use fused_adam_low_precision for 16-bit states)");
  const int64_t n = master.numel();
  check_same_numel(exp_avg, "exp_avg", n);
  check_same_numel(exp_avg_sq, "exp_avg_sq", n);
  check_same_numel(grad, "grad", n);
  check_low_precision_out(low_precision_out, n);
  const math::AdamScalars c = adam_scalars(p);
  if (n == 0) return;

  float* param_ptr = master.data_ptr<float>();
  float* m_ptr = exp_avg.data_ptr<float>();
  float* v_ptr = exp_avg_sq.data_ptr<float>();
  dispatch_float_types(grad.scalar_type(), "grad", [&](auto grad_tag) {
    using GradT = decltype(grad_tag);
    const GradT* g_ptr = grad.data_ptr<GradT>();
    with_audit(audit, [&](auto audit_tag) {
      constexpr bool kAudit = decltype(audit_tag)::value;
      if (low_precision_out == nullptr) {
        adam_parallel<float, GradT, float, false, kAudit>(param_ptr, m_ptr, v_ptr, g_ptr, nullptr, n, c, audit);
        return;
      }
      dispatch_float_types(low_precision_out->scalar_type(), "low_precision_out", [&](auto out_tag) {
        using OutT = decltype(out_tag);
        adam_parallel<float, GradT, OutT, true, kAudit>(param_ptr, m_ptr, v_ptr, g_ptr,
                                                        low_precision_out->data_ptr<OutT>(), n, c, audit);
      });
    });
  });
}

void fused_adam_low_precision(at::Tensor& param, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                              const at::Tensor& grad, const AdamParams& p, const math::AuditSpec& audit) {
  check_cpu_contiguous(param, "param");
  check_cpu_contiguous(exp_avg, "exp_avg");
  check_cpu_contiguous(exp_avg_sq, "exp_avg_sq");
  check_cpu_contiguous(grad, "grad");
  const at::ScalarType type = param.scalar_type();
  ST_CHECK(type == at::kBFloat16 || type == at::kHalf,
           "fused_adam_low_precision needs a bfloat16 or float16 param, got ", type,
           " (use fused_adam for float32 masters)");
  ST_CHECK(exp_avg.scalar_type() == type && exp_avg_sq.scalar_type() == type,
           "pure low precision keeps the moments in the param dtype ", type, ", got exp_avg ",
           exp_avg.scalar_type(), ", exp_avg_sq ", exp_avg_sq.scalar_type());
  ST_CHECK(grad.scalar_type() == type || grad.scalar_type() == at::kFloat,
           "grad must be ", type, " or float32, got ", grad.scalar_type());
  const int64_t n = param.numel();
  check_same_numel(exp_avg, "exp_avg", n);
  check_same_numel(exp_avg_sq, "exp_avg_sq", n);
  check_same_numel(grad, "grad", n);
  const math::AdamScalars c = adam_scalars(p);
  if (n == 0) return;

  dispatch_float_types(type, "param", [&](auto state_tag) {
    using StateT = decltype(state_tag);
    if constexpr (kIsLowPrecision<StateT>) {
      StateT* param_ptr = param.data_ptr<StateT>();
      StateT* m_ptr = exp_avg.data_ptr<StateT>();
      StateT* v_ptr = exp_avg_sq.data_ptr<StateT>();
      dispatch_float_types(grad.scalar_type(), "grad", [&](auto grad_tag) {
        using GradT = decltype(grad_tag);
        with_audit(audit, [&](auto audit_tag) {
          adam_parallel<StateT, GradT, float, false, decltype(audit_tag)::value>(
              param_ptr, m_ptr, v_ptr, grad.data_ptr<GradT>(), nullptr, n, c, audit);
        });
      });
    }
  });
}

void fused_sgd(at::Tensor& master, at::Tensor* momentum_buffer, const at::Tensor& grad,
               at::Tensor* low_precision_out, const SgdParams& params, const math::AuditSpec& audit) {
  check_cpu_contiguous(master, "master");
  check_cpu_contiguous(grad, "grad");
  ST_CHECK(master.scalar_type() == at::kFloat, "fused_sgd keeps the master in float32, got ",
           master.scalar_type());
  const int64_t n = master.numel();
  check_same_numel(grad, "grad", n);
  check_low_precision_out(low_precision_out, n);
  const math::SgdScalars c = sgd_scalars(params);
  float* buffer_ptr = nullptr;
  if (c.use_momentum) {
    ST_CHECK(momentum_buffer != nullptr, "fused_sgd with momentum ", params.momentum,
             " needs a momentum buffer");
    check_cpu_contiguous(*momentum_buffer, "momentum_buffer");
    ST_CHECK(momentum_buffer->scalar_type() == at::kFloat, "momentum_buffer must be float32, got ",
             momentum_buffer->scalar_type());
    check_same_numel(*momentum_buffer, "momentum_buffer", n);
    buffer_ptr = momentum_buffer->data_ptr<float>();
  }
  if (n == 0) return;

  float* param_ptr = master.data_ptr<float>();
  dispatch_float_types(grad.scalar_type(), "grad", [&](auto grad_tag) {
    using GradT = decltype(grad_tag);
    const GradT* g_ptr = grad.data_ptr<GradT>();
    with_audit(audit, [&](auto audit_tag) {
      constexpr bool kAudit = decltype(audit_tag)::value;
      if (low_precision_out == nullptr) {
        sgd_parallel<GradT, float, false, kAudit>(param_ptr, buffer_ptr, g_ptr, nullptr, n, c, audit);
        return;
      }
      dispatch_float_types(low_precision_out->scalar_type(), "low_precision_out", [&](auto out_tag) {
        using OutT = decltype(out_tag);
        sgd_parallel<GradT, OutT, true, kAudit>(param_ptr, buffer_ptr, g_ptr, low_precision_out->data_ptr<OutT>(),
                                                n, c, audit);
      });
    });
  });
}

double sum_of_squares(const at::Tensor& t) {
  check_cpu_contiguous(t, "sum_of_squares input");
  const int64_t n = t.numel();
  if (n == 0) return 0.0;
  const int64_t blocks = math::sum_blocks(n);
  std::vector<double> partial(static_cast<size_t>(blocks), 0.0);
  dispatch_float_types(t.scalar_type(), "sum_of_squares input", [&](auto tag) {
    using T = decltype(tag);
    const T* data = t.data_ptr<T>();
    // Grain 2 blocks (32K elements); each task writes only its own blocks' slots.
    at::parallel_for(0, blocks, 2, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t first = b * kSumBlock;
        partial[static_cast<size_t>(b)] =
            block_sum_of_squares(data + first, std::min(kSumBlock, n - first));
      }
    });
  });
  double total = 0.0;
  for (const double s : partial) total += s;
  return total;
}

bool has_inf_or_nan(const at::Tensor& t) {
  check_cpu_contiguous(t, "has_inf_or_nan input");
  const int64_t n = t.numel();
  if (n == 0) return false;
  std::atomic<bool> found{false};
  dispatch_float_types(t.scalar_type(), "has_inf_or_nan input", [&](auto tag) {
    using T = decltype(tag);
    const T* data = t.data_ptr<T>();
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      // Branch-free inner loops over 4K-element pieces, with an early exit
      // between pieces once any task has found one.
      constexpr int64_t kPiece = 4096;
      for (int64_t i = begin; i < end; i += kPiece) {
        if (found.load(std::memory_order_relaxed)) return;
        if (count_non_finite(data + i, std::min(end, i + kPiece) - i) != 0) {
          found.store(true, std::memory_order_relaxed);
          return;
        }
      }
    });
  });
  return found.load();
}

}  // namespace shardtrain::kernels::cpu
