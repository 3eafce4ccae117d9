#pragma once
// A hook that runs after autograd has accumulated a leaf's gradient into
// .grad(), removable by its owner.
//
// Why not a tensor hook (Tensor::register_hook): it runs before accumulation,
// and while it holds the gradient, AccumulateGrad cannot adopt that tensor as
// .grad() and clones it instead, so every gradient would be copied once more
// and the whole model's gradients would stay alive until backward ends.
// After accumulation the engine moves .grad() out and reduces that tensor
// itself. Why not LibTorch's post-accumulate-grad hook slot
// (torch::autograd::impl::set_post_acc_grad_hooks, behind Python's
// register_post_accumulate_grad_hook): a tensor has one such slot, which a
// user's own hook would replace, and no handle removes it. Post hooks on the
// AccumulateGrad node, as PyTorch's DDP reducer and DeepSpeed use them, can be
// many and are removed by key.

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace shardtrain::engine {

/// Runs a function each time autograd has accumulated into a leaf's
/// .grad(), from construction until destruction: the destructor removes the
/// hook, so a graph that outlives its owner never calls into freed state.
class GradReadyHook {
 public:
  GradReadyHook(const at::Tensor& leaf, std::function<void()> hook)
      : accumulator_(torch::autograd::impl::grad_accumulator(leaf)) {
    // The leaf holds its accumulator only weakly: keeping it here keeps the
    // hook's node the one the next backward uses.
    key_ = accumulator_->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [hook = std::move(hook)](const torch::autograd::variable_list& outputs,
                                 const torch::autograd::variable_list& /*inputs*/) {
          hook();
          return outputs;
        }));
  }
  ~GradReadyHook() { accumulator_->del_post_hook(key_); }
  GradReadyHook(const GradReadyHook&) = delete;
  GradReadyHook& operator=(const GradReadyHook&) = delete;

 private:
  // Whatever owning pointer this LibTorch hands out: std::shared_ptr up to
  // 2.14, c10::intrusive_ptr from 2.15 (the one version-specific type here).
  decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>())) accumulator_;
  std::uintptr_t key_ = 0;
};

}  // namespace shardtrain::engine
