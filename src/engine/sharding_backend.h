#pragma once
// What a sharding backend is, as the engine core sees it. A backend (one
// folder under src/backends/) makes exactly two decisions: it turns its
// config section into the engine plan (its partitioning rule, when units are
// gathered and freed, how gradients are reduced, its precision policy), and
// it splits the world into the communicator groups that plan runs over. The
// engine core runs any plan; src/engine_factory.cpp picks the backend.

#include "engine/engine_plan.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/config.h"

namespace shardtrain::engine {

class ShardingBackend {
 public:
  virtual ~ShardingBackend() = default;
  /// The engine plan of a resolved `config`. A config this backend cannot run
  /// is a ConfigError here, before any communicator exists.
  virtual EnginePlan plan(const TrainingConfig& config, const PlanContext& context) const = 0;
  /// The communicators `plan` (this backend's) runs over, split from `world`.
  virtual EngineGroups groups(const comm::CommunicatorPtr& world, const EnginePlan& plan) const = 0;
};

}  // namespace shardtrain::engine
