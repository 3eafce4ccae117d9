#pragma once
// The shard loader: fills every shard at set-up and points the module's
// parameters at their unit's buffer. One collective first settles, the same
// on every rank, where each parameter's values come from (this rank's own,
// rank 0's, or a weight source that reads only this rank's slices); the
// loader counts the bytes of unsharded values held meanwhile (load_peak).
// It also owns the module buffers: broadcast, cast to buffer_dtype, and
// reported in their original dtype.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "engine/engine_plan.h"
#include "engine/gather_scheduler.h"
#include "engine/shard_groups.h"
#include "engine/shard_storage.h"
#include "engine/unit_table.h"

namespace torch::nn {
class Module;
}

namespace shardtrain::engine {

class ShardLoader {
 public:
  ShardLoader(torch::nn::Module& model, const EnginePlan& plan, const ShardGroups& groups, const UnitTable& units,
              ShardStorage& storage, GatherScheduler& gather);
  ShardLoader(const ShardLoader&) = delete;
  ShardLoader& operator=(const ShardLoader&) = delete;

  /// Fills every shard, makes the parameters views into their unit's buffer
  /// (gathered or not, by the reshard policy), then sets up the module buffers.
  void load();
  /// The most bytes of unsharded parameter values held at once during load().
  int64_t peak_bytes() const { return peak_; }
  /// Every module buffer by name in its original dtype, as a state dict holds it.
  void append_buffers(std::vector<std::pair<std::string, at::Tensor>>& out) const;

 private:
  /// How a parameter's shard gets its initial values (settled identically on every rank).
  enum class Source {
    kLocal,     ///< this rank's own values (sync_module_states off)
    kFromRoot,  ///< rank 0's values, sent one rank's chunk at a time
    kWeights,   ///< the weight source, each rank reading its own slices
  };
  /// A module buffer and, when buffer_dtype cast it, what it was.
  struct Buffer {
    std::string name;
    at::Tensor buffer;     ///< the module's buffer (identity kept)
    bool cast = false;
    at::Tensor original;   ///< its value before the cast (full precision)
  };

  /// One collective that settles how each parameter's shard is filled and
  /// checks that the ranks built the same model.
  std::vector<std::vector<Source>> agree_on_sources();
  /// Fills this rank's shard of an entry some rank built (partly) without
  /// storage. Rank 0's values travel one rank's chunk (S elements) at a time,
  /// so a receiving rank never holds more than its shard plus one chunk, and
  /// rank 0 nothing beyond the module it already holds; the weight source is
  /// asked for this rank's slices only.
  void fill_released(int i, const std::vector<Source>& sources, const at::Tensor& shard);
  /// A buffer's compute value under buffer_dtype. As for parameters, fp16 on a
  /// CPU computes in fp32 on fp16-rounded values (LibTorch has no fp16 matmul there).
  at::Tensor cast_buffer(const at::Tensor& value) const;
  /// Buffers are replicated, not sharded: rank 0's are broadcast
  /// (sync_module_states, as FSDP's _sync_module_params_and_buffers), then
  /// floating-point ones are cast to buffer_dtype in place for compute, as
  /// FSDP1's root does in _lazy_init (integer buffers are never cast).
  void setup_buffers();
  at::Tensor reuse(at::Tensor& buffer, int64_t numel, const at::TensorOptions& options);
  void note_peak();

  torch::nn::Module& model_;
  const EnginePlan& plan_;
  const ShardGroups& groups_;
  const UnitTable& units_;
  ShardStorage& storage_;
  GatherScheduler& gather_;
  std::vector<Buffer> buffers_;
  /// Per entry: some rank built a parameter of it without storage.
  std::vector<bool> loads_released_;
  /// Per entry: the module's own storage behind its parameters, before set-up.
  std::vector<int64_t> original_storage_bytes_;
  int64_t held_ = 0;       ///< the module's parameter storage not yet replaced by shards
  int64_t transient_ = 0;  ///< value copies and loading chunks of the entry being set up
  int64_t peak_ = 0;
  // Loading entries with released parameters reuses one shard buffer and one
  // chunk buffer, sized for the largest entry (no per-entry heap churn).
  at::Tensor shard_buffer_, chunk_buffer_;
};

}  // namespace shardtrain::engine
