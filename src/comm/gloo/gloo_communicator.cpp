// Gloo backend of the Communicator (CPU tensors), over c10d::ProcessGroupGloo.
//
// The only file that includes c10d's ProcessGroupGloo.hpp, and with it gloo's
// headers. The PyTorch wheel ships no gloo headers, so they come from
// Debian's libgloo-dev, a snapshot older than the gloo inside libtorch_cpu.
// What keeps that safe: this file touches gloo only through c10d's exported,
// out-of-line functions (the ProcessGroupGloo constructor, createDevice*,
// the collectives' virtual calls) and pointers (shared_ptr<gloo::Device>), never
// a gloo struct's layout; and it is compiled with hidden visibility, so no
// inline function or vtable it instantiates from those headers can interpose
// on libtorch_cpu's own (CMakeLists.txt). DistCollectives proves every
// collective exact in fp32, bf16, fp16, fp64 and int64 at worlds 1 to 4 on the wheel.
//
// The backend moves bf16 as raw 2-byte data wherever it only moves bytes
// (all-gather, broadcast, the exchange inside reduce-scatter: exact whatever
// gloo's own bf16 support), implements reduce-scatter as alltoall + a local
// sum over the received chunks in rank order, accumulated in fp32 for
// bf16/fp16 (bandwidth-optimal and deterministic: every element is summed in
// the same order on every run), reduces bf16/fp16 all-reduces in fp32, and
// AVG as SUM followed by a division.

#include "comm/gloo/gloo_factory.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "comm/collective_log.h"
#include "comm/store_check_in.h"
#include "comm/work_util.h"
#include "shardtrain/error.h"

namespace shardtrain::comm {
namespace {

/// A Gloo process group whose sockets bind to `hostname`'s interface (or the
/// default interface when empty). Constructing it is itself a rendezvous
/// (full-mesh connect through the store), bounded by `timeout`.
/// One worker thread per group, never c10d's default of two. In torch 2.11,
/// ProcessGroupGloo::runLoop writes the group's status after every work
/// (pgStatus_->lastCompletedWorkName = opTypeToString(...)) with no lock
/// held, so two workers finishing at once race on one std::string: a name
/// longer than the 15-character small-string buffer ("ALLGATHER_COALESCED",
/// our unit gathers) is freed twice. Seen as glibc tcache corruption in a
/// Gloo worker (a SIGSEGV in malloc, "unaligned tcache chunk"), about one
/// ZeRO-3 run in ten; AddressSanitizer preloaded named it: "double-free ... in
/// c10d::ProcessGroupGloo::runLoop", freed by both worker threads. One worker
/// also runs the group's collectives in issue order on every rank.
constexpr int kGlooWorkerThreads = 1;

c10::intrusive_ptr<c10d::ProcessGroupGloo> make_gloo_group(const StorePtr& store, int rank, int size,
                                                           std::chrono::milliseconds timeout,
                                                           const std::string& hostname) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  if (hostname.empty()) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  } else {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
  }
  options->threads = kGlooWorkerThreads;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

class GlooCommunicator final : public Communicator {
 public:
  /// `store` is shared by the whole job; `hostname` selects the interface Gloo binds.
  GlooCommunicator(StorePtr store, int rank, int world_size, std::vector<int> global_ranks,
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
  void do_new_group_not_member(const std::vector<int>& ranks, int64_t group_index) override;

 private:
  WorkPtr wrap(WorkHandle work, const CollectiveEvent& event, std::function<void()> finalize);
  /// Gloo refused `event` as it was issued: the backend's error, with the hang report.
  [[noreturn]] void fail_to_issue(const CollectiveEvent& event, const std::exception& failure);

  StorePtr root_store_;
  std::string hostname_;
  std::string store_prefix_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
};

/// Moving bytes does not care about the type: a bf16 tensor viewed as float16
/// arrives bit-exact, over every gloo version.
at::Tensor as_wire_bytes(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? t.view(at::kHalf) : t;
}

bool is_low_precision(at::ScalarType dtype) { return dtype == at::kBFloat16 || dtype == at::kHalf; }

c10d::ReduceOp to_c10d(ReduceOp op) {
  return op == ReduceOp::kMax ? c10d::ReduceOp(c10d::ReduceOp::MAX) : c10d::ReduceOp(c10d::ReduceOp::SUM);
}

class GlooWork final : public Work {
 public:
  GlooWork(WorkHandle work, std::string description, std::chrono::milliseconds timeout,
           std::function<void()> finalize, std::shared_ptr<CollectiveLog> log)
      : work_(std::move(work)), description_(std::move(description)), timeout_(timeout),
        finalize_(std::move(finalize)), log_(std::move(log)) {}

