// NCCL backend of the Communicator (CUDA tensors): its per-communicator
// state, how a collective is issued on the communication stream and tracked
// by the watchdog, the work objects, sub-groups, and the factory behind
// nccl_factory.h.
//
// One piece: NcclState, IssueContext and NcclWork are this communicator's own
// private types, used by every collective below; apart they would be a
// private header with one user. What stands on its own is apart already: the
// watchdog (nccl_watchdog.cpp) and the NCCL helpers (nccl_utils.h).

#include "comm/nccl/nccl_communicator.h"
#include "build_config.h"  // SHARDTRAIN_WITH_NCCL, SHARDTRAIN_WITH_CUDA_KERNELS

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <utility>
#include <stdexcept>
#include <thread>

#include <ATen/ATen.h>
#include <nccl.h>

#include "comm/nccl/nccl_utils.h"
#include "comm/collective_log.h"
#include "comm/nccl/nccl_watchdog.h"
#include "comm/nccl/nccl_factory.h"
#include "comm/work_util.h"
#include "kernels/cuda/cuda_kernels.h"
#include "local_gpu.h"
#include "shardtrain/error.h"
#include "shardtrain/logging.h"
#include "torch_cuda.h"

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

namespace kcuda = ::shardtrain::kernels::cuda;

/// The one stream every communicator of this process enqueues on for
/// `device`. One, because collectives of two communicators (HYBRID_SHARD's
/// shard and replicate groups, the world) on two streams may run in an order
/// that differs from rank to rank, which NCCL documents can deadlock; on one
/// stream they run in issue order, which is the same on every rank as long as
/// one thread at a time issues them (the engines do: the training thread, or
/// autograd's while backward() holds it). Never destroyed, because the
/// caching allocator keeps the stream that record_cuda_stream named for a
/// block until the block is freed, which may be after its communicator is
/// gone (a buffer Accelerator::gather_for_metrics returned). Its own, not one
/// of ATen's pool, which hands its streams out again in turn to whoever asks.
/// Highest priority, as c10d's NCCL streams; non-blocking with the legacy
/// default stream; ordering with the caller's stream is by events.
cudaStream_t communication_stream(int device) {
  static std::mutex mutex;
  static std::map<int, cudaStream_t> streams;
  std::lock_guard<std::mutex> lock(mutex);
  auto found = streams.find(device);
  if (found != streams.end()) return found->second;
  const CudaDeviceGuard guard(device);
  int least = 0, greatest = 0;
  ST_CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t stream = nullptr;
  ST_CHECK_CUDA(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest));
  streams.emplace(device, stream);
  return stream;
}

/// The stream the caller's CUDA work runs on. `device` must be current: the
/// legacy default stream (and ATen's default stream, which is the same
/// handle) means "the current device's".
cudaStream_t caller_stream(int device) {
  return static_cast<cudaStream_t>(torch_cuda::current_cuda_stream(device));
}

