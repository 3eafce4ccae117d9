// CPU versions of the shared kernels (see cpu_kernels.h for the contract).
//
// Each kernel walks its buffers once, a Vectorized<float> at a time, inside
// at::parallel_for chunks. The per-element arithmetic lives in one inline
// function per kernel that the full-width and the tail paths both call, so the
// two cannot drift apart and the result of an element never depends on where
// the chunk boundaries fell.

#include "kernels/cpu/cpu_kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "shardtrain/error.h"

namespace shardtrain::kernels::cpu {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
// ~32K elements per task: big enough that the pool's dispatch cost is noise
// next to streaming 4-5 buffers, small enough to spread a 1M-element shard
// over every core.
constexpr int64_t kGrain = 32768;

template <typename T>
constexpr bool kIsLowPrecision = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;

template <typename T>
inline Vec load(const T* src, int64_t count) {
  if constexpr (std::is_same_v<T, float>) {
    return count == kLanes ? Vec::loadu(src) : Vec::loadu(src, count);
  } else {
    alignas(64) float tmp[kLanes] = {};
    for (int64_t k = 0; k < count; ++k) tmp[k] = static_cast<float>(src[k]);
    return Vec::loadu(tmp);
  }
}

// The c10::BFloat16 / c10::Half constructors round to nearest even, the same
// conversion at::Tensor::to applies, so the compute copy equals master.to(dtype).
template <typename T>
inline void store(T* dst, const Vec& v, int64_t count) {
  if constexpr (std::is_same_v<T, float>) {
    if (count == kLanes) {
      v.store(dst);
    } else {
      v.store(dst, static_cast<int>(count));
    }
  } else {
    alignas(64) float tmp[kLanes];
    v.store(tmp);
    for (int64_t k = 0; k < count; ++k) dst[k] = T(tmp[k]);
  }
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

// ---- Adam ---------------------------------------------------------------------

/// Per-step constants, each rounded to float from a double expression exactly
/// where torch::optim rounds its Scalar arguments.
struct AdamCoefficients {
  Vec grad_scale;
  Vec l2;             ///< wd, Adam mode only
  Vec decay;          ///< 1 - lr*wd, AdamW mode only
  Vec beta1, one_minus_beta1;
  Vec beta2, one_minus_beta2;
  Vec sqrt_bc2;       ///< sqrt(1 - beta2^step)
  Vec eps;
  Vec neg_step_size;  ///< -lr / (1 - beta1^step)
  // torch skips these terms when wd == 0; skipping too keeps 0*inf from
  // turning an inf parameter into NaN where torch would not.
  bool use_l2 = false;
  bool use_decay = false;
};

AdamCoefficients adam_coefficients(const AdamParams& p) {
  ST_CHECK(p.step >= 1, "Adam step must be >= 1 (1-based, after the increment), got ", p.step);
  ST_CHECK(std::isfinite(p.lr) && std::isfinite(p.eps) && std::isfinite(p.weight_decay) &&
               std::isfinite(p.grad_scale),
           "Adam hyper-parameters must be finite (lr=", p.lr, ", eps=", p.eps,
           ", weight_decay=", p.weight_decay, ", grad_scale=", p.grad_scale, ")");
  ST_CHECK(p.beta1 >= 0.0 && p.beta1 < 1.0 && p.beta2 >= 0.0 && p.beta2 < 1.0,
           "Adam betas must lie in [0, 1), got (", p.beta1, ", ", p.beta2, ")");
  const double step = static_cast<double>(p.step);
  // std::pow in double, as torch computes bias_correction = 1 - std::pow(beta, step).
  const double bc1 = p.bias_correction ? 1.0 - std::pow(p.beta1, step) : 1.0;
  const double bc2 = p.bias_correction ? 1.0 - std::pow(p.beta2, step) : 1.0;
  AdamCoefficients c;
  c.grad_scale = Vec(static_cast<float>(p.grad_scale));
  c.use_l2 = !p.adam_w_mode && p.weight_decay != 0.0;
  c.use_decay = p.adam_w_mode && p.weight_decay != 0.0;
  c.l2 = Vec(static_cast<float>(p.weight_decay));
  c.decay = Vec(static_cast<float>(1.0 - p.lr * p.weight_decay));
  c.beta1 = Vec(static_cast<float>(p.beta1));
  c.one_minus_beta1 = Vec(static_cast<float>(1.0 - p.beta1));
  c.beta2 = Vec(static_cast<float>(p.beta2));
  c.one_minus_beta2 = Vec(static_cast<float>(1.0 - p.beta2));
  c.sqrt_bc2 = Vec(static_cast<float>(std::sqrt(bc2)));
  c.eps = Vec(static_cast<float>(p.eps));
  c.neg_step_size = Vec(static_cast<float>(-(p.lr / bc1)));
  return c;
}

/// One Adam(W) element update in torch::optim's operation order:
///   AdamW: p.mul_(1 - lr*wd)          Adam: grad = grad.add(p, wd)
///   m.mul_(b1).add_(g, 1 - b1)        -> (m*b1) + (1-b1)*g
///   v.mul_(b2).addcmul_(g, g, 1 - b2) -> (v*b2) + ((1-b2)*g)*g
///   denom = (v.sqrt() / sqrt(bc2)).add_(eps)
///   p.addcdiv_(m, denom, -step_size)  -> p + ((-step_size)*m)/denom
inline void adam_update(Vec& p, Vec& m, Vec& v, Vec g, const AdamCoefficients& c) {
  g = g * c.grad_scale;
  if (c.use_l2) g = g + c.l2 * p;
  if (c.use_decay) p = p * c.decay;
  m = m * c.beta1 + c.one_minus_beta1 * g;
  v = v * c.beta2 + c.one_minus_beta2 * g * g;
  const Vec denom = v.sqrt() / c.sqrt_bc2 + c.eps;
  p = p + c.neg_step_size * m / denom;
}

/// StateT: the type param/m/v are stored in (float, or bf16/fp16 in pure low
/// precision mode). OutT: the optional compute copy's type (ignored unless kWriteOut).
template <typename StateT, typename GradT, typename OutT, bool kWriteOut>
void adam_range(StateT* param, StateT* exp_avg, StateT* exp_avg_sq, const GradT* grad, OutT* out,
                int64_t begin, int64_t end, const AdamCoefficients& c) {
  for (int64_t i = begin; i < end; i += kLanes) {
    const int64_t count = std::min(kLanes, end - i);
    Vec p = load(param + i, count);
    Vec m = load(exp_avg + i, count);
    Vec v = load(exp_avg_sq + i, count);
    adam_update(p, m, v, load(grad + i, count), c);
    store(param + i, p, count);
    store(exp_avg + i, m, count);
    store(exp_avg_sq + i, v, count);
    if constexpr (kWriteOut) store(out + i, p, count);
  }
}

// ---- SGD ----------------------------------------------------------------------

struct SgdCoefficients {
  Vec grad_scale;
  Vec weight_decay;
  Vec momentum;
  Vec neg_lr;  ///< -1 * lr, torch's add_(d_p, -1 * lr)
  bool use_wd = false;
  bool use_momentum = false;
  bool nesterov = false;
  bool first_step = false;
};

/// torch::optim::SGD's order: d = grad.add(p, wd); buf = clone(d) on the first
/// step, else buf.mul_(mom).add_(d, 1 - 0) -> (buf*mom) + d; nesterov:
/// d = d.add(buf, mom) -> d + mom*buf, else d = buf; p.add_(d, -lr) -> p + (-lr)*d.
inline void sgd_update(Vec& p, Vec& buf, Vec d, const SgdCoefficients& c) {
  d = d * c.grad_scale;
  if (c.use_wd) d = d + c.weight_decay * p;
  if (c.use_momentum) {
    buf = c.first_step ? d : buf * c.momentum + d;
    d = c.nesterov ? d + c.momentum * buf : buf;
  }
  p = p + c.neg_lr * d;
}

template <typename GradT, typename OutT, bool kWriteOut>
void sgd_range(float* param, float* buffer, const GradT* grad, OutT* out, int64_t begin, int64_t end,
               const SgdCoefficients& c) {
  for (int64_t i = begin; i < end; i += kLanes) {
    const int64_t count = std::min(kLanes, end - i);
    Vec p = load(param + i, count);
    Vec buf = (c.use_momentum && !c.first_step) ? load(buffer + i, count) : Vec(0.0f);
    sgd_update(p, buf, load(grad + i, count), c);
    store(param + i, p, count);
    if (c.use_momentum) store(buffer + i, buf, count);
    if constexpr (kWriteOut) store(out + i, p, count);
  }
}

// ---- reductions -----------------------------------------------------------------

// The unit of deterministic summation: blocks are fixed by the element index
// alone, never by the thread count.
constexpr int64_t kSumBlock = 16384;

template <typename T>
double block_sum_of_squares(const T* x, int64_t n) {
  // Eight independent accumulators (a fixed pattern, so still deterministic)
  // let the compiler keep several fp64 adds in flight instead of one chain.
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) {
      const double d = static_cast<float>(x[i + k]);
      acc[k] += d * d;
    }
  }
  for (; i < n; ++i) {
    const double d = static_cast<float>(x[i]);
    acc[i & 7] += d * d;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// Inf and NaN are the values whose exponent bits are all ones, in every IEEE
// format; testing the bits avoids converting 16-bit values to float.
inline bool non_finite_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits & 0x7f800000u) == 0x7f800000u;
}
inline bool non_finite_bits(c10::BFloat16 x) { return (x.x & 0x7f80u) == 0x7f80u; }
inline bool non_finite_bits(c10::Half x) { return (x.x & 0x7c00u) == 0x7c00u; }

}  // namespace

