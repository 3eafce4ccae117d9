// Activation checkpointing as an autograd function (see activation_recompute.h).

#include "engine/activation_recompute.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/Context.h>

namespace shardtrain::engine {

namespace {

/// The default generator's state of `device` (a copy).
at::Tensor rng_state(const at::Device& device) {
  at::Generator generator = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_rng_state(const at::Device& device, const at::Tensor& state) {
  at::Generator generator = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

/// For the recomputation: the random state the forward saw (so dropout draws
/// the same mask, as torch.utils.checkpoint's preserve_rng_state does), then,
/// when it ends, the state the rest of backward expects.
class ReplayedRng {
 public:
  ReplayedRng(std::vector<std::pair<at::Device, at::Tensor>> forward_states) {
    for (auto& [device, state] : forward_states) {
      now_.emplace_back(device, rng_state(device));
      set_rng_state(device, state);
    }
  }
  ~ReplayedRng() {
    for (auto& [device, state] : now_) set_rng_state(device, state);
  }
  ReplayedRng(const ReplayedRng&) = delete;
  ReplayedRng& operator=(const ReplayedRng&) = delete;

 private:
  std::vector<std::pair<at::Device, at::Tensor>> now_;
};

/// The devices whose generators a body on `input` may draw from: the CPU's
/// always, and the input's own.
std::vector<at::Device> rng_devices(const at::Tensor& input) {
  std::vector<at::Device> devices{at::Device(at::kCPU)};
  if (!input.device().is_cpu()) devices.push_back(input.device());
  return devices;
}

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
    const std::vector<at::Device> devices = rng_devices(input);
    for (std::size_t i = 0; i < devices.size(); ++i) {
      ctx->saved_data["rng" + std::to_string(i)] = rng_state(devices[i]);
    }
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
    std::vector<std::pair<at::Device, at::Tensor>> forward_rng;
    const std::vector<at::Device> devices = rng_devices(input);
    for (std::size_t i = 0; i < devices.size(); ++i) {
      forward_rng.emplace_back(devices[i], ctx->saved_data["rng" + std::to_string(i)].toTensor());
    }
    at::Tensor output;
    {
      ReplayedRng replay(std::move(forward_rng));
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
