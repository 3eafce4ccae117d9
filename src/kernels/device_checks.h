#pragma once
// The one check every dispatch branch of the kernel layer makes first: all
// tensors of a call are defined and on one device (kernels.cpp for the CPU,
// cuda/cuda_dispatch.cpp for CUDA).

#include <ATen/core/Tensor.h>

#include "shardtrain/error.h"

namespace shardtrain::kernels {

inline void check_same_device(const at::Tensor& reference, const at::Tensor& t, const char* name) {
  ST_CHECK(t.defined(), name, " is an undefined tensor");
  ST_CHECK(t.device() == reference.device(), name, " is on ", t.device(), " but the step runs on ",
           reference.device(), "; every tensor of one kernel call must be on one device");
}

}  // namespace shardtrain::kernels
