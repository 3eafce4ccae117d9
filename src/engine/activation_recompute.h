#pragma once
// Activation checkpointing for one unit: its forward runs without recording
// a graph, and runs again with grad mode on during backward.

#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace shardtrain::engine {

/// Runs `body(input)` now without a graph, and again in backward to
/// differentiate it. `params` (the unit's trainable parameters) are inputs of
/// the recorded node, so their gradients reach their AccumulateGrad nodes and
/// the engine's hooks as usual; by the time backward reruns the body, the
/// engine's pre-backward hook on the output has gathered them.
at::Tensor run_with_recompute(std::function<at::Tensor(const at::Tensor&)> body, const at::Tensor& input,
                              const std::vector<at::Tensor>& params);

}  // namespace shardtrain::engine
