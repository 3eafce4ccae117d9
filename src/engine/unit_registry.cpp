// Which modules are sharding units and which parameters belong to each:
// the outermost marked modules the wrap policy selects, each split into its
// trainable and frozen parameters (flattened separately).

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_set>

#include <ATen/ATen.h>

#include "engine/storage_resize.h"
#include "engine/engine_state.h"
#include "shardtrain/error.h"
#include "shardtrain/logging.h"

namespace shardtrain::engine {

void ShardedEngine::State::register_units() {
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> unit_modules;
  std::vector<std::string> marked_classes;
  if (plan.wrap_units) {
    for (const auto& item : model->named_modules("", /*include_self=*/false)) {
      auto* marked = dynamic_cast<Unit*>(item.value().get());
      if (marked == nullptr) continue;
      marked_classes.push_back(marked->unit_class_name());
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
  if (comm->rank() == 0) {
    // A config may list several families' classes (LlamaDecoderLayer,MistralDecoderLayer)
    // so one file serves both: a missing name only warns when no listed class matched.
    const bool any_listed_found = std::any_of(
        plan.unit_classes.begin(), plan.unit_classes.end(), [&](const std::string& cls) {
          return std::find(marked_classes.begin(), marked_classes.end(), cls) != marked_classes.end();
        });
    for (const auto& cls : plan.unit_classes) {
      if (std::find(marked_classes.begin(), marked_classes.end(), cls) != marked_classes.end()) continue;
      if (any_listed_found) {
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
    UnitState trainable, frozen;
    for (UnitState* st : {&trainable, &frozen}) {
      st->path = path;
      st->unit = unit;
    }
    frozen.trainable = false;
    for (const auto& item : module.named_parameters(/*recurse=*/true)) {
      const at::Tensor& p = item.value();
      if (!claimed.insert(p.unsafeGetTensorImpl()).second) continue;  // shared/tied: the first owner keeps it
      UnitState& st = p.requires_grad() ? trainable : frozen;
      st.names.push_back(join_path(path, item.key()));
      st.params.push_back(p);
      st.shapes.push_back(p.sizes().vec());
    }
    for (UnitState* st : {&trainable, &frozen}) {
      if (!st->params.empty() || (st == &trainable && unit == nullptr)) units.push_back(std::move(*st));
    }
  };
  // Units first (so they claim their parameters), then the root takes the rest.
  for (const auto& [path, module] : unit_modules) collect(path, dynamic_cast<Unit*>(module.get()), *module);
  const std::size_t unit_state_count = units.size();
  collect("", nullptr, *model);
  // Root states go first in the list; keep their relative order.
  std::rotate(units.begin(), units.begin() + static_cast<std::ptrdiff_t>(unit_state_count), units.end());
  for (std::size_t i = 0; i < units.size(); ++i) {
    if (units[i].unit) unit_states[units[i].unit].push_back(static_cast<int>(i));
  }
}

}  // namespace shardtrain::engine
