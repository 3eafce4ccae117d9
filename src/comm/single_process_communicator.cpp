// One-rank communicator (see single_process_communicator.h).

#include "comm/single_process_communicator.h"

#include "shardtrain/error.h"

namespace shardtrain::comm {
namespace {

[[noreturn]] void unreachable(const char* hook) {
  // The base class answers every collective of a one-rank group itself.
  ST_THROW(Error, "single-process communicator: ", hook, " was reached with one rank; this is a shardtrain bug");
}

}  // namespace

SingleProcessCommunicator::SingleProcessCommunicator(at::Device device, CommOptions options)
    : Communicator(0, 1, {0}, options), device_(device) {}

WorkPtr SingleProcessCommunicator::do_all_gather(const at::Tensor&, const at::Tensor&, const CollectiveEvent&) {
  unreachable("all_gather");
}
WorkPtr SingleProcessCommunicator::do_reduce_scatter(const at::Tensor&, const at::Tensor&, ReduceOp,
                                                     const CollectiveEvent&) {
  unreachable("reduce_scatter");
}
WorkPtr SingleProcessCommunicator::do_reduce_scatter_v(const at::Tensor&, const at::Tensor&,
                                                       const std::vector<int64_t>&, ReduceOp, const CollectiveEvent&) {
  unreachable("reduce_scatter_v");
}
WorkPtr SingleProcessCommunicator::do_all_reduce(const at::Tensor&, ReduceOp, const CollectiveEvent&) {
  unreachable("all_reduce");
}
WorkPtr SingleProcessCommunicator::do_broadcast(const at::Tensor&, int, const CollectiveEvent&) {
  unreachable("broadcast");
}
void SingleProcessCommunicator::do_barrier(const CollectiveEvent& /*event*/) { unreachable("barrier"); }

std::shared_ptr<Communicator> SingleProcessCommunicator::do_new_group(const std::vector<int>&, int64_t) {
  return std::make_shared<SingleProcessCommunicator>(device_, options());
}

}  // namespace shardtrain::comm
