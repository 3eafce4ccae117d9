// The small Work kinds the backends share: completed, chained and all-of
// work, and the wording of a backend failure as a timeout or an error
// (work_util.h).
#include "comm/work_util.h"

#include <algorithm>
#include <cctype>

#include <c10/util/Exception.h>

#include "shardtrain/error.h"

namespace shardtrain::comm {
namespace {

class CompletedWork final : public Work {
 public:
  void wait() override {}
  bool is_completed() override { return true; }
};

class ThenWork final : public Work {
 public:
  ThenWork(WorkPtr inner, std::function<void()> then) : inner_(std::move(inner)), then_(std::move(then)) {}
  void wait() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) return;
    inner_->wait();
    if (then_) then_();
    then_ = nullptr;
    done_ = true;
  }
  bool is_completed() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_ || inner_->is_completed();
  }

 private:
  std::mutex mutex_;
  WorkPtr inner_;
  std::function<void()> then_;
  bool done_ = false;
};

class AllOfWork final : public Work {
 public:
  explicit AllOfWork(std::vector<WorkPtr> works) : works_(std::move(works)) {}
  void wait() override {
    for (auto& work : works_) work->wait();
  }
  bool is_completed() override {
    return std::all_of(works_.begin(), works_.end(), [](const WorkPtr& w) { return w->is_completed(); });
  }

 private:
  std::vector<WorkPtr> works_;
};

bool looks_like_timeout(std::string message) {
  std::transform(message.begin(), message.end(), message.begin(), ::tolower);
  return message.find("timed out") != std::string::npos ||
         message.find("timeout") != std::string::npos;
}

}  // namespace

std::string backend_message(const std::exception& failure) {
  // c10::Error::what() carries a full C++ backtrace; users need the first line.
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&failure)) {
    return c10_error->what_without_backtrace();
  }
  return failure.what();
}

WorkPtr completed_work() { return std::make_shared<CompletedWork>(); }

WorkPtr all_of_work(std::vector<WorkPtr> works) {
  if (works.empty()) return completed_work();
  if (works.size() == 1) return std::move(works[0]);
  return std::make_shared<AllOfWork>(std::move(works));
}

WorkPtr then_work(WorkPtr inner, std::function<void()> then) {
  return std::make_shared<ThenWork>(std::move(inner), std::move(then));
}

WorkSlice wait_slice(const WorkHandle& work, std::chrono::milliseconds slice) {
  WorkSlice result;
  try {
    result.completed = work->wait(slice);
    return result;
  } catch (const std::exception&) {
    if (!work->isCompleted()) return result;  // the slice ran out first
  }
  // Finished, whatever the slice said: an unbounded wait on a completed work
  // returns at once, or rethrows the work's own failure.
  result.completed = true;
  try {
    work->wait();
  } catch (const std::exception&) {
    result.error = std::current_exception();
  }
  return result;
}

void rethrow_collective_failure(const std::string& description, std::chrono::milliseconds timeout,
                                const std::exception& failure, const std::string& hang_report) {
  const std::string said = backend_message(failure);
  const std::string report = hang_report.empty() ? "" : "\n" + hang_report;
  if (looks_like_timeout(said)) {
    ST_THROW(TimeoutError, description, " did not complete within the timeout of ", timeout.count(),
             " ms: a peer rank did not join or died. Every rank must call the same collectives in "
             "the same order; if the job is just slow, raise the timeout (SHARDTRAIN_COMM_TIMEOUT_S). "
             "The communicator cannot be used after this. Backend said: ",
             said, report);
  }
  ST_THROW(Error, description, " failed: ", said, report);
}

}  // namespace shardtrain::comm
