#include "comm/nccl/nccl_communicator.h"
#include "build_config.h"  // SHARDTRAIN_WITH_NCCL, SHARDTRAIN_WITH_CUDA_KERNELS

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>

#include <ATen/ATen.h>
#include <nccl.h>

#include "comm/nccl/nccl_utils.h"
#include "comm/nccl_factory.h"
#include "comm/work_util.h"
#include "kernels/cuda/cuda_kernels.h"
#include "shardtrain/error.h"
#include "shardtrain/logging.h"

#if !defined(SHARDTRAIN_WITH_CUDA_KERNELS)
// The fp32 widening of bf16/fp16 reductions runs on the communication stream
// with the kernel library's cast; CMake builds that library whenever nvcc is
// found, which finding NCCL implies.
#error "the NCCL backend needs the CUDA kernel library (SHARDTRAIN_WITH_CUDA_KERNELS)"
#endif

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "the NCCL backend needs NCCL 2.14 or newer (non-blocking communicators, ncclCommFinalize)"
#endif

namespace shardtrain::comm {
namespace nccl_detail {

using Clock = std::chrono::steady_clock;
namespace kcuda = ::shardtrain::kernels::cuda;

/// Host-side poll interval: short at first so that small collectives return
/// within microseconds of finishing, growing to 1 ms so that a long wait (a
/// straggling rank) does not spin a core the data loader may need.
class Backoff {
 public:
  void sleep() {
    std::this_thread::sleep_for(delay_);
    delay_ = std::min(delay_ * 2, std::chrono::microseconds(1000));
  }

 private:
  std::chrono::microseconds delay_{5};
};

/// The stream the caller's CUDA work runs on. `device` must be current: the
/// legacy default stream (and ATen's default stream, which is the same
/// handle) means "the current device's".
cudaStream_t caller_stream(int device) {
#if defined(SHARDTRAIN_TORCH_CUDA)
  return compat::current_cuda_stream(device);
#else
  // Without a CUDA LibTorch no ATen stream exists; any CUDA work of the
  // caller runs on the legacy default stream.
  (void)device;
  return cudaStreamLegacy;
#endif
}

ncclDataType_t nccl_type(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return ncclFloat32;
    case at::kBFloat16: return ncclBfloat16;
    case at::kHalf: return ncclFloat16;
    case at::kLong: return ncclInt64;
    case at::kDouble: return ncclFloat64;
    default:
      ST_THROW(Error, "the nccl backend has no mapping for dtype ", c10::toString(dtype),
               "; use float32, bfloat16, float16, float64 or int64");
  }
}

kcuda::DType kernel_type(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return kcuda::DType::kF32;
    case at::kBFloat16: return kcuda::DType::kBF16;
    case at::kHalf: return kcuda::DType::kF16;
    default:
      ST_THROW(Error, "no CUDA cast kernel for dtype ", c10::toString(dtype));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
  }
  ST_THROW(Error, "unknown reduce op ", static_cast<int>(op));
}

/// bf16/fp16 SUM and AVG accumulate rounding error in 16 bits (over W ranks,
/// and NCCL's ring order differs per chunk); the contract promises fp32
/// accumulation. MAX only selects one of the inputs, so it is exact natively.
bool widen_for_reduction(at::ScalarType dtype, ReduceOp op) {
  return (dtype == at::kBFloat16 || dtype == at::kHalf) && op != ReduceOp::kMax;
}

/// Everything a communicator and its in-flight Work share. Owned through
/// shared_ptr by both, so a Work that outlives its communicator still finds the
/// stream and the NCCL handle it must poll.
struct NcclState {
  int device = 0;
  std::chrono::milliseconds timeout{0};
  std::string name;  ///< "rank r of W on cuda:d (store prefix 'p')", for teardown messages
  cudaStream_t stream = nullptr;
  cudaEvent_t ready_event = nullptr;  ///< recorded on the caller's stream before each collective
  float* barrier_buffer = nullptr;    ///< the one element a barrier all-reduces

