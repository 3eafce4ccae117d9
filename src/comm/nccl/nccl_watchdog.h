#pragma once
// The NCCL backend's watchdog: one thread per communicator that follows every
// collective in flight, so that no caller ever blocks on the GPU to learn
// whether a collective finished. Work::wait() only orders the caller's stream
// after the collective (the CPU runs ahead, as in c10d); the watchdog notices
// completion, NCCL's asynchronous errors and missed deadlines, and on a
// failure marks the communicator aborted, fails the pending work with an
// error naming the operation, the rank and the sizes, and then tears the
// communicator down (ncclCommAbort makes the stuck kernels exit, so the GPU
// queue drains; it may block until the whole queue has, which is why the
// callers hear first).
//
// No lock is held while it polls: the pending list is swapped out under a
// short lock, and events and NCCL's error state are queried outside it.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

namespace shardtrain::comm::nccl_detail {

using Clock = std::chrono::steady_clock;

/// One collective in flight: its completion event and what became of it.
/// Shared by the Work the caller holds and the watchdog, so the event lives
/// until both are done with it.
class PendingCollective {
 public:
  enum class Status { kRunning, kDone, kFailed };

  PendingCollective(int device, cudaEvent_t done, std::string description, Clock::time_point deadline)
      : device_(device), done_(done), description_(std::move(description)), deadline_(deadline) {}
  ~PendingCollective();
  PendingCollective(const PendingCollective&) = delete;
  PendingCollective& operator=(const PendingCollective&) = delete;

  cudaEvent_t done_event() const { return done_; }
  const std::string& description() const { return description_; }
  Clock::time_point deadline() const { return deadline_; }
  Status status() const { return status_.load(std::memory_order_acquire); }
  /// Why it failed (set before status() reads kFailed).
  std::exception_ptr failure() const;

  void mark_done() { status_.store(Status::kDone, std::memory_order_release); }
  void mark_failed(std::exception_ptr failure);

  /// Blocks the host until the watchdog has settled this collective (done or
  /// failed); the watchdog settles every one by its deadline.
  void wait_settled() const;

 private:
  int device_;
  cudaEvent_t done_;
  std::string description_;
  Clock::time_point deadline_;
  std::atomic<Status> status_{Status::kRunning};
  mutable std::mutex failure_mutex_;
  std::exception_ptr failure_;
};

class Watchdog {
 public:
  /// NCCL's asynchronous error for the communicator: empty while healthy,
  /// else a description (the callback has marked the communicator aborted).
  using AsyncErrorPoll = std::function<std::string()>;
  /// Marks the communicator aborted, with a reason later calls report; quick.
  using MarkAborted = std::function<void(const std::string& reason)>;
  /// Tears a communicator marked aborted down (ncclCommAbort); may block
  /// until the GPU's queue drains. Does nothing when none is marked.
  using FinishAbort = std::function<void()>;
  /// Whether an abort has begun (from any thread), read without a lock.
  using IsAborted = std::function<bool()>;
  /// The cross-rank hang report for a timed-out collective (CollectiveLog::report()).
  using HangReport = std::function<std::string()>;

  Watchdog(int device, std::chrono::milliseconds timeout, AsyncErrorPoll poll, MarkAborted mark_aborted,
           FinishAbort finish_abort, IsAborted is_aborted, HangReport hang_report);
  /// Stops and joins the thread; collectives still pending stay unsettled.
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  void watch(std::shared_ptr<PendingCollective> pending);

  /// Collectives watched and not yet settled.
  int in_flight() const { return in_flight_.load(std::memory_order_acquire); }

  /// Blocks (sleeping, no lock held) until fewer than `limit` collectives are
  /// in flight or the communicator is aborted. Issuing calls it first, so no
  /// thread sits inside an NCCL call on a full queue when an abort is due.
  void wait_for_room(int limit) const;

 private:
  void run();
  /// Fails `pending` with a copy of the exception `make_error` throws.
  static void fail(PendingCollective& pending, const std::function<void()>& make_error);
  /// Fails `pending` as cut short by the abort (abort_reason_).
  void fail_aborted(PendingCollective& pending) const;

  int device_;
  std::chrono::milliseconds timeout_;
  HangReport hang_report_;
  AsyncErrorPoll poll_;
  MarkAborted mark_aborted_;
  FinishAbort finish_abort_;
  IsAborted is_aborted_;
  std::atomic<int> in_flight_{0};
  std::mutex mutex_;  ///< guards pending_ and stop_ only; never held while polling
  std::condition_variable wake_;
  std::vector<std::shared_ptr<PendingCollective>> pending_;
  bool stop_ = false;
  std::string abort_reason_;  ///< watchdog thread only: set once it marked the communicator aborted
  std::thread thread_;
};

}  // namespace shardtrain::comm::nccl_detail
