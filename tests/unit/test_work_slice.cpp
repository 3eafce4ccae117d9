// wait_slice: one bounded wait on a c10d work, as the Gloo backend polls its
// collectives. The race it closes: c10d's Work::wait(timeout) throws when the
// slice runs out, and the work can complete in that same instant; the Gloo
// backend used to take such a throw from a completed work for a failure and
// report a collective that had succeeded as timed out
// (FaultCheckpointCrash.SaveKilledAtAnyPointLeavesALoadableCheckpoint failed
// that way on a loaded 2-core machine). These stand-in works make the
// instant deterministic.

#include <chrono>
#include <stdexcept>
#include <string>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "comm/work_util.h"

namespace {

using shardtrain::comm::wait_slice;

/// A work whose bounded wait ends exactly as the slice runs out: it finishes
/// (with `outcome`, or successfully when null), then throws the slice's timeout.
class FinishesAsTheSliceRunsOut : public c10d::Work {
 public:
  explicit FinishesAsTheSliceRunsOut(std::exception_ptr outcome) : outcome_(std::move(outcome)) {}
  bool wait(std::chrono::milliseconds timeout) override {
    if (timeout == kNoTimeout) return c10d::Work::wait(timeout);
    finish(outcome_);
    throw std::runtime_error("Operation timed out!");
  }

 private:
  std::exception_ptr outcome_;
};

/// A work that never finishes: every bounded wait times out.
class NeverFinishes : public c10d::Work {
 public:
  bool wait(std::chrono::milliseconds timeout) override {
    if (timeout == kNoTimeout) throw std::logic_error("an unbounded wait on a pending work would hang");
    throw std::runtime_error("Operation timed out!");
  }
};

std::string message_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  }
}

TEST(UnitWorkSlice, AWorkThatSucceedsAsItsSliceRunsOutIsCompletedNotFailed) {
  auto work = c10::make_intrusive<FinishesAsTheSliceRunsOut>(nullptr);
  const auto slice = wait_slice(work, std::chrono::milliseconds(500));
  EXPECT_TRUE(slice.completed);
  EXPECT_FALSE(slice.error) << message_of(slice.error);
}

TEST(UnitWorkSlice, AWorkThatFailsAsItsSliceRunsOutReportsItsOwnFailure) {
  auto work = c10::make_intrusive<FinishesAsTheSliceRunsOut>(
      std::make_exception_ptr(std::runtime_error("Connection closed by peer [127.0.0.1]:4242")));
  const auto slice = wait_slice(work, std::chrono::milliseconds(500));
  EXPECT_TRUE(slice.completed);
  ASSERT_TRUE(slice.error);
  EXPECT_NE(message_of(slice.error).find("Connection closed by peer"), std::string::npos) << message_of(slice.error);
}

TEST(UnitWorkSlice, APendingWorkIsNeitherCompletedNorFailedWhenItsSliceRunsOut) {
  auto work = c10::make_intrusive<NeverFinishes>();
  const auto slice = wait_slice(work, std::chrono::milliseconds(1));
  EXPECT_FALSE(slice.completed);
  EXPECT_FALSE(slice.error);
}

}  // namespace
