#pragma once
// Hyper-parameters of the fused optimizer steps, and their one translation
// into the per-step float constants both devices' kernels use.

#include <cstdint>

#include "kernels/element_math.h"

namespace shardtrain::kernels {

/// Hyper-parameters of one Adam/AdamW step.
struct AdamParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  /// 1-based number of this step, counted after the increment (the first step is 1).
  int64_t step = 1;
  /// true: AdamW, decoupled weight decay (master *= 1 - lr*wd), as torch::optim::AdamW.
  /// false: Adam with L2 regularisation (g += wd*master), as torch::optim::Adam.
  bool adam_w_mode = true;
  /// Divide the moments by 1 - beta^step, as torch and DeepSpeed's FusedAdam do.
  bool bias_correction = true;
  /// Multiplies the gradient before anything else. The engines fold loss-scale
  /// unscaling (1/scale) and the clip coefficient into this one factor, so the
  /// gradient is read once per step.
  double grad_scale = 1.0;
};

/// Hyper-parameters of one SGD step (dampening 0), as torch::optim::SGD.
struct SgdParams {
  double lr = 1e-3;
  double momentum = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  /// As AdamParams::grad_scale.
  double grad_scale = 1.0;
  /// The first step initialises the momentum buffer from the gradient, as torch does.
  bool first_step = true;
};

/// The float constants of one Adam(W) step, each rounded from a double
/// expression exactly where torch::optim rounds its Scalar arguments. Throws
/// shardtrain::Error for a step < 1, non-finite values or betas outside [0, 1).
math::AdamScalars adam_scalars(const AdamParams& p);

/// The float constants of one SGD step. Throws for non-finite values and for
/// Nesterov without momentum.
math::SgdScalars sgd_scalars(const SgdParams& p);

}  // namespace shardtrain::kernels
