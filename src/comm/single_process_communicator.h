#pragma once
// The communicator of a one-process job on a build without Gloo: with one
// rank every collective is the identity, which the Communicator base class
// answers itself, so no backend hook is ever reached.

#include <memory>
#include <string>

#include "shardtrain/comm/communicator.h"

namespace shardtrain::comm {

class SingleProcessCommunicator final : public Communicator {
 public:
  SingleProcessCommunicator(at::Device device, CommOptions options);

  std::string backend() const override { return "single-process"; }
  at::Device device() const override { return device_; }

 protected:
  WorkPtr do_all_gather(const at::Tensor& output, const at::Tensor& input, const CollectiveEvent& event) override;
  WorkPtr do_reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                            const CollectiveEvent& event) override;
  WorkPtr do_reduce_scatter_v(const at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& splits,
                              ReduceOp op, const CollectiveEvent& event) override;
  WorkPtr do_all_reduce(const at::Tensor& tensor, ReduceOp op, const CollectiveEvent& event) override;
  WorkPtr do_broadcast(const at::Tensor& tensor, int root, const CollectiveEvent& event) override;
  void do_barrier(const CollectiveEvent& event) override;
  std::shared_ptr<Communicator> do_new_group(const std::vector<int>& ranks, int64_t group_index) override;

 private:
  at::Device device_;
};

}  // namespace shardtrain::comm
