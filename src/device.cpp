// Device selection and device facts for training programs (see device.h).

#include "shardtrain/device.h"

#include <algorithm>
#include <cctype>

#include <ATen/ATen.h>

#include "local_gpu.h"
#include "shardtrain/error.h"
#include "torch_cuda.h"

namespace shardtrain {
namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

int visible_gpus() {
  const int count = torch_cuda::cuda_device_count();
  ST_CHECK_T(ConfigError, count > 0, "--device cuda: this process sees no GPU (no device, no driver, or "
             "CUDA_VISIBLE_DEVICES hides them); use --device cpu");
  return count;
}

c10::Device cuda_device(int index) {
  return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index));
}

/// cuda:N as the user named it: that device or an error, no fallback.
c10::Device named_cuda_device(int index) {
  const int count = visible_gpus();
  ST_CHECK_T(ConfigError, index >= 0 && index < count, "--device: GPU ", index, " does not exist; this process sees ",
             count, " (CUDA_VISIBLE_DEVICES counts from 0 in each process)");
  return cuda_device(index);
}

/// The local rank's GPU (gpu_for_local_rank).
c10::Device local_rank_cuda_device(int local_rank) {
  const int count = visible_gpus();
  const std::optional<int> index = gpu_for_local_rank(local_rank, count);
  ST_CHECK_T(ConfigError, index.has_value(), "--device cuda: local rank ", local_rank, " has no GPU; this process "
             "sees ", count, " (one process per GPU: launch at most ", count, " processes per machine)");
  return cuda_device(*index);
}

}  // namespace

c10::Device resolve_device(const std::string& name, int local_rank) {
  if (name == "cpu") return c10::Device(c10::DeviceType::CPU);
  if (name == "cuda") return local_rank_cuda_device(local_rank);
  if (name.rfind("cuda:", 0) == 0) {
    const std::string digits = name.substr(5);
    ST_CHECK_T(ConfigError, !digits.empty() && std::all_of(digits.begin(), digits.end(), ::isdigit),
               "--device '", name, "': expected cuda:N with N a GPU index");
    return named_cuda_device(std::stoi(digits));
  }
  if (name == "auto") {
    return torch_cuda::cuda_device_count() > 0 ? local_rank_cuda_device(local_rank) : c10::Device(c10::DeviceType::CPU);
  }
  ST_THROW(ConfigError, "--device '", name, "' is not one of cpu, cuda, cuda:N, auto");
}

at::Tensor to_device_without_waiting(const at::Tensor& tensor, const c10::Device& device) {
  if (tensor.device() == device) return tensor;
  if (tensor.is_cpu() && device.is_cuda()) return tensor.pin_memory().to(device, /*non_blocking=*/true);
  return tensor.to(device);
}

std::string backend_for(const c10::Device& device) { return device.is_cuda() ? "nccl" : "gloo"; }

std::string device_name(const c10::Device& device) {
  if (!device.is_cuda()) return "cpu";
  return torch_cuda::cuda_device_name(device.index());
}

std::optional<double> known_peak_tflops(const std::string& gpu_name, const std::string& dtype) {
  if (dtype != "bf16" && dtype != "fp16") return std::nullopt;
  const std::string name = lower(gpu_name);
  // Dense tensor-core rates from NVIDIA's H100/H200 and A100 datasheets
  // (half their "with sparsity" figures). The NVL cards (PCIe, 350-600 W)
  // are rated below the SXM parts of the same name.
  const bool nvl = name.find("nvl") != std::string::npos;
  if (name.find("h200") != std::string::npos) return nvl ? 835.0 : 989.0;
  if (name.find("h100") != std::string::npos) {
    return nvl ? 835.0 : name.find("pcie") != std::string::npos ? 756.0 : 989.0;
  }
  if (name.find("a100") != std::string::npos) return 312.0;
  return std::nullopt;
}

DeviceMemory device_memory(const c10::Device& device) {
  DeviceMemory out;
  if (!device.is_cuda()) return out;
  const torch_cuda::CudaMemoryStats stats = torch_cuda::cuda_memory_stats(device.index());
  out.allocated = stats.allocated;
  out.peak_allocated = stats.peak_allocated;
  out.reserved = stats.reserved;
  out.peak_reserved = stats.peak_reserved;
  return out;
}

void reset_device_peak_memory(const c10::Device& device) {
  if (device.is_cuda()) torch_cuda::reset_cuda_peak_memory(device.index());
}

}  // namespace shardtrain
