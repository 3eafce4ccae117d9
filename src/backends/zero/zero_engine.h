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

#include "engine/sharding_backend.h"

namespace shardtrain::zero {

/// The ZeRO plan of a resolved `config`: its zero_optimization section at
/// the configured stage under DEEPSPEED, stage 0 (data parallel) under every
/// other distributed type but FSDP. Defaults are DeepSpeed's (ZeroConfig).
engine::EnginePlan plan(const TrainingConfig& config, const engine::PlanContext& context);

/// The ZeRO backend: zero::plan, over the whole world as one shard group.
const engine::ShardingBackend& backend();

}  // namespace shardtrain::zero
