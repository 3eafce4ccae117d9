// ShardedEngine: the constructor, which runs the set-up phases in order (see
// engine_state.h for where each lives), and the engine's identity.

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

ShardedEngine::~ShardedEngine() {
  State& s = *state_;
  for (auto& u : s.units) {
    if (u.unit) u.unit->attach_unit_hooks(nullptr, -1);
  }
  // A gather or reduction still in flight (a prefetch no forward consumed, a
  // forward or backward that threw) writes into buffers this state owns:
  // the communicator's threads must be done with them before they are freed.
  // Every wait is bounded by the communicator's timeout; a failure here is
  // logged, since a destructor must not throw.
  auto settle = [&](const comm::WorkPtr& work, const std::string& what) {
    if (!work) return;
    try {
      work->wait();
    } catch (const std::exception& e) {
      ST_LOG_WARN("{}: {} still in flight at shutdown failed: {}", s.plan.name, what, e.what());
    }
  };
  for (auto& u : s.units) settle(u.gather_work, "the gather of " + u.label());
  for (auto& bucket : s.in_flight) {
    for (auto& work : bucket.works) settle(work, "a gradient reduction");
  }
}

std::string ShardedEngine::name() const { return state_->plan.name; }

const EnginePlan& ShardedEngine::plan() const { return state_->plan; }

ShardedEngine::ShardedEngine(std::shared_ptr<torch::nn::Module> model, EngineGroups groups, EnginePlan plan)
    : state_(std::make_unique<State>(std::move(model), std::move(groups), std::move(plan))) {
  State& s = *state_;
  ST_CHECK(s.model != nullptr, s.plan.name, ": the model is null");
  if (s.sync_group().rank() == 0) {
    for (const std::string& notice : s.plan.notices) ST_LOG_WARN("{}", notice);
  }
  ST_CHECK(!(s.plan.pure_low_precision && s.plan.optimizer.type == "SGD"), s.plan.name,
           ": pure low precision runs AdamW/Adam on low-precision state; SGD is not supported there");
  ST_CHECK(!(s.plan.pure_low_precision && s.plan.optimizer.custom_factory), s.plan.name,
           ": a custom optimizer needs an fp32 master; it cannot run in pure low precision");

  s.register_units();
  s.bind_device();
  s.allocate_partitions();
  s.shard_initial_values(this, s.agree_on_load_modes());
  s.create_custom_optimizer();
  const int64_t trainable = std::accumulate(s.units.begin(), s.units.end(), int64_t{0}, [](int64_t a, const UnitState& u) {
    return a + (u.trainable ? u.layout->total_param_numel() : 0);
  });
  ST_LOG_INFO("{}: {} unit states, {} trainable elements over {} ranks; compute {}, shard {}, reduce {}{}{}",
              s.plan.name, s.units.size(), trainable, s.layout_world(), c10::toString(s.plan.compute_dtype),
              c10::toString(s.plan.param_dtype), c10::toString(s.plan.reduce_dtype),
              s.pure() ? ", pure low precision (no fp32 master)" : "",
              s.plan.offload_optimizer ? ", optimizer offloaded to CPU" : "");
}

}  // namespace shardtrain::engine
