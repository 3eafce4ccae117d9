#pragma once
// NCCL backend of the Communicator (CUDA tensors): direct NCCL calls on one
// communication stream per GPU, shared by every communicator of the process
// (nccl_communicator.cpp, communication_stream, says why).
//
//  * Ordering with the caller is by CUDA events, both ways: a collective
//    starts after everything already enqueued on the caller's current stream
//    (ATen's current stream with a CUDA LibTorch, else the legacy default
//    stream), and Work::wait() makes the caller's stream wait for it. Compute
//    enqueued between issue and wait overlaps the transfer.
//  * Work::wait() never blocks the host (the CPU runs ahead, as in c10d). A
//    watchdog thread (nccl_watchdog.h) follows every collective in flight and,
//    at the timeout, aborts the communicator (ncclCommAbort) and fails the
//    pending work with a TimeoutError; check_health() and the next collective
//    report it. At most kMaxInFlight collectives are in flight: issuing waits
//    (without a lock) for the oldest, so no thread ever blocks inside NCCL on
//    a full queue while the watchdog needs to abort.
//  * bf16/fp16 SUM/AVG reductions are widened to an fp32 temporary on the
//    communication stream, reduced in fp32 and narrowed back there (the
//    Communicator contract; NCCL itself would accumulate in 16 bits). MAX only
//    selects, so it runs natively.
//  * The ncclUniqueId travels through the job's c10d store under a key unique
//    to this communicator; sub-groups are split from it (ncclCommSplit, NCCL
//    >= 2.18), or on older NCCL get a new id under a derived prefix.
//  * Communicators are non-blocking (NCCL >= 2.14): creation and the
//    connection set-up inside a first collective are bounded by the timeout too.

#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <nccl.h>

#include "comm/c10d.h"
#include "shardtrain/comm/communicator.h"

namespace shardtrain::comm {

namespace nccl_detail {
struct NcclState;
struct IssueContext;
}  // namespace nccl_detail

// Not final: tests/gpu derives from it to call the backend hooks directly,
// because on a one-GPU machine the group has one rank and the base class
// answers world-size-1 collectives without reaching NCCL.
class NcclCommunicator : public Communicator {
 public:
  /// Collective over the ranks of the group: connects through `store` (shared by
  /// the whole job) under `store_prefix`, on CUDA device `device_index`.
  /// Throws TimeoutError when not every rank arrives within options.timeout.
  NcclCommunicator(comm::StorePtr store, int rank, int world_size, std::vector<int> global_ranks,
                   CommOptions options, int device_index, std::string store_prefix);
  /// A sub-group split from `parent` (ncclCommSplit, NCCL >= 2.18): called by
  /// the members, while the other ranks of `parent` take part through
  /// do_new_group_not_member. `rank` is this process's rank in the sub-group.
  NcclCommunicator(NcclCommunicator& parent, int rank, int world_size, std::vector<int> global_ranks,
                   int64_t group_index);
  ~NcclCommunicator() override;

  std::string backend() const override { return "nccl"; }
  at::Device device() const override {
    return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_));
  }
  /// The CUDA device this communicator drives; tensors must live there.
  int device_index() const { return device_; }
  /// Throws the failure that aborted this communicator (a timeout, a dead
  /// peer), if any: results produced since may be garbage.
  void check_health() const override;

 protected:
  WorkPtr do_all_gather(const at::Tensor& output, const at::Tensor& input,
                        const CollectiveEvent& event) override;
  WorkPtr do_all_gather_coalesced(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                                  const CollectiveEvent& event) override;
  WorkPtr do_reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                            const CollectiveEvent& event) override;
  WorkPtr do_reduce_scatter_v(const at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& splits,
                              ReduceOp op, const CollectiveEvent& event) override;
  WorkPtr do_all_reduce(const at::Tensor& tensor, ReduceOp op, const CollectiveEvent& event) override;
  WorkPtr do_broadcast(const at::Tensor& tensor, int root, const CollectiveEvent& event) override;
  void do_barrier(const CollectiveEvent& event) override;
  std::shared_ptr<Communicator> do_new_group(const std::vector<int>& ranks, int64_t group_index) override;
  void do_new_group_not_member(const std::vector<int>& ranks, int64_t group_index) override;

 private:
  /// Collectives in flight at most. Far below what fills NCCL's and CUDA's
  /// queues (a full queue would block an issuing thread inside NCCL with the
  /// communicator's lock held, and then no abort could get it), and far above
  /// what the engines keep in flight (a few per unit of prefetch).
  static constexpr int kMaxInFlight = 64;
  /// Orders the communication stream after the caller's stream, runs `enqueue`
  /// (casts and NCCL calls on the communication stream), records completion and
  /// returns the Work that owns `keep_alive` until it is waited for.
  WorkPtr issue(const CollectiveEvent& event, std::vector<at::Tensor> keep_alive,
                const std::function<void(nccl_detail::IssueContext&)>& enqueue);
  /// A reduction from `input` into `output` (separate buffers): `reduce`
  /// enqueues the NCCL calls on the buffers and type it is given, which are
  /// `input`/`output` themselves, or fp32 copies when 16-bit sums must
  /// accumulate in fp32 (widened before, narrowed after, on the same stream).
  WorkPtr issue_reduction(const CollectiveEvent& event, const at::Tensor& output, const at::Tensor& input,
                          ReduceOp op,
                          const std::function<void(nccl_detail::IssueContext&, const at::Tensor& in,
                                                   const at::Tensor& out, ncclDataType_t type)>& reduce);
  void check_device(const CollectiveEvent& event, const at::Tensor& tensor) const;

  comm::StorePtr root_store_;
  std::string store_prefix_;
  int device_;
  std::shared_ptr<nccl_detail::NcclState> state_;
};

}  // namespace shardtrain::comm
