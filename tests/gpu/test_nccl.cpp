// GPU tests of the NCCL backend: collectives on one and two GPUs, ordering
// with the caller's stream, and timeouts enforced by the watchdog.
//
// Built only against a CUDA LibTorch; scripts/gpu-check runs them on a GPU
// machine and counts any skip as a failure. Tests that need two GPUs skip on one.

#include <chrono>
#include "build_config.h"  // SHARDTRAIN_WITH_NCCL
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/nccl/nccl_factory.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/error.h"
#include "spin_kernel.h"
#include "support/awkward_values.h"

#if defined(SHARDTRAIN_WITH_NCCL)
#include "comm/nccl/nccl_communicator.h"
#endif

namespace {

namespace comm = shardtrain::comm;
using Clock = std::chrono::steady_clock;

using shardtrain::testing::same_bits;

// ---- NCCL backend ----------------------------------------------------------------

comm::CommOptions options_with_timeout(std::chrono::milliseconds timeout) {
  comm::CommOptions options;
  options.timeout = timeout;
  return options;
}

at::TensorOptions on_gpu(int device, at::ScalarType dtype) {
  return at::TensorOptions().dtype(dtype).device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
}

TEST(NcclBackend, ReportsItselfUsableOnAGpuMachine) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (comm::nccl_version_string().empty()) GTEST_SKIP() << "NCCL backend not compiled";
  EXPECT_TRUE(comm::nccl_usable()) << comm::nccl_unavailable_reason();
  EXPECT_TRUE(comm::nccl_unavailable_reason().empty());
}

TEST(NcclBackend, WorldOfOneThroughThePublicApi) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (comm::nccl_version_string().empty()) GTEST_SKIP() << "NCCL backend not compiled";
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto nccl = comm::make_nccl_communicator(store, 0, 1, {0}, options_with_timeout(std::chrono::seconds(60)), 0);
  EXPECT_EQ(nccl->backend(), "nccl");
  EXPECT_EQ(nccl->device_type(), at::kCUDA);

  std::vector<comm::CollectiveEvent> seen;
  nccl->set_observer([&](const comm::CollectiveEvent& e) { seen.push_back(e); });

  at::Tensor input = at::arange(7, on_gpu(0, at::kFloat)).to(at::kBFloat16);
  at::Tensor output = at::empty({7}, on_gpu(0, at::kBFloat16));
  nccl->all_gather(output, input);
  EXPECT_TRUE(same_bits(output.cpu(), input.cpu()));
  nccl->reduce_scatter(output, input, comm::ReduceOp::kAvg);
  EXPECT_TRUE(same_bits(output.cpu(), input.cpu()));
  nccl->all_reduce(output, comm::ReduceOp::kMax);
  nccl->broadcast(output, 0);
  nccl->barrier();
  ASSERT_EQ(seen.size(), 5u);
  EXPECT_EQ(seen[0].op, "all_gather");
  EXPECT_EQ(seen[0].dtype, at::kBFloat16);
  EXPECT_EQ(seen[1].op, "reduce_scatter");

  // CPU tensors belong to gloo: a clear error, not a crash inside NCCL.
  try {
    nccl->all_reduce(at::ones({4}));
    ADD_FAILURE() << "a CPU tensor was accepted by the nccl backend";
  } catch (const shardtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cuda"), std::string::npos) << e.what();
  }

  // Sub-groups make their own NCCL communicators through the same store.
  auto sub = nccl->new_group({0});
  ASSERT_NE(sub, nullptr);
  sub->all_reduce(output);
  auto part = nccl->split({{0}});
  ASSERT_NE(part, nullptr);
  EXPECT_EQ(part->world_size(), 1);
}

#if defined(SHARDTRAIN_WITH_NCCL)
/// Exposes the backend hooks: with one GPU the group has one rank, and the
/// public API answers world-size-1 collectives itself without reaching NCCL.
class NcclProbe : public comm::NcclCommunicator {
 public:
  using comm::NcclCommunicator::NcclCommunicator;
  using comm::NcclCommunicator::do_all_gather;
  using comm::NcclCommunicator::do_all_gather_coalesced;
  using comm::NcclCommunicator::do_all_reduce;
  using comm::NcclCommunicator::do_barrier;
  using comm::NcclCommunicator::do_broadcast;
  using comm::NcclCommunicator::do_reduce_scatter;
  using comm::NcclCommunicator::do_reduce_scatter_v;
};