  /// Serialises NCCL calls on this communicator (NCCL communicators are not
  /// thread-safe) and guards the fields below.
  std::mutex mutex;
  ncclComm_t comm = nullptr;
  bool aborted = false;
  std::string abort_reason;

  NcclState() = default;
  NcclState(const NcclState&) = delete;
  NcclState& operator=(const NcclState&) = delete;
  ~NcclState();

  /// ncclCommAbort: kills the NCCL kernels still waiting for peers, so the
  /// GPU stream drains and the process can exit or report. Requires `mutex`.
  void abort_locked(const std::string& reason) {
    if (comm != nullptr) {
      (void)ncclCommAbort(comm);
      comm = nullptr;
    }
    if (!aborted) {
      aborted = true;
      abort_reason = reason;
    }
  }

  void abort(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mutex);
    abort_locked(reason);
  }

  bool is_aborted() {
    std::lock_guard<std::mutex> lock(mutex);
    return aborted;
  }

  void ensure_usable_locked(const std::string& description) const {
    if (aborted) {
      ST_THROW(Error, description, ": this NCCL communicator was aborted after an earlier failure (",
               abort_reason,
               ") and can no longer communicate; restart the job (resume from the last checkpoint)");
    }
  }

  /// Waits out ncclInProgress (non-blocking communicator: NCCL finishes the call
  /// on its own thread, e.g. connecting to peers) until `deadline`. Returns the
  /// final result; sets *timed_out when the deadline passed first. Requires `mutex`.
  ncclResult_t settle_locked(ncclResult_t result, Clock::time_point deadline, bool* timed_out) const {
    *timed_out = false;
    Backoff backoff;
    while (result == ncclInProgress) {
      if (comm == nullptr) return ncclInternalError;
      if (Clock::now() >= deadline) {
        *timed_out = true;
        return result;
      }
      backoff.sleep();
      ncclResult_t state = ncclSuccess;
      const ncclResult_t query = ncclCommGetAsyncError(comm, &state);
      result = query != ncclSuccess ? query : state;
    }
    return result;
  }

  /// NCCL's asynchronous state (a peer's network error, a failed proxy). On a
  /// real error the communicator is aborted; `detail` receives NCCL's last
  /// error text, read before the abort frees it.
  ncclResult_t poll_async_error(std::string* detail) {
    std::lock_guard<std::mutex> lock(mutex);
    if (comm == nullptr) return ncclSuccess;  // aborted: reported through `aborted`
    ncclResult_t state = ncclSuccess;
    const ncclResult_t query = ncclCommGetAsyncError(comm, &state);
    const ncclResult_t result = query != ncclSuccess ? query : state;
    if (result != ncclSuccess && result != ncclInProgress) {
      const char* text = ncclGetLastError(comm);
      *detail = text != nullptr ? text : "";
      abort_locked(std::string("NCCL reported ") + ncclGetErrorString(result));
    }
    return result;
  }
};

