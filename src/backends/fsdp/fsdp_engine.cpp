// The FSDP backend's decisions (see fsdp_engine.h), from the config's
// fsdp_config section and mixed-precision keys, and the communicator groups
// its sharding strategy runs over.

#include "backends/fsdp/fsdp_engine.h"

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "shardtrain/error.h"

namespace shardtrain::fsdp {

std::pair<double, double> gradient_divide_factors(int world_size) {
  // torch.distributed.fsdp._runtime_utils._get_gradient_predivide_factor.
  int factor = 1;
  while (world_size % factor == 0 && world_size / factor > factor) factor *= 2;
  return {static_cast<double>(factor), static_cast<double>(world_size) / factor};
}

namespace {

/// The pure-low-precision rule (Accelerate's): the explicit
/// fsdp_pure_low_precision key, else a bf16/fp16 load with mixed_precision: no.
bool pure_low_precision(const TrainingConfig& config, const std::string& load_dtype) {
  if (config.fsdp.pure_low_precision) return *config.fsdp.pure_low_precision;
  return config.mixed_precision == MixedPrecision::kNo && config.compute_dtype() == DType::kFp32 &&
         (load_dtype == "bf16" || load_dtype == "fp16");
}

}  // namespace

engine::EnginePlan plan(const TrainingConfig& config, const engine::PlanContext& context) {
  const FsdpConfig& c = config.fsdp;
  const bool pure = pure_low_precision(config, context.load_dtype);
  // Standard mode computes in the mixed-precision dtype; pure mode in the load dtype.
  const DType shard = c.param_dtype.value_or(pure ? (context.load_dtype == "fp16" ? DType::kFp16 : DType::kBf16)
                                                  : config.compute_dtype());
  engine::EnginePlan o;
  o.layout = engine::UnitLayout::Kind::kFlat;
  o.param_dtype = engine::scalar_type(shard);
  o.compute_dtype = engine::compute_dtype(shard, context);
  o.reduce_dtype = engine::scalar_type(c.reduce_dtype.value_or(shard));
  // LoRA adapters must not train in bf16 (a LoRA learning rate's updates are
  // mostly below half an ulp): under pure mode they keep fp32 masters and fp32
  // optimizer state, as PEFT's autocast_adapter_dtype keeps them fp32 on a
  // bf16 base, and only the frozen base is held in the low dtype alone.
  const bool pure_adapters = pure && context.trains_lora_adapters;
  o.pure_low_precision = pure && !pure_adapters;
  // FSDP keeps a frozen flat parameter in the dtype it arrives in (Accelerate
  // upcasts only the ones that train): an fp32 copy only of fp32-loaded frozen
  // weights, and none in pure mode, where the loaded 16-bit values are all.
  o.frozen_fp32_copy = !pure && context.frozen_weights_in_fp32;
  // Pure mode's gradients are low precision already; with an fp32 param_dtype there is nothing to keep low.
  o.keep_low_precision_grads = c.keep_low_precision_grads && !o.pure_low_precision && o.param_dtype != at::kFloat;
  if (c.buffer_dtype) o.buffer_dtype = engine::scalar_type(*c.buffer_dtype);
  o.rank0_loads_weights = c.cpu_ram_efficient_loading;
  o.loss_scale = config.fp16;
  o.fp16 = shard == DType::kFp16;
  o.optimizer = engine::optimizer_spec(config);
  // cpu_ram_efficient_loading needs rank 0's values (Accelerate forces sync_module_states with it);
  // parameters a rank built without storage come from rank 0 either way.
  o.sync_module_states = c.sync_module_states || c.cpu_ram_efficient_loading;
  o.offload_optimizer = c.offload_params;  // FSDP's CPUOffload steps the optimizer on the host
  o.activation_checkpointing = c.activation_checkpointing;
  // FSDP sums and divides around the reduction by these factors of the whole world.
  o.average = false;
  std::tie(o.predivide, o.postdivide) = gradient_divide_factors(context.world_size);
  o.overlap_comm = true;
  // One bucket per unit: FSDP reduce-scatters each FlatParameter on its own.
  o.reduce_bucket_size = 1;
  // FSDP frees a FULL_SHARD unit after forward whenever its backward comes.
  o.max_reuse_distance = 0;
  // FSDP gathers one unit ahead.
  o.max_prefetch_units = 1;
  o.limit_all_gathers = c.limit_all_gathers;
  o.prefetch_bucket_size = c.forward_prefetch ? (int64_t{1} << 62) : 0;
  o.backward_prefetch = c.backward_prefetch == BackwardPrefetch::kBackwardPre    ? engine::BackwardPrefetchMode::kPre
                        : c.backward_prefetch == BackwardPrefetch::kBackwardPost ? engine::BackwardPrefetchMode::kPost
                                                                                 : engine::BackwardPrefetchMode::kNone;
  o.prefetch_first_backward_unit = c.backward_prefetch == BackwardPrefetch::kBackwardPre;
  switch (c.auto_wrap_policy) {
    case AutoWrapPolicy::kTransformerBased:
      o.unit_classes = c.transformer_layer_cls_to_wrap;
      o.unnamed_takes_blocks_only = true;
      break;
    case AutoWrapPolicy::kSizeBased:
      o.min_unit_params = c.min_num_params;
      break;
    case AutoWrapPolicy::kNoWrap:
      o.wrap_units = false;
      break;
  }

  const int W = context.world_size;
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
      const int local = context.local_world_size > 0 ? context.local_world_size : W;
      ST_CHECK_T(ConfigError, local >= 1 && W % local == 0, to_string(c.sharding_strategy),
                 ": the world size ", W, " is not a multiple of the processes per machine (LOCAL_WORLD_SIZE=", local,
                 "); every machine must run the same number of processes");
      o.hybrid_shard_size = local;
      o.reshard = c.sharding_strategy == ShardingStrategy::kHybridShard ? engine::Reshard::kAfterForward
                                                                         : engine::Reshard::kAfterBackward;
      break;
    }
  }
  // The parameter shards go to the host with it, as FSDP's CPUOffload(offload_params=True) keeps them;
  // NO_SHARD keeps the whole model gathered on the device, so there only the optimizer moves.
  o.offload_params = c.offload_params && o.shard_params;
  if (c.offload_params && !o.shard_params) {
    o.notices.push_back("fsdp: fsdp_offload_params with NO_SHARD offloads the optimizer step only: every rank "
                        "keeps the whole model gathered on its device");
  }
  o.name = std::string("fsdp ") + to_string(c.sharding_strategy) +
           (pure_adapters ? " pure low precision, fp32 adapters" : pure ? " pure low precision" : " standard");
  if (c.keep_low_precision_grads && !o.keep_low_precision_grads) {
    o.notices.push_back(std::string("fsdp: fsdp_keep_low_precision_grads has no effect here: ") +
                        (o.pure_low_precision ? "pure low precision keeps every gradient in the low dtype already"
                              : "param_dtype is fp32, so gradients are fp32 anyway"));
  }
  if (pure_adapters) {
    o.notices.push_back("fsdp pure low precision with LoRA: the frozen base is held in " +
                        std::string(c10::toString(o.param_dtype)) +
                        " only (no fp32 copy); the trained parameters (the adapters, and any modules_to_save or "
                        "trained biases) keep fp32 masters and fp32 optimizer state and compute in " +
                        std::string(c10::toString(o.param_dtype)) + ".");
  } else if (pure) {
    o.notices.push_back("fsdp pure low precision: parameters, gradients and optimizer state are " +
                        std::string(c10::toString(o.param_dtype)) +
                        "; an update smaller than half an ulp of its weight is lost (the seeds' stalled Mistral "
                        "run). Use mixed_precision: bf16 for an fp32 master.");
  }
  return o;
}