ncclDataType_t nccl_type(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return ncclFloat32;
    case at::kBFloat16: return ncclBfloat16;
    case at::kHalf: return ncclFloat16;
    case at::kLong: return ncclInt64;
    case at::kDouble: return ncclFloat64;
    case at::kByte: return ncclUint8;  // moved only (all-gather, broadcast); never reduced
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
  /// The handle of a communicator marked aborted whose ncclCommAbort is still
  /// to run (the watchdog runs it after failing what was pending).
  ncclComm_t doomed = nullptr;
  bool aborted = false;
  std::string abort_reason;  ///< written once, before abort_started
  /// Set before ncclCommAbort, read without the lock: the watchdog must not
  /// take an event that an abort made fire for a completion, and
  /// check_health() reads abort_reason once it is set.
  std::atomic<bool> abort_started{false};
  /// Follows the collectives in flight; stopped first at teardown.
  std::unique_ptr<Watchdog> watchdog;
  /// The communicator's CollectiveLog::report(), for the watchdog's timeout error.
  std::function<std::string()> hang_report;

  NcclState() = default;
  NcclState(const NcclState&) = delete;
  NcclState& operator=(const NcclState&) = delete;
  ~NcclState();

  /// Marks the communicator aborted (the first reason is the one later calls
  /// report) and takes its handle out of use, into `doomed`. Requires `mutex`.
  void mark_aborted_locked(const std::string& reason) {
    if (!aborted) {
      aborted = true;
      abort_reason = reason;
    }
    abort_started.store(true, std::memory_order_release);
    if (comm != nullptr) {
      doomed = comm;
      comm = nullptr;
    }
  }

  /// ncclCommAbort: kills the NCCL kernels still waiting for peers, so the
  /// GPU stream drains and the process can exit or report. Requires `mutex`
  /// (the callers issuing or creating, who wait for the abort anyway).
  void abort_locked(const std::string& reason) {
    mark_aborted_locked(reason);
    finish_abort(std::exchange(doomed, nullptr));
  }

  /// The watchdog's abort, in two halves. Marking takes the lock only briefly;
  /// ncclCommAbort then runs outside it, after the watchdog has failed what
  /// was pending, because it can block until the whole GPU queue drains (at
  /// teardown it frees pinned host memory, and cudaFreeHost waits for the
  /// device): a caller learns of a timeout at its deadline, and
  /// check_health() and issuing never wait behind the teardown.
  void mark_aborted(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mutex);
    mark_aborted_locked(reason);
  }
  void finish_abort() {
    ncclComm_t handle = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex);
      handle = std::exchange(doomed, nullptr);
    }
    finish_abort(handle);
  }
  static void finish_abort(ncclComm_t handle) {
    if (handle != nullptr) (void)ncclCommAbort(handle);
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

  /// NCCL's asynchronous state (a peer's network error, a failed proxy), for
  /// the watchdog: empty while healthy; on a real error the communicator is
  /// marked aborted (the watchdog finishes the abort) and the text names
  /// NCCL's error. Never blocks: while another thread is inside an NCCL call
  /// this round is skipped.
  std::string poll_async_error() {
    std::unique_lock<std::mutex> lock(mutex, std::try_to_lock);
    if (!lock.owns_lock()) return {};
    if (aborted) return abort_reason;  // aborted while issuing (a fatal NCCL result)
    if (comm == nullptr) return {};
    ncclResult_t state = ncclSuccess;
    const ncclResult_t query = ncclCommGetAsyncError(comm, &state);
    const ncclResult_t result = query != ncclSuccess ? query : state;
    if (result == ncclSuccess || result == ncclInProgress) return {};
    const char* text = ncclGetLastError(comm);
    const std::string reason = std::string("NCCL reported ") + ncclGetErrorString(result) +
                               (text != nullptr && *text != 0 ? std::string(" (") + text + ")" : std::string()) +
                               "; a peer rank probably died or lost its network";
    mark_aborted_locked(reason);
    return reason;
  }

  /// Takes the device's communication stream; creates the events, barrier
  /// buffer and the watchdog.
  void create_resources() {
    stream = nccl_detail::communication_stream(device);
    ST_CHECK_CUDA(cudaEventCreateWithFlags(&ready_event, cudaEventDisableTiming));
    ST_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&barrier_buffer), sizeof(float)));
    ST_CHECK_CUDA(cudaMemsetAsync(barrier_buffer, 0, sizeof(float), stream));
    watchdog = std::make_unique<Watchdog>(
        device, timeout, [this] { return poll_async_error(); },
        [this](const std::string& reason) { mark_aborted(reason); }, [this] { finish_abort(); },
        [this] { return abort_started.load(std::memory_order_acquire); },
        [this] { return hang_report ? hang_report() : std::string(); });
  }
};

