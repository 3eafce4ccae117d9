// The fused optimizer steps on the GPU: Adam/AdamW on an fp32 master (with an
// optional 16-bit compute copy written in the same pass), pure low-precision
// Adam/AdamW, and SGD.
//
// One kernel reads the gradient and the state once and writes the state (and
// the copy) once: the step is bound by memory traffic (16-18 bytes per
// parameter), so fusing the unscale/clip multiply, the update and the downcast
// into one pass is the whole optimisation. The arithmetic is element_math.h's,
// with fused multiply-adds.

#include "kernels/cuda/kernel_common.cuh"

namespace shardtrain::kernels::cuda {
namespace {

using detail::load_pack;
using detail::store_pack;
using Ops = math::ScalarOps<true>;

struct AdamPointers {
  void* param;
  void* exp_avg;
  void* exp_avg_sq;
  const void* grad;
  void* out;
};

/// State: the element type of param and moments (F32 for a master). Out is
/// only touched when kWriteOut.
/// The audit is a run-time switch: one uniform branch per element costs
/// nothing next to the memory traffic, and templating on it would double the
/// kernels nvcc compiles.
template <class State, class Grad, class Out, bool kWriteOut>
__global__ void __launch_bounds__(kThreads)
    adam_kernel(AdamPointers ptr, ElementwisePlan plan, math::AdamScalars c, math::AuditSpec audit) {
  using S = typename State::Storage;
  S* param = static_cast<S*>(ptr.param);
  S* exp_avg = static_cast<S*>(ptr.exp_avg);
  S* exp_avg_sq = static_cast<S*>(ptr.exp_avg_sq);
  const auto* grad = static_cast<const typename Grad::Storage*>(ptr.grad);
  auto* out = static_cast<typename Out::Storage*>(ptr.out);
  const bool auditing = audit.counts != nullptr;
  detail::AuditTally tally;
  auto element = [&](int64_t i) {
    float p = State::load(param[i]);
    const float before = p;
    float m = State::load(exp_avg[i]);
    float v = State::load(exp_avg_sq[i]);
    const float update = math::adam_update<Ops>(p, m, v, Grad::load(grad[i]), c);
    const S stored = State::store(p);
    param[i] = stored;
    exp_avg[i] = State::store(m);
    exp_avg_sq[i] = State::store(v);
    if constexpr (kWriteOut) out[i] = Out::store(p);
    if (auditing && math::audited_element(i, audit.sample_period)) {
      detail::audit_adam(tally, before, State::load(stored), update, c);
    }
  };
  auto pack = [&](int64_t first) {
    float p[kVec], m[kVec], v[kVec], g[kVec], before[kVec], update[kVec];
    load_pack<State>(param, first, p);
    load_pack<State>(exp_avg, first, m);
    load_pack<State>(exp_avg_sq, first, v);
    load_pack<Grad>(grad, first, g);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      before[k] = p[k];
      update[k] = math::adam_update<Ops>(p[k], m[k], v[k], g[k], c);
    }
    store_pack<State>(param, first, p);
    store_pack<State>(exp_avg, first, m);
    store_pack<State>(exp_avg_sq, first, v);
    if constexpr (kWriteOut) store_pack<Out>(out, first, p);
    if (auditing) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (math::audited_element(first + k, audit.sample_period)) {
          detail::audit_adam(tally, before[k], State::load(State::store(p[k])), update[k], c);
        }
      }
    }
  };
  for_each_plan_item(plan, detail::global_thread(), detail::grid_stride(), element, pack);
  if (auditing) detail::flush_audit(audit, tally);
}

struct SgdPointers {
  float* param;
  float* buffer;
  const void* grad;
  void* out;
};

template <class Grad, class Out, bool kWriteOut>
__global__ void __launch_bounds__(kThreads)
    sgd_kernel(SgdPointers ptr, ElementwisePlan plan, math::SgdScalars c, math::AuditSpec audit) {
  const auto* grad = static_cast<const typename Grad::Storage*>(ptr.grad);
  auto* out = static_cast<typename Out::Storage*>(ptr.out);
  const bool read_buffer = c.use_momentum && !c.first_step;
  const bool auditing = audit.counts != nullptr;
  detail::AuditTally tally;
  auto element = [&](int64_t i) {
    float p = ptr.param[i];
    const float before = p;
    float buf = read_buffer ? ptr.buffer[i] : 0.0f;
    const float direction = math::sgd_update<Ops>(p, buf, Grad::load(grad[i]), c);
    ptr.param[i] = p;
    if (c.use_momentum) ptr.buffer[i] = buf;
    if constexpr (kWriteOut) out[i] = Out::store(p);
    if (auditing && math::audited_element(i, audit.sample_period)) detail::audit_sgd(tally, before, p, direction, c);
  };
  auto pack = [&](int64_t first) {
    float p[kVec], buf[kVec] = {0.0f, 0.0f, 0.0f, 0.0f}, g[kVec], before[kVec], direction[kVec];
    load_pack<detail::F32>(ptr.param, first, p);
    if (read_buffer) load_pack<detail::F32>(ptr.buffer, first, buf);
    load_pack<Grad>(grad, first, g);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      before[k] = p[k];
      direction[k] = math::sgd_update<Ops>(p[k], buf[k], g[k], c);
    }
    store_pack<detail::F32>(ptr.param, first, p);
    if (c.use_momentum) store_pack<detail::F32>(ptr.buffer, first, buf);
    if constexpr (kWriteOut) store_pack<Out>(out, first, p);
    if (auditing) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (math::audited_element(first + k, audit.sample_period)) {
          detail::audit_sgd(tally, before[k], p[k], direction[k], c);
        }
      }
    }
  };
  for_each_plan_item(plan, detail::global_thread(), detail::grid_stride(), element, pack);
  if (auditing) detail::flush_audit(audit, tally);
}

