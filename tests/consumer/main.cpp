// Uses the installed headers and library: joins a single-process job and
// all-reduces a tensor; prints the version so the test can check it. Built
// with CUDA, it also asks the CUDA runtime its version (which needs no GPU).
#include <iostream>

#include <ATen/ATen.h>
#include <shardtrain/comm/rendezvous.h>
#include <shardtrain/version.h>

#ifdef CONSUMER_CALLS_CUDA_RUNTIME
#include <cuda_runtime_api.h>
#endif

int main() {
  auto comm = shardtrain::init_distributed(shardtrain::detect_dist_env());
  at::Tensor t = at::ones({4}, at::kBFloat16);
  comm->all_reduce(t);
  std::cout << "consumer ok: shardtrain " << SHARDTRAIN_VERSION_STRING << ", world " << comm->world_size()
            << ", sum " << t.sum().item<float>() << std::endl;
#ifdef CONSUMER_CALLS_CUDA_RUNTIME
  int runtime_version = 0;
  if (cudaRuntimeGetVersion(&runtime_version) != cudaSuccess) return 1;
  std::cout << "consumer calls the CUDA runtime " << runtime_version << std::endl;
#endif
  return t.sum().item<float>() == 4.0f ? 0 : 1;
}