  void wait() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) return;
    // Gloo's own context timeout fires first; the margin keeps ours from racing it.
    const auto deadline = std::chrono::steady_clock::now() + timeout_ + std::chrono::seconds(5);
    // In slices, so that a rank blocked here joins the hang report as soon as
    // a peer gives up, rather than at its own timeout.
    while (true) {
      const WorkSlice slice = wait_slice(work_, CollectiveLog::kPollInterval);
      if (slice.error) {
        try {
          std::rethrow_exception(slice.error);
        } catch (const std::exception& failure) {
          rethrow_collective_failure(description_, timeout_, failure, log_->report());
        }
      }
      if (slice.completed) break;
      if (std::chrono::steady_clock::now() >= deadline) {
        const std::runtime_error timed_out("Operation timed out: the Gloo work is still pending at the deadline");
        rethrow_collective_failure(description_, timeout_, timed_out, log_->report());
      }
      if (log_->peer_reported()) {
        const std::runtime_error abandoned(
            "abandoned: another rank of this group reported a failed collective (a timeout or a lost peer)");
        rethrow_collective_failure(description_, timeout_, abandoned, log_->report());
      }
    }
    if (finalize_) finalize_();
    finalize_ = nullptr;
    done_ = true;
  }

  bool is_completed() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_ || work_->isCompleted();
  }

 private:
  std::mutex mutex_;
  WorkHandle work_;
  std::string description_;
  std::chrono::milliseconds timeout_;
  std::function<void()> finalize_;
  std::shared_ptr<CollectiveLog> log_;
  bool done_ = false;
};

}  // namespace

GlooCommunicator::GlooCommunicator(StorePtr store, int rank, int world_size,
                                   std::vector<int> global_ranks, CommOptions options,
                                   std::string hostname, std::string store_prefix)
    : Communicator(rank, world_size, std::move(global_ranks), options),
      root_store_(std::move(store)), hostname_(std::move(hostname)),
      store_prefix_(std::move(store_prefix)) {
  const auto start = std::chrono::steady_clock::now();
  try {
    group_ = make_gloo_group(make_prefix_store(store_prefix_, root_store_), rank,
                                     world_size, options.timeout, hostname_);
  } catch (const std::exception& failure) {
    const auto waited =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
    ST_THROW(TimeoutError, "rank ", rank, " of ", world_size, " waited ", waited.count(), " ms (limit ",
             options.timeout.count(), " ms) for all ", world_size,
             " ranks of the group to connect (Gloo full-mesh rendezvous, store prefix '", store_prefix_,
             "') and some did not: check that every rank started and creates the same "
             "groups in the same order. Backend said: ", backend_message(failure));
  }
  check_in_after_connect(*root_store_, store_prefix_, this->global_ranks(), this->global_ranks()[rank],
                         options.timeout);
  collective_log()->attach_store(root_store_, store_prefix_, options.timeout);
}

void GlooCommunicator::fail_to_issue(const CollectiveEvent& event, const std::exception& failure) {
  rethrow_collective_failure(describe(event), options().timeout, failure, collective_log()->report());
}

WorkPtr GlooCommunicator::wrap(WorkHandle work, const CollectiveEvent& event,
                               std::function<void()> finalize) {
  return std::make_shared<GlooWork>(std::move(work), describe(event), options().timeout,
                                    std::move(finalize), collective_log());
}

WorkPtr GlooCommunicator::do_all_gather(const at::Tensor& output, const at::Tensor& input,
                                        const CollectiveEvent& event) {
  at::Tensor wire_out = as_wire_bytes(output);
  std::vector<at::Tensor> inputs{as_wire_bytes(input)};
  // Views into the flat output: Gloo copies each rank's chunk straight into place.
  std::vector<std::vector<at::Tensor>> outputs(1);
  outputs[0] = wire_out.view({world_size(), input.numel()}).unbind(0);
  try {
    return wrap(group_->allgather(outputs, inputs), event, nullptr);
  } catch (const std::exception& failure) {
    fail_to_issue(event, failure);
  }
}

