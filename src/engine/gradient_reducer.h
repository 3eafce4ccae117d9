#pragma once
// The gradient reducer: takes each parameter's gradient from autograd's
// post-accumulate hook, reduce-scatters (or all-reduces) it in buckets
// straight from where autograd left it, and adds the result into the shard's
// gradient. It owns the hooks, the gradients waiting for their unit, ZeRO-1's
// boundary accumulators, the bucket being filled and the ones in flight.

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "comm/work_util.h"
#include "engine/engine_plan.h"
#include "engine/gather_scheduler.h"
#include "engine/grad_ready_hook.h"
#include "engine/shard_groups.h"
#include "engine/shard_storage.h"
#include "engine/unit_table.h"

namespace shardtrain::engine {

class GradientReducer {
 public:
  /// `gather` frees each unit once its gradients are in, and prefetches the
  /// next one in backward (post-backward prefetch).
  GradientReducer(const EnginePlan& plan, const ShardGroups& groups, const UnitTable& units, ShardStorage& storage,
                  GatherScheduler& gather);
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  /// Set-up, per trainable entry: the hooks on its parameters, and ZeRO-1's
  /// boundary accumulator.
  void attach(int i);
  /// Runs backward of the (already scaled) loss and every reduction it
  /// starts, through to the gradients in the shards. `sync`: the last
  /// micro-batch of a gradient-accumulation window.
  void backward(const at::Tensor& scaled_loss, bool sync);
  /// A forward of `unit` (holding frozen weights, which give backward no
  /// gradient to wait for) hooked its input: the next backward frees the
  /// unit only after that input's gradient has arrived.
  void expect_input_grad(const Unit& unit);
  /// The gradient of one hooked input of `unit` has arrived. Once every
  /// forward's has (a unit may run more than once per step) and its
  /// trainable gradients are in, every autograd node that read its weights
  /// has run: frees its parameters (FSDP's post-backward reshard).
  void unit_input_grad_ready(const Unit& unit);
  /// zero_grad's part: ZeRO-1's accumulators, when a window left them non-zero.
  void clear_window();
  /// Bytes of ZeRO-1's boundary accumulators (gradients at rest).
  int64_t accumulator_bytes() const;
  /// The most bytes that gradient reductions in flight held at once (their
  /// unsharded inputs and sharded outputs) since the last reset_peak().
  int64_t peak_bytes() const { return peak_bytes_; }
  void reset_peak() { peak_bytes_ = live_bytes_; }
  /// Waits for reductions still in flight (they write into buffers this
  /// reducer owns); failures are logged, as this runs on the engine's destruction.
  void settle_in_flight(const std::string& engine_name) noexcept;

 private:
  /// Gradient reductions issued together. Each entry reduces `input` (a
  /// parameter's gradient, or a piece of a full-layout gradient buffer) and
  /// adds the result to entry `unit`'s gradient at [grad_offset, +length).
  struct Bucket {
    struct Entry {
      int unit = 0;
      at::Tensor input;
      int64_t grad_offset = 0;
      int64_t length = 0;
      std::vector<int64_t> splits;  ///< uneven reduce-scatter counts per rank; empty: even chunks
    };
    std::vector<Entry> entries;
    int64_t numel = 0;                 ///< input elements queued
    std::vector<comm::WorkPtr> works;  ///< in issue order
    at::Tensor output;                 ///< sharded: the reduced chunks, entry after entry
    int64_t bytes() const;             ///< what it holds while in flight
  };
  /// One entry's gradients on their way.
  struct Pending {
    std::vector<at::Tensor> grads;  ///< autograd's gradients, moved out of .grad()
    std::vector<bool> issued;       ///< its reduction is queued already (the root entry's, as they arrive)
    int seen = 0;
    /// zero 1: fp32, in the full layout; made by the first backward without sync.
    at::Tensor boundary_accumulator;
    bool boundary_reduced = false;    ///< zero 1: its accumulator went out during this boundary backward
  };

