// Activation recomputation's backward half (recompute.h).
#include "kernels/recompute.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "shardtrain/error.h"

namespace shardtrain::kernels {
namespace {

thread_local int recomputation_depth = 0;

struct RecomputationScope {
  RecomputationScope() { ++recomputation_depth; }
  ~RecomputationScope() { --recomputation_depth; }
  RecomputationScope(const RecomputationScope&) = delete;
  RecomputationScope& operator=(const RecomputationScope&) = delete;
};

}  // namespace

bool in_recomputation() { return recomputation_depth > 0; }

std::vector<at::Tensor> recomputed_gradients(const std::vector<at::Tensor>& inputs,
                                             const std::function<at::Tensor(const std::vector<at::Tensor>&)>& forward,
                                             const at::Tensor& grad_output, const char* what) {
  // The autograd engine runs backward with grad mode on exactly when
  // create_graph was requested.
  ST_CHECK(!at::GradMode::is_enabled(), "double backward (create_graph) through ", what, " is not supported");
  std::vector<at::Tensor> detached, wrt;
  for (const at::Tensor& input : inputs) {
    detached.push_back(input.detach().requires_grad_(input.requires_grad()));
    if (detached.back().requires_grad()) wrt.push_back(detached.back());
  }
  std::vector<at::Tensor> result(inputs.size());
  if (wrt.empty() || !grad_output.defined()) return result;
  at::Tensor out;
  {
    at::AutoGradMode enable(true);
    const RecomputationScope scope;
    out = forward(detached);
  }
  auto computed = torch::autograd::grad({out}, wrt, {grad_output}, /*retain_graph=*/false,
                                        /*create_graph=*/false, /*allow_unused=*/true);
  std::size_t j = 0;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (detached[i].requires_grad()) result[i] = computed[j++];
  }
  return result;
}

}  // namespace shardtrain::kernels
