#pragma once
// The gather scheduler: when each unit's full parameters exist. It owns the
// buffers the module's parameters view, gathers them from the low-precision
// shards around each unit's forward and backward, prefetches along the
// recorded unit order within the prefetch window and the live-parameter
// budget, frees them by the plan's reshard policy, and counts the bytes
// gathered at once.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <unordered_set>
#include <vector>

#include <ATen/core/Tensor.h>

#include "comm/work_util.h"
#include "engine/engine_plan.h"
#include "engine/shard_groups.h"
#include "engine/shard_storage.h"
#include "engine/unit_table.h"
#include "shardtrain/step_report.h"
#include "torch_cuda.h"

namespace shardtrain::engine {

class GatherScheduler {
 public:
  GatherScheduler(const EnginePlan& plan, const ShardGroups& groups, const UnitTable& units,
                  const ShardStorage& storage);
  GatherScheduler(const GatherScheduler&) = delete;
  GatherScheduler& operator=(const GatherScheduler&) = delete;

  // ---- set-up: the buffer entry i's parameters view ---------------------------
  /// Gives entry i its full buffer (compute dtype), not yet counted as
  /// gathered. `views_shard`: the buffer is the shard itself (one rank or no
  /// sharding, and the shard holds the compute dtype), so gathering and
  /// releasing it are nothing to do.
  void bind(int i, at::Tensor full, bool views_shard);
  const at::Tensor& full(int i) const { return slots_[static_cast<std::size_t>(i)].full; }
  bool views_shard(int i) const { return slots_[static_cast<std::size_t>(i)].views_shard; }
  /// The buffer was filled in place at set-up: it counts as gathered.
  void mark_gathered(int i);
  /// The dtype of entry i's full buffer, what its parameters view: the
  /// compute dtype, or bytes for a packed (NF4) entry.
  at::ScalarType full_dtype(int i) const;
  /// Bytes of entry i's full buffer.
  int64_t full_bytes(int i) const;

  // ---- the reshard policy --------------------------------------------------------
  bool frees_after_forward(int i) const;
  bool frees_after_backward(int i) const;
  /// Kept gathered between steps (reshard never, or a persistent unit).
  bool stays_gathered(int i) const;

  // ---- gathering and freeing -----------------------------------------------------
  /// Issues entry i's all-gather (nothing when gathered, in flight or a shard view).
  void start(int i);
  /// Waits for entry i's gather (issuing it first if needed).
  void finish(int i);
  /// Frees entry i's full buffer; a gather of it still in flight is waited
  /// for first. Whether it freed a buffer.
  bool release(int i);
  void gather_unit(const Unit& unit);
  void release_unit(const Unit& unit, bool after_forward);
  /// The root entries (parameters outside every unit), around the whole forward.
  void gather_root();
  /// After backward: frees what the reshard policy frees then.
  void release_after_backward();
  /// Issues gathers for the units of `order` from position `first` on while
  /// they fit in the prefetch window (elements, units) and the live-parameter budget.
  void prefetch_from(const std::vector<const Unit*>& order, std::size_t first, int64_t window_elements);
  /// A unit's forward produced an output that needs a gradient: its backward
  /// will run in this step's backward, so backward prefetch may gather it.
  void expect_backward(const Unit& unit) { awaiting_backward_.insert(&unit); }
  /// Gathers the unit whose backward comes after `current`'s; with nullptr,
  /// the unit whose backward comes first (backward has reached no unit yet).
  void prefetch_for_backward(const Unit* current);
  /// After the optimizer step: frees the stepped entries' stale values and
  /// issues the gathers of the ones kept gathered, in the next forward's
  /// order, without waiting: each unit's forward waits for its own.
  void regather_after_step();
  /// Waits for every gather in flight: before anything writes the shards
  /// they read (the optimizer step) or reads the buffers they fill other
  /// than a unit's forward (a user reading the module's parameters).
  void finish_in_flight();
  /// Gathers issued and not yet waited for.
  int in_flight() const;
  /// Frees every entry, waiting first for its gather in flight.
  void release_all();
  /// Before host memory the gathers upload from is written (the optimizer
  /// step, a checkpoint load): blocks until the uploads queued so far are
  /// done. A gather's wait() orders only the device's streams, not the host.
  void wait_for_uploads();
  /// After the shards were overwritten (a checkpoint load), with every entry
  /// released before: gathers the ones kept gathered.
  void gather_kept();
  /// All-gathers `shard`'s pieces into `target`, a full-layout buffer of the
  /// shard's dtype: each piece lands where the parameters view it.
  comm::WorkPtr gather_pieces(const UnitLayout& layout, const at::Tensor& shard, const at::Tensor& target) const;

  // ---- accounting --------------------------------------------------------------
  int64_t live_bytes() const { return live_bytes_; }
  int64_t peak_bytes() const { return peak_bytes_; }
  void reset_peak() { peak_bytes_ = live_bytes_; }
  const TrafficReport& traffic() const { return traffic_; }
  void reset_traffic() { traffic_ = TrafficReport(); }
  /// Waits (bounded by the communicator's timeout) for gathers still in
  /// flight, which write into buffers this scheduler owns, and for uploads
  /// still reading offloaded shards; failures are logged, as this runs on
  /// the engine's destruction.
  void settle_in_flight(const std::string& engine_name) noexcept;

 private:
  struct Slot {
    at::Tensor full;       ///< compute dtype; the parameters are views into it
    bool gathered = false;
    bool views_shard = false;
    comm::WorkPtr work;    ///< the gather in flight
    at::Tensor staging;    ///< param-dtype landing buffer when the compute dtype differs (fp16 on a CPU)
    at::Tensor upload;     ///< the shard's device copy under the parameter offload, until the gather is done
  };
  bool gathered_or_pending(const Unit& unit) const;
  void add_live(int64_t delta);
  /// limit_all_gathers: waits until fewer than two released units are ahead of the device.
  void pace_gather();

  const EnginePlan& plan_;
  const ShardGroups& groups_;
  const UnitTable& units_;
  const ShardStorage& storage_;
  std::vector<Slot> slots_;
  /// The CUDA streams (cudaStream_t) that uploads were queued on since the
  /// last wait_for_uploads(): one in normal use, a few at most.
  std::vector<void*> upload_streams_;
  /// Where the device stream stood when each of the last units was released,
  /// oldest first (limit_all_gathers).
  std::deque<torch_cuda::CudaStreamMark> releases_;
  int64_t live_bytes_ = 0;
  int64_t peak_bytes_ = 0;
  TrafficReport traffic_;
  /// Units of this step's forwards with a backward to come (expect_backward).
  std::unordered_set<const Unit*> awaiting_backward_;
};

}  // namespace shardtrain::engine
