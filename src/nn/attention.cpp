// shardtrain::nn::scaled_dot_product_attention: the public face of the kernel
// layer's mixed-precision attention.
#include "shardtrain/nn/attention.h"

#include "kernels/mixed_attention.h"

namespace shardtrain::nn {

at::Tensor scaled_dot_product_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& attend) {
  return kernels::mixed_attention(q, k, v, attend);
}

}  // namespace shardtrain::nn
