#pragma once
// The unit table: which modules are sharding units, which parameters each
// owns (trainable and frozen ones flattened apart, so frozen weights never
// enter the optimizer), how each is laid out over the ranks, and the unit
// order recorded on the first forward, which prefetch follows. Fixed after
// set-up except for the recorded order.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>

#include "engine/engine_plan.h"
#include "engine/unit_layout.h"
#include "shardtrain/unit.h"

namespace torch::nn {
class Module;
}

namespace shardtrain::engine {

/// One unit's parameters of one kind (trainable, frozen, or frozen bytes).
struct UnitEntry {
  std::string path;                 ///< module path ("" = root)
  Unit* unit = nullptr;             ///< nullptr for the root
  bool trainable = true;
  /// Frozen opaque bytes (uint8 parameters: an NF4-quantized base weight):
  /// stored, gathered and viewed as bytes, never converted; no master.
  bool packed = false;
  std::vector<std::string> names;   ///< fully-qualified parameter names
  std::vector<at::Tensor> params;   ///< the module's parameters (identity kept)
  std::vector<std::vector<int64_t>> shapes;
  std::unique_ptr<UnitLayout> layout;
  int64_t shard_offset = 0;         ///< offset in the flat partitions (trainable entries)
  bool persistent = false;          ///< below param_persistence_threshold: stays gathered
  /// How hang reports name this unit's collectives: "layers.3 (LlamaDecoderLayer)".
  std::string label() const;
};

class UnitTable {
 public:
  /// Picks the units (the outermost marked modules the wrap policy selects),
  /// splits each into trainable and frozen entries (root entries first) and
  /// lays each out over `layout_world` ranks. `logs`: this rank reports what
  /// the wrap policy matched.
  UnitTable(torch::nn::Module& model, const EnginePlan& plan, int layout_world, bool logs);

  int size() const { return static_cast<int>(entries_.size()); }
  UnitEntry& operator[](int i) { return entries_[static_cast<std::size_t>(i)]; }
  const UnitEntry& operator[](int i) const { return entries_[static_cast<std::size_t>(i)]; }
  const std::vector<UnitEntry>& entries() const { return entries_; }
  /// Elements of each flat partition: every trainable entry's shard, in order.
  int64_t trainable_shard_numel() const { return trainable_shard_numel_; }

  bool manages(const Unit& unit) const { return by_unit_.count(&unit) != 0; }
  /// The entries (trainable, then frozen) of a managed unit.
  const std::vector<int>& entries_of(const Unit& unit) const { return by_unit_.at(&unit); }
  int64_t unit_numel(const Unit& unit) const;
  /// The unit holds a frozen entry (a LoRA base, an NF4 one): weights that
  /// give backward no gradient to signal that the unit is done.
  bool holds_frozen(const Unit& unit) const;
  /// The unit holds a trainable entry.
  bool trains(const Unit& unit) const;

  // ---- the recorded unit order -----------------------------------------------
  void begin_forward() { current_order_.clear(); }
  /// Appends `unit` to this forward's order and returns its position there. A
  /// forward that departs from the recorded trace invalidates it (logged).
  std::size_t record(const Unit& unit, const std::string& engine_name);
  /// The first forward's order becomes the trace (and again after a change).
  void end_forward();
  bool trace_valid() const { return trace_valid_; }
  const std::vector<const Unit*>& trace() const { return trace_; }
  /// The order backward runs the units in reverse: the trace, or this forward's.
  const std::vector<const Unit*>& forward_order() const { return trace_valid_ ? trace_ : current_order_; }
  /// Elements gathered between this unit's forward and its backward, by the recorded order.
  int64_t reuse_distance(const Unit& unit) const;

 private:
  std::vector<UnitEntry> entries_;
  std::unordered_map<const Unit*, std::vector<int>> by_unit_;
  int64_t trainable_shard_numel_ = 0;
  std::vector<const Unit*> trace_;
  std::vector<const Unit*> current_order_;
  bool trace_valid_ = false;
  int64_t forward_count_ = 0;
};

}  // namespace shardtrain::engine
