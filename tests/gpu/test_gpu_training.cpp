// Training on a GPU: the same train_tiny run on cuda:0 and on the CPU, and
// the engines' state living on the device.
//
// Built only against a CUDA LibTorch; scripts/gpu-check runs it.

#include "build_config.h"  // SHARDTRAIN_SOURCE_DIR

#include <cmath>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include "shardtrain/device.h"
#include "tiny/tiny_train.h"

namespace {

tiny::TinyRunOptions tiny_run(const std::string& device, const std::string& config_path) {
  tiny::TinyRunOptions options;
  options.device = device;
  options.steps = 10;
  options.micro_batch = 4;
  options.seed = 1;
  options.quiet = true;
  if (!config_path.empty()) options.config_path = config_path;
  return options;
}

// Why 1e-5 relative per step. Both runs start from the same fp32 weights
// (initialised on the CPU, then moved) and see the same batches; only the
// order of additions inside the kernels differs (cuBLAS against OpenBLAS or
// oneDNN blocking, GPU against CPU reductions in softmax, norms and the
// loss). TF32 is off, so every operation is fp32 with unit roundoff
// u = 2^-24 = 6e-8. A sum of K terms in a different order differs by at most
// about K*u relative and typically sqrt(K)*u; the longest reductions of the
// tiny model are K = 256 (the vocabulary and the FFN width), so per operation
// ~1e-6 typically and 1.5e-5 in the very worst case. The loss is a mean over
// 4 x 32 tokens, which averages independent rounding further, and Adam's
// normalised updates (lr 1e-3) carry a relative parameter difference forward
// without amplifying it over ten steps. The observed difference should thus
// be ~1e-6; 1e-5 leaves a factor of ten, and a real defect (a wrong mask, a
// missed gradient, a stale parameter) moves the loss by 1e-3 or more.
constexpr double kLossBound = 1e-5;

void expect_same_losses(const std::string& config_path) {
  at::globalContext().setAllowTF32CuBLAS(false);
  const tiny::TinyRunResult cpu = tiny::run_tiny(tiny_run("cpu", config_path));
  const tiny::TinyRunResult gpu = tiny::run_tiny(tiny_run("cuda", config_path));
  ASSERT_EQ(cpu.losses.size(), gpu.losses.size());
  for (std::size_t step = 0; step < cpu.losses.size(); ++step) {
    const double relative = std::abs(gpu.losses[step] - cpu.losses[step]) / std::abs(cpu.losses[step]);
    EXPECT_LE(relative, kLossBound) << "step " << step + 1 << ": cpu " << cpu.losses[step] << ", cuda "
                                    << gpu.losses[step];
  }
  EXPECT_LT(gpu.losses.back(), gpu.losses.front()) << "the run on the GPU did not learn";
}

TEST(GpuTraining, TinyRunOnCudaFollowsTheCpuRunStepByStep) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  expect_same_losses("");
}

TEST(GpuTraining, Zero3AndFsdpFp32OnCudaFollowTheCpuRun) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  // World 1, but through the sharded engines' full path: gathers, releases,
  // reductions, the fused step and the norm, all on the device.
  for (const char* config : {"/configs/zero3_fp32.json", "/configs/fsdp_fp32.yaml"}) {
    SCOPED_TRACE(config);
    expect_same_losses(std::string(SHARDTRAIN_SOURCE_DIR) + config);
  }
}

TEST(GpuTraining, PeakMemoryComesFromTheCachingAllocator) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const c10::Device gpu = shardtrain::resolve_device("cuda", 0);
  shardtrain::reset_device_peak_memory(gpu);
  const int64_t before = shardtrain::device_memory(gpu).peak_allocated;
  {
    at::Tensor block = at::empty({64 << 20}, at::TensorOptions().dtype(at::kByte).device(gpu));
    EXPECT_GE(shardtrain::device_memory(gpu).allocated, int64_t{64} << 20);
  }
  EXPECT_GE(shardtrain::device_memory(gpu).peak_allocated, before + (int64_t{64} << 20));
  EXPECT_FALSE(shardtrain::device_name(gpu).empty());
}

}  // namespace