comm::CollectiveEvent event_for(const char* op, const at::Tensor& t, comm::ReduceOp reduce = comm::ReduceOp::kSum) {
  comm::CollectiveEvent event{op, t.scalar_type(), t.numel(), t.numel(), reduce};
  return event;
}

TEST(NcclBackend, SingleRankCollectivesRunThroughNccl) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  auto store = c10::make_intrusive<c10d::HashStore>();
  NcclProbe nccl(store, 0, 1, {0}, options_with_timeout(std::chrono::seconds(60)), 0, "probe/");

  // Ordering with the caller: the input is produced by kernels queued on a
  // side stream made current; the collective must start after them.
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, 0);
  c10::cuda::CUDAStreamGuard stream_guard(side);
  at::Tensor input = at::zeros({1 << 22}, on_gpu(0, at::kFloat));
  for (int i = 0; i < 20; ++i) input.add_(1.0);
  at::Tensor output = at::empty_like(input);
  comm::WorkPtr work = nccl.do_all_gather(output, input, event_for("all_gather", input));
  work->wait();  // orders the current (side) stream after the collective; the host does not block
  work->wait();  // a second wait is a no-op
  EXPECT_TRUE(at::all(output == 20.0).item<bool>()) << "the collective read the input before it was written";
  // The watchdog notices completion within its poll interval (at most 1 ms once idle).
  const auto noticed_by = Clock::now() + std::chrono::seconds(5);
  while (!work->is_completed() && Clock::now() < noticed_by) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_TRUE(work->is_completed());

  // Every dtype and op, including the fp32-widened bf16/fp16 reductions
  // (with one rank each result equals the input, bit for bit).
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble, at::kLong}) {
    SCOPED_TRACE(c10::toString(dtype));
    const at::Tensor reference = (at::arange(1001, on_gpu(0, at::kFloat)) - 500.0).to(dtype);
    std::vector<comm::ReduceOp> ops{comm::ReduceOp::kSum, comm::ReduceOp::kMax};
    if (at::isFloatingType(dtype)) ops.push_back(comm::ReduceOp::kAvg);
    for (comm::ReduceOp op : ops) {
      at::Tensor t = reference.clone();
      nccl.do_all_reduce(t, op, event_for("all_reduce", t, op))->wait();
      EXPECT_TRUE(same_bits(t.cpu(), reference.cpu())) << "all_reduce " << comm::to_string(op);
      at::Tensor chunk = at::empty_like(reference);
      nccl.do_reduce_scatter(chunk, reference, op, event_for("reduce_scatter", reference, op))->wait();
      EXPECT_TRUE(same_bits(chunk.cpu(), reference.cpu())) << "reduce_scatter " << comm::to_string(op);
    }
    at::Tensor b = reference.clone();
    nccl.do_broadcast(b, 0, event_for("broadcast", b))->wait();
    EXPECT_TRUE(same_bits(b.cpu(), reference.cpu()));
  }
  nccl.do_barrier(comm::CollectiveEvent{"barrier", at::kFloat, 0, 0});

  // The calls issued as one NCCL group: a unit's pieces, and the uneven reduce-scatter's reduces.
  std::vector<at::Tensor> pieces{(at::arange(7, on_gpu(0, at::kFloat)) * 0.25).to(at::kBFloat16),
                                 at::full({3}, 5.0, on_gpu(0, at::kBFloat16))};
  std::vector<at::Tensor> gathered{at::empty({7}, on_gpu(0, at::kBFloat16)), at::empty({3}, on_gpu(0, at::kBFloat16))};
  nccl.do_all_gather_coalesced(gathered, pieces, comm::CollectiveEvent{"all_gather", at::kBFloat16, 10, 10})->wait();
  for (std::size_t i = 0; i < pieces.size(); ++i) EXPECT_TRUE(same_bits(gathered[i].cpu(), pieces[i].cpu())) << i;
  const at::Tensor uneven = (at::arange(9, on_gpu(0, at::kFloat)) * 0.5).to(at::kBFloat16);
  at::Tensor uneven_out = at::empty({9}, on_gpu(0, at::kBFloat16));
  nccl.do_reduce_scatter_v(uneven_out, uneven, {9}, comm::ReduceOp::kSum, event_for("reduce_scatter", uneven))->wait();
  EXPECT_TRUE(same_bits(uneven_out.cpu(), uneven.cpu()));

  // Async: several in flight, waited for out of order; dropping one unwaited is safe.
  at::Tensor a = at::ones({1 << 20}, on_gpu(0, at::kBFloat16));
  at::Tensor b = at::full({1 << 20}, 2.0, on_gpu(0, at::kHalf));
  auto wa = nccl.do_all_reduce(a, comm::ReduceOp::kSum, event_for("all_reduce", a));
  auto wb = nccl.do_all_reduce(b, comm::ReduceOp::kAvg, event_for("all_reduce", b, comm::ReduceOp::kAvg));
  (void)nccl.do_broadcast(at::ones({1000}, on_gpu(0, at::kFloat)), 0,
                          event_for("broadcast", at::ones({1000}, on_gpu(0, at::kFloat))));
  wb->wait();
  wa->wait();
  EXPECT_TRUE(at::all(a == 1.0).item<bool>());
  EXPECT_TRUE(at::all(b == 2.0).item<bool>());
}

