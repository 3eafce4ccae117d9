// The backend-neutral half of the Communicator (communicator.h): chunk sizes,
// the dtypes it takes, the argument checks, and what each collective records
// first (its sequence number in the log hang reports read, the observer, the
// testing delay). The backends add the transport.
#include "shardtrain/comm/communicator.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include <ATen/ATen.h>

#include "comm/collective_log.h"
#include "comm/work_util.h"
#include "shardtrain/error.h"

namespace shardtrain::comm {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
  }
  return "?";
}

int64_t chunk_size(int64_t numel, int world_size) {
  ST_CHECK(world_size > 0, "world size must be positive, got ", world_size);
  return (numel + world_size - 1) / world_size;
}

bool is_supported_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
    case at::kBFloat16:
    case at::kHalf:
    case at::kLong:
    case at::kDouble:
      return true;
    default:
      return false;
  }
}

Communicator::Communicator(int rank, int world_size, std::vector<int> global_ranks,
                           CommOptions options)
    : rank_(rank), world_size_(world_size), global_ranks_(std::move(global_ranks)),
      options_(options) {
  ST_CHECK(world_size_ > 0 && rank_ >= 0 && rank_ < world_size_, "invalid rank ", rank_,
           " for a group of ", world_size_);
  ST_CHECK(static_cast<int>(global_ranks_.size()) == world_size_,
           "global rank list has ", global_ranks_.size(), " entries for a group of ", world_size_);
  log_ = std::make_shared<CollectiveLog>(rank_, global_ranks_);
}

std::vector<int> Communicator::global_ranks_of(const std::vector<int>& ranks) const {
  std::vector<int> global;
  global.reserve(ranks.size());
  for (int r : ranks) global.push_back(global_ranks_[static_cast<std::size_t>(r)]);
  return global;
}

std::string Communicator::describe(const CollectiveEvent& event) const {
  std::ostringstream out;
  out << event.op;
  if (event.op == "all_reduce" || event.op == "reduce_scatter") out << "(" << to_string(event.reduce) << ")";
  if (event.op == "broadcast") out << "(root " << event.root << ")";
  out << " on " << backend() << " rank " << rank_ << " of " << world_size_ << " (global rank "
      << global_ranks_[rank_] << ")";
  if (event.op != "barrier") {
    out << ", " << c10::toString(event.dtype) << ", " << event.input_numel << " -> "
        << event.output_numel << " elements";
  }
  return out.str();
}

void Communicator::before_collective(CollectiveEvent& event) {
  event.seq = log_->record(event);
  if (observer_) observer_(event);
  if (options_.inject_max_delay_ms > 0) {
    thread_local std::mt19937 generator(std::random_device{}());
    std::uniform_int_distribution<int> delay(0, options_.inject_max_delay_ms);
    std::this_thread::sleep_for(std::chrono::milliseconds(delay(generator)));
  }
}

namespace {

void check_tensor(const Communicator& comm, const CollectiveEvent& event, const at::Tensor& t,
                  const char* role) {
  ST_CHECK(t.defined(), event.op, ": the ", role, " tensor is undefined");
  // Collectives that only move data also take raw bytes (uint8: the NF4
  // buffers of a quantized frozen base); reductions need an arithmetic type.
  const bool moves_only = event.op == "all_gather" || event.op == "broadcast";
  ST_CHECK(is_supported_dtype(t.scalar_type()) || (moves_only && t.scalar_type() == at::kByte), event.op, " on ",
           comm.backend(), ": dtype ", c10::toString(t.scalar_type()), " of the ", role,
           " is not supported; use float32, bfloat16, float16, float64 or int64",
           moves_only ? " (or uint8 bytes)" : "");
  ST_CHECK(t.is_contiguous(), event.op, ": the ", role,
           " tensor must be contiguous (call .contiguous() first)");
  ST_CHECK(t.device().type() == comm.device_type(), event.op, ": the ", role, " tensor is on ",
           t.device().str(), " but the ", comm.backend(), " backend works on ",
           c10::DeviceTypeName(comm.device_type(), /*lower_case=*/true),
           " tensors; move it, or use the matching backend");
}

void check_same_dtype(const CollectiveEvent& event, const at::Tensor& output, const at::Tensor& input) {
  ST_CHECK(output.scalar_type() == input.scalar_type(), event.op, ": output dtype ",
           c10::toString(output.scalar_type()), " differs from input dtype ",
           c10::toString(input.scalar_type()), "; cast one of them first");
  ST_CHECK(output.device() == input.device(), event.op, ": output on ", output.device().str(),
           " but input on ", input.device().str());
}

}  // namespace

