#pragma once
/// @file communicator.h
/// The collective-communication interface every engine talks to.
///
/// Engines never call c10d, Gloo or NCCL directly: they hold a Communicator.
/// Two backends implement it: "gloo" (CPU tensors, over c10d::ProcessGroupGloo)
/// and "nccl" (CUDA tensors, direct NCCL calls on a dedicated stream).
///
/// Semantics shared by all backends:
///  * Every rank of the group calls the same collectives in the same order.
///  * Supported dtypes: float32, bfloat16, float16, int64 (float64 too where
///    the backend has it). Reductions of bf16/fp16 accumulate in fp32.
///  * Tensors must be contiguous and on the backend's device; output and input
///    of one call share a dtype.
///  * Sizes need not divide by the world size: an all-gather of per-rank
///    chunks of `c` elements may write an output of n elements with
///    (W-1)*c < n <= W*c (the last rank's tail beyond n is dropped), and a
///    reduce-scatter of n input elements gives every rank a chunk of
///    c = ceil(n/W) elements, the input treated as zero-padded to W*c.
///  * The async forms return a Work handle; the output is valid only after
///    Work::wait() returns. wait() throws TimeoutError when the collective
///    did not finish within the communicator's timeout (a rank that never
///    joins), and Error for any other failure, naming the operation, rank,
///    dtype and sizes. Where the ranks can still reach the store, the error
///    ends with a hang report: the ranks' recent collectives compared, the
///    first sequence number where they differ, and who is behind or missing.
///    On NCCL, wait() only orders the caller's GPU stream after the
///    collective and returns at once, so a failure found later is thrown by
///    check_health() and by any later wait() on its Work.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace shardtrain::comm {

enum class ReduceOp { kSum, kAvg, kMax };

/// "sum", "avg" or "max".
const char* to_string(ReduceOp op);

/// What a collective was asked to do; handed to the observer (tests assert
/// dtypes at the collectives with it) and used in error messages.
struct CollectiveEvent {
  std::string op;           ///< "all_gather", "reduce_scatter", "all_reduce", "broadcast", "barrier"
  at::ScalarType dtype = at::kFloat;
  int64_t input_numel = 0;
  int64_t output_numel = 0;
  ReduceOp reduce = ReduceOp::kSum;
  int root = -1;            ///< broadcast root (group rank), else -1
  int64_t seq = -1;         ///< this group's count of collectives before this one (set when issued)
};

/// Names what the calling thread is doing while it issues collectives
/// ("save_state()", "gather layers.3 (LlamaDecoderLayer)"), for the hang
/// report a failed collective gives. Scopes nest: a collective records the
/// chain, outermost first.
class CollectiveScope {
 public:
  explicit CollectiveScope(std::string what);
  ~CollectiveScope();
  CollectiveScope(const CollectiveScope&) = delete;
  CollectiveScope& operator=(const CollectiveScope&) = delete;
  /// The calling thread's chain, joined by " > "; empty outside any scope.
  static std::string current();
};

class CollectiveLog;

/// Handle of an in-flight collective.
class Work {
 public:
  virtual ~Work() = default;
  /// Blocks until the collective is complete and its output written. Calling it again is a no-op.
  virtual void wait() = 0;
  /// True once wait() would return without blocking on communication.
  virtual bool is_completed() = 0;
};
using WorkPtr = std::shared_ptr<Work>;

struct CommOptions {
  /// Bound on every collective and on rendezvous. 10 minutes, as torch.distributed.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  /// Testing aid: sleep a random 0..N ms before each collective is issued, to
  /// expose missing waits (the technique of PyTorch's FSDP2 tests). 0 = off.
  int inject_max_delay_ms = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  /// This process's rank inside the group.
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  /// Global ranks of the group's members, in group-rank order.
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  /// "gloo" or "nccl".
  virtual std::string backend() const = 0;
  /// Where the group's tensors must live: cpu for gloo, cuda:<index> for
  /// nccl (the GPU this process drives).
  virtual at::Device device() const = 0;
  at::DeviceType device_type() const { return device().type(); }
  /// Throws when an earlier collective failed in the background (backends
  /// whose wait() does not block the host: NCCL's watchdog aborts on a
  /// timeout after wait() has returned). Engines call it before applying an
  /// update that depends on collective results. Default: nothing to report.
  virtual void check_health() const {}
  const CommOptions& options() const { return options_; }

