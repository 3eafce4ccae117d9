// What the engine plan takes from the config outside any backend's section:
// the optimizer, the dtype mapping and where the offloads have work (see
// engine_plan.h).

#include "engine/engine_plan.h"

#include <array>
#include <cstdlib>
#include <string>

namespace shardtrain::engine {

at::ScalarType scalar_type(DType dtype) {
  switch (dtype) {
    case DType::kFp32: return at::kFloat;
    case DType::kBf16: return at::kBFloat16;
    case DType::kFp16: return at::kHalf;
  }
  return at::kFloat;
}

DType dtype_of(at::ScalarType type) {
  return type == at::kBFloat16 ? DType::kBf16 : type == at::kHalf ? DType::kFp16 : DType::kFp32;
}

at::ScalarType compute_dtype(DType low, const PlanContext& context) {
  return low == DType::kFp16 && !context.on_cuda ? at::kFloat : scalar_type(low);
}

bool offload_moves_states(bool on_cuda) {
  static const bool forced_on_cpu = [] {
    const char* value = std::getenv("SHARDTRAIN_OFFLOAD_ON_CPU");
    return value != nullptr && std::string(value) == "1";
  }();
  return on_cuda || forced_on_cpu;
}

OptimizerSpec optimizer_spec(const TrainingConfig& config) {
  const OptimizerConfig& oc = config.optimizer;
  OptimizerSpec spec;
  spec.type = oc.type;
  const auto betas = oc.betas.value_or(std::array<double, 2>{0.9, 0.999});
  spec.beta1 = betas[0];
  spec.beta2 = betas[1];
  spec.eps = oc.eps.value_or(1e-8);
  // resolve_auto gave every run's config its default (config_resolve.cpp).
  spec.weight_decay = oc.weight_decay.value_or(0.0);
  spec.momentum = oc.momentum;
  spec.nesterov = oc.nesterov;
  spec.audit_sample_period = config.precision_audit.sample_period();
  if (spec.type == "Adam" && oc.adam_w_mode.value_or(false)) spec.type = "AdamW";
  return spec;
}

}  // namespace shardtrain::engine
