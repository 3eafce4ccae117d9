// Where the shards live: the model's device (checked against the
// communicators'), the flat partitions (master, low-precision copy,
// gradient, optimizer state) and each unit entry's views into them, what the
// optimizer and parameter offloads keep in host memory, and unit buffers
// that own no memory until gathered.

#include "engine/shard_storage.h"

#include <string>

#include <ATen/ATen.h>

#include "shardtrain/error.h"
#include "torch_cuda.h"

namespace shardtrain::engine {
namespace {

/// The model's device, from its parameters; every one must be on it, and so
/// must the communicators' tensors. Checked once here, so a model left on the
/// CPU under NCCL (or moved to a GPU under Gloo) fails with the fix instead of
/// inside the first collective.
at::Device bind_device(const EnginePlan& plan, const UnitTable& units, const ShardGroups& groups) {
  at::Device device = groups.shard().device();
  const std::string* first_name = nullptr;
  for (const auto& u : units.entries()) {
    for (std::size_t k = 0; k < u.params.size(); ++k) {
      const at::Device d = u.params[k].device();
      if (first_name == nullptr) {
        first_name = &u.names[k];
        device = d;
      }
      ST_CHECK(d == device, plan.name, ": parameter '", u.names[k], "' is on ", d, " but '", *first_name,
               "' is on ", device, "; move the whole model to one device (model->to(device)) before prepare()");
    }
  }
  for (comm::Communicator* group : {&groups.shard(), groups.separate_sync()}) {
    if (group == nullptr) continue;
    ST_CHECK_T(ConfigError, group->device() == device, plan.name, ": the model is on ", device,
               " but the ", group->backend(), " communicator moves tensors on ", group->device(),
               "; move the model there before prepare() (model->to(accelerator.device())), or pick the backend "
               "for the model's device (gloo for cpu, nccl for cuda:LOCAL_RANK)");
  }
  return device;
}

}  // namespace

at::Tensor ShardStorage::unallocated_buffer(int64_t numel, const at::TensorOptions& options) {
  const std::size_t bytes = static_cast<std::size_t>(numel) * c10::elementSize(options.dtype().toScalarType());
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, at::DataPtr(nullptr, options.device()),
                       c10::GetAllocator(options.device().type()), /*resizable=*/true);
  return at::empty({0}, options).set_(storage, 0, {numel}, {1});
}

ShardStorage::ShardStorage(const EnginePlan& plan, const UnitTable& units, const ShardGroups& groups)
    : plan_(plan), device_(bind_device(plan, units, groups)) {
  ST_CHECK(!plan.offload_params || (plan.offload_optimizer && plan.shard_params), plan.name,
           ": the parameter offload needs the optimizer offload and sharded parameters (the backend's plan)");
  const bool pure = plan.pure_low_precision;
  // With the model on the CPU every partition already lives on the host, so
  // the offload has nothing to move: a host copy of the low-precision
  // partition would only cost memory and two copies a step.
  offloaded_ = plan.offload_optimizer && offload_moves_states(!device_.is_cpu());
  params_offloaded_ = offloaded_ && plan.offload_params;
  const at::TensorOptions fp32 = fp32_options();
  // Offloaded states are allocated in host memory directly: a model that
  // fits its GPU only because of the offload must never hold them on the
  // device, not even while prepare() builds them. zeros() pins them there
  // (plan.offload_pin_memory) when the model is on a GPU.
  const at::TensorOptions host = fp32.device(at::kCPU);
  host_pinned_ = offloaded_ && device_.is_cuda() && plan.offload_pin_memory;
  // Under offload the step runs on the host, on the master, the moments and
  // a gradient partition there: each reduction's result comes down as it is
  // added in (GradientReducer), as DeepSpeed's offload keeps its fp32
  // gradient partitions in CPU memory.
  const at::TensorOptions stepped_on = offloaded_ ? host : fp32;
  const at::TensorOptions state_options = pure ? stepped_on.dtype(plan.param_dtype) : stepped_on;
  const int64_t total_shard = units.trainable_shard_numel();
  if (!pure) master_ = zeros(total_shard, stepped_on);
  // keep_low_precision_grads: the reduced gradient stays in param_dtype (the
  // optimizer kernels widen it as they read it), as FSDP1 leaves flat_param.grad.
  const bool low_grads = pure || (plan.keep_low_precision_grads && plan.param_dtype != at::kFloat);
  grad_ = zeros(total_shard, low_grads ? stepped_on.dtype(plan.param_dtype) : stepped_on);
  // The partition the model gathers: under the parameter offload in host
  // memory, where the step writes it and each gather uploads it from; else
  // on the device. fp32 parameters are the master itself where both live
  // in one place.
  const at::TensorOptions partition_on = params_offloaded_ ? host : fp32;
  const bool lp_is_master = !pure && plan.param_dtype == at::kFloat && (params_offloaded_ || !offloaded_);
  lp_ = lp_is_master ? master_ : zeros(total_shard, partition_on.dtype(plan.param_dtype));
  // The optimizer offload alone: pure low precision steps this host copy of
  // its partition in place; a 16-bit param_dtype rounds the fp32 master into
  // it; fp32 parameters need none (the host master is uploaded as it is).
  if (offloaded_ && !params_offloaded_ && (pure || plan.param_dtype != at::kFloat)) {
    host_lp_ = zeros(total_shard, host.dtype(plan.param_dtype));
  }
  const std::string& opt = plan.optimizer.type;
  if (!plan.optimizer.custom_factory) {
    if (opt == "AdamW" || opt == "Adam") {
      exp_avg_ = zeros(total_shard, state_options);
      exp_avg_sq_ = zeros(total_shard, state_options);
    } else if (opt == "SGD") {
      if (plan.optimizer.momentum != 0.0) momentum_ = zeros(total_shard, stepped_on);
    } else {
      ST_THROW(ConfigError, "optimizer type '", opt, "' is not one of AdamW, Adam, SGD");
    }
  }

  shards_.resize(static_cast<std::size_t>(units.size()));
  for (int i = 0; i < units.size(); ++i) {
    const UnitEntry& u = units[i];
    UnitShard& shard = shards_[static_cast<std::size_t>(i)];
    const int64_t S = u.layout->shard_numel();
    if (u.trainable) {
      if (!pure) shard.master = master_.narrow(0, u.shard_offset, S);
      shard.grad = grad_.narrow(0, u.shard_offset, S);
      shard.lp = lp_.narrow(0, u.shard_offset, S);
      if (exp_avg_.defined()) {
        shard.exp_avg = exp_avg_.narrow(0, u.shard_offset, S);
        shard.exp_avg_sq = exp_avg_sq_.narrow(0, u.shard_offset, S);
      }
    } else if (u.packed) {
      shard.lp = zeros(S, partition_on.dtype(at::kByte));
    } else {
      shard.lp = zeros(S, partition_on.dtype(plan.param_dtype));
      if (plan.frozen_fp32_copy) shard.master = plan.param_dtype == at::kFloat ? shard.lp : zeros(S, partition_on);
    }
  }
}

