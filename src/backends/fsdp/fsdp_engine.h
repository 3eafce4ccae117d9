#pragma once
// PyTorch-FSDP-style engine, as a configuration of the shared sharded engine.
//
// Each unit's parameters are flattened into one FlatParameter (trainable and
// frozen parameters separately, so LoRA-style units work — FSDP1 refuses them
// with "FlatParameter requires uniform requires_grad"), padded to a multiple
// of the shard-group size; rank r owns chunk r, and the module's parameters
// are views into the gathered flat buffer.
//
// Sharding strategies: FULL_SHARD (free after forward, regather for
// backward), SHARD_GRAD_OP (keep gathered until the unit's gradients are
// reduced), NO_SHARD (DDP), HYBRID_SHARD / HYBRID_SHARD_ZERO2 (shard inside a
// machine, all-reduce gradients across machines).
//
// Precision, as Accelerate >= 0.30 defines it:
//  * standard: the sharded flat parameter is FP32 (upcast), the optimizer
//    runs in FP32, compute uses param_dtype — numerically the zero engine's.
//  * pure low precision: flat parameter, gradients and optimizer state in the
//    low dtype; half the optimizer memory; updates below half an ulp are lost.
// keep_low_precision_grads keeps the sharded gradient in param_dtype (the
// optimizer widens it as it reads it); buffer_dtype casts floating-point
// buffers for compute (state dicts return them in their original dtype).
//
// cpu_ram_efficient_loading: only rank 0 materialises the weights; the other
// ranks build the model without parameter storage (see
// shardtrain/weight_loading.h) and receive only their shard from rank 0.

#include "engine/sharding_backend.h"

namespace shardtrain::fsdp {

/// The FSDP plan of a resolved `config` (its fsdp_config section and the
/// mixed-precision keys, as Accelerate resolves them). A HYBRID_SHARD world
/// that is not a whole number of machines is a ConfigError here, before any
/// communicator exists.
engine::EnginePlan plan(const TrainingConfig& config, const engine::PlanContext& context);

/// FSDP's gradient pre/post-divide factors for a world size: the largest power
/// of two f with f*f <= W dividing W (so both divisions stay well scaled), and W/f.
std::pair<double, double> gradient_divide_factors(int world_size);

/// The FSDP backend: fsdp::plan, over the whole world, or for HYBRID_SHARD a
/// shard group per machine and a replica group per local rank.
const engine::ShardingBackend& backend();

}  // namespace shardtrain::fsdp
