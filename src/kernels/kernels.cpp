// The device dispatch of the kernel layer (see shardtrain/kernels.h): CPU
// tensors go to the CPU kernels, CUDA tensors to cuda/cuda_dispatch.h (a stub
// that says why in a build without nvcc), anything else is refused.

#include "shardtrain/kernels.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/core/DeviceGuard.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/nf4_cpu.h"
#include "kernels/cuda/cuda_dispatch.h"
#include "kernels/device_checks.h"
#include "kernels/element_math.h"
#include "kernels/nf4_format.h"
#include "shardtrain/error.h"

namespace shardtrain::kernels {
namespace {

[[noreturn]] void unsupported_device(const at::Tensor& t, const char* what) {
  ST_THROW(Error, what, ": no kernels for tensors on ", t.device(), " (CPU and CUDA are supported)");
}

/// The kernels' view of an audit: its counters on `reference`'s device.
math::AuditSpec audit_spec(const at::Tensor& reference, UpdateAudit* audit) {
  math::AuditSpec spec;
  if (audit == nullptr) return spec;
  check_same_device(reference, audit->counts, "audit counts");
  ST_CHECK(audit->counts.scalar_type() == at::kLong && audit->counts.numel() == 3 && audit->counts.is_contiguous(),
           "audit counts must be a contiguous int64 tensor of 3 elements, got ", audit->counts.scalar_type(), " of ",
           audit->counts.numel());
  ST_CHECK(audit->sample_period >= 1, "audit sample_period must be >= 1, got ", audit->sample_period);
  // Two's complement: the unsigned counters the CUDA atomics need hold the same bits.
  spec.counts = reinterpret_cast<unsigned long long*>(audit->counts.data_ptr<int64_t>());
  spec.sample_period = audit->sample_period;
  return spec;
}

}  // namespace

int64_t audit_pattern_elements(int64_t sample_period) {
  return math::kAuditGranule * std::max<int64_t>(1, sample_period);
}

bool has_kernels_for(c10::DeviceType device) {
  return device == c10::DeviceType::CPU || (device == c10::DeviceType::CUDA && cuda_dispatch::available());
}

void adam_step(at::Tensor& master, at::Tensor& exp_avg, at::Tensor& exp_avg_sq, const at::Tensor& grad,
               at::Tensor* low_precision_out, const AdamParams& p, UpdateAudit* audit) {
  ST_CHECK(master.defined(), "adam_step: master is an undefined tensor");
  const math::AuditSpec spec = audit_spec(master, audit);
  if (master.is_cpu()) {
    cpu::fused_adam(master, exp_avg, exp_avg_sq, grad, low_precision_out, p, spec);
    return;
  }
  if (master.is_cuda()) {
    cuda_dispatch::adam_step(master, exp_avg, exp_avg_sq, grad, low_precision_out, p, spec);
    return;
  }
  unsupported_device(master, "adam_step");
}

void adam_step_low_precision(at::Tensor& param, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                             const at::Tensor& grad, const AdamParams& p, UpdateAudit* audit) {
  ST_CHECK(param.defined(), "adam_step_low_precision: param is an undefined tensor");
  const math::AuditSpec spec = audit_spec(param, audit);
  if (param.is_cpu()) {
    cpu::fused_adam_low_precision(param, exp_avg, exp_avg_sq, grad, p, spec);
    return;
  }
  if (param.is_cuda()) {
    cuda_dispatch::adam_step_low_precision(param, exp_avg, exp_avg_sq, grad, p, spec);
    return;
  }
  unsupported_device(param, "adam_step_low_precision");
}

void sgd_step(at::Tensor& master, at::Tensor* momentum_buffer, const at::Tensor& grad,
              at::Tensor* low_precision_out, const SgdParams& p, UpdateAudit* audit) {
  ST_CHECK(master.defined(), "sgd_step: master is an undefined tensor");
  const math::AuditSpec spec = audit_spec(master, audit);
  if (master.is_cpu()) {
    cpu::fused_sgd(master, momentum_buffer, grad, low_precision_out, p, spec);
    return;
  }
  if (master.is_cuda()) {
    cuda_dispatch::sgd_step(master, momentum_buffer, grad, low_precision_out, p, spec);
    return;
  }
  unsupported_device(master, "sgd_step");
}

at::Tensor sum_of_squares(const at::Tensor& t) {
  ST_CHECK(t.defined(), "sum_of_squares: the input is an undefined tensor");
  if (t.is_cpu()) return at::scalar_tensor(cpu::sum_of_squares(t), at::TensorOptions().dtype(at::kDouble));
  if (t.is_cuda()) return cuda_dispatch::sum_of_squares(t);
  unsupported_device(t, "sum_of_squares");
}

at::Tensor non_finite_flag(const at::Tensor& t) {
  ST_CHECK(t.defined(), "non_finite_flag: the input is an undefined tensor");
  if (t.is_cpu()) {
    return at::scalar_tensor(cpu::has_inf_or_nan(t) ? 1.0f : 0.0f, at::TensorOptions().dtype(at::kFloat));
  }
  if (t.is_cuda()) return cuda_dispatch::non_finite_flag(t);
  unsupported_device(t, "non_finite_flag");
}

void cast_into(at::Tensor& dst, const at::Tensor& src) {
  ST_CHECK(dst.defined() && src.defined(), "cast_into: undefined tensor");
  check_same_device(dst, src, "cast_into source");
  // One shape contract on every device (the CUDA kernel reads flat memory, copy_ broadcasts).
  ST_CHECK(dst.sizes() == src.sizes(), "cast_into: a source of shape ", src.sizes(), " into a destination of shape ",
           dst.sizes(), "; the shapes must be equal");
  ST_CHECK(dst.is_contiguous(), "cast_into: the destination must be contiguous");
  // The CUDA kernel reads and writes in parallel: a destination over part of
  // the source would overwrite elements not yet read (copy_ refuses it too).
  ST_CHECK(at::get_overlap_status(dst, src) != at::MemOverlapStatus::Partial,
           "cast_into: the destination (", dst.scalar_type(), ") overlaps part of the source (", src.scalar_type(),
           ") in memory; cast into a separate buffer");
  if (dst.is_cpu()) {
    // ATen's CPU conversion rounds to nearest even, the same as the CUDA kernel.
    dst.copy_(src);
    return;
  }
  if (dst.is_cuda()) {
    cuda_dispatch::cast_into(dst, src);
    return;
  }
  unsupported_device(dst, "cast_into");
}

at::Tensor nf4_quantize(const at::Tensor& weight) {
  ST_CHECK(weight.defined(), "nf4_quantize: undefined weight");
  if (weight.is_cpu()) return cpu::nf4_quantize(weight.contiguous());
  return cpu::nf4_quantize(weight.to(at::kCPU)).to(weight.device());
}

int64_t nf4_buffer_bytes(int64_t numel) { return nf4::Layout::of(numel).bytes; }

namespace {

/// The layout of `numel` NF4 elements, once `buffer` is checked to be exactly its bytes.
nf4::Layout nf4_layout_of(const at::Tensor& buffer, int64_t numel, const char* what) {
  ST_CHECK(buffer.defined(), what, ": undefined buffer");
  const nf4::Layout layout = nf4::Layout::of(numel);
  ST_CHECK(buffer.scalar_type() == at::kByte && numel % nf4::kBlock == 0 && buffer.numel() == layout.bytes, what,
           ": a ", buffer.scalar_type(), " buffer of ", buffer.numel(), " elements does not hold ", numel,
           " NF4 elements (", layout.bytes, " uint8 bytes)");
  return layout;
}

}  // namespace

at::Tensor nf4_dequantize(const at::Tensor& buffer, int64_t numel, at::ScalarType dtype) {
  nf4_layout_of(buffer, numel, "nf4_dequantize");
  at::Tensor out = at::empty({numel}, buffer.options().dtype(dtype));
  if (buffer.is_cpu()) {
    cpu::nf4_dequantize(buffer.contiguous(), out);
  } else if (buffer.is_cuda()) {
    cuda_dispatch::nf4_dequantize(buffer.contiguous(), out);
  } else {
    unsupported_device(buffer, "nf4_dequantize");
  }
  return out;
}

Nf4State nf4_state(const at::Tensor& buffer, int64_t numel) {
  const nf4::Layout l = nf4_layout_of(buffer, numel, "nf4_state");
  const at::Tensor host = buffer.to(at::kCPU).contiguous();
  Nf4State state;
  state.codes = host.narrow(0, l.codes, numel / 2).clone();
  state.absmax = host.narrow(0, l.absmax_codes, l.blocks).clone();
  state.nested_absmax = host.narrow(0, l.absmax_scales, 4 * l.absmax_blocks).clone().view(at::kFloat);
  state.offset = host.narrow(0, l.offset, 4).clone().view(at::kFloat).reshape({});
  state.nested_quant_map = cpu::nf4_absmax_code().clone();
  return state;
}

}  // namespace shardtrain::kernels
