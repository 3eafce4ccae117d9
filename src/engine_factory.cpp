// Picking a sharding backend (see engine_factory.h).

#include "engine_factory.h"

#include <utility>

#include "backends/fsdp/fsdp_engine.h"
#include "backends/zero/zero_engine.h"
#include "engine/sharded_engine.h"

namespace shardtrain {

const engine::ShardingBackend& sharding_backend(DistributedType type) {
  // A new backend (one folder under src/backends/) is one more line here.
  if (type == DistributedType::kFsdp) return fsdp::backend();
  return zero::backend();
}

engine::EnginePlan plan_engine(const TrainingConfig& config, const engine::PlanContext& context) {
  return sharding_backend(config.distributed_type).plan(config, context);
}

std::unique_ptr<engine::Engine> make_engine(std::shared_ptr<torch::nn::Module> model, comm::CommunicatorPtr world,
                                            DistributedType type, engine::EnginePlan plan) {
  engine::EngineGroups groups = sharding_backend(type).groups(world, plan);
  return std::make_unique<engine::ShardedEngine>(std::move(model), std::move(groups), std::move(plan));
}

}  // namespace shardtrain