void fused_adam(at::Tensor& master, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                const at::Tensor& grad, at::Tensor* low_precision_out, const AdamParams& p) {
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
  const AdamCoefficients c = adam_coefficients(p);
  if (n == 0) return;

  float* param_ptr = master.data_ptr<float>();
  float* m_ptr = exp_avg.data_ptr<float>();
  float* v_ptr = exp_avg_sq.data_ptr<float>();
  dispatch_float_types(grad.scalar_type(), "grad", [&](auto grad_tag) {
    using GradT = decltype(grad_tag);
    const GradT* g_ptr = grad.data_ptr<GradT>();
    if (low_precision_out == nullptr) {
      at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
        adam_range<float, GradT, float, false>(param_ptr, m_ptr, v_ptr, g_ptr, nullptr, begin, end, c);
      });
      return;
    }
    dispatch_float_types(low_precision_out->scalar_type(), "low_precision_out", [&](auto out_tag) {
      using OutT = decltype(out_tag);
      OutT* out_ptr = low_precision_out->data_ptr<OutT>();
      at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
        adam_range<float, GradT, OutT, true>(param_ptr, m_ptr, v_ptr, g_ptr, out_ptr, begin, end, c);
      });
    });
  });
}

void fused_adam_low_precision(at::Tensor& param, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                              const at::Tensor& grad, const AdamParams& p) {
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
  const AdamCoefficients c = adam_coefficients(p);
  if (n == 0) return;

  dispatch_float_types(type, "param", [&](auto state_tag) {
    using StateT = decltype(state_tag);
    if constexpr (kIsLowPrecision<StateT>) {
      StateT* param_ptr = param.data_ptr<StateT>();
      StateT* m_ptr = exp_avg.data_ptr<StateT>();
      StateT* v_ptr = exp_avg_sq.data_ptr<StateT>();
      dispatch_float_types(grad.scalar_type(), "grad", [&](auto grad_tag) {
        using GradT = decltype(grad_tag);
        const GradT* g_ptr = grad.data_ptr<GradT>();
        at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
          adam_range<StateT, GradT, float, false>(param_ptr, m_ptr, v_ptr, g_ptr, nullptr, begin, end,
                                                  c);
        });
      });
    }
  });
}

