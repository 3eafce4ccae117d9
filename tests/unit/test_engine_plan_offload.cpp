// The backends' offload decisions (zero::plan, fsdp::plan): the parameter
// offload where the peer offloads parameters, the optimizer offload it needs,
// and a notice wherever shardtrain does something other than what the
// config's words say.

#include <algorithm>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine_factory.h"
#include "shardtrain/config.h"
#include "support/scratch_dir.h"

namespace {

using shardtrain::testing::ScratchDir;

shardtrain::engine::EnginePlan plan_of(const std::string& config_path) {
  shardtrain::engine::PlanContext context;
  context.world_size = 2;
  context.on_cuda = true;
  return shardtrain::plan_engine(shardtrain::load_config(config_path), context);
}

/// A DeepSpeed ZeRO config with `offload` as its extra zero_optimization keys.
std::string zero_json(int stage, const std::string& offload) {
  return R"({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": )" + std::to_string(stage) + offload + "}}";
}

bool says(const shardtrain::engine::EnginePlan& plan, const std::string& words) {
  return std::any_of(plan.notices.begin(), plan.notices.end(),
                     [&](const std::string& notice) { return notice.find(words) != std::string::npos; });
}

std::string all_notices(const shardtrain::engine::EnginePlan& plan) {
  std::string text;
  for (const auto& notice : plan.notices) text += notice + "\n";
  return text;
}

TEST(UnitEnginePlanOffload, ZeroThreeOffloadsParametersAndTheOptimizerTheyNeed) {
  ScratchDir dir;
  const auto both = plan_of(dir.write("both.json", zero_json(3, R"(, "offload_optimizer": {"device": "cpu"},
      "offload_param": {"device": "cpu"})")));
  EXPECT_TRUE(both.offload_params);
  EXPECT_TRUE(both.offload_optimizer);
  EXPECT_TRUE(both.notices.empty()) << all_notices(both);

  const auto optimizer_only = plan_of(dir.write("optimizer.json", zero_json(3, R"(, "offload_optimizer": {"device": "cpu"})")));
  EXPECT_FALSE(optimizer_only.offload_params);
  EXPECT_TRUE(optimizer_only.offload_optimizer);

  // The step writes the partition where it lives: the optimizer goes with it, and the plan says so.
  const auto params_only = plan_of(dir.write("params.json", zero_json(3, R"(, "offload_param": {"device": "cpu"})")));
  EXPECT_TRUE(params_only.offload_params);
  EXPECT_TRUE(params_only.offload_optimizer);
  EXPECT_TRUE(says(params_only, "offload_param without offload_optimizer: the optimizer is offloaded")) << all_notices(params_only);

  const auto nvme = plan_of(dir.write("nvme.json", zero_json(3, R"(, "offload_param": {"device": "nvme", "nvme_path": "/nvme"},
      "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"})")));
  EXPECT_TRUE(nvme.offload_params);
  EXPECT_TRUE(says(nvme, "offload_param.device nvme is not implemented; offloading to CPU memory")) << all_notices(nvme);
  EXPECT_TRUE(says(nvme, "offload_optimizer.device nvme is not implemented; offloading to CPU memory")) << all_notices(nvme);

  // Below stage 3 the parameters are not partitioned: DeepSpeed ignores offload_param there, so does the plan.
  const auto stage2 = plan_of(dir.write("stage2.json", zero_json(2, R"(, "offload_optimizer": {"device": "cpu"},
      "offload_param": {"device": "cpu"})")));
  EXPECT_FALSE(stage2.offload_params);
  EXPECT_TRUE(stage2.offload_optimizer);
}

TEST(UnitEnginePlanOffload, FsdpOffloadParamsMovesParametersAndOptimizerExceptUnderNoShard) {
  ScratchDir dir;
  const std::string yaml = "distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 2\nfsdp_config:\n"
                           "  fsdp_offload_params: true\n  fsdp_sharding_strategy: ";
  for (const std::string strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"}) {
    const auto plan = plan_of(dir.write(strategy + ".yaml", yaml + strategy + "\n"));
    EXPECT_TRUE(plan.offload_params) << strategy;
    EXPECT_TRUE(plan.offload_optimizer) << strategy;
  }
  const auto no_shard = plan_of(dir.write("NO_SHARD.yaml", yaml + "NO_SHARD\n"));
  EXPECT_FALSE(no_shard.offload_params);
  EXPECT_TRUE(no_shard.offload_optimizer);
  EXPECT_TRUE(says(no_shard, "fsdp_offload_params with NO_SHARD offloads the optimizer step only")) << all_notices(no_shard);
}

}  // namespace
