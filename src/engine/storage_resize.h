#pragma once
// In-place release and refill of a tensor's storage on any device, without
// c10d or CUDA headers.

#include <cstddef>

#include <ATen/core/Tensor.h>
#include <ATen/native/Resize.h>

#include "torch_cuda.h"
#include "shardtrain/error.h"

namespace shardtrain::engine {

/// Frees (bytes = 0) or re-allocates a tensor's storage in place, keeping the
/// StorageImpl — so every view and every tensor autograd saved keeps pointing
/// at it (FSDP1's trick for freeing gathered parameters between forward and
/// backward). Each device's own allocator does the work.
inline void resize_storage_bytes(const at::Tensor& tensor, std::size_t bytes) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  if (tensor.is_cpu()) {
    at::native::resize_bytes_cpu(storage, bytes);
  } else if (tensor.is_cuda()) {
    torch_cuda::resize_cuda_storage_bytes(storage, bytes);
  } else {
    ST_THROW(Error, "resize_storage_bytes: tensors on ", tensor.device(),
             " are not supported (CPU and CUDA are)");
  }
}

}  // namespace shardtrain::engine
