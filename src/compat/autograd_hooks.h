#pragma once
// A hook that runs after autograd has accumulated a leaf's gradient into
// .grad(), on every LibTorch shardtrain builds against.
//
// Why not a tensor hook (Tensor::register_hook): it runs before accumulation,
// and while it holds the gradient, AccumulateGrad cannot adopt that tensor as
// .grad() and clones it instead, so every gradient would be copied once more
// and the whole model's gradients would stay alive until backward ends.
// After accumulation the engine moves .grad() out and reduces that tensor
// itself. LibTorch 2.1 added Tensor::register_post_accumulate_grad_hook;
// 1.13 has only post hooks on the AccumulateGrad node, which is what
// PyTorch's DDP reducer and DeepSpeed use, and which 2.x still has.

#include <functional>
#include <memory>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace shardtrain::compat {

/// Runs `hook` each time autograd has accumulated into `leaf.grad()`. The
/// returned node must be kept alive as long as the hook should run: the leaf
/// holds its accumulator only weakly, and a new one would have no hook.
inline std::shared_ptr<torch::autograd::Node> add_post_accumulate_grad_hook(const at::Tensor& leaf,
                                                                             std::function<void()> hook) {
  std::shared_ptr<torch::autograd::Node> accumulator = torch::autograd::impl::grad_accumulator(leaf);
  accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
      [hook = std::move(hook)](const torch::autograd::variable_list& outputs,
                               const torch::autograd::variable_list& /*inputs*/) {
        hook();
        return outputs;
      }));
  return accumulator;
}

}  // namespace shardtrain::compat
