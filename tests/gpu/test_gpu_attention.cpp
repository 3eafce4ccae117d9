// FlashAttention's variable-length kernel over packed sequences (the Llama
// models' attention for packed fine-tuning batches on a GPU in 16 bits,
// kernels/packed_attention.h) against the attention under the packing mask
// computed in fp64, output and gradients, within what bf16 rounding allows;
// with packed documents and with a sliding window, over grouped key/value
// heads; and the causal attention without a mask (SDPA's fused kernels on
// the grouped heads as they are) against the same reference. The packed
// cases go through the model's core_attention, which on a GPU must never
// build the packing mask's tensor. In the dry run the CPU's bf16 attention
// stands in for the GPU's, so the reference and the bounds run before they
// meet a GPU.

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include "gpu_test_device.h"
#include "kernels/packed_attention.h"
#include "shardtrain/models/llama.h"
#include "shardtrain/nn/attention.h"

namespace {

using shardtrain::testing::test_device;

constexpr int64_t kRows = 2, kTokens = 96, kHeads = 8, kKvHeads = 2, kHeadDim = 64;

struct PackingCase {
  const char* name;
  std::vector<std::vector<int64_t>> document_lengths;  ///< per row, summing to kTokens
  std::optional<int64_t> window;
  /// Not packed: plain causal attention through SDPA (no mask tensor, the
  /// grouped heads as they are where a fused kernel takes them).
  bool causal_sdpa = false;
};

const PackingCase kPackings[] = {
    {"documents", {{40, 30, 26}, {96}}, std::nullopt},
    {"window_and_documents", {{96}, {50, 46}}, 24},
    {"causal_sdpa", {{96}, {96}}, std::nullopt, true},
};

at::Tensor document_ids_of(const PackingCase& c) {
  std::vector<at::Tensor> rows;
  for (const auto& lengths : c.document_lengths) {
    std::vector<at::Tensor> docs;
    for (std::size_t d = 0; d < lengths.size(); ++d) docs.push_back(at::full({lengths[d]}, int64_t(d), at::kLong));
    rows.push_back(at::cat(docs));
  }
  return at::stack(rows);
}

/// The model's mask: key j for query i when j <= i, within the window, same document.
at::Tensor packing_mask(const at::Tensor& document_ids, std::optional<int64_t> window) {
  const at::Tensor idx = at::arange(kTokens, at::kLong);
  const at::Tensor diff = idx.unsqueeze(1) - idx.unsqueeze(0);
  at::Tensor allowed = diff >= 0;
  if (window) allowed = allowed & (diff < *window);
  return allowed.view({1, 1, kTokens, kTokens}) &
         (document_ids.unsqueeze(2) == document_ids.unsqueeze(1)).unsqueeze(1);
}

at::Tensor repeat_heads(const at::Tensor& kv) {
  return kv.unsqueeze(2).expand({kRows, kKvHeads, kHeads / kKvHeads, kTokens, kHeadDim}).reshape(
      {kRows, kHeads, kTokens, kHeadDim});
}
at::Tensor sum_groups(const at::Tensor& per_query_head) {
  return per_query_head.view({kRows, kKvHeads, kHeads / kKvHeads, kTokens, kHeadDim}).sum(2);
}

/// Largest |got - expected| / bound; <= 1 passes.
double worst_ratio(const at::Tensor& got, const at::Tensor& expected, const at::Tensor& bound) {
  return ((got.to(at::kCPU, at::kDouble) - expected).abs() / bound).max().item<double>();
}

// Why these bounds. The inputs are bf16 values, exact in fp64, so the fp64
// attention is the exact one to 2^-50 or so. The kernel computes in fp32 and
// rounds to bf16 (at most 2^-9 relative, half an ulp) at these points: the
// probabilities before the P V product (the normalising sum keeps them
// unrounded), the output; in backward the probabilities again, dS before its
// two products, each query head's gradient and, for grouped key/value
// heads, the sum over the group (flash's grouped backward and the repeated
// heads' backward both sum rounded per-head gradients). r roundings compound
// to (1 + 2^-9)^r - 1: below 2^-7 for three, below 5 x 2^-9 for four. With
// P the exact probabilities and Pv = P |v| (a weighted mean of |v|, per
// output element):
// - out = P v: p rounded (2^-9 p_ij |v_j|, summing to 2^-9 Pv), the
//   normalisation of rounded against unrounded p (2^-9 |out| <= 2^-9 Pv),
//   the output rounded, and the fp32 pipeline, far smaller (delta below):
//   (2^-7 + delta) Pv.
// - dV_j = sum over the group's heads of sum_i p_ij dO_i: p, each head's dV
//   and the group's sum rounded: (5 x 2^-9 + delta) sum p_ij |dO_i|.
// - dS_ij = p_ij (dP_ij - D_i) with dP_ij = dO_i . v_j (fp32 from bf16:
//   gamma_d sum_t |dO_it v_jt|) and D_i = dO_i . out_i taken from the
//   rounded output: off by sum_t |dO_it| times out's own bound. Then p's
//   rounding, dS's, each head's gradient's and the group sum's, four in all:
//   (5 x 2^-9 + delta) |dS| |k| for dQ (|dS| |q| for dK), plus p_ij times
//   the dP and D errors.
// delta = expm1(2 E) + 2 (S + 8) u + gamma_S (u = 2^-24, E a score's fp32
// error gamma_d scale max sum_t |q_t k_t|), as the widened attention's test
// derives it. A key attended that should not be (a window off by one, a
// document boundary missed) moves an output by about its weight, 1/24 to
// 1/96 of |v|: several times these bounds.
struct Reference {
  at::Tensor out, dq, dk, dv;
  at::Tensor out_bound, dq_bound, dk_bound, dv_bound;
};

Reference fp64_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                         const at::Tensor& allowed) {
  const double u = std::ldexp(1.0, -24);
  const double three_roundings = std::ldexp(1.0, -7), four_roundings = 5 * std::ldexp(1.0, -9);
  auto gamma = [&](double n) { return n * u / (1 - n * u); };
  const double scale = 1.0 / std::sqrt(double(kHeadDim));
  const at::Tensor qd = q.to(at::kCPU, at::kDouble), kd = repeat_heads(k.to(at::kCPU, at::kDouble)),
                   vd = repeat_heads(v.to(at::kCPU, at::kDouble)), gd = g.to(at::kCPU, at::kDouble);
  const at::Tensor p =
      at::softmax((at::matmul(qd, kd.transpose(-2, -1)) * scale).masked_fill(~allowed, -INFINITY), -1);
  const double score_error =
      gamma(kHeadDim) * scale * at::matmul(qd.abs(), kd.abs().transpose(-2, -1)).max().item<double>();
  const double delta = std::expm1(2 * score_error) + 2 * (kTokens + 8) * u + gamma(kTokens);
  Reference r;
  r.out = at::matmul(p, vd);
  const at::Tensor pv = at::matmul(p, vd.abs());
  r.out_bound = (three_roundings + delta) * pv;
  const at::Tensor dp = at::matmul(gd, vd.transpose(-2, -1));
  const at::Tensor d_row = (gd * r.out).sum(-1, true);
  const at::Tensor ds = p * (dp - d_row);
  const at::Tensor dp_error = gamma(kHeadDim) * at::matmul(gd.abs(), vd.abs().transpose(-2, -1));
  const at::Tensor d_error = (gd.abs() * r.out_bound).sum(-1, true);
  const at::Tensor ds_bound = (four_roundings + delta) * ds.abs() + p * (dp_error + d_error);
  r.dq = scale * at::matmul(ds, kd);
  r.dq_bound = scale * at::matmul(ds_bound, kd.abs());
  r.dk = sum_groups(scale * at::matmul(ds.transpose(-2, -1), qd));
  r.dk_bound = sum_groups(scale * at::matmul(ds_bound.transpose(-2, -1), qd.abs()));
  r.dv = sum_groups(at::matmul(p.transpose(-2, -1), gd));
  r.dv_bound = sum_groups((four_roundings + delta) * at::matmul(p.transpose(-2, -1), gd.abs()));
  return r;
}