void fused_sgd(at::Tensor& master, at::Tensor* momentum_buffer, const at::Tensor& grad,
               at::Tensor* low_precision_out, double lr, double momentum, double weight_decay,
               bool nesterov, double grad_scale, bool first_step) {
  check_cpu_contiguous(master, "master");
  check_cpu_contiguous(grad, "grad");
  ST_CHECK(master.scalar_type() == at::kFloat, "fused_sgd keeps the master in float32, got ",
           master.scalar_type());
  const int64_t n = master.numel();
  check_same_numel(grad, "grad", n);
  check_low_precision_out(low_precision_out, n);
  ST_CHECK(std::isfinite(lr) && std::isfinite(momentum) && std::isfinite(weight_decay) &&
               std::isfinite(grad_scale),
           "SGD hyper-parameters must be finite (lr=", lr, ", momentum=", momentum,
           ", weight_decay=", weight_decay, ", grad_scale=", grad_scale, ")");
  ST_CHECK(!nesterov || momentum > 0.0, "Nesterov momentum requires momentum > 0, got ", momentum);
  SgdCoefficients c;
  c.use_momentum = momentum != 0.0;
  c.use_wd = weight_decay != 0.0;
  c.nesterov = nesterov;
  c.first_step = first_step;
  c.grad_scale = Vec(static_cast<float>(grad_scale));
  c.weight_decay = Vec(static_cast<float>(weight_decay));
  c.momentum = Vec(static_cast<float>(momentum));
  c.neg_lr = Vec(static_cast<float>(-1 * lr));
  float* buffer_ptr = nullptr;
  if (c.use_momentum) {
    ST_CHECK(momentum_buffer != nullptr, "fused_sgd with momentum ", momentum,
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
    if (low_precision_out == nullptr) {
      at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
        sgd_range<GradT, float, false>(param_ptr, buffer_ptr, g_ptr, nullptr, begin, end, c);
      });
      return;
    }
    dispatch_float_types(low_precision_out->scalar_type(), "low_precision_out", [&](auto out_tag) {
      using OutT = decltype(out_tag);
      OutT* out_ptr = low_precision_out->data_ptr<OutT>();
      at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
        sgd_range<GradT, OutT, true>(param_ptr, buffer_ptr, g_ptr, out_ptr, begin, end, c);
      });
    });
  });
}

double sum_of_squares(const at::Tensor& t) {
  check_cpu_contiguous(t, "sum_of_squares input");
  const int64_t n = t.numel();
  if (n == 0) return 0.0;
  const int64_t blocks = (n + kSumBlock - 1) / kSumBlock;
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
      // Branch-free inner loops over 4K-element pieces (they vectorise), with
      // an early exit between pieces once any task has found one.
      constexpr int64_t kPiece = 4096;
      for (int64_t i = begin; i < end; i += kPiece) {
        if (found.load(std::memory_order_relaxed)) return;
        const int64_t stop = std::min(end, i + kPiece);
        bool bad = false;
        for (int64_t j = i; j < stop; ++j) bad |= non_finite_bits(data[j]);
        if (bad) {
          found.store(true, std::memory_order_relaxed);
          return;
        }
      }
    });
  });
  return found.load();
}

}  // namespace shardtrain::kernels::cpu