  /// EnginePlan::adds_grads_directly for these groups.
  bool adds_grads_directly() const;
  /// After autograd accumulated into a parameter's .grad(): takes that tensor
  /// (autograd's own output, not a copy) and leaves .grad() empty.
  void on_grad_accumulated(int i, int param_index);
  void unit_grads_ready(int i);
  /// Whether this backward's gradients go to a collective as they come
  /// (not added directly on one rank, nor accumulated for ZeRO-1's boundary).
  bool reduces_during_backward() const;
  /// Queues the reduction of entry i's gradient k (zeros if it got none).
  void enqueue_gradient(int i, int k);
  /// Issues the bucket when it is full; without overlap_comm, waits for it.
  void flush_if_due();
  /// Frees a unit holding frozen weights after backward once both signals
  /// came: its trainable gradients (if it has any) and its input's gradient.
  void release_frozen_unit_if_done(const Unit& unit);
  /// A pending gradient in the reduce dtype, flattened (zeros where the
  /// parameter got none: every rank reduces the same pieces).
  at::Tensor reduce_input(int i, int k) const;
  /// `splits` (one count per rank) makes it an uneven reduce-scatter; empty: even chunks of `length`.
  void enqueue(int i, at::Tensor input, int64_t grad_offset, int64_t length, std::vector<int64_t> splits = {});
  /// Queues the reduction of gradients held in entry i's full layout, one piece at a time.
  void enqueue_full_layout(int i, const at::Tensor& full_input);
  /// Issues the queued reductions as one coalesced collective: reduce-scatters
  /// of the pieces into one output buffer, or (unsharded) all-reduces in place.
  /// With kMaxBucketsInFlight issued already, finishes the oldest first.
  void flush_bucket();
  /// Waits for the oldest bucket in flight and adds its results into the
  /// gradient shards.
  void finish_oldest_bucket();
  void finish_reductions();
  /// zero 1: queues the reduction of one entry's accumulator (a copy in the
  /// reduce dtype) and zeroes it for the next window.
  void reduce_accumulator(int i);
  /// zero 1, at the boundary: reduces the accumulators not yet reduced during
  /// backward (entries that got no gradient) and waits for all of them.
  void reduce_boundary_accumulators();

  const EnginePlan& plan_;
  const ShardGroups& groups_;
  const UnitTable& units_;
  ShardStorage& storage_;
  GatherScheduler& gather_;
  std::vector<Pending> pending_;
  /// on_grad_accumulated's hooks on the trainable parameters; removed with the reducer.
  std::vector<std::unique_ptr<GradReadyHook>> hooks_;
  Bucket filling_;
  /// Buckets issued and not yet finished, oldest first. Each holds its
  /// unsharded gradients until it is finished, so with no bound a backward
  /// under overlap_comm would hold every unit's (FSDP issues a bucket per
  /// unit): the whole model's gradients, unsharded, at the end of backward.
  /// Two: while backward computes a unit's gradients, the reductions of the
  /// two units before it run; issuing a third waits for the oldest (DeepSpeed
  /// ZeRO-3 alternates two buckets; FSDP2 keeps one reduce-scatter in
  /// flight). On a GPU the limit is on buckets issued, not on device memory:
  /// a finished bucket's blocks return to the caching allocator once the
  /// communication stream is past them.
  static constexpr std::size_t kMaxBucketsInFlight = 2;
  std::deque<Bucket> in_flight_;
  int64_t live_bytes_ = 0;  ///< Bucket::bytes() of in_flight_
  int64_t peak_bytes_ = 0;
  /// Per unit that holds frozen weights, from its forwards to the end of the
  /// backward: its trainable gradients are all in; its inputs hooked, and how
  /// many of their gradients have arrived.
  struct UnitBackward {
    bool grads_in = false;
    int inputs_hooked = 0;
    int input_grads_in = 0;
  };
  std::map<const Unit*, UnitBackward> frozen_unit_backward_;
  /// zero 1: the running backward ends an accumulation window, so each unit's
  /// accumulator is reduced as soon as its gradients are in (overlapping the
  /// rest of backward, as ZeRO-2's reductions do) instead of after backward.
  bool boundary_backward_ = false;
  /// zero 1: a backward without sync has added to the accumulators since the
  /// last boundary. When none has (an accumulation window of one micro-batch,
  /// every step with gradient_accumulation_steps 1), the accumulator would hold
  /// 0 + g: the boundary backward reduces each gradient straight from autograd
  /// instead, as zero 2 does, with the same sums and the same bits, and no
  /// full-size fp32 add, copy and zeroing per step.
  bool accumulated_in_window_ = false;
};

}  // namespace shardtrain::engine
