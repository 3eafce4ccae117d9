// The one translation unit that includes LibTorch's CUDA headers (see
// torch_cuda.h). shardtrain builds only against a CUDA LibTorch (the PyPI
// wheel; a CPU-only one is refused at configure time), so these calls always
// exist; without a driver or a GPU no CUDA tensor reaches them.

#include "torch_cuda.h"

#include <cstring>

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/native/cuda/Resize.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "shardtrain/error.h"

namespace shardtrain::torch_cuda {

int cuda_device_count() { return static_cast<int>(c10::cuda::device_count()); }

void* current_cuda_stream(int device_index) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_index)).stream();
}

void synchronize_cuda_stream(int device_index, void* stream) {
  c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), static_cast<c10::DeviceIndex>(device_index))
      .synchronize();
}

CudaStreamMark CudaStreamMark::now_on(int device_index, void* stream) {
  auto event = std::make_shared<at::cuda::CUDAEvent>(cudaEventDisableTiming);
  event->record(
      c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), static_cast<c10::DeviceIndex>(device_index)));
  CudaStreamMark mark;
  mark.event_ = std::move(event);
  return mark;
}

void CudaStreamMark::wait() const {
  if (event_) static_cast<const at::cuda::CUDAEvent*>(event_.get())->synchronize();
}

void record_cuda_stream(const at::Tensor& tensor, void* stream) {
  if (!tensor.defined() || !tensor.is_cuda() || !tensor.has_storage()) return;
  const c10::cuda::CUDAStream wrapped =
      c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), tensor.device().index());
  c10::cuda::CUDACachingAllocator::recordStream(tensor.storage().data_ptr(), wrapped);
}

std::string cuda_device_name(int device_index) {
  return at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(device_index))->name;
}

int cuda_compute_capability(int device_index) {
  const auto* properties = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(device_index));
  return 10 * properties->major + properties->minor;
}

void resize_cuda_storage_bytes(c10::StorageImpl* storage, std::size_t bytes) {
  at::native::resize_bytes_cuda(storage, bytes);
}

at::Tensor pinned_host_zeros(int64_t numel, c10::ScalarType dtype, int device_index) {
  const std::size_t bytes = static_cast<std::size_t>(numel) * c10::elementSize(dtype);
  if (bytes == 0) return at::empty({numel}, at::TensorOptions().dtype(dtype).device(at::kCPU));
  const auto device = static_cast<c10::DeviceIndex>(device_index);
  void* data = nullptr;
  {
    const c10::cuda::CUDAGuard guard(device);
    const cudaError_t status = cudaHostAlloc(&data, bytes, cudaHostAllocDefault);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();  // an allocation failure is not sticky; leave none behind
      ST_THROW(Error, "cannot pin ", bytes, " bytes of host memory (cudaHostAlloc: ", cudaGetErrorString(status),
               ")");
    }
  }
  // Written by the host here, before any stream can read it: no copy is queued on it yet.
  std::memset(data, 0, bytes);
  // Whoever queued copies on the buffer waits for them before its last
  // reference goes (the engine's teardown waits for its uploads); cudaFreeHost
  // synchronizes the device besides, which LibTorch's pinned allocator exists
  // to avoid. The guard keeps a thread that never chose a GPU (an
  // allocator's, autograd's) from creating a context on GPU 0 for it.
  // A deleter must not throw (c10's guard does on a failing runtime, as at
  // exit): the memory is then the process's until it ends.
  auto release = [device](void* pointer) noexcept {
    try {
      const c10::cuda::CUDAGuard guard(device);
      if (cudaFreeHost(pointer) != cudaSuccess) (void)cudaGetLastError();
    } catch (...) {
      (void)cudaGetLastError();
    }
  };
  return at::from_blob(data, {numel}, release, at::TensorOptions().dtype(dtype).device(at::kCPU));
}

CudaMemoryStats cuda_memory_stats(int device_index) {
  const auto stats =
      c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device_index));
  // Index 0 is StatType::AGGREGATE (all pools) in every LibTorch since 1.6;
  // the enum itself moved namespaces in 2.x.
  CudaMemoryStats out;
  out.allocated = stats.allocated_bytes[0].current;
  out.peak_allocated = stats.allocated_bytes[0].peak;
  out.reserved = stats.reserved_bytes[0].current;
  out.peak_reserved = stats.reserved_bytes[0].peak;
  return out;
}

void reset_cuda_peak_memory(int device_index) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device_index));
}

void restore_cuda_device(int device_index) noexcept {
  // It runs in destructors: c10's device checks throw on a failing runtime
  // (at process exit, one unloading), and a throw there would terminate.
  try {
    (void)c10::cuda::MaybeSetDevice(static_cast<c10::DeviceIndex>(device_index));
  } catch (...) {
    (void)cudaGetLastError();
  }
}


}  // namespace shardtrain::torch_cuda
