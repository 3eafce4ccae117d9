#pragma once
// The CUDA branch of the kernel layer (shardtrain/kernels.h): the same
// functions for tensors on a GPU, turned into the raw pointers and dtype
// enums of the CUDA launchers (cuda_kernels.h), which nvcc compiled without
// ATen. Every build has these declarations, so kernels.cpp dispatches with no
// #if: cuda_dispatch.cpp implements them where nvcc compiled the kernels, and
// cuda_dispatch_unavailable.cpp, in a build without nvcc, says so.
//
// The caller (kernels.cpp) has checked that the first tensor is defined and
// on a CUDA device, and turned the optional audit into `audit`.

#include <ATen/core/Tensor.h>

#include "kernels/element_math.h"
#include "shardtrain/kernels.h"

namespace shardtrain::kernels::cuda_dispatch {

/// Whether this build has the CUDA kernels.
bool available();

void adam_step(at::Tensor& master, at::Tensor& exp_avg, at::Tensor& exp_avg_sq, const at::Tensor& grad,
               at::Tensor* low_precision_out, const AdamParams& p, const math::AuditSpec& audit);
void adam_step_low_precision(at::Tensor& param, at::Tensor& exp_avg, at::Tensor& exp_avg_sq, const at::Tensor& grad,
                             const AdamParams& p, const math::AuditSpec& audit);
void sgd_step(at::Tensor& master, at::Tensor* momentum_buffer, const at::Tensor& grad, at::Tensor* low_precision_out,
              const SgdParams& p, const math::AuditSpec& audit);
at::Tensor sum_of_squares(const at::Tensor& t);
at::Tensor non_finite_flag(const at::Tensor& t);
void cast_into(at::Tensor& dst, const at::Tensor& src);
/// The caller (kernels.cpp) has checked the buffer's dtype and size against out.numel().
void nf4_dequantize(const at::Tensor& buffer, at::Tensor& out);

}  // namespace shardtrain::kernels::cuda_dispatch
