#include "shardtrain/precision_plan.h"

#include <iomanip>
#include <sstream>

namespace shardtrain {
namespace {

double size_of(DType d) { return d == DType::kFp32 ? 4.0 : 2.0; }
const char* name_of(DType d) { return d == DType::kFp32 ? "fp32" : d == DType::kBf16 ? "bf16" : "fp16"; }

std::string human(double bytes) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(2);
  if (bytes >= 1e9) out << bytes / 1e9 << " GB";
  else if (bytes >= 1e6) out << bytes / 1e6 << " MB";
  else if (bytes >= 1e3) out << bytes / 1e3 << " kB";
  else out << bytes << " B";
  return out.str();
}

}  // namespace

double PrecisionPlan::optimizer_bytes_per_param_total() const {
  return (master_bytes + optimizer_bytes + (master_is_params ? params_bytes : 0.0)) * world_size;
}

PrecisionPlan plan_precision(const TrainingConfig& config, int64_t num_params, int world_size, bool on_cuda,
                             const std::string& load_dtype) {
  PrecisionPlan plan;
  plan.num_params = num_params;
  plan.world_size = world_size;
  plan.load_dtype = load_dtype;
  const double W = world_size;
  const DType low = config.compute_dtype();
  const bool fp16_on_cpu = low == DType::kFp16 && !on_cuda;
  plan.compute_dtype = fp16_on_cpu ? "fp32 (on fp16-rounded values: no fp16 matmul on CPU)" : name_of(low);
  plan.shard_dtype = name_of(low);
  plan.reduce_dtype = name_of(config.communication_data_type.value_or(low));
  const std::string& opt = config.optimizer.type;
  const double state_per_param = opt == "SGD" ? (config.optimizer.momentum != 0.0 ? 4.0 : 0.0) : 8.0;

  const int stage = config.distributed_type == DistributedType::kDeepSpeed ? config.zero.stage : 0;
  plan.engine = config.distributed_type == DistributedType::kDeepSpeed ? "zero-" + std::to_string(stage)
                                                                        : "ddp (zero-0)";
  plan.master_dtype = "fp32";
  plan.optimizer_dtype = "fp32";
  const double shard = size_of(low);
  // Every rank keeps an fp32 master partition; in fp32 runs the partition is the master itself.
  plan.params_bytes = shard / (stage == 0 ? 1.0 : W);
  plan.master_bytes = low == DType::kFp32 ? 0.0 : 4.0 / (stage == 0 ? 1.0 : W);
  plan.master_is_params = low == DType::kFp32;
  plan.optimizer_bytes = state_per_param / (stage == 0 ? 1.0 : W);
  plan.grads_bytes = 4.0 / (stage == 0 ? 1.0 : W);
  if (stage == 1) plan.grads_bytes += 4.0;  // full fp32 accumulation until the boundary
  const double compute_size = fp16_on_cpu ? 4.0 : size_of(low);
  plan.gathered_at_rest_bytes = (stage == 3) ? 0.0 : compute_size;
  if (fp16_on_cpu) plan.notes += "fp16 on CPU: parameters, gradients and communication are fp16, compute is fp32. ";
  if (low == DType::kFp16) plan.notes += "Dynamic loss scaling (fp16). ";
  return plan;
}

std::string PrecisionPlan::to_string() const {
  std::ostringstream out;
  out << "precision plan (" << engine << ", " << num_params << " parameters, " << world_size << " ranks)\n";
  out << "  load " << load_dtype << " | shard at rest " << shard_dtype << " | compute " << compute_dtype
      << " | grad reduce " << reduce_dtype << " | master " << master_dtype << " | optimizer state "
      << optimizer_dtype << "\n";
  out << std::fixed << std::setprecision(3);
  auto row = [&](const char* kind, double per_param) {
    out << "  " << std::left << std::setw(22) << kind << std::right << std::setw(8) << per_param
        << " B/param/rank  = " << human(per_param * num_params) << " per rank\n";
  };
  row("params (shard)", params_bytes);
  row("grads", grads_bytes);
  if (master_is_params) {
    out << "  fp32 master            (the fp32 shard above is the master)\n";
  } else {
    row("fp32 master", master_bytes);
  }
  row("optimizer state", optimizer_bytes);
  row("gathered at rest", gathered_at_rest_bytes);
  row("total model states", params_bytes + grads_bytes + master_bytes + optimizer_bytes + gathered_at_rest_bytes);
  out << "  optimizer bytes per parameter over the job (master + state): " << optimizer_bytes_per_param_total()
      << "\n";
  if (!notes.empty()) out << "  note: " << notes << "\n";
  return out.str();
}

}  // namespace shardtrain
