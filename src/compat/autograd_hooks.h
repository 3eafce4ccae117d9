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

#include <cstdint>
#include <functional>
#include <memory>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace shardtrain::compat {

/// Runs a function each time autograd has accumulated into a leaf's
/// .grad(), from construction until destruction: the destructor removes the
/// hook, so a graph that outlives its owner never calls into freed state.
class PostAccumulateGradHook {
 public:
  PostAccumulateGradHook(const at::Tensor& leaf, std::function<void()> hook)
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
  ~PostAccumulateGradHook() { accumulator_->del_post_hook(key_); }
  PostAccumulateGradHook(const PostAccumulateGradHook&) = delete;
  PostAccumulateGradHook& operator=(const PostAccumulateGradHook&) = delete;

 private:
  std::shared_ptr<torch::autograd::Node> accumulator_;
  std::uintptr_t key_ = 0;
};

}  // namespace shardtrain::compat