// The watchdog's timeout path on one GPU: a kernel that spins on the
// caller's stream past the deadline holds the collective back (the
// communicator's stream waits for the caller's), exactly as a peer that
// never joins would; the watchdog must fail it, say what it was, and abort.
TEST(NcclBackend, WatchdogFailsACollectiveHeldPastItsDeadline) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  auto store = c10::make_intrusive<c10d::HashStore>();
  NcclProbe nccl(store, 0, 1, {0}, options_with_timeout(std::chrono::milliseconds(2000)), 0, "watchdog/");
  at::Tensor t = at::ones({1000}, on_gpu(0, at::kBFloat16));
  nccl.do_all_reduce(t, comm::ReduceOp::kSum, event_for("all_reduce", t))->wait();  // connected and warm
  ASSERT_EQ(shardtrain::testing::launch_spin(c10::cuda::getCurrentCUDAStream(0).stream(), 6.0), cudaSuccess);
  const auto start = Clock::now();
  comm::WorkPtr work = nccl.do_all_reduce(t, comm::ReduceOp::kSum, event_for("all_reduce", t));
  work->wait();  // stream ordering only: returns at once
  while (!work->is_completed() && Clock::now() - start < std::chrono::seconds(20)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(work->is_completed()) << "the watchdog never settled the collective";
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  RecordProperty("seconds_to_timeout", std::to_string(seconds));
  EXPECT_GE(seconds, 2.0) << "settled before its deadline: the spin did not hold it back";
  EXPECT_LT(seconds, 2.0 + 3.0);
  try {
    work->wait();
    ADD_FAILURE() << "wait() succeeded although the collective was held past its deadline";
  } catch (const shardtrain::TimeoutError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("all_reduce(sum)"), std::string::npos) << what;
    EXPECT_NE(what.find("BFloat16"), std::string::npos) << what;
    EXPECT_NE(what.find("2000 ms"), std::string::npos) << what;
  }
  EXPECT_THROW(nccl.check_health(), shardtrain::TimeoutError);
  // Let the spin end before the next test uses the device.
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}
#endif  // SHARDTRAIN_WITH_NCCL

