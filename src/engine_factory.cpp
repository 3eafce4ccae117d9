// Picking a sharding backend (see engine_factory.h).

#include "engine_factory.h"

#include <utility>

#include "backends/fsdp/fsdp_engine.h"
#include "backends/zero/zero_engine.h"

namespace shardtrain {

engine::EnginePlan plan_engine(const TrainingConfig& config, const engine::PlanContext& context) {
  if (config.distributed_type == DistributedType::kFsdp) return fsdp::plan(config, context);
  return zero::plan(config, context);
}

std::unique_ptr<engine::Engine> make_engine(std::shared_ptr<torch::nn::Module> model, comm::CommunicatorPtr world,
                                            DistributedType type, engine::EnginePlan plan) {
  if (type == DistributedType::kFsdp) {
    return std::make_unique<fsdp::FsdpEngine>(std::move(model), std::move(world), std::move(plan));
  }
  return std::make_unique<zero::ZeroEngine>(std::move(model), std::move(world), std::move(plan));
}

}  // namespace shardtrain
