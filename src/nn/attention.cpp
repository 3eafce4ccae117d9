// shardtrain::nn::scaled_dot_product_attention: the public face of the kernel
// layer's mixed-precision attention.
#include "shardtrain/nn/attention.h"

#include "kernels/mixed_attention.h"
#include "shardtrain/error.h"

namespace shardtrain::nn {

at::Tensor scaled_dot_product_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& attend) {
  ST_CHECK(attend.defined(), "scaled_dot_product_attention: the mask is undefined; for causal attention without a "
           "mask call causal_scaled_dot_product_attention");
  return kernels::mixed_attention(q, k, v, attend);
}

at::Tensor causal_scaled_dot_product_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return kernels::mixed_attention(q, k, v, at::Tensor());
}

}  // namespace shardtrain::nn