NcclState::~NcclState() {
  // The watchdog calls back into this state: it goes first.
  watchdog.reset();
  TeardownDeviceGuard guard(device);
  if (!guard.usable()) return;
  finish_abort(std::exchange(doomed, nullptr));  // defensive: the watchdog finishes what it marks
  if (comm != nullptr && std::uncaught_exceptions() > 0) {
    // An error unwinds this rank: its peers are probably inside a collective
    // it will never join, and ncclCommFinalize, a collective itself, would
    // wait the whole timeout for them. Aborting now lets this process exit
    // at once, and the launcher then stops the peers (which NCCL does not
    // tell: over sockets they may see an error, over NVLink they wait for
    // their own watchdog).
    ST_LOG_WARN("nccl communicator {}: torn down while an error unwinds; aborting it", name);
    (void)ncclCommAbort(comm);
    comm = nullptr;
  }
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
    if (drained == cudaErrorCudartUnloading) {
      guard.abandon();
      return;
    }
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
      ST_LOG_WARN("nccl communicator {}: the communication stream (shared by every communicator on this GPU) "
                  "did not drain within {} ms at teardown; aborting it", name, timeout.count());
      (void)ncclCommAbort(comm);
    }
    comm = nullptr;
  }
  if (barrier_buffer != nullptr) (void)cudaFree(barrier_buffer);
  if (ready_event != nullptr) (void)cudaEventDestroy(ready_event);
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

  /// Runs `calls` (NCCL calls through nccl()) inside one NCCL group: one
  /// launch for all of them. A throw between start and end still closes the
  /// group: an open group defers every later NCCL call of this thread, on any
  /// communicator.
  void in_one_group(const std::function<void()>& calls) {
    nccl(ncclGroupStart(), "ncclGroupStart");
    bool open = true;
    struct Closer {
      bool& open;
      ~Closer() {
        if (open) (void)ncclGroupEnd();
      }
    } closer{open};
    calls();
    open = false;
    nccl(ncclGroupEnd(), "ncclGroupEnd");
  }

  void cuda(cudaError_t status, const char* call) const {
    if (status == cudaSuccess) return;
    (void)cudaGetLastError();
    ST_THROW(Error, description, " failed: ", call, ": ", cudaGetErrorName(status), " (",
             cudaGetErrorString(status), ")");
  }
};

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
/// ncclCommSplit of `parent` (collective over all its ranks): `color` picks
/// the sub-group (NCCL_SPLIT_NOCOLOR: none, the result is null), `key` the
/// rank order in it. Non-blocking, like every communicator here, and bounded
/// by the parent's timeout.
ncclComm_t split_communicator(NcclState& parent, int color, int key, const std::string& what) {
  std::lock_guard<std::mutex> lock(parent.mutex);
  parent.ensure_usable_locked(what);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t child = nullptr;
  ncclResult_t result = ncclCommSplit(parent.comm, color, key, &child, &config);
  const Clock::time_point deadline = Clock::now() + parent.timeout;
  Backoff backoff;
  // Both communicators report the split's progress: the parent (which all
  // ranks share) and the child (members only).
  // NCCL's own thread writes `child` while the split runs.
  auto current_child = [&child] { return __atomic_load_n(&child, __ATOMIC_ACQUIRE); };
  auto state_of = [](ncclComm_t c) {
    if (c == nullptr) return ncclSuccess;
    ncclResult_t state = ncclSuccess;
    const ncclResult_t query = ncclCommGetAsyncError(c, &state);
    return query != ncclSuccess ? query : state;
  };
  while (result == ncclInProgress) {
    if (Clock::now() >= deadline) {
      // The parent first: aborting it ends the split, after which the child
      // handle is final and can be aborted too.
      parent.abort_locked("timeout of " + what);
      if (current_child() != nullptr) (void)ncclCommAbort(current_child());
      rethrow_collective_failure(what, parent.timeout,
                                 std::runtime_error("ncclCommSplit timed out: not every rank of the parent group "
                                                    "called new_group/split; the parent communicator was aborted"));
    }
    backoff.sleep();
    const ncclResult_t from_parent = state_of(parent.comm);
    const ncclResult_t from_child = state_of(current_child());
    result = from_parent != ncclSuccess ? from_parent : from_child;
  }
  if (result != ncclSuccess) {
    const char* text = ncclGetLastError(parent.comm);
    const std::string detail = text != nullptr ? text : "";
    parent.abort_locked(std::string("ncclCommSplit returned ") + ncclGetErrorString(result));
    if (current_child() != nullptr) (void)ncclCommAbort(current_child());
    ST_THROW(Error, what, " failed: ncclCommSplit returned ", ncclGetErrorString(result), detail.empty() ? "" : " (",
             detail, detail.empty() ? "" : ")", "; the parent communicator was aborted");
  }
  return current_child();
}
#endif

