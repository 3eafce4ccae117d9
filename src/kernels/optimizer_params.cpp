// Validation of the optimizer hyper-parameters and their rounding into the
// kernels' per-step constants (see optimizer_params.h).

#include "kernels/optimizer_params.h"

#include <cmath>

#include "shardtrain/error.h"

namespace shardtrain::kernels {

math::AdamScalars adam_scalars(const AdamParams& p) {
  ST_CHECK(p.step >= 1, "Adam step must be >= 1 (1-based, after the increment), got ", p.step);
  ST_CHECK(std::isfinite(p.lr) && std::isfinite(p.eps) && std::isfinite(p.weight_decay) &&
               std::isfinite(p.grad_scale),
           "Adam hyper-parameters must be finite (lr=", p.lr, ", eps=", p.eps,
           ", weight_decay=", p.weight_decay, ", grad_scale=", p.grad_scale, ")");
  ST_CHECK(p.beta1 >= 0.0 && p.beta1 < 1.0 && p.beta2 >= 0.0 && p.beta2 < 1.0,
           "Adam betas must lie in [0, 1), got (", p.beta1, ", ", p.beta2, ")");
  const double step = static_cast<double>(p.step);
  // std::pow in double, as torch computes bias_correction = 1 - std::pow(beta, step):
  // beta2^step in fp32 loses most of its digits exactly in the early steps,
  // where the correction matters most.
  const double bc1 = p.bias_correction ? 1.0 - std::pow(p.beta1, step) : 1.0;
  const double bc2 = p.bias_correction ? 1.0 - std::pow(p.beta2, step) : 1.0;
  math::AdamScalars c{};
  c.grad_scale = static_cast<float>(p.grad_scale);
  c.use_l2 = !p.adam_w_mode && p.weight_decay != 0.0;
  c.use_decay = p.adam_w_mode && p.weight_decay != 0.0;
  c.l2 = static_cast<float>(p.weight_decay);
  c.decay = static_cast<float>(1.0 - p.lr * p.weight_decay);
  c.beta1 = static_cast<float>(p.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - p.beta1);
  c.beta2 = static_cast<float>(p.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - p.beta2);
  c.sqrt_bc2 = static_cast<float>(std::sqrt(bc2));
  c.eps = static_cast<float>(p.eps);
  c.neg_step_size = static_cast<float>(-(p.lr / bc1));
  return c;
}

math::SgdScalars sgd_scalars(const SgdParams& p) {
  ST_CHECK(std::isfinite(p.lr) && std::isfinite(p.momentum) && std::isfinite(p.weight_decay) &&
               std::isfinite(p.grad_scale),
           "SGD hyper-parameters must be finite (lr=", p.lr, ", momentum=", p.momentum,
           ", weight_decay=", p.weight_decay, ", grad_scale=", p.grad_scale, ")");
  ST_CHECK(!p.nesterov || p.momentum > 0.0, "Nesterov momentum requires momentum > 0, got ", p.momentum);
  math::SgdScalars c{};
  c.use_momentum = p.momentum != 0.0;
  c.use_wd = p.weight_decay != 0.0;
  c.nesterov = p.nesterov;
  c.first_step = p.first_step;
  c.grad_scale = static_cast<float>(p.grad_scale);
  c.weight_decay = static_cast<float>(p.weight_decay);
  c.momentum = static_cast<float>(p.momentum);
  c.neg_lr = static_cast<float>(-1 * p.lr);
  return c;
}

}  // namespace shardtrain::kernels