NcclState::~NcclState() {
  int previous = -1;
  // At process exit the CUDA runtime may already be unloading; then touching
  // NCCL or CUDA can crash, and the OS reclaims everything anyway.
  if (cudaGetDevice(&previous) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  (void)cudaSetDevice(device);
  if (comm != nullptr) {
    // Collectives whose Work was dropped without wait() may still be queued;
    // NCCL's buffers must outlive them. Bounded: a peer may never arrive.
    const Clock::time_point deadline = Clock::now() + timeout;
    Backoff backoff;
    cudaError_t drained = stream != nullptr ? cudaStreamQuery(stream) : cudaSuccess;
    while (drained == cudaErrorNotReady && Clock::now() < deadline) {
      backoff.sleep();
      drained = cudaStreamQuery(stream);
    }
    if (drained == cudaErrorCudartUnloading) return;
    (void)cudaGetLastError();
    bool clean = false;
    if (drained == cudaSuccess) {
      // Finalize, then destroy: the documented way to tear down a non-blocking
      // communicator without blocking forever inside ncclCommDestroy.
      bool timed_out = false;
      const ncclResult_t finalized = settle_locked(ncclCommFinalize(comm), deadline, &timed_out);
      clean = finalized == ncclSuccess && ncclCommDestroy(comm) == ncclSuccess;
    }
    if (!clean) {
      ST_LOG_WARN("nccl communicator {}: work did not drain within {} ms at teardown; aborting it", name,
                  timeout.count());
      (void)ncclCommAbort(comm);
    }
    comm = nullptr;
  }
  if (barrier_buffer != nullptr) (void)cudaFree(barrier_buffer);
  if (ready_event != nullptr) (void)cudaEventDestroy(ready_event);
  if (stream != nullptr) (void)cudaStreamDestroy(stream);
  (void)cudaGetLastError();
  (void)cudaSetDevice(previous);
}

/// What the enqueue step of one collective sees. NCCL/CUDA results go through
/// nccl()/cuda(), which turn failures into errors naming the collective.
struct IssueContext {
  NcclState& state;
  cudaStream_t stream;
  const std::string& description;
  Clock::time_point deadline;

  ncclComm_t comm() const { return state.comm; }

  void nccl(ncclResult_t result, const char* call) {
    bool timed_out = false;
    result = state.settle_locked(result, deadline, &timed_out);
    if (timed_out) {
      state.abort_locked("timeout while issuing " + description);
      rethrow_collective_failure(
          description, state.timeout,
          std::runtime_error(std::string(call) +
                             " timed out before NCCL could enqueue it (connecting to the peer ranks did "
                             "not finish); the communicator was aborted (ncclCommAbort)"));
    }
    if (result == ncclSuccess) return;
    const char* text = state.comm != nullptr ? ncclGetLastError(state.comm) : nullptr;
    const std::string detail = text != nullptr ? text : "";
    // Argument errors are caught before anything is enqueued and leave the
    // communicator usable; anything else may have left peers mid-collective.
    const bool fatal = result != ncclInvalidArgument && result != ncclInvalidUsage;
    if (fatal) state.abort_locked(std::string(call) + " returned " + ncclGetErrorString(result));
    ST_THROW(Error, description, " failed: ", call, " returned ", ncclGetErrorString(result),
             detail.empty() ? "" : " (", detail, detail.empty() ? "" : ")",
             fatal ? "; the communicator was aborted" : "");
  }

  void cuda(cudaError_t status, const char* call) const {
    if (status == cudaSuccess) return;
    (void)cudaGetLastError();
    ST_THROW(Error, description, " failed: ", call, ": ", cudaGetErrorName(status), " (",
             cudaGetErrorString(status), ")");
  }
};

/// Handle of one issued collective. Owns its completion event and every tensor
/// the GPU still reads or writes (inputs, outputs, fp32 temporaries), so their
/// memory cannot return to the caching allocator while NCCL uses it.
class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclState> state, cudaEvent_t done, cudaStream_t issue_stream,
           std::vector<at::Tensor> keep_alive, std::string description, Clock::time_point deadline)
      : state_(std::move(state)), done_(done), issue_stream_(issue_stream),
        keep_alive_(std::move(keep_alive)), description_(std::move(description)), deadline_(deadline) {}

  ~NcclWork() override {
    int previous = -1;
    if (cudaGetDevice(&previous) != cudaSuccess) {
      (void)cudaGetLastError();
      return;  // runtime unloading at exit
    }
    (void)cudaSetDevice(state_->device);
    if (!finished_) {
      // Dropped without wait(): the kept tensors go back to the caching
      // allocator now, which may hand their blocks to the next allocation on the
      // issuing stream while the collective still writes them. Making that
      // stream wait for the collective closes the window without blocking here.
      (void)cudaStreamWaitEvent(issue_stream_, done_, 0);
    }
    (void)cudaEventDestroy(done_);
    (void)cudaGetLastError();
    (void)cudaSetDevice(previous);
  }

  void wait() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_) std::rethrow_exception(failure_);
    if (finished_) return;
    try {
      wait_locked();
    } catch (...) {
      failure_ = std::current_exception();
      throw;
    }
  }

  bool is_completed() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished_ || failure_) return true;
    const cudaError_t query = cudaEventQuery(done_);
    if (query != cudaSuccess && query != cudaErrorNotReady) (void)cudaGetLastError();
    return query != cudaErrorNotReady;  // an error is "completed": wait() reports it
  }

 private:
  void wait_locked() {
    CudaDeviceGuard guard(state_->device);
    // GPU-side ordering first: work the caller enqueues after wait() must see
    // the output, on the stream current now and on the stream that issued.
    const cudaStream_t caller = caller_stream(state_->device);
    ST_CHECK_CUDA(cudaStreamWaitEvent(caller, done_, 0));
    if (issue_stream_ != caller) ST_CHECK_CUDA(cudaStreamWaitEvent(issue_stream_, done_, 0));

    // Then the host waits, with a deadline: a GPU kernel waiting for a rank
    // that never joins would otherwise never finish, and nothing would report it.
    Backoff backoff;
    while (true) {
      const cudaError_t query = cudaEventQuery(done_);
      if (query == cudaSuccess) break;
      if (query != cudaErrorNotReady) {
        (void)cudaGetLastError();
        state_->abort(std::string("CUDA error ") + cudaGetErrorName(query));
        ST_THROW(Error, description_, " failed: CUDA reported ", cudaGetErrorName(query), " (",
                 cudaGetErrorString(query), ") while it ran; the communicator was aborted");
      }
      std::string detail;
      const ncclResult_t async = state_->poll_async_error(&detail);
      if (async != ncclSuccess && async != ncclInProgress) {
        ST_THROW(Error, description_, " failed: NCCL reported ", ncclGetErrorString(async),
                 detail.empty() ? "" : " (", detail, detail.empty() ? "" : ")",
                 "; a peer rank probably died or lost its network. The communicator was aborted");
      }
      if (state_->is_aborted()) {
        // Another collective's failure aborted the communicator: this one can
        // no longer complete correctly, so there is nothing to wait for.
        std::lock_guard<std::mutex> state_lock(state_->mutex);
        ST_THROW(Error, description_, " failed: the communicator was aborted while this collective was in "
                 "flight (", state_->abort_reason, ")");
      }
      if (Clock::now() >= deadline_) {
        state_->abort("timeout of " + description_);
        rethrow_collective_failure(
            description_, state_->timeout,
            std::runtime_error("the NCCL collective timed out: still running on the GPU at the deadline; "
                               "the communicator was aborted (ncclCommAbort)"));
      }
      backoff.sleep();
    }
    {
      // After ncclCommAbort the NCCL kernels are cut short and the event fires
      // anyway: completion then does not mean the output is valid.
      std::lock_guard<std::mutex> state_lock(state_->mutex);
      if (state_->aborted) {
        ST_THROW(Error, description_, " failed: the communicator was aborted while this collective was in "
                 "flight (", state_->abort_reason, "); its output is not valid");
      }
    }
    keep_alive_.clear();
    finished_ = true;
  }

  std::mutex mutex_;
  std::shared_ptr<NcclState> state_;
  cudaEvent_t done_;
  cudaStream_t issue_stream_;
  std::vector<at::Tensor> keep_alive_;
  std::string description_;
  Clock::time_point deadline_;
  bool finished_ = false;
  std::exception_ptr failure_;
};

}  // namespace nccl_detail