  // The collectives. Each returns at once with a handle whose wait() blocks
  // until the result is in place (bounded by CommOptions::timeout); every
  // rank must issue the same collectives in the same order, on tensors of
  // device() and one dtype, flattened in memory order (any shape).

  /// `output` receives every rank's `input` in rank order. It holds
  /// world_size x input.numel() elements, or fewer by part of the last
  /// rank's chunk (a flat buffer whose padding is cut off).
  WorkPtr all_gather_async(const at::Tensor& output, const at::Tensor& input);
  /// `input` reduced over the ranks with `op`; this rank receives chunk
  /// rank() (output.numel() elements) in `output`. `input` holds world_size x
  /// output.numel() elements, or fewer by less than one chunk (the missing
  /// tail counts as zeros). kAvg needs a floating-point dtype.
  WorkPtr reduce_scatter_async(const at::Tensor& output, const at::Tensor& input, ReduceOp op);
  /// `tensor` reduced over the ranks with `op`, in place on every rank.
  WorkPtr all_reduce_async(const at::Tensor& tensor, ReduceOp op);
  /// Copies `root`'s (group rank) tensor into every rank's `tensor`, in place.
  WorkPtr broadcast_async(const at::Tensor& tensor, int root);

  /// Several all-gathers issued together: outputs[i] receives every rank's
  /// inputs[i], each pair under all_gather_async's rules; the one handle
  /// completes when all have. Engines pass the pieces of a unit's buffer, so
  /// that each rank's values land where the parameters look for them.
  WorkPtr all_gather_coalesced_async(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs);
  /// Several reduce-scatters issued together, as all_gather_coalesced_async.
  WorkPtr reduce_scatter_coalesced_async(const std::vector<at::Tensor>& outputs,
                                         const std::vector<at::Tensor>& inputs, ReduceOp op);

  /// A reduce-scatter with uneven pieces: `splits` has one count per rank
  /// and sums to input.numel(); rank r receives in `output` (splits[r]
  /// elements, possibly none) the reduction of every rank's
  /// input[splits[0] + ... + splits[r-1], +splits[r]). No padding: engines
  /// reduce a parameter's gradient where it lies even when the ranks' shards
  /// cut it unevenly (FSDP's flat parameter).
  WorkPtr reduce_scatter_v_async(const at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& splits,
                                 ReduceOp op);

  /// Several all-reduces issued together, as all_gather_coalesced_async.
  WorkPtr all_reduce_coalesced_async(const std::vector<at::Tensor>& tensors, ReduceOp op);