WorkPtr Communicator::all_gather_async(const at::Tensor& output, const at::Tensor& input) {
  CollectiveEvent event{"all_gather", input.defined() ? input.scalar_type() : at::kFloat,
                        input.defined() ? input.numel() : 0, output.defined() ? output.numel() : 0};
  check_tensor(*this, event, input, "input");
  check_tensor(*this, event, output, "output");
  check_same_dtype(event, output, input);
  const int64_t chunk = input.numel();
  const int64_t full = chunk * world_size_;
  ST_CHECK(output.numel() <= full && (output.numel() > full - chunk || full == 0), describe(event),
           ": output must hold world_size x input elements (", full,
           "), or that minus part of the last rank's chunk (more than ", full - chunk,
           "); pad the flat buffer to a multiple of the world size");
  before_collective(event);
  if (chunk == 0) return completed_work();
  at::Tensor in = input.reshape({-1});
  at::Tensor out = output.reshape({-1});
  if (world_size_ == 1) {
    out.copy_(in.narrow(0, 0, out.numel()));
    return completed_work();
  }
  if (output.numel() == full) return do_all_gather(out, in, event);
  at::Tensor padded = at::empty({full}, output.options());
  WorkPtr inner = do_all_gather(padded, in, event);
  return then_work(std::move(inner), [out, padded]() mutable {
    out.copy_(padded.narrow(0, 0, out.numel()));
  });
}

WorkPtr Communicator::reduce_scatter_async(const at::Tensor& output, const at::Tensor& input,
                                           ReduceOp op) {
  CollectiveEvent event{"reduce_scatter", input.defined() ? input.scalar_type() : at::kFloat,
                        input.defined() ? input.numel() : 0, output.defined() ? output.numel() : 0,
                        op};
  check_tensor(*this, event, input, "input");
  check_tensor(*this, event, output, "output");
  check_same_dtype(event, output, input);
  ST_CHECK(!(op == ReduceOp::kAvg && !at::isFloatingType(input.scalar_type())), describe(event),
           ": AVG needs a floating-point dtype; reduce with SUM and divide yourself");
  const int64_t chunk = output.numel();
  const int64_t full = chunk * world_size_;
  ST_CHECK(input.numel() <= full && (input.numel() > full - chunk || full == 0), describe(event),
           ": input must hold world_size x output elements (", full,
           ") or be shorter by less than one chunk; output chunk must be ceil(input/world_size) = ",
           chunk_size(input.numel(), world_size_));
  before_collective(event);
  if (chunk == 0) return completed_work();
  at::Tensor in = input.reshape({-1});
  at::Tensor out = output.reshape({-1});
  if (world_size_ == 1) {
    out.narrow(0, 0, in.numel()).copy_(in);
    if (in.numel() < chunk) out.narrow(0, in.numel(), chunk - in.numel()).zero_();
    return completed_work();
  }
  if (input.numel() == full) return do_reduce_scatter(out, in, op, event);
  at::Tensor padded = at::zeros({full}, input.options());
  padded.narrow(0, 0, in.numel()).copy_(in);
  return do_reduce_scatter(out, padded, op, event);
}