namespace {

/// The communicators of `plan` over `world`: HYBRID_SHARD shards within each
/// machine and all-reduces across the machines' same local ranks; initial
/// values are always synchronised over the whole world.
engine::EngineGroups make_groups(const comm::CommunicatorPtr& world, const engine::EnginePlan& plan) {
  engine::EngineGroups groups{world, nullptr, world};
  const int local = plan.hybrid_shard_size;
  if (local == 0) return groups;
  const int W = world->world_size();
  ST_CHECK_T(ConfigError, W % local == 0, plan.name, ": the world size ", W,
             " is not a multiple of the processes per machine (", local, ")");
  std::vector<std::vector<int>> machines, replicas;
  for (int m = 0; m < W / local; ++m) {
    machines.emplace_back();
    for (int l = 0; l < local; ++l) machines.back().push_back(m * local + l);
  }
  for (int l = 0; l < local; ++l) {
    replicas.emplace_back();
    for (int m = 0; m < W / local; ++m) replicas.back().push_back(m * local + l);
  }
  groups.shard = world->split(machines);
  groups.replicate = world->split(replicas);
  return groups;
}

class FsdpBackend final : public engine::ShardingBackend {
 public:
  engine::EnginePlan plan(const TrainingConfig& config, const engine::PlanContext& context) const override {
    return fsdp::plan(config, context);
  }
  engine::EngineGroups groups(const comm::CommunicatorPtr& world, const engine::EnginePlan& plan) const override {
    return make_groups(world, plan);
  }
};

}  // namespace

const engine::ShardingBackend& backend() {
  static const FsdpBackend instance;
  return instance;
}

}  // namespace shardtrain::fsdp
