#pragma once
// The one translation of the optimizer steps' hyper-parameters (AdamParams,
// SgdParams: shardtrain/kernels.h) into the per-step float constants both
// devices' kernels use.

#include <cstdint>

#include "kernels/element_math.h"
#include "shardtrain/kernels.h"

namespace shardtrain::kernels {

/// The float constants of one Adam(W) step, each rounded from a double
/// expression exactly where torch::optim rounds its Scalar arguments. Throws
/// shardtrain::Error for a step < 1, non-finite values or betas outside [0, 1).
math::AdamScalars adam_scalars(const AdamParams& p);

/// The float constants of one SGD step. Throws for non-finite values and for
/// Nesterov without momentum.
math::SgdScalars sgd_scalars(const SgdParams& p);

}  // namespace shardtrain::kernels
