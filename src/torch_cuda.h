#pragma once
// LibTorch's CUDA calls, behind plain declarations: ATen's current CUDA
// stream, the caching allocator's statistics and in-place storage resizing of
// CUDA tensors. torch_cuda.cpp is the only file that includes LibTorch's CUDA
// headers, so the kernel dispatch, the NCCL backend, the engines and the
// examples compile without them (and without nvcc's include path).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace c10 {
struct StorageImpl;
enum class ScalarType : int8_t;
}
namespace at {
class Tensor;
}

namespace shardtrain::torch_cuda {

/// CUDA devices ATen can use (0 without a CUDA LibTorch, a driver or a visible device).
int cuda_device_count();

/// The stream ATen enqueues work on for `device_index` in this thread (what a
/// stream guard set, else the default stream), as a cudaStream_t. Kernels and
/// collectives order themselves after it.
void* current_cuda_stream(int device_index);

/// The GPU's product name as the driver reports it ("NVIDIA H200").
std::string cuda_device_name(int device_index);

/// The GPU's compute capability as 10 x major + minor (90 for an H100 or H200).
int cuda_compute_capability(int device_index);

/// Blocks the calling thread until the work queued so far on `stream` (a
/// cudaStream_t of `device_index`, as current_cuda_stream gave it) is done.
void synchronize_cuda_stream(int device_index, void* stream);

/// A point in a stream's queue that the host can wait for: a CUDA event
/// recorded there. A default-constructed one is already passed.
class CudaStreamMark {
 public:
  CudaStreamMark() = default;
  /// Where `stream` (a cudaStream_t of `device_index`) has got to in its queue now.
  static CudaStreamMark now_on(int device_index, void* stream);
  /// Blocks the calling thread until the device has passed the mark.
  void wait() const;

 private:
  std::shared_ptr<void> event_;  // an at::cuda::CUDAEvent, named only in torch_cuda.cpp
};

/// Tells the caching allocator that `stream` (a cudaStream_t) uses `tensor`:
/// its block is not reused until that stream is past the work queued now.
/// Nothing for a CPU tensor.
void record_cuda_stream(const at::Tensor& tensor, void* stream);

/// Frees (bytes = 0) or re-allocates a CUDA tensor's storage in place through
/// the caching allocator, keeping the StorageImpl.
void resize_cuda_storage_bytes(c10::StorageImpl* storage, std::size_t bytes);

/// `numel` zeroed elements of `dtype` in page-locked host memory, exactly
/// that many bytes, as a CPU tensor whose last reference hands the memory
/// back to the driver. For buffers that live as long as an engine (the
/// offloaded partitions): LibTorch's pinned allocator
/// (`pinned_memory(true)`) rounds every block up to a power of two and keeps
/// it cached, which can nearly double a multi-GB partition. Allocated with
/// `device_index` current, so that no rank creates a CUDA context on another
/// rank's GPU. Throws shardtrain::Error with the driver's reason when the
/// memory cannot be pinned.
at::Tensor pinned_host_zeros(int64_t numel, c10::ScalarType dtype, int device_index);

/// The caching allocator's byte counts for one device.
struct CudaMemoryStats {
  int64_t allocated = 0;       ///< bytes in live tensors now
  int64_t peak_allocated = 0;  ///< the most bytes in live tensors since the last reset
  int64_t reserved = 0;        ///< bytes the allocator holds from the driver now
  int64_t peak_reserved = 0;
};
CudaMemoryStats cuda_memory_stats(int device_index);
void reset_cuda_peak_memory(int device_index);

/// Makes `device_index` this thread's current device again after a guard
/// switched away from it, without creating a CUDA context on it where none
/// exists (c10::cuda::MaybeSetDevice). A thread that never touched a GPU
/// reports device 0; a plain cudaSetDevice(0) back would create a context
/// there, some hundreds of MB on GPU 0, for every rank whose GPU is not 0.
/// Never throws: destructors call it.
void restore_cuda_device(int device_index) noexcept;

}  // namespace shardtrain::torch_cuda
