#pragma once
// The plain loop's Adam and AdamW: torch::optim's optimizer interface and
// state (AdamWParamState), stepping each parameter with the engines' own
// kernel (shardtrain::kernels::adam_step).
//
// Why not torch::optim::Adam(W) itself: the reference exists to show that
// sharding changes nothing, bit for bit, so it must do the engines'
// per-element arithmetic. torch::optim's is the same sequence of operations,
// but the PyTorch wheel's float32 sqrt on the CPU is not correctly rounded
// (MKL's vector math: about 0.6% of values one ulp off, and which ones
// depends on the CPU), while the kernels use the IEEE square root, as the
// CUDA kernels do. How far the kernel may be from torch::optim is asserted
// separately, with a derived bound (UnitCpuKernels.FusedAdamW*).

#include <vector>

#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

namespace tiny {

class ReferenceAdam final : public torch::optim::Optimizer {
 public:
  /// `decoupled`: AdamW (params *= 1 - lr*wd); else Adam with L2 (grad += wd*param).
  ReferenceAdam(std::vector<at::Tensor> params, const torch::optim::AdamWOptions& options, bool decoupled);
  at::Tensor step(LossClosure closure = nullptr) override;

 private:
  bool decoupled_;
};

}  // namespace tiny
