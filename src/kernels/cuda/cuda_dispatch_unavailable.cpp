// Built when nvcc was not found at configure time: the CUDA branch of the
// kernel layer exists (kernels.cpp calls it with no #if) and says why it
// cannot run.
#include "kernels/cuda/cuda_dispatch.h"

#include "shardtrain/error.h"

namespace shardtrain::kernels::cuda_dispatch {
namespace {

[[noreturn]] void no_cuda_kernels(const char* what) {
  ST_THROW(Error, what, ": this shardtrain was built without its CUDA kernels (nvcc was not found at "
                        "configure time); reconfigure with the CUDA toolkit on PATH or CUDACXX set");
}

}  // namespace

bool available() { return false; }

void adam_step(at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, at::Tensor*, const AdamParams&,
               const math::AuditSpec&) {
  no_cuda_kernels("adam_step");
}
void adam_step_low_precision(at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, const AdamParams&,
                             const math::AuditSpec&) {
  no_cuda_kernels("adam_step_low_precision");
}
void sgd_step(at::Tensor&, at::Tensor*, const at::Tensor&, at::Tensor*, const SgdParams&, const math::AuditSpec&) {
  no_cuda_kernels("sgd_step");
}
at::Tensor sum_of_squares(const at::Tensor&) { no_cuda_kernels("sum_of_squares"); }
at::Tensor non_finite_flag(const at::Tensor&) { no_cuda_kernels("non_finite_flag"); }
void cast_into(at::Tensor&, const at::Tensor&) { no_cuda_kernels("cast_into"); }
void nf4_dequantize(const at::Tensor&, at::Tensor&) { no_cuda_kernels("nf4_dequantize"); }

}  // namespace shardtrain::kernels::cuda_dispatch
