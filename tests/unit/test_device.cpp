// Device selection and device facts (shardtrain/device.h) on a machine that
// may or may not have a GPU: the CPU answers exactly, the GPU answers as
// errors that say what to do.

#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include <torch/cuda.h>

#include "comm/nccl/nccl_factory.h"
#include "local_gpu.h"
#include "shardtrain/device.h"
#include "shardtrain/error.h"

namespace {

TEST(UnitDevice, CpuAndAutoResolveAndTheBackendFollowsTheDevice) {
  const c10::Device cpu = shardtrain::resolve_device("cpu", 3);
  EXPECT_TRUE(cpu.is_cpu());
  EXPECT_EQ(shardtrain::backend_for(cpu), "gloo");
  EXPECT_EQ(shardtrain::device_name(cpu), "cpu");
  const c10::Device automatic = shardtrain::resolve_device("auto", 0);
  if (torch::cuda::is_available()) {
    EXPECT_EQ(automatic, c10::Device(c10::DeviceType::CUDA, 0));
    EXPECT_EQ(shardtrain::backend_for(automatic), "nccl");
  } else {
    EXPECT_TRUE(automatic.is_cpu()) << "no GPU visible: auto must mean cpu";
  }
}

TEST(UnitDevice, UnknownOrUnusableDevicesAreConfigErrorsThatNameTheFix) {
  try {
    shardtrain::resolve_device("tpu", 0);
    FAIL() << "tpu is not a device shardtrain trains on";
  } catch (const shardtrain::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("cpu, cuda, cuda:N, auto"), std::string::npos) << e.what();
  }
  EXPECT_THROW(shardtrain::resolve_device("cuda:x", 0), shardtrain::ConfigError);
  if (!torch::cuda::is_available()) {
    try {
      shardtrain::resolve_device("cuda", 0);
      FAIL() << "cuda without a GPU must fail";
    } catch (const shardtrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("use --device cpu"), std::string::npos) << e.what();
    }
  } else if (torch::cuda::device_count() > 1) {
    // One process per GPU: a local rank past the last GPU is a launch error.
    EXPECT_THROW(shardtrain::resolve_device("cuda", static_cast<int>(torch::cuda::device_count())),
                 shardtrain::ConfigError);
  } else {
    // One GPU visible (one per task): every local rank uses it.
    EXPECT_EQ(shardtrain::resolve_device("cuda", 3), c10::Device(c10::DeviceType::CUDA, 0));
  }
}

// The one rule that resolve_device("cuda") and the NCCL backend share.
TEST(UnitDevice, EachLocalRankUsesItsGpuAndAProcessSeeingOneGpuUsesThatOne) {
  using shardtrain::gpu_for_local_rank;
  EXPECT_EQ(gpu_for_local_rank(0, 8), 0);
  EXPECT_EQ(gpu_for_local_rank(5, 8), 5);
  EXPECT_EQ(gpu_for_local_rank(7, 8), 7);
  // One GPU per task (Slurm --gpus-per-task=1): every local rank's device 0.
  EXPECT_EQ(gpu_for_local_rank(0, 1), 0);
  EXPECT_EQ(gpu_for_local_rank(3, 1), 0);
  // More processes than GPUs, or none visible.
  EXPECT_EQ(gpu_for_local_rank(2, 2), std::nullopt);
  EXPECT_EQ(gpu_for_local_rank(8, 8), std::nullopt);
  EXPECT_EQ(gpu_for_local_rank(0, 0), std::nullopt);
  EXPECT_EQ(gpu_for_local_rank(-1, 4), std::nullopt);
  EXPECT_EQ(gpu_for_local_rank(-1, 1), std::nullopt);
}