int64_t head_of(const void* p, DType dtype) { return elements_to_pack_alignment(p, detail::element_size(dtype)); }

template <class State>
cudaError_t launch_adam_state(AdamPointers ptr, DType state_type, DType grad_type, const LowPrecisionOut& out,
                              int64_t n, const math::AdamScalars& c, const math::AuditSpec& audit,
                              cudaStream_t stream) {
  const bool write_out = out.data != nullptr;
  ElementwisePlan plan;
  const int64_t head = common_head({head_of(ptr.param, state_type), head_of(ptr.exp_avg, state_type),
                                    head_of(ptr.exp_avg_sq, state_type), head_of(ptr.grad, grad_type),
                                    write_out ? head_of(out.data, out.dtype) : kNoStream});
  cudaError_t status = detail::plan_for(n, head, &plan);
  if (status != cudaSuccess) return status;
  return detail::with_type(grad_type, [&](auto grad_tag) -> cudaError_t {
    using Grad = decltype(grad_tag);
    if (!write_out) {
      adam_kernel<State, Grad, detail::F32, false><<<plan.blocks, plan.threads, 0, stream>>>(ptr, plan, c, audit);
      return cudaGetLastError();
    }
    return detail::with_type(out.dtype, [&](auto out_tag) -> cudaError_t {
      using Out = decltype(out_tag);
      adam_kernel<State, Grad, Out, true><<<plan.blocks, plan.threads, 0, stream>>>(ptr, plan, c, audit);
      return cudaGetLastError();
    });
  });
}

bool valid_out(const LowPrecisionOut& out) {
  return out.data == nullptr || out.dtype == DType::kBF16 || out.dtype == DType::kF16;
}

}  // namespace

cudaError_t launch_adam(float* master, float* exp_avg, float* exp_avg_sq, const void* grad, DType grad_type,
                        LowPrecisionOut out, int64_t n, const math::AdamScalars& c, const math::AuditSpec& audit,
                        cudaStream_t stream) {
  if (n < 0 || !detail::valid(grad_type) || !valid_out(out)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (master == nullptr || exp_avg == nullptr || exp_avg_sq == nullptr || grad == nullptr) {
    return cudaErrorInvalidValue;
  }
  return launch_adam_state<detail::F32>(AdamPointers{master, exp_avg, exp_avg_sq, grad, out.data}, DType::kF32,
                                        grad_type, out, n, c, audit, stream);
}

cudaError_t launch_adam_low_precision(void* param, void* exp_avg, void* exp_avg_sq, DType state_type,
                                      const void* grad, DType grad_type, int64_t n, const math::AdamScalars& c,
                                      const math::AuditSpec& audit, cudaStream_t stream) {
  if (n < 0 || (state_type != DType::kBF16 && state_type != DType::kF16)) return cudaErrorInvalidValue;
  if (grad_type != state_type && grad_type != DType::kF32) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (param == nullptr || exp_avg == nullptr || exp_avg_sq == nullptr || grad == nullptr) {
    return cudaErrorInvalidValue;
  }
  const AdamPointers ptr{param, exp_avg, exp_avg_sq, grad, nullptr};
  const LowPrecisionOut none{};
  if (state_type == DType::kBF16) {
    return launch_adam_state<detail::BF16>(ptr, state_type, grad_type, none, n, c, audit, stream);
  }
  return launch_adam_state<detail::F16>(ptr, state_type, grad_type, none, n, c, audit, stream);
}

cudaError_t launch_sgd(float* master, float* momentum_buffer, const void* grad, DType grad_type,
                       LowPrecisionOut out, int64_t n, const math::SgdScalars& c, const math::AuditSpec& audit,
                       cudaStream_t stream) {
  if (n < 0 || !detail::valid(grad_type) || !valid_out(out)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (master == nullptr || grad == nullptr || (c.use_momentum && momentum_buffer == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const bool write_out = out.data != nullptr;
  const int64_t head = common_head({head_of(master, DType::kF32),
                                    c.use_momentum ? head_of(momentum_buffer, DType::kF32) : kNoStream,
                                    head_of(grad, grad_type), write_out ? head_of(out.data, out.dtype) : kNoStream});
  ElementwisePlan plan;
  cudaError_t status = detail::plan_for(n, head, &plan);
  if (status != cudaSuccess) return status;
  const SgdPointers ptr{master, momentum_buffer, grad, out.data};
  return detail::with_type(grad_type, [&](auto grad_tag) -> cudaError_t {
    using Grad = decltype(grad_tag);
    if (!write_out) {
      sgd_kernel<Grad, detail::F32, false><<<plan.blocks, plan.threads, 0, stream>>>(ptr, plan, c, audit);
      return cudaGetLastError();
    }
    return detail::with_type(out.dtype, [&](auto out_tag) -> cudaError_t {
      using Out = decltype(out_tag);
      sgd_kernel<Grad, Out, true><<<plan.blocks, plan.threads, 0, stream>>>(ptr, plan, c, audit);
      return cudaGetLastError();
    });
  });
}

}  // namespace shardtrain::kernels::cuda