class GpuPackedAttention : public ::testing::TestWithParam<PackingCase> {};

TEST_P(GpuPackedAttention, IsTheMaskedAttentionWithinBf16Rounding) {
  REQUIRE_TEST_DEVICE();
  const PackingCase c = GetParam();
  torch::manual_seed(21);
  const at::Tensor document_ids = document_ids_of(c);
  const at::Tensor allowed = packing_mask(document_ids, c.window);
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(test_device());
  const at::Tensor q = at::randn({kRows, kHeads, kTokens, kHeadDim}).to(bf16).requires_grad_();
  const at::Tensor k = at::randn({kRows, kKvHeads, kTokens, kHeadDim}).to(bf16).requires_grad_();
  const at::Tensor v = at::randn({kRows, kKvHeads, kTokens, kHeadDim}).to(bf16).requires_grad_();
  const at::Tensor g = at::randn({kRows, kHeads, kTokens, kHeadDim}).to(bf16);

  at::Tensor out;
  if (c.causal_sdpa) {
    out = shardtrain::nn::causal_scaled_dot_product_attention(q, k, v);
  } else {
    // The model's call. On a GPU: FlashAttention's variable-length kernel,
    // and the mask tensor is never built. In the dry run the CPU's masked
    // attention stands in, on the tensor built once.
    const bool flash = shardtrain::kernels::flash_attention_runs(q, true);
    if (test_device().is_cuda()) ASSERT_TRUE(flash) << "FlashAttention should run on this GPU in bf16";
    int builds = 0;
    const shardtrain::models::AttentionMask mask = shardtrain::models::AttentionMask::packed(
        shardtrain::models::packed_sequences(document_ids, kRows, kTokens, test_device(), c.window), [&] {
          ++builds;
          return allowed.expand({kRows, 1, kTokens, kTokens}).to(test_device());
        });
    out = shardtrain::models::core_attention(q, k, v, mask);
    EXPECT_EQ(builds, flash ? 0 : 1) << "the packed mask's tensor was built " << builds << " times";
  }
  const std::vector<at::Tensor> grads = torch::autograd::grad({out}, {q, k, v}, {g});
  const Reference ref = fp64_reference(q.detach(), k.detach(), v.detach(), g, allowed);
  const double ratios[] = {worst_ratio(out.detach(), ref.out, ref.out_bound),
                           worst_ratio(grads[0], ref.dq, ref.dq_bound), worst_ratio(grads[1], ref.dk, ref.dk_bound),
                           worst_ratio(grads[2], ref.dv, ref.dv_bound)};
  const char* names[] = {"output", "q gradient", "k gradient", "v gradient"};
  for (int i = 0; i < 4; ++i) {
    EXPECT_LE(ratios[i], 1.0) << c.name << " " << names[i] << ": worst error / bound on " << test_device();
    RecordProperty(std::string("worst_") + names[i], std::to_string(ratios[i]));
  }
}

INSTANTIATE_TEST_SUITE_P(GpuAttention, GpuPackedAttention, ::testing::ValuesIn(kPackings),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
