#pragma once
// Activation recomputation, the backward half: an autograd function that
// saved only its inputs rebuilds its graph from detached copies of them and
// differentiates it. Shared by the widened attention (kernels) and the
// models' selectively checkpointed attention, which differ only in what they
// recompute.

#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace shardtrain::kernels {

/// The gradients of `forward(inputs)`, given `grad_output`, with respect to
/// each of `inputs` that requires grad (undefined for the others): `forward`
/// runs again with grad mode on, over detached copies. Throws
/// shardtrain::Error naming `what` under create_graph: the rebuilt graph hangs
/// off detached inputs, so a second derivative through it would silently be
/// wrong.
std::vector<at::Tensor> recomputed_gradients(const std::vector<at::Tensor>& inputs,
                                             const std::function<at::Tensor(const std::vector<at::Tensor>&)>& forward,
                                             const at::Tensor& grad_output, const char* what);

/// True while recomputed_gradients reruns a forward on this thread. What that
/// forward builds is differentiated at once and dropped, so an operation that
/// saves less for a later backward by recomputing (the widened attention)
/// can build its plain graph there instead of recomputing a second time.
bool in_recomputation();

}  // namespace shardtrain::kernels
