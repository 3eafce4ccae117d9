#pragma once
// The precision plan of an engine plan (precision_plan.cpp): what the user
// sees is printed from the plan the engine runs, never derived again from
// the config.

#include <cstdint>

#include "engine/engine_plan.h"
#include "shardtrain/precision_plan.h"

namespace shardtrain {

PrecisionPlan precision_plan_of(const engine::EnginePlan& plan, int64_t num_params,
                                const engine::PlanContext& context);

}  // namespace shardtrain
