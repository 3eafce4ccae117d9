#pragma once
// Small Work implementations shared by the backends (not a public header).

#include <functional>
#include <mutex>
#include <vector>

#include "comm/c10d.h"
#include "shardtrain/comm/communicator.h"

namespace shardtrain::comm {

/// A collective that finished while it was issued (world size 1, empty tensors).
WorkPtr completed_work();

/// Runs `then` once, after `inner` completes, inside wait(). Used for work
/// that must follow the transfer on the host: copying out of a padded
/// buffer, a local reduction, a cast back to the caller's dtype.
WorkPtr then_work(WorkPtr inner, std::function<void()> then);

/// Completes when every one of `works` has (at once when there are none);
/// wait() waits them in order, so a failure surfaces from the first
/// collective that failed.
WorkPtr all_of_work(std::vector<WorkPtr> works);

/// What one bounded wait on a c10d work found.
struct WorkSlice {
  bool completed = false;      ///< the work has finished (with `error` or successfully)
  std::exception_ptr error;    ///< the work's own failure, when it finished with one
};

/// Waits at most `slice` for `work`. A slice that runs out is not a failure:
/// c10d's Work::wait(timeout) throws when the slice ends, and the work may
/// complete in that same instant, so a throw is judged by the work's own
/// state — completed means its real outcome (success or its error) is read
/// again from the work; not completed means only "not yet". Judging the throw
/// itself turned a collective that finished just as a slice ended into a
/// timeout (FaultCheckpointCrash on a loaded machine).
WorkSlice wait_slice(const WorkHandle& work, std::chrono::milliseconds slice);

/// The backend's message without the C++ backtrace c10::Error appends.
std::string backend_message(const std::exception& failure);

/// Rethrows a backend failure as TimeoutError or Error, prefixed with the
/// collective's description and followed by the usual fix and, when given,
/// the hang report (CollectiveLog::report()).
[[noreturn]] void rethrow_collective_failure(const std::string& description,
                                             std::chrono::milliseconds timeout,
                                             const std::exception& failure,
                                             const std::string& hang_report = "");

}  // namespace shardtrain::comm
