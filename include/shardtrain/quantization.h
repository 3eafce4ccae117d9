#pragma once
/// @file quantization.h
/// QLoRA: the frozen base of a LoRA model held in 4-bit NF4.
///
/// quantize_frozen_base() replaces every frozen shardtrain::nn::Linear weight
/// (the skip list aside, by default the output layer) with its NF4 bytes:
/// QLoRA's 4-bit NormalFloat in blocks of 64 with double-quantized absmax
/// values, bit for bit what bitsandbytes' quantize_4bit gives on the CPU
/// (bnb_4bit_quant_type "nf4", bnb_4bit_use_double_quant true), 0.516 bytes
/// per weight instead of 2 in bf16. The layers decode it for each product
/// and compute in `compute_dtype`. Under ZeRO-3 and FSDP the bytes are what
/// is sharded and all-gathered: the base's communication is about a quarter
/// of a bf16 base's (Accelerator::traffic() measures it).
///
///     shardtrain::apply_lora(*model, lora);           // freezes the base
///     shardtrain::quantize_frozen_base(*model);       // NF4, compute in bf16
///     accelerator.prepare(model, ...);
///
/// Call it after apply_lora (or load_lora_adapter) and before prepare(), on
/// every rank, after moving the model to its device and dtype: LibTorch's
/// Module::to(dtype) converts every parameter, the NF4 bytes too (a layer
/// then refuses to run). Under rank-0-only loading (fsdp_cpu_ram_efficient_
/// loading, zero3_init_flag) the ranks where materialize_full_weights() is
/// false quantize the model they built without weights: its weights get
/// their NF4 shapes without values, and prepare() fills each rank's shard of
/// the bytes from rank 0's (a weight source cannot: it reads original
/// values). A quantized base is not written to checkpoints (it is made again
/// from the base weights, the same bits) and cannot be exported as a full
/// model: save the adapter (Accelerator::save_lora_adapter) and merge it
/// onto the original base.

#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include "shardtrain/weight_loading.h"

namespace shardtrain {

/// The fields of transformers' BitsAndBytesConfig that shardtrain implements;
/// the format itself is fixed (4-bit NF4, blocksize 64, double quantization).
struct QuantizationConfig {
  /// bnb_4bit_compute_dtype: what the layers multiply in (bf16, fp16 or fp32).
  c10::ScalarType compute_dtype = c10::ScalarType::BFloat16;
  /// llm_int8_skip_modules: Linear layers kept as they are (a module matches
  /// when its path equals a name or ends with "." + name).
  std::vector<std::string> skip_modules = {"lm_head"};
};

/// What quantize_frozen_base did.
struct QuantizationSummary {
  std::vector<std::string> quantized_modules;
  int64_t quantized_parameters = 0;  ///< weights now held in NF4
  int64_t bytes_before = 0;          ///< their bytes before
  int64_t bytes_after = 0;           ///< their NF4 bytes
  /// "NF4 (blocksize 64, double quant) on 8 layers: 1,048,576 weights, 2.00 MiB -> 0.52 MiB".
  std::string describe() const;
};

/// Quantizes the frozen Linear weights of `model` (see the file comment).
/// Throws ConfigError when no layer is left to quantize, when a weight size
/// is not whole NF4 blocks, or for a compute dtype it does not take.
/// Trainable layers (adapters, modules_to_save) are left alone.
QuantizationSummary quantize_frozen_base(torch::nn::Module& model, const QuantizationConfig& config = {});

/// The same for a model built without its weights (models::make_llama_without_
/// weights) on a rank that loads them: every parameter without storage is
/// filled from `values` (e.g. models::hf_weight_source), one at a time, and
/// each weight to quantize is quantized as soon as it has its values, so the
/// process holds the NF4 base, the parameters that stay unquantized and at
/// most one weight in its load dtype, as transformers' load_in_4bit quantizes
/// each weight as it loads it. The bytes are those of loading the whole
/// model, then quantizing. An empty `values` is the overload above.
QuantizationSummary quantize_frozen_base(torch::nn::Module& model, const WeightSource& values,
                                         const QuantizationConfig& config = {});

}  // namespace shardtrain