using nccl_detail::Clock;
using nccl_detail::CudaDeviceGuard;
using nccl_detail::IssueContext;
using nccl_detail::NcclState;
namespace kcuda = ::shardtrain::kernels::cuda;

NcclCommunicator::NcclCommunicator(compat::StorePtr store, int rank, int world_size,
                                   std::vector<int> global_ranks, CommOptions options, int device_index,
                                   std::string store_prefix)
    : Communicator(rank, world_size, std::move(global_ranks), options), root_store_(std::move(store)),
      store_prefix_(std::move(store_prefix)), device_(device_index),
      state_(std::make_shared<NcclState>()) {
  ST_CHECK(root_store_, "NcclCommunicator needs a store to exchange the NCCL unique id");
  const std::string what = "nccl rendezvous of rank " + std::to_string(rank) + " of " +
                           std::to_string(world_size) + " on cuda:" + std::to_string(device_index) +
                           " (store prefix '" + store_prefix_ + "')";
  state_->device = device_;
  state_->timeout = options.timeout;
  state_->name = "rank " + std::to_string(rank) + " of " + std::to_string(world_size) + " on cuda:" +
                 std::to_string(device_index) + " (store prefix '" + store_prefix_ + "')";
  const Clock::time_point deadline = Clock::now() + options.timeout;

  // If anything below throws, state_'s destructor releases what exists so far.
  CudaDeviceGuard guard(device_);
  // Non-blocking: it must not synchronise with the legacy default stream,
  // which a caller without a CUDA LibTorch computes on; ordering is by events.
  ST_CHECK_CUDA(cudaStreamCreateWithFlags(&state_->stream, cudaStreamNonBlocking));
  ST_CHECK_CUDA(cudaEventCreateWithFlags(&state_->ready_event, cudaEventDisableTiming));
  ST_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&state_->barrier_buffer), sizeof(float)));
  ST_CHECK_CUDA(cudaMemsetAsync(state_->barrier_buffer, 0, sizeof(float), state_->stream));

  // Rank 0 creates the id (it embeds rank 0's bootstrap address); everyone else
  // reads it from the store, bounded by the timeout.
  const std::string key = "nccl/" + store_prefix_ + "unique_id";
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  try {
    if (rank == 0) {
      ST_CHECK_NCCL(ncclGetUniqueId(&id));
      const auto* bytes = reinterpret_cast<const uint8_t*>(&id);
      root_store_->set(key, std::vector<uint8_t>(bytes, bytes + sizeof(id)));
    } else {
      root_store_->wait({key}, options.timeout);
      const std::vector<uint8_t> bytes = root_store_->get(key);
      ST_CHECK(bytes.size() == sizeof(id), what, ": store key '", key, "' holds ", bytes.size(),
               " bytes, not an ncclUniqueId (", sizeof(id), " bytes); another program uses this store prefix?");
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& failure) {
    rethrow_collective_failure(what, options.timeout, failure);
  }

  // A blocking ncclCommInitRank waits for every rank with no timeout; a
  // non-blocking communicator lets a missing rank end in a TimeoutError.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t started = ncclCommInitRankConfig(&comm, world_size, id, rank, &config);
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->comm = comm;
    bool timed_out = false;
    const ncclResult_t result = state_->settle_locked(started, deadline, &timed_out);
    if (timed_out) {
      state_->abort_locked("initialisation timed out");
      rethrow_collective_failure(
          what, options.timeout,
          std::runtime_error("ncclCommInitRankConfig timed out: not every rank of the group joined"));
    }
    if (result != ncclSuccess) {
      const char* text = comm != nullptr ? ncclGetLastError(comm) : ncclGetLastError(nullptr);
      const std::string detail = text != nullptr ? text : "";
      state_->abort_locked("initialisation failed");
      ST_THROW(Error, what, " failed: ncclCommInitRankConfig returned ", ncclGetErrorString(result),
               detail.empty() ? "" : " (", detail, detail.empty() ? "" : ")",
               ". Set NCCL_DEBUG=INFO for NCCL's own account (network interface: NCCL_SOCKET_IFNAME)");
    }
  }
  if (rank == 0) {
    // Every rank has read the id once initialisation completed (NCCL's bootstrap
    // needs all of them), so the key can go: a later communicator under the same
    // prefix (a second init on the same store) then cannot pick up this stale id.
    try {
      root_store_->deleteKey(key);
    } catch (const std::exception& failure) {
      ST_LOG_DEBUG("nccl: could not delete store key '{}' ({}); harmless unless the prefix is reused", key,
                   failure.what());
    }
  }
}

