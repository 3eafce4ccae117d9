#pragma once
/// @file weight_loading.h
/// Building a model without holding its full weights, and filling the
/// engine's shards from rank 0 or from a weight source.
///
/// What Accelerate calls `fsdp_cpu_ram_efficient_loading` (DeepSpeed:
/// `zero3_init_flag`): only rank 0 materialises the full weights; every other
/// rank allocates only its shard. Python does it with meta-device parameters
/// that FSDP later materialises; LibTorch cannot `set_data` a meta tensor to a
/// CPU one ("incompatible tensor type", 2.11 too), so models cooperate instead:
///
///  1. The program asks `accelerator.materialize_full_weights()`. Where it is
///     false, it builds the model module by module and calls
///     release_parameter_storage() on each module right after constructing it
///     (the parameters keep their shape, dtype and identity; their storage
///     becomes 0 bytes), so the process never holds more than one module's
///     weights. Where it is true it builds and loads the model as usual.
///  2. prepare() finds the storage-less parameters and allocates only this
///     rank's shard of them, filling it from the weight source (RunInfo::
///     weight_source) when one is given, else from rank 0, one unit at a time
///     and one rank's chunk at a time, so no rank ever holds more than one
///     unit of unsharded values (and the receiving ranks one shard chunk).
///
/// With a weight source (e.g. models::hf_weight_source) every rank may build
/// the model without weights: each rank then reads only its own slices and no
/// rank ever holds the whole model.

#include <cstdint>
#include <functional>
#include <string>

#include <ATen/core/Tensor.h>

namespace torch::nn {
class Module;
}

namespace shardtrain {

/// Frees the storage of `tensor` in place: shape, dtype, device, requires_grad
/// and the tensor's identity (every module member and registry entry pointing
/// at it) stay; its data is gone (0 bytes). Returns the bytes released.
/// Throws when the tensor views a larger storage (it already belongs to a
/// prepared model or shares memory with another tensor): freeing that storage
/// would destroy the other tensor's values.
int64_t release_storage(const at::Tensor& tensor);

/// release_storage() for every parameter of `module` and its submodules
/// (buffers keep their values: they are small and often computed, not
/// loaded). Returns the bytes released. Call it on a freshly built module.
int64_t release_parameter_storage(torch::nn::Module& module);

/// True when `tensor` has elements but no storage behind them.
bool is_storage_released(const at::Tensor& tensor);

/// Bytes of storage behind the parameters of `module` (each storage once).
int64_t parameter_storage_bytes(torch::nn::Module& module);

/// Where the engine reads the values of storage-less parameters: fills `out`
/// (1-D, `length` elements, the engine's shard dtype: convert into it) with
/// elements [begin, begin + length) of the flattened parameter `name` (its
/// fully-qualified name, as module->named_parameters() spells it). Throws
/// shardtrain::Error when it cannot; prepare() then fails on every rank.
using WeightSource =
    std::function<void(const std::string& name, int64_t begin, int64_t length, at::Tensor out)>;

/// Asks `source` for elements [begin, begin + length) of `name` into `out`
/// and checks that it wrote every one: `out` is filled with NaN first, so a
/// source that returns without writing (or rebinds `out`) throws
/// shardtrain::Error naming the parameter and the range.
void read_weights(const WeightSource& source, const std::string& name, int64_t begin, int64_t length,
                  const at::Tensor& out);

}  // namespace shardtrain