  /// Concatenates every rank's `input` into `output` (rank order).
  void all_gather(const at::Tensor& output, const at::Tensor& input) {
    all_gather_async(output, input)->wait();
  }
  /// Reduces `input` over ranks; this rank receives chunk `rank()` in `output`.
  void reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op = ReduceOp::kSum) {
    reduce_scatter_async(output, input, op)->wait();
  }
  void all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum) {
    all_reduce_async(tensor, op)->wait();
  }
  /// Copies `root`'s (group rank) tensor into every rank's `tensor`.
  void broadcast(const at::Tensor& tensor, int root = 0) { broadcast_async(tensor, root)->wait(); }
  /// Blocks until every rank of the group reached the barrier (bounded by the timeout).
  void barrier();

  /// Creates a sub-group of the listed group ranks. Collective over this group:
  /// every rank calls it with the same list, in the same order relative to other
  /// new_group/split calls (as torch.distributed.new_group). Returns nullptr on
  /// ranks that are not members.
  std::shared_ptr<Communicator> new_group(const std::vector<int>& ranks);

  /// Partitions the group into disjoint sub-groups (e.g. the per-machine shard
  /// groups of HYBRID_SHARD) and returns the one this rank belongs to.
  /// Collective; every rank passes the same partition, which must cover all ranks.
  std::shared_ptr<Communicator> split(const std::vector<std::vector<int>>& groups);

  /// Called with every collective issued by this communicator (not its sub-groups).
  void set_observer(std::function<void(const CollectiveEvent&)> observer) {
    observer_ = std::move(observer);
  }

 protected:
  Communicator(int rank, int world_size, std::vector<int> global_ranks, CommOptions options);
  /// The global ranks of `ranks`, ranks of this group (a sub-group's members).
  std::vector<int> global_ranks_of(const std::vector<int>& ranks) const;

  // Backend hooks. Arguments are validated; sizes are even (output = W * chunk
  // for all-gather, input = W * chunk for reduce-scatter) — the base class pads.
  virtual WorkPtr do_all_gather(const at::Tensor& output, const at::Tensor& input,
                                const CollectiveEvent& event) = 0;
  virtual WorkPtr do_reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                                    ReduceOp op, const CollectiveEvent& event) = 0;
  /// Even all-gathers of one dtype (outputs[i] = W x inputs[i]); world > 1.
  /// Default: one do_all_gather per pair, issued back to back.
  virtual WorkPtr do_all_gather_coalesced(const std::vector<at::Tensor>& outputs,
                                          const std::vector<at::Tensor>& inputs, const CollectiveEvent& event);
  /// `splits` sums to input.numel() and output holds splits[rank()]; world > 1.
  virtual WorkPtr do_reduce_scatter_v(const at::Tensor& output, const at::Tensor& input,
                                      const std::vector<int64_t>& splits, ReduceOp op,
                                      const CollectiveEvent& event) = 0;
  virtual WorkPtr do_all_reduce(const at::Tensor& tensor, ReduceOp op,
                                const CollectiveEvent& event) = 0;
  virtual WorkPtr do_broadcast(const at::Tensor& tensor, int root, const CollectiveEvent& event) = 0;
  virtual void do_barrier(const CollectiveEvent& event) = 0;
  /// Builds the communicator of a sub-group. `group_index` is unique per call
  /// sequence and identical on all ranks; `ranks` are group ranks of this
  /// communicator; called only on members.
  virtual std::shared_ptr<Communicator> do_new_group(const std::vector<int>& ranks,
                                                     int64_t group_index) = 0;
  /// new_group on a rank that is not a member: backends whose sub-groups are
  /// built collectively over the parent (NCCL's ncclCommSplit) take part
  /// here, and Gloo's store host waits for the members to connect. Default:
  /// nothing.
  virtual void do_new_group_not_member(const std::vector<int>& /*ranks*/, int64_t /*group_index*/) {}

  /// "all_reduce(sum) on rank 1 of 4 (global 1), bfloat16, 1000 -> 1000 elements".
  std::string describe(const CollectiveEvent& event) const;
  /// The ring of this group's recent collectives; backends attach the store
  /// to it and ask it for the hang report when a collective fails.
  const std::shared_ptr<CollectiveLog>& collective_log() const { return log_; }

 private:
  void before_collective(CollectiveEvent& event);

  int rank_;
  int world_size_;
  std::vector<int> global_ranks_;
  CommOptions options_;
  int64_t next_group_index_ = 0;
  std::function<void(const CollectiveEvent&)> observer_;
  std::shared_ptr<CollectiveLog> log_;
};

using CommunicatorPtr = std::shared_ptr<Communicator>;

/// Elements per rank when n elements are split evenly over world_size ranks with padding: ceil(n / W).
int64_t chunk_size(int64_t numel, int world_size);

/// True if the dtype can travel through a Communicator.
bool is_supported_dtype(at::ScalarType dtype);

}  // namespace shardtrain::comm