NcclCommunicator::~NcclCommunicator() = default;

void NcclCommunicator::check_device(const CollectiveEvent& event, const at::Tensor& tensor) const {
  ST_CHECK(tensor.device().index() == device_, describe(event), ": tensor on ", tensor.device().str(),
           ", but this NCCL communicator drives cuda:", device_, "; move the tensor to cuda:", device_);
}

WorkPtr NcclCommunicator::issue(const CollectiveEvent& event, std::vector<at::Tensor> keep_alive,
                                const std::function<void(IssueContext&)>& enqueue) {
  const std::string description = describe(event);
  const Clock::time_point deadline = Clock::now() + options().timeout;
  CudaDeviceGuard guard(device_);
  const cudaStream_t caller = nccl_detail::caller_stream(device_);
  cudaEvent_t done = nullptr;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->ensure_usable_locked(description);
    IssueContext context{*state_, state_->stream, description, deadline};
    context.cuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    try {
      // The collective reads what the caller's stream produced up to now.
      context.cuda(cudaEventRecord(state_->ready_event, caller), "cudaEventRecord (caller stream)");
      context.cuda(cudaStreamWaitEvent(state_->stream, state_->ready_event, 0), "cudaStreamWaitEvent");
      enqueue(context);
      context.cuda(cudaEventRecord(done, state_->stream), "cudaEventRecord (communication stream)");
    } catch (...) {
      // Part of the work (a cast) may be queued already and reads or writes the
      // tensors about to be released: the caller's stream waits for it first.
      if (cudaEventRecord(done, state_->stream) == cudaSuccess) (void)cudaStreamWaitEvent(caller, done, 0);
      (void)cudaEventDestroy(done);
      (void)cudaGetLastError();
      throw;
    }
  }
  return std::make_shared<nccl_detail::NcclWork>(state_, done, caller, std::move(keep_alive), description,
                                                 deadline);
}

