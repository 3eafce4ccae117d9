#include "backends/zero/zero_engine.h"

#include "shardtrain/error.h"

namespace shardtrain::zero {
namespace {

engine::ShardingOptions to_sharding(const ZeroOptions& z) {
  ST_CHECK_T(ConfigError, z.stage >= 0 && z.stage <= 3, "zero_optimization.stage must be 0, 1, 2 or 3, got ", z.stage);
  engine::ShardingOptions o;
  o.name = z.stage == 0 ? "ddp (zero-0)" : "zero-" + std::to_string(z.stage);
  o.layout = engine::UnitLayout::Kind::kPerParam;
  o.shard_params = z.stage != 0;
  o.reshard = z.stage == 3 ? engine::Reshard::kAfterForward : engine::Reshard::kNever;
  o.reduce_at_boundary_only = z.stage == 1;
  o.compute_dtype = z.compute_dtype;
  o.param_dtype = z.param_dtype;
  o.reduce_dtype = z.reduce_dtype;
  o.average = true;  // DeepSpeed averages: sum in fp32, one division, one rounding
  o.overlap_comm = z.overlap_comm;
  o.reduce_bucket_size = z.reduce_bucket_size;
  o.sub_group_size = z.sub_group_size;
  o.prefetch_bucket_size = z.prefetch_bucket_size;
  o.backward_prefetch = engine::BackwardPrefetchMode::kPre;
  o.param_persistence_threshold = z.stage == 3 ? z.param_persistence_threshold : 0;
  o.max_live_parameters = z.max_live_parameters;
  o.max_reuse_distance = z.stage == 3 ? z.max_reuse_distance : 0;
  o.allgather_bucket_size = z.allgather_bucket_size;
  o.offload_optimizer = z.offload_optimizer;
  o.activation_checkpointing = z.activation_checkpointing;
  o.sync_module_states = true;
  o.loss_scale = z.loss_scale;
  o.fp16 = z.fp16;
  o.optimizer = z.optimizer;
  o.weight_source = z.weight_source;
  o.rank0_loads_weights = z.zero3_init && z.stage == 3;
  return o;
}

}  // namespace

ZeroEngine::ZeroEngine(std::shared_ptr<torch::nn::Module> model, comm::CommunicatorPtr comm,
                       const ZeroOptions& options)
    : ShardedEngine(std::move(model), std::move(comm), to_sharding(options)) {}

}  // namespace shardtrain::zero
