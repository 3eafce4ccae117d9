#pragma once
// DeepSpeed-style ZeRO engine, stages 0-3, as a configuration of the shared
// sharded engine.
//
// Every trainable parameter is partitioned separately (rank r owns
// [r*c, (r+1)*c) of it, c = ceil(n/W); DeepSpeed's partition_parameters), and
// every rank keeps an FP32 master partition of what it owns whatever the load
// dtype (DeepSpeed's _create_fp32_partitions), its optimizer state, an FP32
// gradient partition, and a low-precision copy of the master (the all-gather
// input).
//  * stage 0: plain data parallel (everything replicated, gradients all-reduced).
//  * stage 1: parameters stay gathered; full-size fp32 gradients accumulate
//    locally and are reduce-scattered at the accumulation boundary.
//  * stage 2: parameters stay gathered; each unit's gradients are
//    reduce-scattered (in buckets of reduce_bucket_size) as soon as its backward is done.
//  * stage 3: as stage 2, and a unit's parameters are gathered just before its
//    forward/backward and freed after, prefetching the next units in the order
//    recorded on the first step; units below the persistence threshold stay gathered.

#include "engine/sharded_engine.h"

namespace shardtrain::zero {

struct ZeroOptions {
  int stage = 3;
  /// dtype the module computes in: bf16, fp16 on CUDA, fp32 (also for fp16 on
  /// CPU, which has no fp16 matmul).
  at::ScalarType compute_dtype = at::kFloat;
  /// dtype of the low-precision partition and of the all-gather.
  at::ScalarType param_dtype = at::kFloat;
  /// dtype of the gradient reduction (communication_data_type).
  at::ScalarType reduce_dtype = at::kFloat;
  bool overlap_comm = true;
  // Defaults: DeepSpeed's, from ZeroConfig (shardtrain/config.h).
  int64_t reduce_bucket_size = ZeroConfig::kDefaultReduceBucketSize;
  int64_t sub_group_size = ZeroConfig::kDefaultSubGroupSize;
  int64_t prefetch_bucket_size = ZeroConfig::kDefaultPrefetchBucketSize;  ///< elements gathered ahead (stage 3)
  /// Units smaller than this stay gathered (stage 3).
  int64_t param_persistence_threshold = ZeroConfig::kDefaultParamPersistenceThreshold;
  int64_t max_live_parameters = ZeroConfig::kDefaultMaxLiveParameters;
  /// Stage 3: keep units reused within this many elements.
  int64_t max_reuse_distance = ZeroConfig::kDefaultMaxReuseDistance;
  /// Stages 1/2: elements per post-step all-gather.
  int64_t allgather_bucket_size = ZeroConfig::kDefaultAllgatherBucketSize;
  bool offload_optimizer = false;
  bool activation_checkpointing = false;  ///< recompute each unit in backward (gradient_checkpointing)
  LossScaleConfig loss_scale;
  bool fp16 = false;
  engine::OptimizerSpec optimizer;
  /// Fills the shards of parameters built without storage (zero3_init_flag; else rank 0 sends them).
  WeightSource weight_source;
  /// zero3_init_flag at stage 3: ranks other than 0 are expected to build the model without its weights.
  bool zero3_init = false;
};

class ZeroEngine final : public engine::ShardedEngine {
 public:
  ZeroEngine(std::shared_ptr<torch::nn::Module> model, comm::CommunicatorPtr comm, const ZeroOptions& options);
};

}  // namespace shardtrain::zero
