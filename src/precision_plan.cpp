// The precision plan: printed from the engine plan of the run (see
// precision_plan_of.h), never derived again from the config.
#include "shardtrain/precision_plan.h"

#include <algorithm>
#include <iomanip>
#include <sstream>
#include <string>

#include "engine_factory.h"
#include "precision_plan_of.h"
#include "shardtrain/nn/linear.h"

namespace shardtrain {
namespace {

double size_of(DType d) { return d == DType::kFp32 ? 4.0 : 2.0; }
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
  return (master_bytes + optimizer_bytes + (master_is_params ? params_bytes : 0.0)) * shard_count;
}

PrecisionPlan plan_precision(const TrainingConfig& config, int64_t num_params, int world_size, bool on_cuda,
                             const std::string& load_dtype, int local_world_size) {
  engine::PlanContext context;
  context.world_size = world_size;
  context.local_world_size = local_world_size;
  context.on_cuda = on_cuda;
  context.load_dtype = load_dtype;
  context.frozen_weights_in_fp32 = load_dtype == "fp32";
  return precision_plan_of(plan_engine(config, context), num_params, context);
}

PrecisionPlan precision_plan_of(const engine::EnginePlan& engine_plan, int64_t num_params,
                                const engine::PlanContext& context) {
  PrecisionPlan plan;
  plan.num_params = num_params;
  plan.world_size = context.world_size;
  plan.load_dtype = context.load_dtype;
  plan.engine = engine_plan.name;
  const bool pure = engine_plan.pure_low_precision;
  const DType low = engine::dtype_of(engine_plan.param_dtype);
  // The plan decided it (engine::compute_dtype): the compute dtype differs from the shard's only for fp16 on a CPU.
  const bool fp16_on_cpu = engine_plan.compute_dtype != engine_plan.param_dtype;
  plan.compute_dtype = fp16_on_cpu ? "fp32 (on fp16-rounded values: no fp16 matmul on CPU)" : to_string(low);
  plan.shard_dtype = to_string(low);
  if (context.on_cuda) {
    plan.gemm = std::string(to_string(low)) + " (cuBLAS, fp32 accumulation)";
  } else if (low == DType::kBf16) {
    plan.gemm = "bf16 " + nn::cpu_low_precision_gemm().describe();
  } else {
    plan.gemm = "fp32 (LibTorch's BLAS)";
  }
  const DType reduce = engine::dtype_of(engine_plan.reduce_dtype);
  plan.reduce_dtype = to_string(reduce);
  const engine::OptimizerSpec& optimizer = engine_plan.optimizer;
  const double states = optimizer.type == "SGD" ? (optimizer.momentum != 0.0 ? 1.0 : 0.0) : 2.0;

  // How many ranks share each parameter's state.
  const double shards = !engine_plan.shard_params          ? 1.0
                        : engine_plan.hybrid_shard_size > 0 ? engine_plan.hybrid_shard_size
                                                            : context.world_size;
  double gathered_at_rest = engine_plan.reshard == engine::Reshard::kNever ? 1.0 : 0.0;
  // ZeRO-1's full-size fp32 accumulator, held only where micro-batches
  // accumulate between boundaries and are not added straight into the gradient.
  const bool boundary_accumulator = engine_plan.reduce_at_boundary_only && engine_plan.accumulates_between_boundaries &&
                                    !engine_plan.adds_grads_directly(context.world_size == 1);
  plan.shard_count = static_cast<int>(shards);
  const double shard = size_of(low);
  const double compute_size = fp16_on_cpu ? 4.0 : size_of(low);
  // fsdp_keep_low_precision_grads: the gradient shard stays in the 16-bit param dtype.
  const bool low_grads = pure || engine_plan.keep_low_precision_grads;
  plan.grad_dtype = low_grads ? to_string(low) : "fp32";
  plan.master_dtype = pure ? "none" : "fp32";
  plan.optimizer_dtype = pure ? to_string(low) : "fp32";
  plan.params_bytes = shard / shards;
  plan.master_is_params = !pure && low == DType::kFp32;
  plan.master_bytes = (pure || low == DType::kFp32) ? 0.0 : 4.0 / shards;
  plan.grads_bytes = (low_grads ? shard : 4.0) / shards + (boundary_accumulator ? 4.0 : 0.0);
  plan.optimizer_bytes = states * (pure ? shard : 4.0) / shards;
  plan.frozen_copy_bytes = (engine_plan.frozen_fp32_copy && low != DType::kFp32) ? 4.0 / shards : 0.0;
  // A shard that is the whole model (one rank, or no sharding) and holds the
  // compute dtype: the parameters view the shard, nothing is kept gathered.
  if ((context.world_size == 1 || shards == 1) && !fp16_on_cpu) gathered_at_rest = 0;
  plan.gathered_at_rest_bytes = gathered_at_rest * compute_size;
  if (engine_plan.offload_optimizer && engine::offload_moves_states(context.on_cuda)) {
    const bool params_moved = engine_plan.offload_params;
    plan.offload = std::string(params_moved ? "parameter shards, " : "") + (pure ? "" : "fp32 master, ") +
                   "gradient partition, optimizer state; the step runs on the CPU";
    // The gradient partition moves; ZeRO-1's full-size accumulator stays on the device.
    const double grad_partition = (low_grads ? shard : 4.0) / shards;
    // The host holds the parameter partition in every case: the one the step
    // writes (a copy, or the partition itself), or in fp32 the master.
    plan.host_bytes = plan.master_bytes + plan.optimizer_bytes + grad_partition + plan.params_bytes;
    plan.moved_bytes =
        plan.master_bytes + plan.optimizer_bytes + grad_partition + (params_moved ? plan.params_bytes : 0.0);
    plan.offloads_params = params_moved;
    plan.host_memory_pinned = engine_plan.offload_pin_memory;
  } else if (engine_plan.offload_optimizer) {
    plan.offload = "asked for, nothing to move: the model is on the CPU";
  }
  if (fp16_on_cpu) plan.notes += "fp16 on CPU: parameters, gradients and communication are fp16, compute is fp32. ";
  if (low == DType::kFp16) plan.notes += "Dynamic loss scaling (fp16). ";
  if (low_grads && !pure) {
    plan.notes += "keep_low_precision_grads: gradients are kept (and accumulated) in " + std::string(to_string(low)) +
                  "; the optimizer widens them as it reads them. ";
  }
  if (pure) {
    plan.notes += "Pure low precision: no fp32 master; an update smaller than half an ulp of its weight is lost "
                  "(a model with LoRA adapters keeps fp32 masters for them: Accelerator::prepare plans it so). ";
  }
  return plan;
}

double PrecisionPlan::frozen_nf4_bytes_per_rank() const {
  // Where parameters stay gathered, the NF4 bytes are not sharded and the
  // parameters view them (no second copy, unlike a float shard kept gathered
  // in another dtype); otherwise each rank holds its shard.
  const bool unsharded = gathered_at_rest_bytes > 0 || shard_count == 1;
  return static_cast<double>(frozen_nf4_bytes) / (unsharded ? 1.0 : static_cast<double>(shard_count));
}

double PrecisionPlan::trained_bytes_per_param() const {
  return params_bytes + grads_bytes + master_bytes + optimizer_bytes + gathered_at_rest_bytes;
}

double PrecisionPlan::total_bytes_per_rank() const {
  // A frozen parameter is its shard at rest (and what is kept gathered) and its fp32 copy, nothing else.
  return trained_bytes_per_param() * static_cast<double>(num_params) +
         (params_bytes + gathered_at_rest_bytes + frozen_copy_bytes) * static_cast<double>(frozen_params) +
         frozen_nf4_bytes_per_rank();
}

double PrecisionPlan::frozen_host_bytes_per_rank() const {
  if (!offloads_params) return 0.0;
  return (params_bytes + frozen_copy_bytes) * static_cast<double>(frozen_params) + frozen_nf4_bytes_per_rank();
}

double PrecisionPlan::device_bytes_per_rank() const {
  // Never below zero: with everything moved, the subtraction of the same
  // fractions summed in another order leaves a rounding residue either side.
  return std::max(0.0, total_bytes_per_rank() - moved_bytes * static_cast<double>(num_params) -
                           frozen_host_bytes_per_rank());
}

double PrecisionPlan::host_bytes_per_rank() const {
  return host_bytes * static_cast<double>(num_params) + frozen_host_bytes_per_rank();
}

std::string PrecisionPlan::to_string() const {
  std::ostringstream out;
  out << "precision plan (" << engine << ", " << num_params << " parameters"
      << (frozen_params > 0 ? " trained, " + std::to_string(frozen_params) + " frozen" : std::string()) << ", "
      << world_size << " ranks)\n";
  out << "  load " << load_dtype << " | shard at rest " << shard_dtype << " | compute " << compute_dtype
      << " | grad reduce " << reduce_dtype << " | grads " << grad_dtype << " | master " << master_dtype << " | optimizer state "
      << optimizer_dtype << "\n";
  if (!gemm.empty()) out << "  GEMM " << gemm << "\n";
  out << std::fixed << std::setprecision(3);
  auto row = [&](const char* kind, double per_param, int64_t params) {
    out << "  " << std::left << std::setw(22) << kind << std::right << std::setw(8) << per_param
        << " B/param/rank  = " << human(per_param * static_cast<double>(params)) << " per rank\n";
  };
  row("params (shard)", params_bytes, num_params);
  row("grads", grads_bytes, num_params);
  if (master_is_params) {
    out << "  fp32 master            (the fp32 shard above is the master)\n";
  } else {
    row("fp32 master", master_bytes, num_params);
  }
  row("optimizer state", optimizer_bytes, num_params);
  row("gathered at rest", gathered_at_rest_bytes, num_params);
  if (frozen_params > 0 || frozen_nf4_bytes > 0) {
    if (frozen_params > 0) row("frozen (shard)", params_bytes + gathered_at_rest_bytes, frozen_params);
    if (frozen_params > 0 && frozen_copy_bytes > 0) row("frozen fp32 copy", frozen_copy_bytes, frozen_params);
    if (frozen_nf4_bytes > 0) {
      out << "  " << std::left << std::setw(22) << "frozen NF4 (shard)" << std::right << std::setw(8) << ""
          << "                = " << human(frozen_nf4_bytes_per_rank()) << " per rank ("
          << human(static_cast<double>(frozen_nf4_bytes)) << " of 4-bit weights and their absmax)\n";
    }
    out << "  " << std::left << std::setw(22) << "total model states" << std::right << std::setw(8) << ""
        << "                = " << human(total_bytes_per_rank()) << " per rank\n";
  } else {
    row("total model states", trained_bytes_per_param(), num_params);
  }
  out << "  optimizer bytes per parameter (master + state, one copy of the model): " << optimizer_bytes_per_param_total()
      << "\n";
  if (!offload.empty()) {
    out << "  offload: " << offload << "\n";
  }
  if (host_bytes > 0) {
    out << "    " << std::left << std::setw(25) << "on the device" << human(device_bytes_per_rank()) << " per rank\n";
    out << "    " << std::setw(25) << (host_memory_pinned ? "in pinned host memory" : "in pageable host memory")
        << human(host_bytes_per_rank())
        << " per rank (a copy of the parameter partition among it, unless the partition itself moved)\n";
  }
  if (!notes.empty()) out << "  note: " << notes << "\n";
  if (frozen_params > 0 && frozen_copy_bytes == 0 && shard_dtype != "fp32") {
    out << "  note: the frozen base is held in " << shard_dtype << " only (no fp32 copy): state dicts, checkpoints "
        << "and exports give its " << shard_dtype << " values\n";
  }
  return out.str();
}

}  // namespace shardtrain
