// Where the shards live: the model's device (checked against the
// communicators'), the flat partitions (master, low-precision copy,
// gradient, optimizer state), the optimizer offload's host copies, and
// unit buffers that own no memory until gathered.

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_set>

#include <ATen/ATen.h>

#include "engine/storage_resize.h"
#include "engine/engine_state.h"
#include "shardtrain/error.h"
#include "shardtrain/logging.h"

namespace shardtrain::engine {

at::Tensor ShardedEngine::State::unallocated_buffer(int64_t numel, const at::TensorOptions& options) {
  const std::size_t bytes = static_cast<std::size_t>(numel) * c10::elementSize(options.dtype().toScalarType());
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, at::DataPtr(nullptr, options.device()),
                       c10::GetAllocator(options.device().type()), /*resizable=*/true);
  return at::empty({0}, options).set_(storage, 0, {numel}, {1});
}

void ShardedEngine::State::bind_device() {
  // Checked once here, so a model left on the CPU under NCCL (or moved to a
  // GPU under Gloo) fails with the fix instead of inside the first collective.
  device = comm->device();
  {
    const std::string* first_name = nullptr;
    for (const auto& u : units) {
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
  }
  for (comm::Communicator* group : {comm.get(), sync_comm.get()}) {
    if (group == nullptr) continue;
    ST_CHECK_T(ConfigError, group->device() == device, plan.name, ": the model is on ", device,
               " but the ", group->backend(), " communicator moves tensors on ", group->device(),
               "; move the model there before prepare() (model->to(accelerator.device())), or pick the backend "
               "for the model's device (gloo for cpu, nccl for cuda:LOCAL_RANK)");
  }
}

void ShardedEngine::State::allocate_partitions() {
  const at::TensorOptions fp32 = fp32_options();
  const at::TensorOptions low = fp32.dtype(plan.param_dtype);
  const at::TensorOptions state_options = pure() ? low : fp32;  // dtype the optimizer steps in
  int64_t total_shard = 0;
  for (auto& u : units) {
    std::vector<int64_t> numels;
    for (const auto& p : u.params) numels.push_back(p.numel());
    u.layout = std::make_unique<UnitLayout>(plan.layout, numels, layout_world(), /*align=*/1);
    u.persistent = u.layout->total_param_numel() < plan.param_persistence_threshold;
    u.pending_grads.resize(u.params.size());
    if (u.trainable) {
      u.shard_offset = total_shard;
      total_shard += u.layout->shard_numel();
    }
  }
  if (!pure()) master_flat = at::zeros({total_shard}, fp32);
  // keep_low_precision_grads: the reduced gradient stays in param_dtype (the
  // optimizer kernels widen it as they read it), as FSDP1 leaves flat_param.grad.
  const bool low_grads = pure() || (plan.keep_low_precision_grads && plan.param_dtype != at::kFloat);
  const at::TensorOptions grad_options = low_grads ? low : fp32;
  grad_flat = at::zeros({total_shard}, grad_options);
  lp_flat = (!pure() && plan.param_dtype == at::kFloat) ? master_flat : at::zeros({total_shard}, low);
  const std::string& opt = plan.optimizer.type;
  if (!plan.optimizer.custom_factory) {
    if (opt == "AdamW" || opt == "Adam") {
      exp_avg_flat = at::zeros({total_shard}, state_options);
      exp_avg_sq_flat = at::zeros({total_shard}, state_options);
    } else if (opt == "SGD") {
      if (plan.optimizer.momentum != 0.0) momentum_flat = at::zeros({total_shard}, fp32);
    } else {
      ST_THROW(ConfigError, "optimizer type '", opt, "' is not one of AdamW, Adam, SGD");
    }
  }
  if (plan.offload_optimizer && !pure()) {
    // The step runs on the host: gradients come down, the low-precision copy goes back up.
    // Pinned next to a GPU, as DeepSpeed's offload buffers are: copies between
    // pinned host memory and the device run at full bus speed and can overlap.
    const at::TensorOptions host = fp32.device(at::kCPU).pinned_memory(device.is_cuda());
    if (!master_flat.is_cpu()) {
      auto to_host = [&](at::Tensor& t) {
        if (t.defined()) t = at::empty({t.numel()}, host.dtype(t.scalar_type())).copy_(t);
      };
      to_host(master_flat);
      to_host(exp_avg_flat);
      to_host(exp_avg_sq_flat);
      to_host(momentum_flat);
    }
    host_grad_flat = at::zeros({total_shard}, host.dtype(grad_options.dtype()));
    host_lp_flat = at::zeros({total_shard}, host.dtype(plan.param_dtype));
  }
}

void ShardedEngine::State::release(UnitState& u) {
  if (!u.gathered || u.views_shard) return;
  engine::resize_storage_bytes(u.full, 0);
  add_gathered(-full_bytes(u));
  u.gathered = false;
}

}  // namespace shardtrain::engine
