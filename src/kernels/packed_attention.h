#pragma once
// Causal attention over sequences packed into a batch's rows (instruction
// fine-tuning packs several examples, and the padding, into each row), by
// FlashAttention's variable-length kernel on a GPU. Each sequence attends
// only within itself: the kernel computes the blocks inside the sequences
// and reads no mask, where SDPA with the [B,1,T,T] packing mask runs the
// memory-efficient kernel over every query and key of a row, reading the
// mask as it goes. A sliding window (Mistral's) is the kernel's own window.
// The model (models/llama.cpp) finds the sequences from its document ids,
// asks flash_attention_runs(), and otherwise uses the mask.

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>

namespace shardtrain::kernels {

/// Whether FlashAttention's variable-length kernel runs for q [B,heads,T,d]
/// (packed_attention(); SDPA makes its own choice, which this copies): on a GPU of
/// compute capability 8.0 or newer, in bf16 or fp16, with a head size that
/// is a multiple of 8 up to 256 (on sm_86/sm_89 not 193 to 224 where a
/// backward follows, as torch rules), and not switched off in ATen's
/// context (torch.backends.cuda.enable_flash_sdp(False) in Python,
/// at::globalContext().setSDPUseFlash(false) in C++). One decision, here.
/// needs_grad: a backward will follow (attention_needs_grad).
bool flash_attention_runs(const at::Tensor& q, bool needs_grad);

/// Whether a backward will go through an attention of q, k, v.
inline bool attention_needs_grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return q.requires_grad() || k.requires_grad() || v.requires_grad();
}
/// The same for a q on `device` in `dtype` with heads of `head_size`.
bool flash_attention_runs(const at::Device& device, at::ScalarType dtype, int64_t head_size, bool needs_grad);

/// q [B,heads,T,d]; k, v [B,kv_heads,T,d] with kv_heads dividing heads
/// (grouped as Llama groups them, taken as they are). The B*T tokens, rows
/// laid one after another, hold sequences: sequence s is tokens
/// cu_seqlens[s] .. cu_seqlens[s+1]-1 (int32 [count + 1] on q's device), at
/// most max_seqlen long. Causal attention within each sequence; with a
/// window, each query attends at most `window` keys, itself included.
/// Returns [B,heads,T,d]. Differentiable. Throws shardtrain::Error where
/// flash_attention_runs(q, ...) is false or the shapes do not fit.
at::Tensor packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_seqlens, int64_t max_seqlen, std::optional<int64_t> window);

}  // namespace shardtrain::kernels
