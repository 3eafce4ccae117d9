#pragma once
// Gloo backend of the Communicator (CPU tensors), over c10d::ProcessGroupGloo.
//
// LibTorch 1.13's Gloo has no reduce_scatter, no _allgather_base, no bf16 in
// allgather/allreduce/broadcast and no AVG. This backend therefore:
//  * moves bf16 as raw 2-byte data (viewed as float16) wherever it only moves
//    bytes (all-gather, broadcast, the exchange inside reduce-scatter): exact;
//  * implements reduce-scatter as alltoall + a local sum over the received
//    chunks in rank order, accumulated in fp32 for bf16/fp16 (bandwidth-optimal
//    and deterministic: every element is summed in the same order on every run);
//  * reduces bf16/fp16 all-reduces in fp32;
//  * implements AVG as SUM followed by a division.

#include <string>

#include "compat/gloo_compat.h"
#include "shardtrain/comm/communicator.h"

namespace shardtrain::comm {

class GlooCommunicator final : public Communicator {
 public:
  /// `store` is shared by the whole job; `hostname` selects the interface Gloo binds.
  GlooCommunicator(compat::StorePtr store, int rank, int world_size, std::vector<int> global_ranks,
                   CommOptions options, std::string hostname, std::string store_prefix);

  std::string backend() const override { return "gloo"; }
  at::Device device() const override { return at::Device(at::kCPU); }

 protected:
  WorkPtr do_all_gather(const at::Tensor& output, const at::Tensor& input,
                        const CollectiveEvent& event) override;
  WorkPtr do_reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                            const CollectiveEvent& event) override;
  WorkPtr do_all_gather_coalesced(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                                  const CollectiveEvent& event) override;
  WorkPtr do_reduce_scatter_v(const at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& splits,
                              ReduceOp op, const CollectiveEvent& event) override;
  WorkPtr do_all_reduce(const at::Tensor& tensor, ReduceOp op, const CollectiveEvent& event) override;
  /// SUM/AVG past two ranks: reduce-scatter (rank-order sums) + all-gather.
  WorkPtr rank_ordered_all_reduce(const at::Tensor& tensor, ReduceOp op, const CollectiveEvent& event);
  WorkPtr do_broadcast(const at::Tensor& tensor, int root, const CollectiveEvent& event) override;
  void do_barrier(const CollectiveEvent& event) override;
  std::shared_ptr<Communicator> do_new_group(const std::vector<int>& ranks, int64_t group_index) override;

 private:
  WorkPtr wrap(compat::WorkHandle work, const CollectiveEvent& event, std::function<void()> finalize);
  /// Gloo refused `event` as it was issued: the backend's error, with the hang report.
  [[noreturn]] void fail_to_issue(const CollectiveEvent& event, const std::exception& failure);

  compat::StorePtr root_store_;
  std::string hostname_;
  std::string store_prefix_;
  compat::GlooGroupPtr group_;
};

}  // namespace shardtrain::comm
