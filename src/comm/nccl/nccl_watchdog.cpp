// The NCCL watchdog (see nccl_watchdog.h).

#include "comm/nccl/nccl_watchdog.h"

#include <algorithm>
#include <stdexcept>

#include "comm/nccl/nccl_utils.h"
#include "comm/work_util.h"
#include "shardtrain/error.h"
#include "shardtrain/logging.h"

namespace shardtrain::comm::nccl_detail {

PendingCollective::~PendingCollective() {
  const TeardownDeviceGuard guard(device_);
  if (guard.usable()) (void)cudaEventDestroy(done_);
}

std::exception_ptr PendingCollective::failure() const {
  std::lock_guard<std::mutex> lock(failure_mutex_);
  return failure_;
}

void PendingCollective::mark_failed(std::exception_ptr failure) {
  {
    std::lock_guard<std::mutex> lock(failure_mutex_);
    failure_ = std::move(failure);
  }
  status_.store(Status::kFailed, std::memory_order_release);
}

void PendingCollective::wait_settled() const {
  Backoff backoff;
  while (status() == Status::kRunning) backoff.sleep();
}

Watchdog::Watchdog(int device, std::chrono::milliseconds timeout, AsyncErrorPoll poll, MarkAborted mark_aborted,
                   FinishAbort finish_abort, IsAborted is_aborted, HangReport hang_report)
    : device_(device), timeout_(timeout), hang_report_(std::move(hang_report)), poll_(std::move(poll)),
      mark_aborted_(std::move(mark_aborted)), finish_abort_(std::move(finish_abort)),
      is_aborted_(std::move(is_aborted)), thread_([this] { run(); }) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Watchdog::wait_for_room(int limit) const {
  Backoff backoff;
  while (in_flight() >= limit && !is_aborted_()) backoff.sleep();
}

void Watchdog::watch(std::shared_ptr<PendingCollective> pending) {
  in_flight_.fetch_add(1, std::memory_order_acq_rel);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.push_back(std::move(pending));
  }
  wake_.notify_one();
}

void Watchdog::fail(PendingCollective& pending, const std::function<void()>& make_error) {
  try {
    make_error();
  } catch (...) {
    pending.mark_failed(std::current_exception());
  }
}

void Watchdog::fail_aborted(PendingCollective& pending) const {
  fail(pending, [&] {
    ST_THROW(Error, pending.description(), " failed: the communicator was aborted while it was in flight (",
             abort_reason_, "); its output is not valid. Restart the job (resume from the last checkpoint)");
  });
}

void Watchdog::run() {
  (void)cudaSetDevice(device_);
  Backoff backoff;
  std::vector<std::shared_ptr<PendingCollective>> mine;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (mine.empty()) {
        wake_.wait(lock, [&] { return stop_ || !pending_.empty(); });
        backoff.reset();  // new work after an idle wait: poll it closely first
      }
      if (stop_) return;
      // Oldest first: collectives on one stream complete in issue order.
      mine.insert(mine.end(), pending_.begin(), pending_.end());
      pending_.clear();
    }
    bool progressed = false;
    if (abort_reason_.empty()) {
      const std::string async_error = poll_();
      if (!async_error.empty()) abort_reason_ = async_error;
    }
    const std::size_t before = mine.size();
    for (auto& p : mine) {
      if (!abort_reason_.empty()) {
        // After an abort the kernels are cut short and events fire anyway:
        // completion no longer means the output is valid.
        fail_aborted(*p);
        p.reset();
        progressed = true;
        continue;
      }
      const cudaError_t query = cudaEventQuery(p->done_event());
      if (query == cudaSuccess && is_aborted_()) {
        // Fired because an abort cut the kernels short, not because they finished.
        fail(*p, [&] {
          ST_THROW(Error, p->description(), " failed: the communicator was aborted while it was in flight; its "
                   "output is not valid. Restart the job (resume from the last checkpoint)");
        });
        p.reset();
        progressed = true;
      } else if (query == cudaSuccess) {
        p->mark_done();
        p.reset();
        progressed = true;
      } else if (query != cudaErrorNotReady) {
        (void)cudaGetLastError();
        abort_reason_ = std::string("CUDA error ") + cudaGetErrorName(query) + " during " + p->description();
        mark_aborted_(abort_reason_);
        fail(*p, [&] {
          ST_THROW(Error, p->description(), " failed: CUDA reported ", cudaGetErrorName(query), " (",
                   cudaGetErrorString(query), ") while it ran; the communicator was aborted. A CUDA error "
                   "is sticky: it may come from a kernel queued before the collective (an out-of-bounds index "
                   "in the model); CUDA_LAUNCH_BLOCKING=1 or compute-sanitizer names the kernel");
        });
        p.reset();
        progressed = true;
      } else if (Clock::now() >= p->deadline()) {
        abort_reason_ = "timeout of " + p->description();
        ST_LOG_ERROR("nccl watchdog: {} did not finish within {} ms; aborting the communicator", p->description(),
                     timeout_.count());
        mark_aborted_(abort_reason_);
        const std::string report = hang_report_ ? hang_report_() : "";
        fail(*p, [&] {
          rethrow_collective_failure(p->description(), timeout_,
                                     std::runtime_error("the NCCL collective timed out: still running on the GPU "
                                                        "at the deadline; the communicator was aborted "
                                                        "(ncclCommAbort)"),
                                     report);
        });
        p.reset();
        progressed = true;
      }
    }
    mine.erase(std::remove(mine.begin(), mine.end(), nullptr), mine.end());
    if (!abort_reason_.empty()) {
      // Those checked before this round's abort was marked (still running
      // then) fail now too: the teardown below may take as long as the GPU
      // queue, and nothing pending may wait for it.
      for (auto& p : mine) fail_aborted(*p);
      mine.clear();
    }
    in_flight_.fetch_sub(static_cast<int>(before - mine.size()), std::memory_order_acq_rel);
    if (!abort_reason_.empty()) finish_abort_();
    if (progressed) {
      backoff.reset();
    } else if (!mine.empty()) {
      backoff.sleep();
    }
  }
}

}  // namespace shardtrain::comm::nccl_detail