TEST(NcclBackend, CreationTimesOutWhenAPeerNeverJoins) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (comm::nccl_version_string().empty()) GTEST_SKIP() << "NCCL backend not compiled";
  const auto timeout = std::chrono::milliseconds(2000);
  {
    // Rank 0 alone: it publishes the id, then NCCL's bootstrap waits for rank 1.
    auto store = c10::make_intrusive<c10d::HashStore>();
    const auto start = Clock::now();
    EXPECT_THROW(comm::make_nccl_communicator(store, 0, 2, {0, 1}, options_with_timeout(timeout), 0),
                 shardtrain::TimeoutError);
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 2.0 + 10.0);
  }
  {
    // Rank 1 alone: the unique id never appears in the store.
    auto store = c10::make_intrusive<c10d::HashStore>();
    const auto start = Clock::now();
    EXPECT_THROW(comm::make_nccl_communicator(store, 1, 2, {0, 1}, options_with_timeout(timeout), 0),
                 shardtrain::TimeoutError);
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 2.0 + 10.0);
  }
}

/// Runs `body` on two ranks (threads), rank r on cuda:r, sharing one HashStore.
void run_on_two_gpus(const std::function<void(comm::Communicator&, int)>& body, std::chrono::milliseconds timeout) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        auto nccl = comm::make_nccl_communicator(store, r, 2, {0, 1}, options_with_timeout(timeout), r);
        body(*nccl, r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST(NcclBackend, TwoGpuCollectives) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (comm::nccl_version_string().empty()) GTEST_SKIP() << "NCCL backend not compiled";
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  run_on_two_gpus([](comm::Communicator& nccl, int rank) {
    // Uneven all-gather: chunks of 3, output of 5 (the last rank's tail is dropped).
    at::Tensor in = at::full({3}, rank + 1.0, on_gpu(rank, at::kFloat));
    at::Tensor out = at::empty({5}, on_gpu(rank, at::kFloat));
    nccl.all_gather(out, in);
    EXPECT_TRUE(at::equal(out.cpu(), at::tensor({1.0f, 1.0f, 1.0f, 2.0f, 2.0f})));

    // Reduce-scatter of 5 bf16 elements: chunks of 3, zero-padded tail.
    const at::Tensor rs_in = (at::arange(5, on_gpu(rank, at::kFloat)) * (rank + 1.0)).to(at::kBFloat16);
    at::Tensor rs_out = at::empty({3}, on_gpu(rank, at::kBFloat16));
    nccl.reduce_scatter(rs_out, rs_in, comm::ReduceOp::kSum);
    const at::Tensor sum = rank == 0 ? at::tensor({0.0f, 3.0f, 6.0f}) : at::tensor({9.0f, 12.0f, 0.0f});
    EXPECT_TRUE(at::equal(rs_out.cpu(), sum.to(at::kBFloat16)));
    nccl.reduce_scatter(rs_out, rs_in, comm::ReduceOp::kAvg);
    EXPECT_TRUE(at::equal(rs_out.cpu(), (sum / 2.0).to(at::kBFloat16)));

    // A unit's pieces in one NCCL group: chunks of 2 and 1 per rank.
    std::vector<at::Tensor> pieces{at::full({2}, rank + 1.0, on_gpu(rank, at::kBFloat16)),
                                   at::full({1}, 10.0 * (rank + 1), on_gpu(rank, at::kBFloat16))};
    std::vector<at::Tensor> gathered{at::empty({4}, on_gpu(rank, at::kBFloat16)),
                                     at::empty({2}, on_gpu(rank, at::kBFloat16))};
    nccl.all_gather_coalesced_async(gathered, pieces)->wait();
    EXPECT_TRUE(at::equal(gathered[0].cpu(), at::tensor({1.0f, 1.0f, 2.0f, 2.0f}).to(at::kBFloat16)));
    EXPECT_TRUE(at::equal(gathered[1].cpu(), at::tensor({10.0f, 20.0f}).to(at::kBFloat16)));
    // Uneven reduce-scatter (one reduce per rank in one group): 3 elements to rank 0, 1 to rank 1.
    const at::Tensor v_in = at::arange(4, on_gpu(rank, at::kFloat)) + rank;
    at::Tensor v_out = at::empty({rank == 0 ? 3 : 1}, on_gpu(rank, at::kFloat));
    nccl.reduce_scatter_v_async(v_out, v_in, {3, 1}, comm::ReduceOp::kSum)->wait();
    EXPECT_TRUE(at::equal(v_out.cpu(), rank == 0 ? at::tensor({1.0f, 3.0f, 5.0f}) : at::tensor({7.0f})));

    at::Tensor mx = at::full({100}, rank == 0 ? -1.0 : 4.0, on_gpu(rank, at::kHalf));
    nccl.all_reduce(mx, comm::ReduceOp::kMax);
    EXPECT_TRUE(at::all(mx == 4.0).item<bool>());
    at::Tensor counts = at::full({10}, rank + 1, on_gpu(rank, at::kLong));
    nccl.all_reduce(counts);
    EXPECT_TRUE(at::all(counts == 3).item<bool>());

    at::Tensor b = at::full({64}, rank == 1 ? 42.0 : 0.0, on_gpu(rank, at::kDouble));
    nccl.broadcast(b, 1);
    EXPECT_TRUE(at::all(b == 42.0).item<bool>());
    nccl.barrier();

    // Sub-groups: list order is group-rank order, so global rank 1 is group rank 0 here.
    auto reversed = nccl.new_group({1, 0});
    ASSERT_NE(reversed, nullptr);
    EXPECT_EQ(reversed->rank(), 1 - rank);
    at::Tensor r = at::full({8}, rank == 1 ? 7.0 : 0.0, on_gpu(rank, at::kFloat));
    reversed->broadcast(r, 0);
    EXPECT_TRUE(at::all(r == 7.0).item<bool>());
    auto alone = nccl.split({{0}, {1}});
    ASSERT_NE(alone, nullptr);
    EXPECT_EQ(alone->world_size(), 1);
    EXPECT_EQ(alone->global_ranks(), std::vector<int>{rank});
  }, std::chrono::seconds(120));
}

