// The ZeRO backend's decisions: what each stage shards, when it frees, how it
// reduces (see zero_engine.h), from the config's zero_optimization section.

#include "backends/zero/zero_engine.h"

#include <string>
#include <utility>

namespace shardtrain::zero {

engine::EnginePlan plan(const TrainingConfig& config, const engine::PlanContext& context) {
  // The stage was validated with the config (config_resolve.cpp), once.
  const int stage = config.distributed_type == DistributedType::kDeepSpeed ? config.zero.stage : 0;
  const ZeroConfig& z = config.zero;
  const DType low = config.compute_dtype();
  engine::EnginePlan o;
  o.name = stage == 0 ? "ddp (zero-0)" : "zero-" + std::to_string(stage);
  o.layout = engine::UnitLayout::Kind::kPerParam;
  o.shard_params = stage != 0;
  o.reshard = stage == 3 ? engine::Reshard::kAfterForward : engine::Reshard::kNever;
  o.reduce_at_boundary_only = stage == 1;
  o.accumulates_between_boundaries = config.gradient_accumulation_steps.value_or(1) > 1;
  o.compute_dtype = engine::compute_dtype(low, context);
  o.param_dtype = engine::scalar_type(low);
  o.reduce_dtype = engine::scalar_type(config.communication_data_type.value_or(low));
  o.average = true;  // DeepSpeed averages: sum in fp32, one division, one rounding
  o.overlap_comm = z.overlap_comm.value_or(ZeroConfig::default_overlap_comm(stage));
  o.reduce_bucket_size = z.reduce_bucket_size.value_or(ZeroConfig::kDefaultReduceBucketSize);
  o.sub_group_size = z.sub_group_size;
  o.prefetch_bucket_size = z.stage3_prefetch_bucket_size.value_or(ZeroConfig::kDefaultPrefetchBucketSize);
  o.backward_prefetch = engine::BackwardPrefetchMode::kPre;
  o.param_persistence_threshold =
      stage == 3 ? z.stage3_param_persistence_threshold.value_or(ZeroConfig::kDefaultParamPersistenceThreshold) : 0;
  o.max_live_parameters = z.stage3_max_live_parameters;
  o.max_reuse_distance = stage == 3 ? z.stage3_max_reuse_distance : 0;
  // Parameters are partitioned at stage 3 only; below it DeepSpeed ignores
  // offload_param, and a config file says so when it is read (config_load).
  o.offload_params = stage == 3 && z.offload_param != OffloadDevice::kNone;
  o.offload_optimizer = z.offload_optimizer != OffloadDevice::kNone || o.offload_params;
  o.offload_pin_memory = z.offload_pin_memory;
  if (o.offload_params && z.offload_optimizer == OffloadDevice::kNone) {
    o.notices.push_back("zero_optimization.offload_param without offload_optimizer: the optimizer is offloaded to "
                        "CPU memory too, since its step writes the offloaded parameter partition where it lives");
  }
  for (const auto& [device, name] : {std::pair{z.offload_optimizer, "offload_optimizer"},
                                     std::pair{o.offload_params ? z.offload_param : OffloadDevice::kNone,
                                               "offload_param"}}) {
    if (device == OffloadDevice::kNvme) {
      o.notices.push_back(std::string("zero_optimization.") + name +
                          ".device nvme is not implemented; offloading to CPU memory instead");
    }
  }
  // DeepSpeed casts the whole module to the 16-bit dtype and gives only the
  // trained partitions fp32 masters: a frozen base (LoRA) is held in bf16 or
  // fp16 alone, 2 B/param instead of 6 with an fp32 copy. Accelerate's DDP
  // and single-process runs (NO, MULTI_CPU, MULTI_GPU: stage 0 here) leave
  // the module as it was loaded: an fp32 copy of an fp32-loaded frozen base.
  o.frozen_fp32_copy = config.distributed_type != DistributedType::kDeepSpeed && context.frozen_weights_in_fp32;
  o.activation_checkpointing = config.gradient_checkpointing;
  o.sync_module_states = true;
  o.loss_scale = config.fp16;
  o.fp16 = low == DType::kFp16;
  o.optimizer = engine::optimizer_spec(config);
  o.rank0_loads_weights = config.zero3_init_flag && stage == 3;
  return o;
}

namespace {

class ZeroBackend final : public engine::ShardingBackend {
 public:
  engine::EnginePlan plan(const TrainingConfig& config, const engine::PlanContext& context) const override {
    return zero::plan(config, context);
  }
  /// Every rank is one shard of the whole world; initial values are broadcast over it.
  engine::EngineGroups groups(const comm::CommunicatorPtr& world, const engine::EnginePlan&) const override {
    return engine::EngineGroups{world, nullptr, nullptr};
  }
};

}  // namespace

const engine::ShardingBackend& backend() {
  static const ZeroBackend instance;
  return instance;
}

}  // namespace shardtrain::zero
