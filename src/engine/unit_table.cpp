// Which modules are sharding units and which parameters belong to each
// (the outermost marked modules the wrap policy selects, each split into its
// trainable and frozen parameters), their layouts, and the recorded order.

#include "engine/unit_table.h"

#include <algorithm>
#include <limits>
#include <unordered_set>

#include <torch/nn/module.h>

#include "shardtrain/logging.h"

namespace shardtrain::engine {
namespace {

std::string join_path(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

}  // namespace

std::string UnitEntry::label() const {
  const std::string name = path.empty() ? "root parameters" : path;
  return unit != nullptr ? name + " (" + unit->unit_class_name() + ")" : name;
}

UnitTable::UnitTable(torch::nn::Module& model, const EnginePlan& plan, int layout_world, bool logs) {
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> unit_modules;
  std::vector<std::string> marked_classes, shared_classes;
  if (plan.wrap_units) {
    for (const auto& item : model.named_modules("", /*include_self=*/false)) {
      auto* marked = dynamic_cast<Unit*>(item.value().get());
      if (marked == nullptr) continue;
      if (marked->unit_kind() == Unit::Kind::kShared) {
        shared_classes.push_back(marked->unit_class_name());
        continue;
      }
      marked_classes.push_back(marked->unit_class_name());
      if (plan.unit_classes.empty() && plan.unnamed_takes_blocks_only && marked->unit_kind() != Unit::Kind::kBlock) {
        continue;
      }
      if (!plan.unit_classes.empty() &&
          std::find(plan.unit_classes.begin(), plan.unit_classes.end(), marked->unit_class_name()) ==
              plan.unit_classes.end()) {
        continue;
      }
      if (plan.min_unit_params > 0) {
        int64_t n = 0;
        for (const auto& p : item.value()->parameters()) n += p.numel();
        if (n < plan.min_unit_params) continue;
      }
      bool nested = false;
      for (const auto& [path, _] : unit_modules) {
        if (item.key().rfind(path + ".", 0) == 0) nested = true;
      }
      if (!nested) unit_modules.emplace_back(item.key(), item.value());
    }
  }
  if (logs) {
    // A config may list several families' classes (LlamaDecoderLayer,MistralDecoderLayer)
    // so one file serves both: a missing name only warns when no listed class matched.
    const bool any_listed_found = std::any_of(
        plan.unit_classes.begin(), plan.unit_classes.end(), [&](const std::string& cls) {
          return std::find(marked_classes.begin(), marked_classes.end(), cls) != marked_classes.end();
        });
    for (const auto& cls : plan.unit_classes) {
      if (std::find(marked_classes.begin(), marked_classes.end(), cls) != marked_classes.end()) continue;
      if (std::find(shared_classes.begin(), shared_classes.end(), cls) != shared_classes.end()) {
        ST_LOG_INFO("{}: transformer_layer_cls_to_wrap names '{}', whose parameters this model also uses outside "
                    "it (tied embeddings); they stay in the root unit", plan.name, cls);
      } else if (any_listed_found) {
        ST_LOG_INFO("{}: transformer_layer_cls_to_wrap also names '{}', which this model does not have",
                    plan.name, cls);
      } else {
        ST_LOG_WARN("{}: transformer_layer_cls_to_wrap names '{}', but no shardtrain::Unit of that class is in "
                    "the model; its layers stay in the root unit", plan.name, cls);
      }
    }
    if (unit_modules.empty() && plan.wrap_units) {
      ST_LOG_WARN("{}: no sharding units selected (the model marks none, or the wrap policy matched none); "
                  "the whole model is one unit, gathered at once. Mark transformer blocks as shardtrain::Unit.",
                  plan.name);
    }
  }

  std::unordered_set<const c10::TensorImpl*> claimed;
  auto collect = [&](const std::string& path, Unit* unit, torch::nn::Module& module) {
    UnitEntry trainable, frozen, packed;
    for (UnitEntry* entry : {&trainable, &frozen, &packed}) {
      entry->path = path;
      entry->unit = unit;
    }
    frozen.trainable = false;
    packed.trainable = false;
    packed.packed = true;
    for (const auto& item : module.named_parameters(/*recurse=*/true)) {
      const at::Tensor& p = item.value();
      if (!claimed.insert(p.unsafeGetTensorImpl()).second) continue;  // shared/tied: the first owner keeps it
      UnitEntry& entry = p.requires_grad() ? trainable : p.scalar_type() == at::kByte ? packed : frozen;
      entry.names.push_back(join_path(path, item.key()));
      entry.params.push_back(p);
      entry.shapes.push_back(p.sizes().vec());
    }
    for (UnitEntry* entry : {&trainable, &frozen, &packed}) {
      if (!entry->params.empty() || (entry == &trainable && unit == nullptr)) entries_.push_back(std::move(*entry));
    }
  };
  // Units first (so they claim their parameters), then the root takes the rest.
  for (const auto& [path, module] : unit_modules) collect(path, dynamic_cast<Unit*>(module.get()), *module);
  const std::size_t unit_entry_count = entries_.size();
  collect("", nullptr, model);
  // Root entries go first in the list; keep their relative order.
  std::rotate(entries_.begin(), entries_.begin() + static_cast<std::ptrdiff_t>(unit_entry_count), entries_.end());
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    if (entries_[i].unit) by_unit_[entries_[i].unit].push_back(static_cast<int>(i));
  }

  for (auto& entry : entries_) {
    std::vector<int64_t> numels;
    for (const auto& p : entry.params) numels.push_back(p.numel());
    entry.layout = std::make_unique<UnitLayout>(plan.layout, numels, layout_world, /*align=*/1);
    entry.persistent = entry.layout->total_param_numel() < plan.param_persistence_threshold;
    if (entry.trainable) {
      entry.shard_offset = trainable_shard_numel_;
      trainable_shard_numel_ += entry.layout->shard_numel();
    }
  }
}

bool UnitTable::holds_frozen(const Unit& unit) const {
  const auto& entries = entries_of(unit);
  return std::any_of(entries.begin(), entries.end(), [&](int i) { return !(*this)[i].trainable; });
}

bool UnitTable::trains(const Unit& unit) const {
  const auto& entries = entries_of(unit);
  return std::any_of(entries.begin(), entries.end(), [&](int i) { return (*this)[i].trainable; });
}

int64_t UnitTable::unit_numel(const Unit& unit) const {
  int64_t n = 0;
  for (int idx : entries_of(unit)) n += (*this)[idx].layout->total_param_numel();
  return n;
}

std::size_t UnitTable::record(const Unit& unit, const std::string& engine_name) {
  const std::size_t pos = current_order_.size();
  current_order_.push_back(&unit);
  if (trace_valid_ && (pos >= trace_.size() || trace_[pos] != &unit)) {
    ST_LOG_WARN("{}: the unit order changed at forward {} (unit '{}' at position {}): prefetch trace rebuilt",
                engine_name, forward_count_ + 1, (*this)[entries_of(unit)[0]].path, pos);
    trace_valid_ = false;
  }
  return pos;
}

void UnitTable::end_forward() {
  ++forward_count_;
  if (!trace_valid_) {
    trace_ = current_order_;
    trace_valid_ = true;
  }
}

int64_t UnitTable::reuse_distance(const Unit& unit) const {
  auto where = std::find(trace_.begin(), trace_.end(), &unit);
  if (where == trace_.end()) return std::numeric_limits<int64_t>::max();
  int64_t between = 0;
  for (auto it = where + 1; it != trace_.end(); ++it) between += unit_numel(**it);
  return 2 * between;  // the later units' forward, then their backward
}

}  // namespace shardtrain::engine
