// Agreeing on a failure (failure_agreement.h): one all-reduce of a flag per
// rank, then the lowest failing rank's reason broadcast as text.

#include "comm/failure_agreement.h"

#include <ATen/ATen.h>

#include "comm/text_exchange.h"

namespace shardtrain::comm {

std::optional<std::string> agree_on_failure(Communicator& comm, bool participate,
                                            const std::function<void()>& phase) {
  std::string reason;
  if (participate) {
    try {
      phase();
    } catch (const std::exception& e) {
      reason = e.what();
      if (reason.empty()) reason = "unknown error";
    }
  }
  const auto options = at::TensorOptions().dtype(at::kFloat).device(comm.device());
  at::Tensor failed = at::zeros({comm.world_size()}, options);
  if (!reason.empty()) failed.index_put_({comm.rank()}, 1.0f);
  comm.all_reduce(failed, ReduceOp::kSum);
  const at::Tensor host = failed.cpu();
  int first = -1;
  for (int r = 0; r < comm.world_size() && first < 0; ++r) {
    if (host.data_ptr<float>()[r] > 0) first = r;
  }
  if (first < 0) return std::nullopt;
  const std::string message = broadcast_text(comm, reason, first, 4096);
  return "rank " + std::to_string(first) + ": " + message;
}

bool all_ranks(Communicator& comm, bool holds) {
  at::Tensor missing = at::full({1}, holds ? 0.0f : 1.0f, at::TensorOptions().dtype(at::kFloat).device(comm.device()));
  comm.all_reduce(missing, ReduceOp::kSum);
  return missing.item<float>() == 0.0f;
}

}  // namespace shardtrain::comm