namespace {

/// `output` = the rank-order reduction of `received`'s rows (row w: rank w's
/// contribution), accumulated in fp32 for 16-bit dtypes. Explicit rank order:
/// the result does not depend on how ATen would vectorise a dim-0 reduction
/// for this shape. An output that already has the accumulation dtype is the
/// accumulator (one pass less).
void reduce_rows_in_rank_order(const at::Tensor& output, const at::Tensor& received, ReduceOp op, int world) {
  const at::ScalarType accumulate_dtype = is_low_precision(output.scalar_type()) ? at::kFloat : output.scalar_type();
  const bool in_place = output.scalar_type() == accumulate_dtype;
  at::Tensor acc = in_place ? output.copy_(received.select(0, 0))
                            : received.select(0, 0).to(accumulate_dtype, /*non_blocking=*/false, /*copy=*/true);
  for (int w = 1; w < world; ++w) {
    if (op == ReduceOp::kMax) {
      at::maximum_out(acc, acc, received.select(0, w).to(accumulate_dtype));
    } else {
      acc.add_(received.select(0, w).to(accumulate_dtype));
    }
  }
  if (op == ReduceOp::kAvg) acc.div_(world);
  if (!in_place) output.copy_(acc);
}

}  // namespace

WorkPtr GlooCommunicator::do_all_gather_coalesced(const std::vector<at::Tensor>& outputs,
                                                  const std::vector<at::Tensor>& inputs,
                                                  const CollectiveEvent& event) {
  // One Gloo collective for all pairs: c10d concatenates the inputs, gathers
  // once and copies rank r's part of pair i into output_lists[r][i], which
  // are views into outputs[i], so each lands in place.
  const int world = world_size();
  std::vector<at::Tensor> input_list;
  std::vector<std::vector<at::Tensor>> output_lists(static_cast<std::size_t>(world));
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const int64_t chunk = inputs[i].numel();
    input_list.push_back(as_wire_bytes(inputs[i]).reshape({-1}));
    at::Tensor rows = as_wire_bytes(outputs[i]).view({world, chunk});
    for (int r = 0; r < world; ++r) output_lists[r].push_back(rows.select(0, r));
  }
  try {
    return wrap(group_->allgather_coalesced(output_lists, input_list), event, nullptr);
  } catch (const std::exception& failure) {
    fail_to_issue(event, failure);
  }
}

WorkPtr GlooCommunicator::do_reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                                            ReduceOp op, const CollectiveEvent& event) {
  // Even chunks are the uneven case with every count equal.
  return do_reduce_scatter_v(output, input, std::vector<int64_t>(static_cast<std::size_t>(world_size()), output.numel()),
                             op, event);
}

WorkPtr GlooCommunicator::do_reduce_scatter_v(const at::Tensor& output, const at::Tensor& input,
                                              const std::vector<int64_t>& splits, ReduceOp op,
                                              const CollectiveEvent& event) {
  const int world = world_size();
  const int64_t mine = output.numel();
  // Rank w sends input[its offset of split r, +splits[r]] to rank r: an
  // alltoall with the splits as send counts reads the input where it lies.
  // Row w of `received` is rank w's copy of this rank's piece.
  at::Tensor received = at::empty({world, mine}, input.options());
  at::Tensor wire_received = as_wire_bytes(received).view({-1});
  at::Tensor wire_in = as_wire_bytes(input);
  std::vector<int64_t> receive_splits(static_cast<std::size_t>(world), mine);
  std::vector<int64_t> send_splits = splits;
  auto finalize = [output, received, op, world]() { reduce_rows_in_rank_order(output, received, op, world); };
  try {
    return wrap(group_->alltoall_base(wire_received, wire_in, receive_splits, send_splits), event,
                std::move(finalize));
  } catch (const std::exception& failure) {
    fail_to_issue(event, failure);
  }
}