WorkPtr Communicator::reduce_scatter_v_async(const at::Tensor& output, const at::Tensor& input,
                                             const std::vector<int64_t>& splits, ReduceOp op) {
  CollectiveEvent event{"reduce_scatter", input.defined() ? input.scalar_type() : at::kFloat,
                        input.defined() ? input.numel() : 0, output.defined() ? output.numel() : 0, op};
  check_tensor(*this, event, input, "input");
  check_tensor(*this, event, output, "output");
  check_same_dtype(event, output, input);
  ST_CHECK(!(op == ReduceOp::kAvg && !at::isFloatingType(input.scalar_type())), describe(event),
           ": AVG needs a floating-point dtype; reduce with SUM and divide yourself");
  ST_CHECK(static_cast<int>(splits.size()) == world_size_, describe(event), ": ", splits.size(),
           " split sizes for ", world_size_, " ranks; give one per rank");
  int64_t total = 0;
  for (int64_t n : splits) {
    ST_CHECK(n >= 0, describe(event), ": split sizes must not be negative");
    total += n;
  }
  ST_CHECK(total == input.numel(), describe(event), ": split sizes sum to ", total, ", the input has ",
           input.numel(), " elements");
  ST_CHECK(output.numel() == splits[rank_], describe(event), ": output must hold this rank's split, ",
           splits[rank_], " elements");
  before_collective(event);
  if (total == 0) return completed_work();
  at::Tensor in = input.reshape({-1});
  at::Tensor out = output.reshape({-1});
  if (world_size_ == 1) {
    out.copy_(in);
    return completed_work();
  }
  return do_reduce_scatter_v(out, in, splits, op, event);
}

WorkPtr Communicator::all_gather_coalesced_async(const std::vector<at::Tensor>& outputs,
                                                 const std::vector<at::Tensor>& inputs) {
  ST_CHECK(outputs.size() == inputs.size(), "all_gather_coalesced on rank ", rank_, ": ", outputs.size(),
           " outputs for ", inputs.size(), " inputs");
  // Even pairs of one dtype go to the backend as one operation (Gloo: one
  // collective, which matters when a generation loop gathers every unit for
  // every token); anything else pair by pair under all_gather_async's rules.
  bool even = world_size_ > 1 && !inputs.empty();
  int64_t in_total = 0, out_total = 0;
  for (std::size_t i = 0; i < inputs.size() && even; ++i) {
    even = inputs[i].defined() && outputs[i].defined() && inputs[i].numel() > 0 &&
           outputs[i].numel() == world_size_ * inputs[i].numel() &&
           inputs[i].scalar_type() == inputs[0].scalar_type() && outputs[i].scalar_type() == inputs[0].scalar_type();
    if (even) {
      in_total += inputs[i].numel();
      out_total += outputs[i].numel();
    }
  }
  if (!even) {
    std::vector<WorkPtr> works;
    works.reserve(inputs.size());
    for (std::size_t i = 0; i < inputs.size(); ++i) works.push_back(all_gather_async(outputs[i], inputs[i]));
    return all_of_work(std::move(works));
  }
  CollectiveEvent event{"all_gather", inputs[0].scalar_type(), in_total, out_total};
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(*this, event, inputs[i], "input");
    check_tensor(*this, event, outputs[i], "output");
  }
  before_collective(event);
  return do_all_gather_coalesced(outputs, inputs, event);
}

WorkPtr Communicator::do_all_gather_coalesced(const std::vector<at::Tensor>& outputs,
                                              const std::vector<at::Tensor>& inputs, const CollectiveEvent& event) {
  std::vector<WorkPtr> works;
  works.reserve(inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    works.push_back(do_all_gather(outputs[i].reshape({-1}), inputs[i].reshape({-1}), event));
  }
  return all_of_work(std::move(works));
}

WorkPtr Communicator::reduce_scatter_coalesced_async(const std::vector<at::Tensor>& outputs,
                                                     const std::vector<at::Tensor>& inputs, ReduceOp op) {
  ST_CHECK(outputs.size() == inputs.size(), "reduce_scatter_coalesced on rank ", rank_, ": ", outputs.size(),
           " outputs for ", inputs.size(), " inputs");
  std::vector<WorkPtr> works;
  works.reserve(inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) works.push_back(reduce_scatter_async(outputs[i], inputs[i], op));
  return all_of_work(std::move(works));
}

