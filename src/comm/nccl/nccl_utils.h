#pragma once
// Error checking and device scoping for the NCCL backend (private header).

#include <algorithm>
#include <chrono>
#include <thread>

#include <cuda_runtime.h>
#include <nccl.h>

#include "shardtrain/error.h"
#include "torch_cuda.h"

namespace shardtrain::comm::nccl_detail {

[[noreturn]] inline void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line) {
  // A failed runtime call also leaves its (non-sticky) error as the thread's
  // "last error"; clear it so the next kernel launch's cudaGetLastError check
  // does not report this failure a second time.
  (void)cudaGetLastError();
  ::shardtrain::detail::throw_with_location<::shardtrain::Error>(
      file, line, "",
      ::shardtrain::detail::concat("CUDA call `", call, "` failed: ", cudaGetErrorName(status), " (",
                                   cudaGetErrorString(status), ")"));
}

[[noreturn]] inline void throw_nccl_error(ncclResult_t status, const char* call, const char* file, int line) {
  // ncclGetLastError carries the detail (which peer, which socket, which
  // environment variable); the error code alone rarely says what to fix.
  const char* detail = ncclGetLastError(nullptr);
  ::shardtrain::detail::throw_with_location<::shardtrain::Error>(
      file, line, "",
      ::shardtrain::detail::concat("NCCL call `", call, "` failed: ", ncclGetErrorString(status),
                                   detail != nullptr && *detail != '\0' ? "; " : "",
                                   detail != nullptr ? detail : ""));
}

/// Poll interval of every host-side wait of the backend (set-up, teardown,
/// the watchdog): short at first so that short waits end within microseconds,
/// growing to 1 ms so that a long one (a straggling rank) does not spin a core
/// the data loader may need.
class Backoff {
 public:
  /// Yields for the first 200 us, then sleeps 5 us doubling to 1 ms. A
  /// non-blocking communicator finishes every call on a thread NCCL starts
  /// for it, usually within tens of microseconds, while a Linux sleep lasts
  /// 50 us or more: sleeping at once would add that to every collective.
  void sleep() {
    if (std::chrono::steady_clock::now() - started_ < std::chrono::microseconds(200)) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(delay_);
    delay_ = std::min(delay_ * 2, std::chrono::microseconds(1000));
  }
  /// Back to yielding (after progress).
  void reset() {
    started_ = std::chrono::steady_clock::now();
    delay_ = std::chrono::microseconds(5);
  }

 private:
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  std::chrono::microseconds delay_{5};
};

/// Makes `device` current for a scope and restores the previous device. Every
/// entry point of the backend uses it: the caller may have any device current
/// (one process can drive several GPUs), while NCCL, the stream and the events
/// of a communicator all belong to its own device.
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int device);
  ~CudaDeviceGuard() {
    if (previous_ != device_) torch_cuda::restore_cuda_device(previous_);
  }
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int device_;
  int previous_ = -1;
};

/// CudaDeviceGuard's form for destructors: it never throws, and tells whether
/// CUDA may be touched at all. At process exit the CUDA runtime may already
/// be unloading (cudaGetDevice fails); then a destructor must leave CUDA and
/// NCCL alone, since touching them can crash, and the OS reclaims everything.
/// Clears CUDA's sticky last error on the way out, as a destructor's
/// ignored calls may leave one.
class TeardownDeviceGuard {
 public:
  explicit TeardownDeviceGuard(int device) noexcept : device_(device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    usable_ = true;
    if (previous_ != device_) (void)cudaSetDevice(device_);
  }
  ~TeardownDeviceGuard() {
    if (!usable_) return;
    (void)cudaGetLastError();
    if (previous_ != device_) torch_cuda::restore_cuda_device(previous_);
  }
  TeardownDeviceGuard(const TeardownDeviceGuard&) = delete;
  TeardownDeviceGuard& operator=(const TeardownDeviceGuard&) = delete;

  /// False where the runtime is unloading: touch nothing.
  bool usable() const { return usable_; }
  /// The runtime turned out to be unloading after all: leave the device as it is.
  void abandon() noexcept { usable_ = false; }

 private:
  int device_;
  int previous_ = -1;
  bool usable_ = false;
};

}  // namespace shardtrain::comm::nccl_detail

/// Throws shardtrain::Error naming the call, CUDA's error name and text, and file:line.
#define ST_CHECK_CUDA(call)                                                                   \
  do {                                                                                        \
    const cudaError_t st_cuda_status_ = (call);                                               \
    if (st_cuda_status_ != cudaSuccess) {                                                     \
      ::shardtrain::comm::nccl_detail::throw_cuda_error(st_cuda_status_, #call, __FILE__, __LINE__); \
    }                                                                                         \
  } while (false)

/// Throws shardtrain::Error naming the call, NCCL's error text and last-error detail,
/// and file:line. Any result but ncclSuccess is an error here, ncclInProgress
/// included: calls on a non-blocking communicator go through
/// NcclCommunicator's own check, which waits those out.
#define ST_CHECK_NCCL(call)                                                                   \
  do {                                                                                        \
    const ncclResult_t st_nccl_status_ = (call);                                              \
    if (st_nccl_status_ != ncclSuccess) {                                                     \
      ::shardtrain::comm::nccl_detail::throw_nccl_error(st_nccl_status_, #call, __FILE__, __LINE__); \
    }                                                                                         \
  } while (false)

namespace shardtrain::comm::nccl_detail {

inline CudaDeviceGuard::CudaDeviceGuard(int device) : device_(device) {
  ST_CHECK_CUDA(cudaGetDevice(&previous_));
  if (previous_ != device_) ST_CHECK_CUDA(cudaSetDevice(device_));
}

}  // namespace shardtrain::comm::nccl_detail
