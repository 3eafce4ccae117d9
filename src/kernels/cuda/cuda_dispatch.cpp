// The CUDA branch of the kernel layer (see cuda_dispatch.h): checks the
// tensors, then calls the launchers nvcc compiled on the tensors' device and
// ATen's current stream of it.

#include "kernels/cuda/cuda_dispatch.h"

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include "kernels/cpu/nf4_cpu.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/device_checks.h"
#include "kernels/optimizer_params.h"
#include "shardtrain/error.h"
#include "torch_cuda.h"

namespace shardtrain::kernels::cuda_dispatch {
namespace {

namespace cuda = ::shardtrain::kernels::cuda;

cuda::DType cuda_type(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return cuda::DType::kF32;
    case at::kBFloat16: return cuda::DType::kBF16;
    case at::kHalf: return cuda::DType::kF16;
    default: ST_THROW(Error, name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

/// The kernels access whole elements: at an address that is not a multiple
/// of the element size (only a from_blob pointer can be there) a load faults,
/// and the fault poisons the process's CUDA context for good.
void check_element_aligned(const at::Tensor& t, const char* name) {
  ST_CHECK(reinterpret_cast<std::uintptr_t>(t.data_ptr()) % t.element_size() == 0, name,
           " starts at an address that is not a multiple of its element size (", t.element_size(),
           " bytes); the CUDA kernels need element-aligned data");
}

void check_cuda_operand(const at::Tensor& reference, const at::Tensor& t, const char* name) {
  check_same_device(reference, t, name);
  check_element_aligned(t, name);
  ST_CHECK(t.is_contiguous(), name, " must be contiguous (these kernels stream flat buffers)");
  ST_CHECK(t.numel() == reference.numel(), name, " has ", t.numel(), " elements, expected ", reference.numel());
}

void check_float32(const at::Tensor& t, const char* name) {
  ST_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
}

/// Runs a launcher on t's device and stream, and turns a launch error into an exception.
template <class Launch>
void on_cuda(const at::Tensor& t, const char* what, Launch&& launch) {
  check_element_aligned(t, what);
  const c10::DeviceGuard guard(t.device());
  auto stream = static_cast<cudaStream_t>(torch_cuda::current_cuda_stream(t.device().index()));
  const cudaError_t status = launch(stream);
  // A failed runtime call (a memset, an attribute query) also stays recorded
  // as the thread's last error, which a later, unrelated launch check would report.
  if (status != cudaSuccess) (void)cudaGetLastError();
  ST_CHECK(status == cudaSuccess, what, " on ", t.device(), " failed to launch: ", cudaGetErrorString(status),
           " (", t.numel(), " elements)");
}

cuda::LowPrecisionOut cuda_out(const at::Tensor& master, at::Tensor* out) {
  cuda::LowPrecisionOut o;
  if (out == nullptr) return o;
  check_cuda_operand(master, *out, "low_precision_out");
  ST_CHECK(out->scalar_type() == at::kBFloat16 || out->scalar_type() == at::kHalf,
           "low_precision_out must be bfloat16 or float16, got ", out->scalar_type());
  o.data = out->data_ptr();
  o.dtype = cuda_type(*out, "low_precision_out");
  return o;
}

}  // namespace

bool available() { return true; }

void adam_step(at::Tensor& master, at::Tensor& exp_avg, at::Tensor& exp_avg_sq, const at::Tensor& grad,
               at::Tensor* low_precision_out, const AdamParams& p, const math::AuditSpec& audit) {
  for (const auto& [t, name] : {std::pair{&master, "master"}, {&exp_avg, "exp_avg"}, {&exp_avg_sq, "exp_avg_sq"}}) {
    check_cuda_operand(master, *t, name);
    check_float32(*t, name);
  }
  check_cuda_operand(master, grad, "grad");
  const math::AdamScalars c = adam_scalars(p);
  const cuda::LowPrecisionOut out = cuda_out(master, low_precision_out);
  const cuda::DType grad_type = cuda_type(grad, "grad");
  on_cuda(master, "adam_step", [&](cudaStream_t stream) {
    return cuda::launch_adam(master.data_ptr<float>(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
                             grad.data_ptr(), grad_type, out, master.numel(), c, audit, stream);
  });
}

void adam_step_low_precision(at::Tensor& param, at::Tensor& exp_avg, at::Tensor& exp_avg_sq, const at::Tensor& grad,
                             const AdamParams& p, const math::AuditSpec& audit) {
  const at::ScalarType type = param.scalar_type();
  ST_CHECK(type == at::kBFloat16 || type == at::kHalf,
           "adam_step_low_precision needs a bfloat16 or float16 param, got ", type);
  for (const auto& [t, name] : {std::pair{&exp_avg, "exp_avg"}, {&exp_avg_sq, "exp_avg_sq"}}) {
    check_cuda_operand(param, *t, name);
    ST_CHECK(t->scalar_type() == type, "pure low precision keeps ", name, " in the param dtype ", type,
             ", got ", t->scalar_type());
  }
  check_cuda_operand(param, param, "param");
  check_cuda_operand(param, grad, "grad");
  ST_CHECK(grad.scalar_type() == type || grad.scalar_type() == at::kFloat, "grad must be ", type,
           " or float32, got ", grad.scalar_type());
  const math::AdamScalars c = adam_scalars(p);
  on_cuda(param, "adam_step_low_precision", [&](cudaStream_t stream) {
    return cuda::launch_adam_low_precision(param.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                                           cuda_type(param, "param"), grad.data_ptr(), cuda_type(grad, "grad"),
                                           param.numel(), c, audit, stream);
  });
}

void sgd_step(at::Tensor& master, at::Tensor* momentum_buffer, const at::Tensor& grad, at::Tensor* low_precision_out,
              const SgdParams& p, const math::AuditSpec& audit) {
  check_cuda_operand(master, master, "master");
  check_float32(master, "master");
  check_cuda_operand(master, grad, "grad");
  const math::SgdScalars c = sgd_scalars(p);
  float* buffer = nullptr;
  if (c.use_momentum) {
    ST_CHECK(momentum_buffer != nullptr, "sgd_step with momentum ", p.momentum, " needs a momentum buffer");
    check_cuda_operand(master, *momentum_buffer, "momentum_buffer");
    check_float32(*momentum_buffer, "momentum_buffer");
    buffer = momentum_buffer->data_ptr<float>();
  }
  const cuda::LowPrecisionOut out = cuda_out(master, low_precision_out);
  const cuda::DType grad_type = cuda_type(grad, "grad");
  on_cuda(master, "sgd_step", [&](cudaStream_t stream) {
    return cuda::launch_sgd(master.data_ptr<float>(), buffer, grad.data_ptr(), grad_type, out, master.numel(), c,
                            audit, stream);
  });
}

at::Tensor sum_of_squares(const at::Tensor& t) {
  check_cuda_operand(t, t, "sum_of_squares input");
  const auto options = at::TensorOptions().dtype(at::kDouble).device(t.device());
  at::Tensor out = at::empty({}, options);
  at::Tensor scratch = at::empty({cuda::sum_of_squares_scratch(t.numel())}, options);
  const cuda::DType type = cuda_type(t, "sum_of_squares input");
  on_cuda(t, "sum_of_squares", [&](cudaStream_t stream) {
    return cuda::launch_sum_of_squares(t.data_ptr(), type, t.numel(), scratch.data_ptr<double>(),
                                       out.data_ptr<double>(), stream);
  });
  return out;
}

at::Tensor non_finite_flag(const at::Tensor& t) {
  check_cuda_operand(t, t, "non_finite_flag input");
  at::Tensor flag = at::empty({}, at::TensorOptions().dtype(at::kFloat).device(t.device()));
  const cuda::DType type = cuda_type(t, "non_finite_flag input");
  on_cuda(t, "non_finite_flag", [&](cudaStream_t stream) {
    return cuda::launch_non_finite_flag(t.data_ptr(), type, t.numel(), flag.data_ptr<float>(), stream);
  });
  return flag;
}

void cast_into(at::Tensor& dst, const at::Tensor& source) {
  // kernels::cast_into checked the shapes and dst; a strided source is read as copy_ on the CPU reads it.
  const at::Tensor src = source.contiguous();
  check_cuda_operand(dst, src, "cast_into source");
  const cuda::DType src_type = cuda_type(src, "cast_into source");
  const cuda::DType dst_type = cuda_type(dst, "cast_into destination");
  on_cuda(dst, "cast_into", [&](cudaStream_t stream) {
    return cuda::launch_cast(src.data_ptr(), src_type, dst.data_ptr(), dst_type, dst.numel(), stream);
  });
}

void nf4_dequantize(const at::Tensor& buffer, at::Tensor& out) {
  check_same_device(out, buffer, "nf4_dequantize buffer");
  // kernels::nf4_dequantize checked that the buffer holds out.numel() NF4 elements.
  ST_CHECK(buffer.is_contiguous() && out.is_contiguous(), "nf4_dequantize: the buffer and out must be contiguous");
  const cuda::DType out_type = cuda_type(out, "nf4_dequantize output");
  // The absmax map, built on the host once, copied to each device once.
  static std::mutex mutex;
  static std::map<int, at::Tensor> code_on_device;
  at::Tensor code;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    at::Tensor& cached = code_on_device[out.device().index()];
    if (!cached.defined()) cached = cpu::nf4_absmax_code().to(out.device());
    code = cached;
  }
  on_cuda(out, "nf4_dequantize", [&](cudaStream_t stream) {
    return cuda::launch_nf4_dequantize(buffer.data_ptr<uint8_t>(), code.data_ptr<float>(), out.data_ptr(), out_type,
                                       out.numel(), stream);
  });
}

}  // namespace shardtrain::kernels::cuda_dispatch