WorkPtr Communicator::all_reduce_coalesced_async(const std::vector<at::Tensor>& tensors, ReduceOp op) {
  std::vector<WorkPtr> works;
  works.reserve(tensors.size());
  for (const auto& tensor : tensors) works.push_back(all_reduce_async(tensor, op));
  return all_of_work(std::move(works));
}

WorkPtr Communicator::all_reduce_async(const at::Tensor& tensor, ReduceOp op) {
  CollectiveEvent event{"all_reduce", tensor.defined() ? tensor.scalar_type() : at::kFloat,
                        tensor.defined() ? tensor.numel() : 0, tensor.defined() ? tensor.numel() : 0,
                        op};
  check_tensor(*this, event, tensor, "input/output");
  ST_CHECK(!(op == ReduceOp::kAvg && !at::isFloatingType(tensor.scalar_type())), describe(event),
           ": AVG needs a floating-point dtype; reduce with SUM and divide yourself");
  before_collective(event);
  if (tensor.numel() == 0 || world_size_ == 1) return completed_work();
  return do_all_reduce(tensor.view({-1}), op, event);
}

WorkPtr Communicator::broadcast_async(const at::Tensor& tensor, int root) {
  CollectiveEvent event{"broadcast", tensor.defined() ? tensor.scalar_type() : at::kFloat,
                        tensor.defined() ? tensor.numel() : 0, tensor.defined() ? tensor.numel() : 0};
  event.root = root;
  check_tensor(*this, event, tensor, "input/output");
  ST_CHECK(root >= 0 && root < world_size_, describe(event), ": root ", root,
           " is not a rank of this group (0..", world_size_ - 1, ")");
  before_collective(event);
  if (tensor.numel() == 0 || world_size_ == 1) return completed_work();
  return do_broadcast(tensor.view({-1}), root, event);
}

void Communicator::barrier() {
  CollectiveEvent event{"barrier", at::kFloat, 0, 0};
  before_collective(event);
  if (world_size_ == 1) return;
  do_barrier(event);
}

std::shared_ptr<Communicator> Communicator::new_group(const std::vector<int>& ranks) {
  ST_CHECK(!ranks.empty(), "new_group: the rank list is empty");
  std::set<int> unique(ranks.begin(), ranks.end());
  ST_CHECK(unique.size() == ranks.size(), "new_group: the rank list has duplicates");
  for (int r : ranks) {
    ST_CHECK(r >= 0 && r < world_size_, "new_group: rank ", r, " is not in the parent group of ",
             world_size_, " ranks");
  }
  const int64_t index = next_group_index_++;
  if (std::find(ranks.begin(), ranks.end(), rank_) == ranks.end()) {
    do_new_group_not_member(ranks, index);
    return nullptr;
  }
  return do_new_group(ranks, index);
}

std::shared_ptr<Communicator> Communicator::split(const std::vector<std::vector<int>>& groups) {
  std::vector<int> seen(world_size_, 0);
  for (const auto& group : groups) {
    for (int r : group) {
      ST_CHECK(r >= 0 && r < world_size_, "split: rank ", r, " is not in the parent group of ",
               world_size_, " ranks");
      ++seen[r];
    }
  }
  for (int r = 0; r < world_size_; ++r) {
    ST_CHECK(seen[r] == 1, "split: rank ", r, " appears ", seen[r],
             " times; the groups must partition the ranks (each exactly once)");
  }
  std::shared_ptr<Communicator> mine;
  // Every rank walks every group, so group indices stay identical on all ranks.
  for (const auto& group : groups) {
    auto created = new_group(group);
    if (created) mine = std::move(created);
  }
  return mine;
}

}  // namespace shardtrain::comm
