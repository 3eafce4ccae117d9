// QLoRA's quantized base (shardtrain/quantization.h): which layers are
// quantized, and the summary. The format is the kernel layer's
// (kernels::nf4_quantize), the layer's forward nn::LinearImpl's.

#include "shardtrain/quantization.h"

#include <iomanip>
#include <sstream>

#include "shardtrain/error.h"
#include "shardtrain/kernels.h"
#include "shardtrain/nn/linear.h"

namespace shardtrain {
namespace {

bool path_matches(const std::string& path, const std::string& name) {
  return path == name || (path.size() > name.size() && path.compare(path.size() - name.size(), name.size(), name) == 0 &&
                          path[path.size() - name.size() - 1] == '.');
}

std::string with_thousands(int64_t n) {
  std::string digits = std::to_string(n), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

}  // namespace

std::string QuantizationSummary::describe() const {
  std::ostringstream out;
  out << "NF4 (blocksize 64, double quant) on " << quantized_modules.size() << " layers: "
      << with_thousands(quantized_parameters) << " weights, " << std::fixed << std::setprecision(2)
      << static_cast<double>(bytes_before) / (1 << 20) << " MiB -> " << static_cast<double>(bytes_after) / (1 << 20)
      << " MiB";
  return out.str();
}

QuantizationSummary quantize_frozen_base(torch::nn::Module& model, const QuantizationConfig& config) {
  ST_CHECK_T(ConfigError, config.compute_dtype == at::kBFloat16 || config.compute_dtype == at::kHalf ||
                              config.compute_dtype == at::kFloat,
             "quantize_frozen_base: compute_dtype must be bf16, fp16 or fp32, got ", config.compute_dtype);
  QuantizationSummary summary;
  std::vector<std::pair<std::string, nn::LinearImpl*>> chosen;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    auto* linear = dynamic_cast<nn::LinearImpl*>(item.value().get());
    if (linear == nullptr || linear->weight_quantized() || linear->weight.requires_grad()) continue;
    bool skipped = false;
    for (const auto& name : config.skip_modules) skipped = skipped || path_matches(item.key(), name);
    if (!skipped) chosen.emplace_back(item.key(), linear);
  }
  ST_CHECK_T(ConfigError, !chosen.empty(), "quantize_frozen_base: no frozen shardtrain::nn::Linear layer to quantize "
             "(apply_lora first, which freezes the base; the skip list is ",
             config.skip_modules.empty() ? std::string("empty") : config.skip_modules.front() + ", ...", ")");
  // Every layer is checked before any changes, so a refusal leaves the model as it was.
  for (const auto& [path, linear] : chosen) {
    const at::Tensor& w = linear->weight;
    ST_CHECK_T(ConfigError, w.numel() % 64 == 0, "quantize_frozen_base: ", path, ".weight has ", w.numel(),
               " elements, not a multiple of the NF4 block of 64; add it to skip_modules");
    ST_CHECK_T(ConfigError, w.has_storage() && w.data_ptr() != nullptr, "quantize_frozen_base: ", path,
               ".weight has no values (a model built without its weights); load the weights before quantizing");
  }
  for (const auto& [path, linear] : chosen) {
    summary.bytes_before += linear->weight.numel() * static_cast<int64_t>(linear->weight.element_size());
    summary.quantized_parameters += linear->weight.numel();
    linear->quantize_weight_nf4(config.compute_dtype);
    summary.bytes_after += linear->weight.numel();
    summary.quantized_modules.push_back(path);
  }
  return summary;
}

}  // namespace shardtrain
