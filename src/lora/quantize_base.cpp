// QLoRA's quantized base (shardtrain/quantization.h): which layers are
// quantized, filling a model built without weights as they are quantized,
// and the summary. The format is the kernel layer's
// (kernels::nf4_quantize), the layer's forward nn::LinearImpl's.

#include "shardtrain/quantization.h"

#include <iomanip>
#include <sstream>

#include <ATen/ATen.h>

#include "lora/lora_common.h"
#include "shardtrain/error.h"
#include "shardtrain/kernels.h"
#include "shardtrain/nn/linear.h"
#include "shardtrain/weight_loading.h"

namespace shardtrain {

std::string QuantizationSummary::describe() const {
  std::ostringstream out;
  out << "NF4 (blocksize 64, double quant) on " << quantized_modules.size() << " layers: "
      << lora_detail::with_thousands(quantized_parameters) << " weights, " << std::fixed << std::setprecision(2)
      << static_cast<double>(bytes_before) / (1 << 20) << " MiB -> " << static_cast<double>(bytes_after) / (1 << 20)
      << " MiB";
  return out.str();
}

namespace {

/// Gives a parameter built without storage its values from `values`.
void fill_from(const at::Tensor& param, const std::string& name, const WeightSource& values) {
  at::NoGradGuard no_grad;
  at::Tensor filled = at::empty(param.sizes(), param.options());
  read_weights(values, name, 0, param.numel(), filled.view({-1}));
  param.set_data(filled);  // the module's parameter and `param` share the TensorImpl
}

}  // namespace

QuantizationSummary quantize_frozen_base(torch::nn::Module& model, const QuantizationConfig& config) {
  return quantize_frozen_base(model, WeightSource(), config);
}

QuantizationSummary quantize_frozen_base(torch::nn::Module& model, const WeightSource& values,
                                         const QuantizationConfig& config) {
  QuantizationSummary summary;
  std::vector<std::pair<std::string, nn::LinearImpl*>> chosen;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    auto* linear = dynamic_cast<nn::LinearImpl*>(item.value().get());
    if (linear == nullptr || linear->weight_quantized() || linear->weight.requires_grad()) continue;
    bool skipped = false;
    for (const auto& name : config.skip_modules) skipped = skipped || lora_detail::names_module(item.key(), name);
    if (!skipped) chosen.emplace_back(item.key(), linear);
  }
  ST_CHECK_T(ConfigError, !chosen.empty(), "quantize_frozen_base: no frozen shardtrain::nn::Linear layer to quantize "
             "(apply_lora first, which freezes the base; the skip list is ",
             config.skip_modules.empty() ? std::string("empty") : config.skip_modules.front() + ", ...", ")");
  // Every layer is checked before any changes, so a refusal leaves the model as it was.
  for (const auto& [path, linear] : chosen) {
    const std::string refusal = linear->nf4_refusal(config.compute_dtype);
    ST_CHECK_T(ConfigError, refusal.empty(), "quantize_frozen_base: ", path, ": ", refusal);
  }
  for (const auto& [path, linear] : chosen) {
    if (values && is_storage_released(linear->weight)) fill_from(linear->weight, path + ".weight", values);
    summary.bytes_before += linear->weight.numel() * static_cast<int64_t>(linear->weight.element_size());
    summary.quantized_parameters += linear->weight.numel();
    linear->quantize_weight_nf4(config.compute_dtype);
    summary.bytes_after += linear->weight.numel();
    summary.quantized_modules.push_back(path);
  }
  if (values) {
    for (const auto& item : model.named_parameters(/*recurse=*/true)) {
      if (is_storage_released(item.value())) fill_from(item.value(), item.key(), values);
    }
  }
  return summary;
}

}  // namespace shardtrain