TEST(NcclBackend, CollectiveThatOneRankNeverJoinsTimesOut) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (comm::nccl_version_string().empty()) GTEST_SKIP() << "NCCL backend not compiled";
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  run_on_two_gpus([](comm::Communicator& nccl, int rank) {
    // Both ranks connect first: NCCL >= 2.22 sets up connections at the first
    // collective (NCCL_RUNTIME_CONNECT), which on a non-blocking communicator
    // would make issuing itself time out instead of the collective.
    at::Tensor warm = at::ones({8}, on_gpu(rank, at::kFloat));
    nccl.all_reduce(warm);
    EXPECT_EQ(warm.sum().item<float>(), 16.0f);
    if (rank == 1) {
      // Alive but absent until rank 0 has given up.
      std::this_thread::sleep_for(std::chrono::seconds(8));
      return;
    }
    at::Tensor t = at::ones({1000}, on_gpu(0, at::kBFloat16));
    const auto start = Clock::now();
    // wait() returns at once (stream ordering only); the watchdog fails the
    // collective at its deadline and aborts the communicator.
    comm::WorkPtr work = nccl.all_reduce_async(t, comm::ReduceOp::kSum);
    work->wait();
    while (!work->is_completed() && Clock::now() - start < std::chrono::seconds(20)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_TRUE(work->is_completed()) << "the watchdog never settled the collective";
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 2.0 + 5.0);
    try {
      work->wait();
      ADD_FAILURE() << "wait() succeeded although rank 1 never joined";
    } catch (const shardtrain::TimeoutError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("all_reduce(sum)"), std::string::npos) << what;
      EXPECT_NE(what.find("rank 0 of 2"), std::string::npos) << what;
      EXPECT_NE(what.find("BFloat16"), std::string::npos) << what;
      EXPECT_NE(what.find("1000 -> 1000 elements"), std::string::npos) << what;
      EXPECT_NE(what.find("2000 ms"), std::string::npos) << what;
    }
    // The aborted communicator says so instead of hanging, to the health
    // check the engines make before a step, and to the next collective.
    EXPECT_THROW(nccl.check_health(), shardtrain::TimeoutError);
    EXPECT_THROW(nccl.all_reduce(t), shardtrain::Error);
  }, std::chrono::milliseconds(2000));
}

}  // namespace
