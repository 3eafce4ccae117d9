// Packed-sequence attention through FlashAttention's variable-length kernel
// (packed_attention.h). at::_flash_attention_forward is ATen's own entry to
// the kernel SDPA uses, with autograd (FlashAttentionBackward0); SDPA itself
// takes no sequence offsets, only a mask, which rules flash out.

#include "kernels/packed_attention.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include "kernels/mixed_attention.h"
#include "shardtrain/error.h"
#include "torch_cuda.h"

namespace shardtrain::kernels {

bool flash_attention_runs(const at::Device& device, at::ScalarType dtype, int64_t head_size, bool needs_grad) {
  if (!device.is_cuda()) return false;
  const bool sixteen_bit = dtype == at::kBFloat16 || dtype == at::kHalf;
  if (!sixteen_bit || head_size % 8 != 0 || head_size > 256 || !at::globalContext().userEnabledFlashSDP()) {
    return false;
  }
  const int capability = torch_cuda::cuda_compute_capability(device.index());
  // torch's check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89:
  // those GPUs lack the shared memory for that backward.
  const bool sm86_or_89 = capability == 86 || capability == 89;
  return capability >= 80 && !(sm86_or_89 && needs_grad && head_size > 192 && head_size <= 224);
}

bool flash_attention_runs(const at::Tensor& q, bool needs_grad) {
  return q.dim() == 4 && flash_attention_runs(q.device(), q.scalar_type(), q.size(3), needs_grad);
}

at::Tensor packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_seqlens, int64_t max_seqlen, std::optional<int64_t> window) {
  // The causal shapes: the sequences' keys are their own queries' tokens.
  check_attention_shapes(q, k, v, at::Tensor());
  check_attention_dtypes(q, k, v, "packed_attention");
  ST_CHECK(flash_attention_runs(q, attention_needs_grad(q, k, v)), "packed_attention: FlashAttention does not run ",
           "for q ", q.sizes(), " ", q.scalar_type(), " on ", q.device(), " (see flash_attention_runs)");
  const int64_t B = q.size(0), T = q.size(2), d = q.size(3);
  ST_CHECK(cu_seqlens.defined() && cu_seqlens.device() == q.device() && cu_seqlens.scalar_type() == at::kInt,
           "packed_attention: the sequence offsets are not int32 on ", q.device());
  ST_CHECK(!window || *window > 0, "packed_attention: a window of ", window.value_or(0), " keys");
  // [B,heads,T,d] -> the kernel's [B*T,heads,d]. The models' q, k, v are laid
  // out [B,T,heads,d] (projections, then RoPE), so there these reshapes are
  // views; elsewhere a copy. flash needs only the last stride to be 1.
  auto tokens_first = [&](const at::Tensor& t) { return t.transpose(1, 2).reshape({B * T, t.size(1), d}); };
  // flash's window (left, right): query i attends keys i - left .. i + right.
  const std::optional<int64_t> left = window ? std::optional<int64_t>(*window - 1) : std::nullopt;
  const std::optional<int64_t> right = window ? std::optional<int64_t>(0) : std::nullopt;
  const at::Tensor out = std::get<0>(at::_flash_attention_forward(
      tokens_first(q), tokens_first(k), tokens_first(v), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
      /*dropout_p=*/0.0, /*is_causal=*/true, /*return_debug_mask=*/false, /*scale=*/std::nullopt, left, right));
  return out.view({B, T, q.size(1), d}).transpose(1, 2);
}

}  // namespace shardtrain::kernels
