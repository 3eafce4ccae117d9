// The dequantizing matmul (nf4_linear.h): the kernel layer decodes the NF4
// buffer (CPU or CUDA kernel), the product is shardtrain::nn's mixed GEMM in
// the compute dtype. For training-size inputs this is also what bitsandbytes
// does (dequantize_4bit, then torch's matmul); a fused 4-bit GEMM pays only
// for single-token inference.

#include "nn/nf4_linear.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "kernels/mixed_gemm.h"
#include "shardtrain/error.h"
#include "shardtrain/kernels.h"
#include "shardtrain/weight_loading.h"

namespace shardtrain::nn {
namespace {

at::Tensor decoded_weight(const at::Tensor& buffer, int64_t out_features, int64_t in_features, at::ScalarType dtype) {
  return kernels::nf4_dequantize(buffer, out_features * in_features, dtype).view({out_features, in_features});
}

/// Saves the buffer itself, not the decoded matrix: under ZeRO-3 and FSDP the
/// buffer is a view the engine regathers before this unit's backward.
class Nf4Matmul : public torch::autograd::Function<Nf4Matmul> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& buffer,
                            int64_t out_features, int64_t in_features) {
    // saved_data, not save_for_backward: the engine's regather rewrites the
    // buffer in place between forward and backward, as it does every weight.
    ctx->saved_data["buffer"] = buffer;
    ctx->saved_data["out"] = out_features;
    ctx->saved_data["in"] = in_features;
    return kernels::mixed_linear(x, decoded_weight(buffer, out_features, in_features, x.scalar_type()), at::Tensor());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor& grad = grads[0];
    const at::Tensor weight = decoded_weight(ctx->saved_data["buffer"].toTensor(), ctx->saved_data["out"].toInt(),
                                             ctx->saved_data["in"].toInt(), grad.scalar_type());
    return {kernels::mixed_matmul(grad, weight), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor nf4_linear(const at::Tensor& input, const at::Tensor& buffer, const at::Tensor& bias, int64_t out_features,
                      int64_t in_features, at::ScalarType compute_dtype) {
  ST_CHECK(buffer.scalar_type() == at::kByte, "nf4_linear: the quantized weight is ", buffer.scalar_type(),
           ", not its NF4 bytes (uint8): the model was converted after quantize_frozen_base (Module::to(dtype) "
           "converts every parameter); move it to its dtype before quantizing");
  ST_CHECK(!is_storage_released(buffer), "nf4_linear: the quantized weight has no values: the model was built "
           "without its weights and quantized, and has not been through Accelerator::prepare(), which fills it");
  ST_CHECK(input.size(-1) == in_features, "nf4_linear: the input's last dimension is ", input.size(-1),
           ", the layer takes ", in_features);
  at::Tensor y = Nf4Matmul::apply(input.to(compute_dtype), buffer, out_features, in_features);
  if (bias.defined()) y = y + bias.to(compute_dtype);
  return y.to(input.scalar_type());
}

}  // namespace shardtrain::nn
