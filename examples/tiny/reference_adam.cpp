// ReferenceAdam: see reference_adam.h for why the plain loop steps with the engines' kernel.
#include "tiny/reference_adam.h"

#include <memory>
#include <utility>

#include "shardtrain/error.h"
#include "shardtrain/kernels.h"

namespace tiny {

ReferenceAdam::ReferenceAdam(std::vector<at::Tensor> params, const torch::optim::AdamWOptions& options,
                             bool decoupled)
    : torch::optim::Optimizer({torch::optim::OptimizerParamGroup(std::move(params))},
                              std::make_unique<torch::optim::AdamWOptions>(options)),
      decoupled_(decoupled) {}

at::Tensor ReferenceAdam::step(LossClosure closure) {
  ST_CHECK(closure == nullptr, "ReferenceAdam::step takes no closure");
  torch::NoGradGuard no_grad;
  for (auto& group : param_groups_) {
    const auto& options = static_cast<const torch::optim::AdamWOptions&>(group.options());
    for (auto& param : group.params()) {
      if (!param.grad().defined()) continue;
      auto& slot = state_[param.unsafeGetTensorImpl()];
      if (!slot) {
        auto fresh = std::make_unique<torch::optim::AdamWParamState>();
        fresh->exp_avg(at::zeros_like(param));
        fresh->exp_avg_sq(at::zeros_like(param));
        slot = std::move(fresh);
      }
      auto& state = static_cast<torch::optim::AdamWParamState&>(*slot);
      state.step(state.step() + 1);
      shardtrain::kernels::AdamParams p;
      p.lr = options.lr();
      p.beta1 = std::get<0>(options.betas());
      p.beta2 = std::get<1>(options.betas());
      p.eps = options.eps();
      p.weight_decay = options.weight_decay();
      p.step = state.step();
      p.adam_w_mode = decoupled_;
      at::Tensor master = param.detach();  // the parameter's own storage, updated in place
      const at::Tensor grad = param.grad().contiguous();
      at::Tensor exp_avg = state.exp_avg(), exp_avg_sq = state.exp_avg_sq();
      shardtrain::kernels::adam_step(master, exp_avg, exp_avg_sq, grad, nullptr, p);
    }
  }
  return {};
}

}  // namespace tiny