WorkPtr NcclCommunicator::do_all_gather(const at::Tensor& output, const at::Tensor& input,
                                        const CollectiveEvent& event) {
  check_device(event, output);
  check_device(event, input);
  const ncclDataType_t type = nccl_detail::nccl_type(input.scalar_type());
  // NCCL writes rank r's chunk at offset r * chunk of the flat output: exactly
  // the Communicator's layout, no staging copy.
  return issue(event, {output, input}, [&](IssueContext& ctx) {
    ctx.nccl(ncclAllGather(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel()), type,
                           ctx.comm(), ctx.stream),
             "ncclAllGather");
  });
}

WorkPtr NcclCommunicator::issue_reduction(
    const CollectiveEvent& event, const at::Tensor& output, const at::Tensor& input, ReduceOp op,
    const std::function<void(IssueContext&, const at::Tensor&, const at::Tensor&, ncclDataType_t)>& reduce) {
  check_device(event, output);
  check_device(event, input);
  if (!nccl_detail::widen_for_reduction(input.scalar_type(), op)) {
    const ncclDataType_t type = nccl_detail::nccl_type(input.scalar_type());
    return issue(event, {output, input}, [&](IssueContext& ctx) { reduce(ctx, input, output, type); });
  }
  // fp32 staging costs 2x the 16-bit input in temporary memory (plus the
  // output) for the duration of the collective, and twice the bytes on the
  // wire; that is the price of fp32 accumulation, as in Gloo's path.
  const kcuda::DType narrow = nccl_detail::kernel_type(input.scalar_type());
  at::Tensor wide_input = at::empty({input.numel()}, input.options().dtype(at::kFloat));
  at::Tensor wide_output = at::empty({output.numel()}, output.options().dtype(at::kFloat));
  return issue(event, {output, input, wide_input, wide_output}, [&](IssueContext& ctx) {
    ctx.cuda(kcuda::launch_cast(input.data_ptr(), narrow, wide_input.data_ptr(), kcuda::DType::kF32,
                                input.numel(), ctx.stream),
             "launch_cast (widen to float32)");
    reduce(ctx, wide_input, wide_output, ncclFloat32);
    if (output.numel() > 0) {
      ctx.cuda(kcuda::launch_cast(wide_output.data_ptr(), kcuda::DType::kF32, output.data_ptr(), narrow,
                                  output.numel(), ctx.stream),
               "launch_cast (narrow the float32 result)");
    }
  });
}

