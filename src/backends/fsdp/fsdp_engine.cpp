#include "backends/fsdp/fsdp_engine.h"

#include "shardtrain/error.h"
#include "shardtrain/logging.h"

namespace shardtrain::fsdp {

std::pair<double, double> gradient_divide_factors(int world_size) {
  // torch.distributed.fsdp._runtime_utils._get_gradient_predivide_factor.
  int factor = 1;
  while (world_size % factor == 0 && world_size / factor > factor) factor *= 2;
  return {static_cast<double>(factor), static_cast<double>(world_size) / factor};
}

namespace {

std::pair<comm::CommunicatorPtr, engine::ShardingOptions> configure(const comm::CommunicatorPtr& world,
                                                                      const FsdpOptions& f) {
  const FsdpConfig& c = f.config;
  engine::ShardingOptions o;
  o.layout = engine::UnitLayout::Kind::kFlat;
  o.compute_dtype = f.compute_dtype;
  o.param_dtype = f.param_dtype;
  o.reduce_dtype = f.reduce_dtype;
  o.pure_low_precision = f.pure_low_precision;
  // Pure mode's gradients are low precision already; with an fp32 param_dtype there is nothing to keep low.
  o.keep_low_precision_grads = c.keep_low_precision_grads && !f.pure_low_precision && f.param_dtype != at::kFloat;
  o.buffer_dtype = f.buffer_dtype;
  o.weight_source = f.weight_source;
  o.rank0_loads_weights = c.cpu_ram_efficient_loading;
  o.loss_scale = f.loss_scale;
  o.fp16 = f.fp16;
  o.optimizer = f.optimizer;
  // cpu_ram_efficient_loading needs rank 0's values (Accelerate forces sync_module_states with it);
  // parameters a rank built without storage come from rank 0 either way.
  o.sync_module_states = c.sync_module_states || c.cpu_ram_efficient_loading;
  o.sync_group = world;
  o.offload_optimizer = c.offload_params;
  o.activation_checkpointing = c.activation_checkpointing;
  // FSDP sums and divides around the reduction by these factors of the whole world.
  o.average = false;
  std::tie(o.predivide, o.postdivide) = gradient_divide_factors(world->world_size());
  o.overlap_comm = true;
  // One bucket per unit: FSDP reduce-scatters each FlatParameter on its own.
  o.reduce_bucket_size = 1;
  // FSDP frees a FULL_SHARD unit after forward whenever its backward comes.
  o.max_reuse_distance = 0;
  // FSDP gathers one unit ahead (limit_all_gathers caps in-flight gathers at two).
  o.max_prefetch_units = 1;
  o.prefetch_bucket_size = c.forward_prefetch ? (int64_t{1} << 62) : 0;
  o.backward_prefetch = c.backward_prefetch == BackwardPrefetch::kBackwardPre    ? engine::BackwardPrefetchMode::kPre
                        : c.backward_prefetch == BackwardPrefetch::kBackwardPost ? engine::BackwardPrefetchMode::kPost
                                                                                 : engine::BackwardPrefetchMode::kNone;
  switch (c.auto_wrap_policy) {
    case AutoWrapPolicy::kTransformerBased:
      o.unit_classes = c.transformer_layer_cls_to_wrap;
      break;
    case AutoWrapPolicy::kSizeBased:
      o.min_unit_params = c.min_num_params;
      break;
    case AutoWrapPolicy::kNoWrap:
      o.wrap_units = false;
      break;
  }

  comm::CommunicatorPtr shard_group = world;
  const int W = world->world_size();
  switch (c.sharding_strategy) {
    case ShardingStrategy::kFullShard:
      o.reshard = engine::Reshard::kAfterForward;
      break;
    case ShardingStrategy::kShardGradOp:
      o.reshard = engine::Reshard::kAfterBackward;
      break;
    case ShardingStrategy::kNoShard:
      o.shard_params = false;
      o.reshard = engine::Reshard::kNever;
      break;
    case ShardingStrategy::kHybridShard:
    case ShardingStrategy::kHybridShardZero2: {
      const int local = f.local_world_size;
      ST_CHECK_T(ConfigError, local >= 1 && W % local == 0, to_string(c.sharding_strategy),
                 ": the world size ", W, " is not a multiple of the processes per machine (LOCAL_WORLD_SIZE=", local,
                 "); every machine must run the same number of processes");
      std::vector<std::vector<int>> machines, replicas;
      for (int m = 0; m < W / local; ++m) {
        machines.emplace_back();
        for (int l = 0; l < local; ++l) machines.back().push_back(m * local + l);
      }
      for (int l = 0; l < local; ++l) {
        replicas.emplace_back();
        for (int m = 0; m < W / local; ++m) replicas.back().push_back(m * local + l);
      }
      shard_group = world->split(machines);
      o.replicate_group = world->split(replicas);
      o.reshard = c.sharding_strategy == ShardingStrategy::kHybridShard ? engine::Reshard::kAfterForward
                                                                         : engine::Reshard::kAfterBackward;
      break;
    }
  }
  o.name = std::string("fsdp ") + to_string(c.sharding_strategy) + (f.pure_low_precision ? " (pure low precision)" : "");
  if (world->rank() == 0) {
    if (c.keep_low_precision_grads && !o.keep_low_precision_grads) {
      ST_LOG_WARN("fsdp: fsdp_keep_low_precision_grads has no effect here: {}",
                  f.pure_low_precision ? "pure low precision keeps every gradient in the low dtype already"
                                       : "param_dtype is fp32, so gradients are fp32 anyway");
    }
    if (f.pure_low_precision) {
      ST_LOG_WARN("fsdp pure low precision: parameters, gradients and optimizer state are {}; an update smaller "
                  "than half an ulp of its weight is lost (the seeds' stalled Mistral run). Use mixed_precision: "
                  "bf16 for an fp32 master.", c10::toString(f.param_dtype));
    }
  }
  return {shard_group, o};
}

}  // namespace

FsdpEngine::FsdpEngine(std::shared_ptr<torch::nn::Module> model, comm::CommunicatorPtr world, const FsdpOptions& options)
    : FsdpEngine(std::move(model), configure(world, options)) {}

FsdpEngine::FsdpEngine(std::shared_ptr<torch::nn::Module> model,
                       std::pair<comm::CommunicatorPtr, engine::ShardingOptions> setup)
    : ShardedEngine(std::move(model), std::move(setup.first), std::move(setup.second)) {}

}  // namespace shardtrain::fsdp
