// Activation checkpointing as an autograd function (see activation_recompute.h).

#include "engine/activation_recompute.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

namespace shardtrain::engine {

namespace {

/// Keeps a unit's forward body alive inside the autograd context until backward.
struct RecomputeBody : torch::CustomClassHolder {
  explicit RecomputeBody(std::function<at::Tensor(const at::Tensor&)> f) : fn(std::move(f)) {}
  std::function<at::Tensor(const at::Tensor&)> fn;
};

/// Activation checkpointing as an autograd function: forward runs the body
/// without recording a graph; backward runs it again with grad mode on (the
/// engine's pre-backward hook on the output has gathered the parameters by
/// then) and differentiates that. The parameters are inputs, so their
/// gradients reach their AccumulateGrad nodes and the engine's hooks as usual.
struct RecomputeFunction : torch::autograd::Function<RecomputeFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            at::TensorList params, c10::IValue body) {
    std::vector<at::Tensor> saved{input};
    saved.insert(saved.end(), params.begin(), params.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["body"] = body;
    at::NoGradGuard no_grad;
    return c10::static_intrusive_pointer_cast<RecomputeBody>(body.toCapsule())->fn(input);
  }

  static std::vector<at::Tensor> backward(torch::autograd::AutogradContext* ctx, std::vector<at::Tensor> grads) {
    auto saved = ctx->get_saved_variables();
    auto body = c10::static_intrusive_pointer_cast<RecomputeBody>(ctx->saved_data["body"].toCapsule());
    at::Tensor input = saved[0].detach().requires_grad_(saved[0].requires_grad());
    std::vector<at::Tensor> wrt;
    if (input.requires_grad()) wrt.push_back(input);
    std::vector<at::Tensor> params(saved.begin() + 1, saved.end());
    for (const auto& p : params) wrt.push_back(p);
    at::Tensor output;
    {
      at::AutoGradMode enable(true);
      output = body->fn(input);
    }
    auto computed = torch::autograd::grad({output}, wrt, {grads[0]}, /*retain_graph=*/false,
                                          /*create_graph=*/false, /*allow_unused=*/true);
    std::vector<at::Tensor> result;
    std::size_t k = 0;
    result.push_back(input.requires_grad() ? computed[k++] : at::Tensor());
    for (std::size_t i = 0; i < params.size(); ++i) result.push_back(computed[k++]);
    result.emplace_back();  // the body
    return result;
  }
};

}  // namespace

at::Tensor run_with_recompute(std::function<at::Tensor(const at::Tensor&)> body, const at::Tensor& input,
                              const std::vector<at::Tensor>& params) {
  auto holder = c10::make_intrusive<RecomputeBody>(std::move(body));
  // TensorList (not std::vector): autograd treats each parameter as an input only in that form.
  return RecomputeFunction::apply(input, at::TensorList(params), c10::IValue::make_capsule(holder));
}

}  // namespace shardtrain::engine