at::Tensor ShardStorage::zeros(int64_t numel, const at::TensorOptions& options) const {
  if (!options.device().is_cpu() || !host_pinned_) return at::zeros({numel}, options);
  try {
    return torch_cuda::pinned_host_zeros(numel, options.dtype().toScalarType(), device_.index());
  } catch (const Error& e) {
    ST_THROW(Error, plan_.name, ": offloading a partition of ", numel * static_cast<int64_t>(options.dtype().itemsize()),
             " bytes: ", e.what(), ". Free host memory or raise the locked-memory limit (ulimit -l), or keep the "
             "offloaded states in pageable memory, at the cost of slower copies to and from the GPU: pin_memory: false "
             "under zero_optimization.offload_optimizer in a DeepSpeed config");
  }
}

at::Tensor ShardStorage::low_precision_out() const {
  if (plan_.pure_low_precision || lp_.is_same(master_)) return {};
  if (host_lp_.defined()) return host_lp_;
  return lp_.scalar_type() == at::kFloat ? at::Tensor() : lp_;
}

void ShardStorage::download_for_step() {
  if (plan_.pure_low_precision && host_lp_.defined()) host_lp_.copy_(lp_);
}

void ShardStorage::upload_low_precision() {
  if (lp_.is_same(master_)) return;
  if (host_lp_.defined()) {
    lp_.copy_(host_lp_);  // the rounded copy, or pure low precision's stepped one
  } else if (!plan_.pure_low_precision && lp_.scalar_type() == at::kFloat) {
    lp_.copy_(master_);
  }
}

void ShardStorage::zero_grads() {
  // step() leaves the gradients zeroed; a second pass over them would be the
  // only work of zero_grad.
  if (!grads_zero_) grad_.zero_();
  grads_zero_ = true;
}

void ShardStorage::clear_grads() {
  grad_.zero_();
  grads_zero_ = true;
}

void ShardStorage::add_memory(MemoryReport& stats) const {
  const bool master_is_lp = lp_.is_same(master_);
  const int64_t master_bytes = master_is_lp ? 0 : bytes_of(master_);
  const int64_t optimizer_bytes = bytes_of(exp_avg_) + bytes_of(exp_avg_sq_) + bytes_of(momentum_);
  stats.params += bytes_of(lp_) + bytes_of(host_lp_);
  stats.master += master_bytes;
  stats.grads += bytes_of(grad_);
  stats.optimizer += optimizer_bytes;
  if (offloaded_) {
    stats.offloaded += master_bytes + optimizer_bytes + bytes_of(grad_) + bytes_of(host_lp_) +
                       (params_offloaded_ ? bytes_of(lp_) : 0);
  }
  for (const UnitShard& shard : shards_) {
    if (shard.grad.defined()) continue;
    // A frozen entry's own shard, and its fp32 copy where it keeps one.
    const int64_t frozen_master = shard.master.is_same(shard.lp) ? 0 : bytes_of(shard.master);
    stats.params += bytes_of(shard.lp);
    stats.master += frozen_master;
    if (params_offloaded_) stats.offloaded += bytes_of(shard.lp) + frozen_master;
  }
}

}  // namespace shardtrain::engine
