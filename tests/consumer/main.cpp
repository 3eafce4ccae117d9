// Uses the installed headers and library: joins a single-process job and
// all-reduces a tensor; prints the version so the test can check it.
#include <iostream>

#include <ATen/ATen.h>
#include <shardtrain/comm/rendezvous.h>
#include <shardtrain/version.h>

int main() {
  auto comm = shardtrain::init_distributed(shardtrain::detect_dist_env());
  at::Tensor t = at::ones({4}, at::kBFloat16);
  comm->all_reduce(t);
  std::cout << "consumer ok: shardtrain " << SHARDTRAIN_VERSION_STRING << ", world " << comm->world_size()
            << ", sum " << t.sum().item<float>() << std::endl;
  return t.sum().item<float>() == 4.0f ? 0 : 1;
}
