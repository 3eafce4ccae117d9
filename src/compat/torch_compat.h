#pragma once
// The one place that knows which LibTorch shardtrain is built against.
//
// LibTorch changed c10d between 1.13 (Debian, CI) and 2.x (GPU users):
// ProcessGroup became a dispatcher over Backend objects, TCPStoreOptions grew
// fields (so it must be filled by name, never positionally), c10::optional
// became std::optional, and Gloo gained _allgather_base / reduce_scatter
// fallbacks. Every version- or CUDA-dependent call goes through this header.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include <torch/version.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#if defined(SHARDTRAIN_TORCH_CUDA)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

#define SHARDTRAIN_TORCH_VERSION_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace shardtrain::compat {

using StorePtr = c10::intrusive_ptr<c10d::Store>;
using GlooGroupPtr = c10::intrusive_ptr<c10d::ProcessGroupGloo>;
using WorkHandle = c10::intrusive_ptr<c10d::Work>;

/// rank 0 hosts the store (is_server), the others connect; waits for all
/// world_size workers up to `timeout`.
inline StorePtr make_tcp_store(const std::string& host, int port, bool is_server, int world_size,
                               std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(port);
  options.isServer = is_server;
  options.numWorkers = static_cast<std::size_t>(world_size);
  options.waitWorkers = true;
  options.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(host, options);
}

inline StorePtr make_prefix_store(const std::string& prefix, StorePtr store) {
  return c10::make_intrusive<c10d::PrefixStore>(prefix, std::move(store));
}

/// A Gloo process group whose sockets bind to `hostname`'s interface (or the
/// default interface when empty). Constructing it is itself a rendezvous
/// (full-mesh connect through the store), bounded by `timeout`.
inline GlooGroupPtr make_gloo_group(const StorePtr& store, int rank, int size,
                                    std::chrono::milliseconds timeout, const std::string& hostname,
                                    int threads) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  if (hostname.empty()) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  } else {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
  }
  options->threads = threads;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

inline std::string torch_version_string() { return TORCH_VERSION; }

inline bool torch_has_cuda() {
#if defined(SHARDTRAIN_TORCH_CUDA)
  return true;
#else
  return false;
#endif
}

#if defined(SHARDTRAIN_TORCH_CUDA)
// Only in a CUDA LibTorch: CUDA streams of ATen. Without one, callers that
// still compile CUDA code (the NCCL backend) order against the legacy default
// stream, which is the stream every CUDA op would run on anyway.

/// The stream ATen enqueues work on for `device_index` in this thread (what
/// at::cuda::CUDAStreamGuard set, else the default stream). Collectives order
/// themselves after it, and it waits for them.
inline cudaStream_t current_cuda_stream(int device_index) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_index)).stream();
}

/// CUDA devices ATen can use (0 when the driver is missing or no GPU is visible).
inline int cuda_device_count() { return static_cast<int>(c10::cuda::device_count()); }
#endif

/// GPUs this process can use: 0 without a CUDA build of LibTorch, or without a driver or a visible device.
inline int visible_cuda_devices() {
#if defined(SHARDTRAIN_TORCH_CUDA)
  return cuda_device_count();
#else
  return 0;
#endif
}

}  // namespace shardtrain::compat

#include <ATen/native/Resize.h>
#if defined(SHARDTRAIN_TORCH_CUDA)
#include <ATen/native/cuda/Resize.h>
#endif

namespace shardtrain::compat {

/// Frees (bytes = 0) or re-allocates a tensor's storage in place, keeping the
/// StorageImpl — so every view and every tensor autograd saved keeps pointing
/// at it (FSDP1's trick for freeing gathered parameters between forward and
/// backward).
inline void resize_storage_bytes(const at::Tensor& tensor, std::size_t bytes) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  if (tensor.is_cpu()) {
    at::native::resize_bytes_cpu(storage, bytes);
    return;
  }
#if defined(SHARDTRAIN_TORCH_CUDA)
  at::native::resize_bytes_cuda(storage, bytes);
#else
  TORCH_CHECK(false, "resize_storage_bytes: ", tensor.device(), " tensors need a CUDA build of LibTorch");
#endif
}

}  // namespace shardtrain::compat