/// Handle of one issued collective. Holds every tensor the GPU still reads or
/// writes (inputs, outputs, fp32 temporaries) until wait() has ordered the
/// caller's stream after the collective, so their memory cannot return to the
/// caching allocator for other work while NCCL uses it. Completion, errors
/// and the deadline are the watchdog's: wait() never blocks the host.
class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclState> state, std::shared_ptr<PendingCollective> pending, cudaStream_t issue_stream,
           std::vector<at::Tensor> keep_alive)
      : state_(std::move(state)), pending_(std::move(pending)), issue_stream_(issue_stream),
        keep_alive_(std::move(keep_alive)) {}

  ~NcclWork() override {
    if (ordered_) return;
    const TeardownDeviceGuard guard(state_->device);
    if (!guard.usable()) return;
    // Dropped without wait(): the kept tensors go back to the caching
    // allocator now, which may hand their blocks to the next allocation on the
    // issuing stream while the collective still writes them. Making that
    // stream wait for the collective closes the window without blocking here.
    (void)cudaStreamWaitEvent(issue_stream_, pending_->done_event(), 0);
  }

  /// Orders the caller's current stream (and the issuing one) after the
  /// collective and returns; throws when the watchdog has failed it already.
  void wait() override {
    std::lock_guard<std::mutex> lock(mutex_);  // guards ordered_ and keep_alive_ only
    if (pending_->status() == PendingCollective::Status::kFailed) std::rethrow_exception(pending_->failure());
    if (ordered_) return;
    CudaDeviceGuard guard(state_->device);
    const cudaStream_t caller = caller_stream(state_->device);
    ST_CHECK_CUDA(cudaStreamWaitEvent(caller, pending_->done_event(), 0));
    if (issue_stream_ != caller) ST_CHECK_CUDA(cudaStreamWaitEvent(issue_stream_, pending_->done_event(), 0));
    keep_alive_.clear();
    ordered_ = true;
  }

  bool is_completed() override { return pending_->status() != PendingCollective::Status::kRunning; }

  /// wait(), then blocks the host until the collective finished (barrier).
  void wait_on_host() {
    wait();
    pending_->wait_settled();
    if (pending_->status() == PendingCollective::Status::kFailed) std::rethrow_exception(pending_->failure());
  }

 private:
  std::mutex mutex_;
  std::shared_ptr<NcclState> state_;
  std::shared_ptr<PendingCollective> pending_;
  cudaStream_t issue_stream_;
  std::vector<at::Tensor> keep_alive_;
  bool ordered_ = false;
};

}  // namespace nccl_detail

using nccl_detail::Clock;
using nccl_detail::CudaDeviceGuard;
using nccl_detail::IssueContext;
using nccl_detail::NcclState;
namespace kcuda = ::shardtrain::kernels::cuda;

NcclCommunicator::NcclCommunicator(comm::StorePtr store, int rank, int world_size,
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
  collective_log()->attach_store(root_store_, store_prefix_, options.timeout);
  state_->hang_report = [log = collective_log()] { return log->report(); };
  state_->name = "rank " + std::to_string(rank) + " of " + std::to_string(world_size) + " on cuda:" +
                 std::to_string(device_index) + " (store prefix '" + store_prefix_ + "')";
  const Clock::time_point deadline = Clock::now() + options.timeout;

  // If anything below throws, state_'s destructor releases what exists so far.
  CudaDeviceGuard guard(device_);
  state_->create_resources();

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
               ". Set NCCL_DEBUG=INFO for NCCL's own account. Common causes: two ranks on one GPU "
               "(CUDA_VISIBLE_DEVICES, one rank per GPU), a /dev/shm too small for NCCL's shared memory "
               "(a container's default 64 MB: docker --shm-size or --ipc=host), the wrong network interface "
               "between machines (NCCL_SOCKET_IFNAME)");
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

void NcclCommunicator::check_health() const {
  if (!state_->abort_started.load(std::memory_order_acquire)) return;
  // Without the lock, which an abort in progress may hold: the reason was
  // written, once, before abort_started.
  const std::string reason = state_->abort_reason;
  const std::string where = "nccl communicator " + state_->name;
  if (reason.rfind("timeout", 0) == 0) {
    ST_THROW(TimeoutError, where, " was aborted (", reason, "): results since then are not valid; restart the job "
             "(resume from the last checkpoint), or raise the timeout (SHARDTRAIN_COMM_TIMEOUT_S) if the job is "
             "only slow");
  }
  ST_THROW(Error, where, " was aborted (", reason, "): results since then are not valid; restart the job (resume "
           "from the last checkpoint)");
}

