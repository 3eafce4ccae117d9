#pragma once
/// @file device.h
/// Choosing the device a training program runs on, moving small host data
/// to it, and what the programs report about it (the GPU's name, its known
/// peak rate, its allocator's memory counters). Works with any LibTorch: without CUDA every GPU answer
/// is "none".

#include <cstdint>
#include <optional>
#include <string>

#include <c10/core/Device.h>

namespace at {
class Tensor;
}

namespace shardtrain {

/// Resolves a --device value: "cpu"; "cuda" (cuda:local_rank); "cuda:N"; or
/// "auto" (cuda:local_rank when this process sees a GPU, else cpu). Throws
/// ConfigError for another value, for cuda without a usable GPU, and for a
/// local rank beyond the visible GPUs (one process per GPU).
c10::Device resolve_device(const std::string& name, int local_rank);

/// `tensor` on `device` without making the host wait for the work already
/// queued there: from the host to a GPU through pinned memory and a
/// non-blocking copy (ATen's blocking copy from pageable memory synchronizes
/// the stream; the caching host allocator keeps the pinned block until the
/// copy is done). Elsewhere tensor.to(device); `tensor` itself where it is
/// there already. For batches and the small tensors of metadata a forward
/// computes on the host.
at::Tensor to_device_without_waiting(const at::Tensor& tensor, const c10::Device& device);

/// The collective backend for a device: "gloo" for cpu, "nccl" for cuda.
std::string backend_for(const c10::Device& device);

/// The GPU's product name as the driver reports it ("NVIDIA H200"), or "cpu".
std::string device_name(const c10::Device& device);

/// Dense (no sparsity) tensor-core peak of a known GPU in TFLOP/s for "bf16"
/// or "fp16", from NVIDIA's datasheets: H100/H200 SXM 989, H100/H200 NVL 835,
/// H100 PCIe 756, A100 312. nullopt for another GPU or dtype (measure it, or pass
/// --peak-tflops).
std::optional<double> known_peak_tflops(const std::string& gpu_name, const std::string& dtype);

/// The CUDA caching allocator's byte counters for a device (all zero on cpu).
struct DeviceMemory {
  int64_t allocated = 0;       ///< bytes in live tensors now
  int64_t peak_allocated = 0;  ///< most bytes in live tensors since the last reset
  int64_t reserved = 0;        ///< bytes the allocator holds from the driver now
  int64_t peak_reserved = 0;
};
/// The counters now (torch.cuda.memory_allocated / max_memory_allocated /
/// memory_reserved / max_memory_reserved).
DeviceMemory device_memory(const c10::Device& device);
/// Starts the peaks anew from the current values (torch.cuda.reset_peak_memory_stats).
void reset_device_peak_memory(const c10::Device& device);

}  // namespace shardtrain
