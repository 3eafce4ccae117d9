#pragma once
// The one place that picks a sharding backend for a resolved config: it asks
// that backend (src/backends/zero or src/backends/fsdp) for the engine plan,
// and builds the engine that runs it. The Accelerator builds its engine here;
// the precision plan (`shardtrain config check` too) is printed from the same
// plan (precision_plan.cpp).

#include <memory>

#include "engine/engine.h"
#include "engine/engine_plan.h"
#include "engine/sharding_backend.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/config.h"

namespace torch::nn {
class Module;
}

namespace shardtrain {

/// The backend that runs a config of distributed type `type`: FSDP's for
/// FSDP, ZeRO's (stage 0, data parallel, unless DEEPSPEED says otherwise) for
/// every other type.
const engine::ShardingBackend& sharding_backend(DistributedType type);

/// The engine plan of a resolved `config`: FSDP's for distributed_type FSDP,
/// ZeRO's (stage 0, data parallel, unless DEEPSPEED says otherwise) for every
/// other type.
engine::EnginePlan plan_engine(const TrainingConfig& config, const engine::PlanContext& context);

/// The engine that runs `plan` (plan_engine's for a config of `type`) over `world`.
std::unique_ptr<engine::Engine> make_engine(std::shared_ptr<torch::nn::Module> model, comm::CommunicatorPtr world,
                                            DistributedType type, engine::EnginePlan plan);

}  // namespace shardtrain