WorkPtr NcclCommunicator::do_reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                                            const CollectiveEvent& event) {
  const ncclRedOp_t nccl_op = nccl_detail::nccl_op(op);
  return issue_reduction(event, output, input, op,
                         [nccl_op](IssueContext& ctx, const at::Tensor& in, const at::Tensor& out,
                                   ncclDataType_t type) {
                           ctx.nccl(ncclReduceScatter(in.data_ptr(), out.data_ptr(),
                                                      static_cast<size_t>(out.numel()), type, nccl_op, ctx.comm(),
                                                      ctx.stream),
                                    "ncclReduceScatter");
                         });
}

WorkPtr NcclCommunicator::do_reduce_scatter_v(const at::Tensor& output, const at::Tensor& input,
                                              const std::vector<int64_t>& splits, ReduceOp op,
                                              const CollectiveEvent& event) {
  const ncclRedOp_t nccl_op = nccl_detail::nccl_op(op);
  // NCCL has no uneven reduce-scatter: one reduce per rank, rooted there, in
  // one group, each reading the input where that rank's piece lies.
  return issue_reduction(event, output, input, op,
                         [&splits, nccl_op](IssueContext& ctx, const at::Tensor& in, const at::Tensor& out,
                                            ncclDataType_t type) {
                           const std::size_t element = in.element_size();
                           ctx.nccl(ncclGroupStart(), "ncclGroupStart");
                           int64_t offset = 0;
                           for (int root = 0; root < static_cast<int>(splits.size()); ++root) {
                             if (splits[root] > 0) {
                               const char* send = static_cast<const char*>(in.data_ptr()) + offset * element;
                               // The receive buffer is read only at the root; elsewhere it is ignored.
                               ctx.nccl(ncclReduce(send, out.data_ptr(), static_cast<size_t>(splits[root]), type,
                                                   nccl_op, root, ctx.comm(), ctx.stream),
                                        "ncclReduce");
                             }
                             offset += splits[root];
                           }
                           ctx.nccl(ncclGroupEnd(), "ncclGroupEnd");
                         });
}

WorkPtr NcclCommunicator::do_all_reduce(const at::Tensor& tensor, ReduceOp op, const CollectiveEvent& event) {
  check_device(event, tensor);
  const size_t count = static_cast<size_t>(tensor.numel());
  const ncclRedOp_t nccl_op = nccl_detail::nccl_op(op);
  if (!nccl_detail::widen_for_reduction(tensor.scalar_type(), op)) {
    const ncclDataType_t type = nccl_detail::nccl_type(tensor.scalar_type());
    return issue(event, {tensor}, [&](IssueContext& ctx) {
      ctx.nccl(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), count, type, nccl_op, ctx.comm(), ctx.stream),
               "ncclAllReduce");
    });
  }
  const kcuda::DType narrow = nccl_detail::kernel_type(tensor.scalar_type());
  at::Tensor wide = at::empty({tensor.numel()}, tensor.options().dtype(at::kFloat));
  return issue(event, {tensor, wide}, [&](IssueContext& ctx) {
    ctx.cuda(kcuda::launch_cast(tensor.data_ptr(), narrow, wide.data_ptr(), kcuda::DType::kF32, tensor.numel(),
                                ctx.stream),
             "launch_cast (widen to float32)");
    ctx.nccl(ncclAllReduce(wide.data_ptr(), wide.data_ptr(), count, ncclFloat32, nccl_op, ctx.comm(), ctx.stream),
             "ncclAllReduce");
    ctx.cuda(kcuda::launch_cast(wide.data_ptr(), kcuda::DType::kF32, tensor.data_ptr(), narrow, tensor.numel(),
                                ctx.stream),
             "launch_cast (narrow the float32 result)");
  });
}

WorkPtr NcclCommunicator::do_broadcast(const at::Tensor& tensor, int root, const CollectiveEvent& event) {
  check_device(event, tensor);
  const ncclDataType_t type = nccl_detail::nccl_type(tensor.scalar_type());
  return issue(event, {tensor}, [&](IssueContext& ctx) {
    ctx.nccl(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()), type, root,
                           ctx.comm(), ctx.stream),
             "ncclBroadcast");
  });
}