void NcclCommunicator::check_device(const CollectiveEvent& event, const at::Tensor& tensor) const {
  ST_CHECK(tensor.device().index() == device_, describe(event), ": tensor on ", tensor.device().str(),
           ", but this NCCL communicator drives cuda:", device_, "; move the tensor to cuda:", device_);
}

WorkPtr NcclCommunicator::issue(const CollectiveEvent& event, std::vector<at::Tensor> keep_alive,
                                const std::function<void(IssueContext&)>& enqueue) {
  const std::string description = describe(event);
  // Back-pressure before any lock: see kMaxInFlight.
  state_->watchdog->wait_for_room(kMaxInFlight);
  const Clock::time_point deadline = Clock::now() + options().timeout;
  CudaDeviceGuard guard(device_);
  // The NCCL stream uses these tensors too: their blocks must not return to
  // the caching allocator for other work until that stream is past them,
  // whichever stream they were allocated on.
  for (const at::Tensor& t : keep_alive) torch_cuda::record_cuda_stream(t, state_->stream);
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
  auto pending = std::make_shared<nccl_detail::PendingCollective>(device_, done, description, deadline);
  state_->watchdog->watch(pending);
  return std::make_shared<nccl_detail::NcclWork>(state_, std::move(pending), caller, std::move(keep_alive));
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

WorkPtr NcclCommunicator::do_all_gather_coalesced(const std::vector<at::Tensor>& outputs,
                                                  const std::vector<at::Tensor>& inputs, const CollectiveEvent& event) {
  // One issue for all the pieces (a unit's parameters), in one NCCL group:
  // one launch, one event, and one thread of NCCL's where a non-blocking
  // communicator would start one per call.
  std::vector<at::Tensor> keep_alive;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    check_device(event, outputs[i]);
    check_device(event, inputs[i]);
    keep_alive.push_back(outputs[i]);
    keep_alive.push_back(inputs[i]);
  }
  return issue(event, std::move(keep_alive), [&](IssueContext& ctx) {
    ctx.in_one_group([&] {
      for (std::size_t i = 0; i < inputs.size(); ++i) {
        ctx.nccl(ncclAllGather(inputs[i].data_ptr(), outputs[i].data_ptr(), static_cast<size_t>(inputs[i].numel()),
                               nccl_detail::nccl_type(inputs[i].scalar_type()), ctx.comm(), ctx.stream),
                 "ncclAllGather");
      }
    });
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
                           ctx.in_one_group([&] {
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
                           });
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

void NcclCommunicator::do_barrier(const CollectiveEvent& event) {
  float* buffer = state_->barrier_buffer;
  // A one-element all-reduce that every rank must join; waiting for it on the
  // host also drains whatever the caller's stream had queued before.
  WorkPtr work = issue(event, {}, [&](IssueContext& ctx) {
    ctx.nccl(ncclAllReduce(buffer, buffer, 1, ncclFloat32, ncclSum, ctx.comm(), ctx.stream),
             "ncclAllReduce (barrier)");
  });
  static_cast<nccl_detail::NcclWork&>(*work).wait_on_host();
}

std::shared_ptr<Communicator> NcclCommunicator::do_new_group(const std::vector<int>& ranks, int64_t group_index) {
  std::vector<int> global = global_ranks_of(ranks);
  const int my_index = static_cast<int>(std::find(ranks.begin(), ranks.end(), rank()) - ranks.begin());
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
  // ncclCommSplit reuses the parent's bootstrap and connections: no store
  // round trip and no new unique id. Non-members take part through
  // do_new_group_not_member.
  return std::make_shared<NcclCommunicator>(*this, my_index, static_cast<int>(ranks.size()), std::move(global),
                                            group_index);
#else
  // Same store, the sub-group prefix Gloo uses too: the sub-group's rank 0
  // publishes a fresh unique id there.
  return std::make_shared<NcclCommunicator>(root_store_, my_index, static_cast<int>(ranks.size()),
                                            std::move(global), options(), device_,
                                            sub_group_store_prefix(store_prefix_, group_index));
#endif
}

void NcclCommunicator::do_new_group_not_member(const std::vector<int>& /*ranks*/, int64_t group_index) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
  CudaDeviceGuard guard(device_);
  (void)nccl_detail::split_communicator(*state_, NCCL_SPLIT_NOCOLOR, rank(),
                                        "new_group " + std::to_string(group_index) + " (not a member) on nccl rank " +
                                            std::to_string(rank()) + " of " + std::to_string(world_size()));
#else
  (void)group_index;  // the unique-id path involves members only
#endif
}

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
NcclCommunicator::NcclCommunicator(NcclCommunicator& parent, int rank, int world_size, std::vector<int> global_ranks,
                                   int64_t group_index)
    : Communicator(rank, world_size, std::move(global_ranks), parent.options()), root_store_(parent.root_store_),
      store_prefix_(parent.store_prefix_ + "g" + std::to_string(group_index) + "/"), device_(parent.device_),
      state_(std::make_shared<NcclState>()) {
  state_->device = device_;
  state_->timeout = options().timeout;
  collective_log()->attach_store(root_store_, store_prefix_, options().timeout);
  state_->hang_report = [log = collective_log()] { return log->report(); };
  state_->name = "rank " + std::to_string(rank) + " of " + std::to_string(world_size) + " on cuda:" +
                 std::to_string(device_) + " (split " + std::to_string(group_index) + " of " + parent.state_->name +
                 ")";
  CudaDeviceGuard guard(device_);
  state_->create_resources();
  // The key orders the sub-group: this rank sits where the caller listed it.
  ncclComm_t child = nccl_detail::split_communicator(*parent.state_, /*color=*/0, /*key=*/rank,
                                                     "new_group " + std::to_string(group_index) + " of " +
                                                         parent.state_->name);
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->comm = child;
}
#endif

// ---- factory (nccl_factory.h) ------------------------------------------------------

std::string nccl_unavailable_reason() {
  if (!at::hasCUDA() || torch_cuda::cuda_device_count() == 0) {
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
}

bool nccl_usable() { return nccl_unavailable_reason().empty(); }

std::string nccl_version_string() {
  return std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR) + "." + std::to_string(NCCL_PATCH);
}

std::string nccl_loaded_version_string() {
  int code = 0;
  ST_CHECK_NCCL(ncclGetVersion(&code));
  // NCCL_VERSION(X,Y,Z) is X*10000 + Y*100 + Z since 2.9.
  return std::to_string(code / 10000) + "." + std::to_string(code / 100 % 100) + "." + std::to_string(code % 100);
}

CommunicatorPtr make_nccl_communicator(comm::StorePtr store, int rank, int world_size,
                                       std::vector<int> global_ranks, CommOptions options, int device_index) {
  const std::string reason = nccl_unavailable_reason();
  if (!reason.empty()) ST_THROW(ConfigError, "cannot create an NCCL communicator: ", reason);
  // The library in the process is the one LibTorch loaded first (one soname,
  // libnccl.so.2); it must not be older than the headers shardtrain was built
  // with, whose calls and config struct it must understand.
  int loaded = 0;
  ST_CHECK_NCCL(ncclGetVersion(&loaded));
  if (loaded < NCCL_VERSION_CODE) {
    ST_THROW(ConfigError, "the NCCL library in this process is version code ", loaded, ", older than the NCCL ",
             nccl_version_string(), " headers shardtrain was built with (code ", NCCL_VERSION_CODE,
             "); rebuild against the NCCL LibTorch uses (the torch wheel's site-packages/nvidia/nccl, which "
             "the configure step takes by itself, or NCCL_HOME)");
  }
  if (loaded / 100 != NCCL_VERSION_CODE / 100) {
    ST_LOG_WARN("NCCL: built with {} headers, running with library version code {} (LibTorch's)",
                nccl_version_string(), loaded);
  }
  int count = 0;
  ST_CHECK_CUDA(cudaGetDeviceCount(&count));
  const std::optional<int> local_gpu = gpu_for_local_rank(device_index, count);
  if (!local_gpu) {
    ST_THROW(ConfigError, "NCCL rank ", rank, " should use cuda:", device_index, " (its local rank), but this "
             "process sees ", count, " CUDA device(s): run at most ", count,
             " processes per machine (one per GPU), or fix CUDA_VISIBLE_DEVICES");
  }
  const int device = *local_gpu;
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