WorkPtr GlooCommunicator::do_all_reduce(const at::Tensor& tensor, ReduceOp op,
                                        const CollectiveEvent& event) {
  // Past two ranks Gloo's ring sums each element in an order that depends on
  // which chunk of the buffer it falls in, so the same gradient reduced in
  // another bucket layout (another engine, another bucket size) would differ
  // in its last bits. Reduce-scatter in rank order, then all-gather, moves the
  // same bytes as the ring and gives every element ((g0 + g1) + g2) + ...
  // At two ranks the ring's a + b is already order-free.
  if (world_size() > 2 && op != ReduceOp::kMax && at::isFloatingType(tensor.scalar_type())) {
    return rank_ordered_all_reduce(tensor, op, event);
  }
  const bool widen = is_low_precision(tensor.scalar_type());
  at::Tensor buffer = widen ? tensor.to(at::kFloat) : tensor;
  std::vector<at::Tensor> tensors{buffer};
  c10d::AllreduceOptions reduce_options;
  reduce_options.reduceOp = to_c10d(op);
  const int world = world_size();
  std::function<void()> finalize;
  if (widen || op == ReduceOp::kAvg) {
    finalize = [tensor, buffer, widen, op, world]() mutable {
      if (op == ReduceOp::kAvg) buffer.div_(world);
      if (widen) tensor.copy_(buffer);
    };
  }
  try {
    return wrap(group_->allreduce(tensors, reduce_options), event, std::move(finalize));
  } catch (const std::exception& failure) {
    fail_to_issue(event, failure);
  }
}

WorkPtr GlooCommunicator::rank_ordered_all_reduce(const at::Tensor& tensor, ReduceOp op,
                                                  const CollectiveEvent& event) {
  const int world = world_size();
  const int64_t n = tensor.numel();
  const int64_t chunk = (n + world - 1) / world;
  at::Tensor padded = at::zeros({world * chunk}, tensor.options());
  padded.narrow(0, 0, n).copy_(tensor.reshape({-1}));
  at::Tensor mine = at::empty({chunk}, tensor.options());
  WorkPtr scatter = do_reduce_scatter(mine, padded, op, event);
  // The all-gather is issued once the reduce-scatter is waited for: every
  // rank waits its collectives in the order it issued them, so the ranks
  // still issue the same collectives in the same order.
  return then_work(std::move(scatter), [this, tensor, padded, mine, event]() mutable {
    do_all_gather(padded, mine, event)->wait();
    tensor.copy_(padded.narrow(0, 0, tensor.numel()).view(tensor.sizes()));
  });
}

WorkPtr GlooCommunicator::do_broadcast(const at::Tensor& tensor, int root,
                                       const CollectiveEvent& event) {
  std::vector<at::Tensor> tensors{as_wire_bytes(tensor)};
  c10d::BroadcastOptions broadcast_options;
  broadcast_options.rootRank = root;
  try {
    return wrap(group_->broadcast(tensors, broadcast_options), event, nullptr);
  } catch (const std::exception& failure) {
    fail_to_issue(event, failure);
  }
}

void GlooCommunicator::do_barrier(const CollectiveEvent& event) {
  try {
    wrap(group_->barrier(), event, nullptr)->wait();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& failure) {
    fail_to_issue(event, failure);
  }
}

std::shared_ptr<Communicator> GlooCommunicator::do_new_group(const std::vector<int>& ranks,
                                                             int64_t group_index) {
  const int my_index = static_cast<int>(std::find(ranks.begin(), ranks.end(), rank()) - ranks.begin());
  return std::make_shared<GlooCommunicator>(root_store_, my_index, static_cast<int>(ranks.size()),
                                            global_ranks_of(ranks), options(), hostname_,
                                            sub_group_store_prefix(store_prefix_, group_index));
}

void GlooCommunicator::do_new_group_not_member(const std::vector<int>& ranks, int64_t group_index) {
  // The store's host waits for the members it is not one of to connect through it.
  if (global_ranks()[rank()] != kStoreHostRank) return;
  check_in_after_connect(*root_store_, sub_group_store_prefix(store_prefix_, group_index), global_ranks_of(ranks),
                         kStoreHostRank, options().timeout);
}

bool gloo_available() { return true; }
std::string gloo_unavailable_reason() { return {}; }

CommunicatorPtr make_gloo_communicator(StorePtr store, int rank, int world_size, std::vector<int> global_ranks,
                                       CommOptions options, std::string hostname, std::string store_prefix) {
  return std::make_shared<GlooCommunicator>(std::move(store), rank, world_size, std::move(global_ranks), options,
                                            std::move(hostname), std::move(store_prefix));
}

}  // namespace shardtrain::comm