void NcclCommunicator::do_barrier() {
  CollectiveEvent event{"barrier", at::kFloat, 0, 0};
  float* buffer = state_->barrier_buffer;
  // A one-element all-reduce that every rank must join; waiting for it on the
  // host also drains whatever the caller's stream had queued before.
  issue(event, {}, [&](IssueContext& ctx) {
    ctx.nccl(ncclAllReduce(buffer, buffer, 1, ncclFloat32, ncclSum, ctx.comm(), ctx.stream),
             "ncclAllReduce (barrier)");
  })->wait();
}

std::shared_ptr<Communicator> NcclCommunicator::do_new_group(const std::vector<int>& ranks, int64_t group_index) {
  std::vector<int> global;
  global.reserve(ranks.size());
  for (int r : ranks) global.push_back(global_ranks()[r]);
  const int my_index = static_cast<int>(std::find(ranks.begin(), ranks.end(), rank()) - ranks.begin());
  // Same store, a prefix derived as GlooCommunicator derives it: the sub-group's
  // rank 0 publishes a fresh unique id there.
  return std::make_shared<NcclCommunicator>(root_store_, my_index, static_cast<int>(ranks.size()),
                                            std::move(global), options(), device_,
                                            store_prefix_ + "g" + std::to_string(group_index) + "/");
}

// ---- factory (comm/nccl_factory.h) -------------------------------------------------

std::string nccl_unavailable_reason() {
#if !defined(SHARDTRAIN_TORCH_CUDA)
  return "LibTorch " + compat::torch_version_string() +
         " was built without CUDA, so there are no CUDA tensors for NCCL to move; build shardtrain against a "
         "CUDA LibTorch (-DCMAKE_PREFIX_PATH=/path/to/libtorch)";
#else
  if (!at::hasCUDA() || compat::cuda_device_count() == 0) {
    return "LibTorch has CUDA but sees no usable GPU (no device, no or too old NVIDIA driver, or "
           "CUDA_VISIBLE_DEVICES hides them all)";
  }
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("the CUDA runtime shardtrain was built with cannot use the GPU: ") +
           cudaGetErrorString(status) +
           " (build with the CUDA toolkit version LibTorch was built with, and check the driver)";
  }
  if (count == 0) return "the CUDA runtime sees no GPU (check CUDA_VISIBLE_DEVICES)";
  return {};
#endif
}

bool nccl_usable() { return nccl_unavailable_reason().empty(); }

std::string nccl_version_string() {
  return std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR) + "." + std::to_string(NCCL_PATCH);
}

CommunicatorPtr make_nccl_communicator(compat::StorePtr store, int rank, int world_size,
                                       std::vector<int> global_ranks, CommOptions options, int device_index) {
  const std::string reason = nccl_unavailable_reason();
  if (!reason.empty()) ST_THROW(ConfigError, "cannot create an NCCL communicator: ", reason);
  int count = 0;
  ST_CHECK_CUDA(cudaGetDeviceCount(&count));
  int device = device_index;
  if (device >= count && count == 1) {
    // Launchers that bind one GPU per task (Slurm --gpus-per-task=1) leave each
    // process exactly one visible device, whatever its local rank.
    device = 0;
  }
  if (device < 0 || device >= count) {
    ST_THROW(ConfigError, "NCCL rank ", rank, " should use cuda:", device_index, " (its local rank), but this "
             "process sees ", count, " CUDA device(s): run at most ", count,
             " processes per machine (one per GPU), or fix CUDA_VISIBLE_DEVICES");
  }
  // The process's default device from now on, as torch.cuda.set_device(local_rank)
  // would make it: the engines allocate their CUDA tensors on the current device.
  ST_CHECK_CUDA(cudaSetDevice(device));
  auto communicator = std::make_shared<NcclCommunicator>(std::move(store), rank, world_size,
                                                         std::move(global_ranks), options, device, "shardtrain/");
  ST_LOG_INFO("initialised nccl communicator: rank {} of {} on cuda:{}, NCCL {}", rank, world_size, device,
              nccl_version_string());
  return communicator;
}

}  // namespace shardtrain::comm
