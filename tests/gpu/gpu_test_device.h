#pragma once
// The device the GPU tests run on, and how they run where there is none.
//
// On a GPU node: cuda:0. Without one, a test skips ("no CUDA device"),
// unless SHARDTRAIN_GPU_TEST_STAND_IN=cpu: then the CPU stands in for cuda:0
// and every test that does not need CUDA itself (a raw kernel launch, the
// caching allocator, NCCL) runs its whole comparison with the CPU on both
// sides. That is scripts/gpu-check's dry run: it proves on the CPU that each
// test's own code, its reference half and its bounds work before the test
// ever meets a GPU, and records the GPU half as owed.

#include <cstdlib>
#include <cstring>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

namespace shardtrain::testing {

inline bool cuda_present() { return torch::cuda::is_available(); }

inline bool cpu_stands_in() {
  const char* mode = std::getenv("SHARDTRAIN_GPU_TEST_STAND_IN");
  return !cuda_present() && mode != nullptr && std::strcmp(mode, "cpu") == 0;
}

/// cuda:0, or the CPU standing in for it.
inline at::Device test_device() { return cuda_present() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU); }

/// The device string the examples take ("cuda" / "cpu").
inline const char* test_device_name() { return cuda_present() ? "cuda" : "cpu"; }

}  // namespace shardtrain::testing

/// The test runs on cuda:0, or on the CPU standing in for it in a dry run.
#define REQUIRE_TEST_DEVICE()                                                                        \
  do {                                                                                               \
    if (!::shardtrain::testing::cuda_present() && !::shardtrain::testing::cpu_stands_in())           \
      GTEST_SKIP() << "no CUDA device (SHARDTRAIN_GPU_TEST_STAND_IN=cpu runs it against the CPU)";  \
    RecordProperty("device", ::shardtrain::testing::test_device().str());                            \
  } while (0)

/// The test needs CUDA itself (a raw launch, the caching allocator, NCCL): no stand-in.
#define REQUIRE_CUDA() \
  if (!::shardtrain::testing::cuda_present()) GTEST_SKIP() << "needs CUDA itself (no CPU stand-in)"