TEST(UnitDevice, KnownPeaksAreTheDatasheetDenseRates) {
  // The names as NVIDIA's drivers report them.
  EXPECT_EQ(shardtrain::known_peak_tflops("NVIDIA H100 80GB HBM3", "bf16"), 989.0);
  EXPECT_EQ(shardtrain::known_peak_tflops("NVIDIA H200", "bf16"), 989.0);
  EXPECT_EQ(shardtrain::known_peak_tflops("NVIDIA H100 PCIe", "fp16"), 756.0);
  EXPECT_EQ(shardtrain::known_peak_tflops("NVIDIA H100 NVL", "bf16"), 835.0);
  EXPECT_EQ(shardtrain::known_peak_tflops("NVIDIA H200 NVL", "bf16"), 835.0);
  EXPECT_EQ(shardtrain::known_peak_tflops("NVIDIA A100-SXM4-80GB", "bf16"), 312.0);
  // fp32 runs on other units (and TF32 is not what fp32 training asks for): no table entry.
  EXPECT_FALSE(shardtrain::known_peak_tflops("NVIDIA H100 80GB HBM3", "fp32").has_value());
  EXPECT_FALSE(shardtrain::known_peak_tflops("NVIDIA GeForce RTX 4090", "bf16").has_value());
}

TEST(UnitDevice, CpuHasNoAllocatorCounters) {
  const shardtrain::DeviceMemory memory = shardtrain::device_memory(c10::Device(c10::DeviceType::CPU));
  EXPECT_EQ(memory.allocated, 0);
  EXPECT_EQ(memory.peak_allocated, 0);
  EXPECT_EQ(memory.reserved, 0);
  EXPECT_NO_THROW(shardtrain::reset_device_peak_memory(c10::Device(c10::DeviceType::CPU)));
}

}  // namespace

// One process, one libnccl: shardtrain's NCCL backend must call the library
// that libtorch_cuda loaded (the torch wheel's nvidia-nccl-cu13), never a
// second copy, which would share symbols but not ncclGroupStart's
// thread-local state. Read from the process's own mappings, so it holds on a
// machine without a GPU.
namespace {

std::set<std::string> mapped_libraries_named(const std::string& stem) {
  std::ifstream maps("/proc/self/maps");
  std::set<std::string> paths;
  std::string line;
  while (std::getline(maps, line)) {
    const auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    const std::string file = path.substr(path.rfind('/') + 1);
    if (file.rfind(stem, 0) == 0) paths.insert(std::filesystem::canonical(path).string());
  }
  return paths;
}

TEST(UnitPlatform, TheProcessHoldsExactlyOneLibncclTheWheelsAtTheVersionBuiltAgainst) {
  const std::string built = shardtrain::comm::nccl_version_string();
  ASSERT_FALSE(built.empty()) << "this build has no NCCL backend; every build on the torch wheel must";
  const std::set<std::string> nccl = mapped_libraries_named("libnccl");
  ASSERT_EQ(nccl.size(), 1u) << "libnccl copies mapped: " << ::testing::PrintToString(nccl);
  EXPECT_NE(nccl.begin()->find("/nvidia/nccl/lib/"), std::string::npos)
      << "the libnccl in the process is not the torch wheel's: " << *nccl.begin();
  EXPECT_EQ(shardtrain::comm::nccl_loaded_version_string(), built);
  // libtorch_cuda is what loads it for PyTorch itself: it is mapped too.
  EXPECT_EQ(mapped_libraries_named("libtorch_cuda").size(), 1u);
}

// The same for the CUDA runtime: libtorch_cuda needs libcudart.so.13, which
// the wheel ships (nvidia/cu13/lib). A process maps one file per soname, the
// first found: linked against the toolkit's (/usr/local/cuda), shardtrain
// made every C++ program run LibTorch on the toolkit's runtime instead of
// the one the wheel was built and tested with.
// Package.OneCudaRuntimeAndNcclWithTheToolkitOnTheLibraryPath runs both tests
// again with the toolkit on LD_LIBRARY_PATH.
TEST(UnitPlatform, TheProcessHoldsExactlyOneLibcudartTheOneLibTorchShips) {
  const std::set<std::string> cudart = mapped_libraries_named("libcudart");
  ASSERT_EQ(cudart.size(), 1u) << "libcudart copies mapped: " << ::testing::PrintToString(cudart);
  EXPECT_NE(cudart.begin()->find("/nvidia/"), std::string::npos)
      << "the libcudart in the process is not the torch wheel's: " << *cudart.begin();
}

}  // namespace
