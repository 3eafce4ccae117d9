// The kernel layer's mixed-precision GEMM and attention (shardtrain::nn::
// linear/matmul/scaled_dot_product_attention, kernels::widened_*): the widened
// path's arithmetic and gradients, the error bound every GEMM path (widened,
// LibTorch native, the process's choice) obeys and the one the widened
// attention obeys, and shardtrain::nn::Linear as a drop-in for
// torch::nn::Linear.
#include <cmath>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "build_config.h"  // SHARDTRAIN_BIN_DIR
#include "kernels/mixed_attention.h"
#include "kernels/mixed_gemm.h"
#include "kernels/recompute.h"
#include "shardtrain/error.h"
#include "shardtrain/nn/attention.h"
#include "shardtrain/nn/linear.h"
#include "support/contains.h"
#include "support/multirank.h"

namespace {

namespace kernels = shardtrain::kernels;

at::Tensor random_bf16(std::vector<int64_t> shape, double scale = 1.0) {
  return (at::randn(shape) * scale).to(at::kBFloat16);
}

// Bound on |bf16(fp32 dot) - exact dot| for a k-term dot product of bf16
// values: the products of two 8-bit significands are exact in fp32; k fp32
// additions err by at most gamma_k = k*u/(1-k*u), u = 2^-24, times sum|x_i w_i|
// (Higham, Accuracy and Stability, eq. 3.5) in any order; the final rounding
// to bf16 (8 significant bits, round to nearest) adds at most u_bf16 = 2^-8
// of the fp32 value, itself within the first error of the exact one. The fp64 reference's own error (k * 2^-53 relative) is
// below 2^-20 of the bound for k < 2^20 and is neglected.
at::Tensor dot_error_bound(const at::Tensor& exact, const at::Tensor& abs_products_sum, int64_t k) {
  const double u = std::ldexp(1.0, -24);
  const double gamma = k * u / (1 - k * u);
  const double half_ulp = std::ldexp(1.0, -8);
  return half_ulp * exact.abs() + (1 + half_ulp) * gamma * abs_products_sum;
}

void expect_within_dot_bound(const at::Tensor& result, const at::Tensor& x, const at::Tensor& w, const char* path) {
  const at::Tensor x64 = x.to(at::kDouble), w64 = w.to(at::kDouble);
  const at::Tensor exact = at::matmul(x64, w64.t());
  const at::Tensor bound = dot_error_bound(exact, at::matmul(x64.abs(), w64.abs().t()), x.size(-1));
  const at::Tensor error = (result.to(at::kDouble) - exact).abs();
  EXPECT_TRUE((error <= bound).all().item<bool>())
      << path << ": worst error/bound " << (error / bound.clamp_min(1e-300)).max().item<double>();
}

TEST(UnitMixedGemm, WidenedLinearIsTheFp32ProductRoundedOnce) {
  torch::manual_seed(1);
  at::Tensor x = random_bf16({3, 5, 40}), w = random_bf16({24, 40}), b = random_bf16({24});
  at::Tensor expected = at::linear(x.to(at::kFloat), w.to(at::kFloat), b.to(at::kFloat)).to(at::kBFloat16);
  at::Tensor y = kernels::widened_linear(x, w, b);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(y, expected));
  EXPECT_TRUE(at::equal(kernels::widened_linear(x, w, at::Tensor()),
                        at::linear(x.to(at::kFloat), w.to(at::kFloat)).to(at::kBFloat16)));
}

TEST(UnitMixedGemm, WidenedLinearGradientsAreTheFp32ProductsRoundedOnce) {
  torch::manual_seed(2);
  at::Tensor x = random_bf16({2, 7, 32}).requires_grad_(), w = random_bf16({16, 32}).requires_grad_(),
             b = random_bf16({16}).requires_grad_();
  at::Tensor g = random_bf16({2, 7, 16});
  kernels::widened_linear(x, w, b).backward(g);
  const at::Tensor g32 = g.to(at::kFloat).reshape({-1, 16});
  const at::Tensor x32 = x.detach().to(at::kFloat).reshape({-1, 32});
  EXPECT_TRUE(at::equal(x.grad(), at::matmul(g.to(at::kFloat), w.detach().to(at::kFloat)).to(at::kBFloat16)));
  EXPECT_TRUE(at::equal(w.grad(), at::mm(g32.t(), x32).to(at::kBFloat16)));
  EXPECT_TRUE(at::equal(b.grad(), g32.sum(0).to(at::kBFloat16)));
  EXPECT_EQ(x.grad().scalar_type(), at::kBFloat16);
  EXPECT_EQ(w.grad().scalar_type(), at::kBFloat16);
}

TEST(UnitMixedGemm, FrozenWeightGetsNoGradientAndInputGradientStillFlows) {
  torch::manual_seed(3);
  at::Tensor x = random_bf16({4, 8}).requires_grad_(), w = random_bf16({6, 8});
  kernels::widened_linear(x, w, at::Tensor()).sum().backward();
  EXPECT_FALSE(w.grad().defined());
  ASSERT_TRUE(x.grad().defined());
  EXPECT_TRUE(at::equal(x.grad(), at::ones({4, 6}).matmul(w.to(at::kFloat)).to(at::kBFloat16)));
}

TEST(UnitMixedGemm, EveryPathStaysWithinTheFp32AccumulationBound) {
  torch::manual_seed(4);
  // k = 512: long enough for accumulation error to matter in the bound.
  at::Tensor x = random_bf16({16, 512}), w = random_bf16({48, 512}, 0.05);
  expect_within_dot_bound(kernels::widened_linear(x, w, at::Tensor()), x, w, "widened");
  // LibTorch's own kernel where it runs (oneDNN capped by DNNL_MAX_CPU_ISA has none).
  at::Tensor native;
  try {
    native = at::linear(x, w);
  } catch (const std::exception&) {
  }
  if (native.defined()) expect_within_dot_bound(native, x, w, "LibTorch native bf16");
  expect_within_dot_bound(shardtrain::nn::linear(x, w), x, w, "shardtrain::nn (this process's choice)");
  expect_within_dot_bound(shardtrain::nn::matmul(x, w.t()), x, w, "shardtrain::nn::matmul");
}

TEST(UnitMixedGemm, BatchedAndBroadcastingMatmulMatchTheWidenedArithmetic) {
  torch::manual_seed(5);
  at::Tensor a = random_bf16({2, 3, 5, 8}).requires_grad_(), b = random_bf16({2, 3, 8, 4}).requires_grad_();
  at::Tensor g = random_bf16({2, 3, 5, 4});
  at::Tensor y = kernels::widened_matmul(a, b);
  EXPECT_TRUE(at::equal(y, at::matmul(a.detach().to(at::kFloat), b.detach().to(at::kFloat)).to(at::kBFloat16)));
  y.backward(g);
  const at::Tensor g32 = g.to(at::kFloat);
  EXPECT_TRUE(at::equal(a.grad(), at::matmul(g32, b.detach().to(at::kFloat).transpose(-2, -1)).to(at::kBFloat16)));
  EXPECT_TRUE(at::equal(b.grad(), at::matmul(a.detach().to(at::kFloat).transpose(-2, -1), g32).to(at::kBFloat16)));

  // Broadcasting (a batch of matrices times one matrix) takes the autograd-of-casts route.
  at::Tensor c = random_bf16({3, 5, 8}).requires_grad_(), d = random_bf16({8, 4}).requires_grad_();
  at::Tensor z = kernels::widened_matmul(c, d);
  at::Tensor c32 = c.detach().to(at::kFloat).requires_grad_(), d32 = d.detach().to(at::kFloat).requires_grad_();
  at::Tensor z32 = at::matmul(c32, d32);
  EXPECT_TRUE(at::equal(z, z32.to(at::kBFloat16)));
  at::Tensor h = random_bf16({3, 5, 4});
  z.backward(h);
  z32.backward(h.to(at::kFloat));
  EXPECT_TRUE(at::equal(c.grad(), c32.grad().to(at::kBFloat16)));
  EXPECT_TRUE(at::equal(d.grad(), d32.grad().to(at::kBFloat16)));
}

TEST(UnitMixedGemm, Fp16OnTheCpuIsAlwaysWidenedAndFp32IsUntouched) {
  torch::manual_seed(6);
  at::Tensor x = at::randn({4, 16}).to(at::kHalf), w = at::randn({8, 16}).to(at::kHalf);
  EXPECT_TRUE(kernels::widens_gemm(x));
  EXPECT_TRUE(at::equal(shardtrain::nn::linear(x, w), at::linear(x.to(at::kFloat), w.to(at::kFloat)).to(at::kHalf)));
  at::Tensor x32 = at::randn({4, 16}), w32 = at::randn({8, 16});
  EXPECT_FALSE(kernels::widens_gemm(x32));
  EXPECT_TRUE(at::equal(shardtrain::nn::linear(x32, w32), at::linear(x32, w32)));
}

TEST(UnitMixedGemm, MixedDtypesAreRejectedByName) {
  at::Tensor x = random_bf16({2, 4}), w = at::randn({3, 4});
  EXPECT_ANY_THROW(shardtrain::nn::linear(x, w));
  try {
    kernels::widened_linear(x, w, at::Tensor());
    FAIL() << "widened_linear accepted bf16 x fp32";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("must share one bf16/fp16 dtype"), std::string::npos) << e.what();
  }
}

TEST(UnitMixedGemm, LinearModuleIsADropInForTorchLinear) {
  torch::manual_seed(7);
  torch::nn::Linear reference(torch::nn::LinearOptions(12, 5).bias(true));
  torch::manual_seed(7);
  shardtrain::nn::Linear ours(torch::nn::LinearOptions(12, 5).bias(true));
  auto ref_params = reference->named_parameters();
  auto our_params = ours->named_parameters();
  ASSERT_EQ(our_params.keys(), ref_params.keys());
  for (const auto& item : ref_params) EXPECT_TRUE(at::equal(our_params[item.key()], item.value())) << item.key();
  at::Tensor x = at::randn({3, 12});
  EXPECT_TRUE(at::equal(ours(x), reference(x)));  // fp32: straight to at::linear
  ours->to(at::kBFloat16);
  at::Tensor xb = x.to(at::kBFloat16);
  at::Tensor expected = kernels::widens_gemm(xb) ? kernels::widened_linear(xb, ours->weight, ours->bias)
                                                  : at::linear(xb, ours->weight, ours->bias);
  EXPECT_TRUE(at::equal(ours(xb), expected));
  // Usable where a torch::nn::LinearImpl is expected.
  EXPECT_NE(ours->as<torch::nn::LinearImpl>(), nullptr);
}

TEST(UnitMixedGemm, ThisProcessesChoiceIsExplained) {
  const auto& choice = shardtrain::nn::cpu_low_precision_gemm();
  EXPECT_FALSE(choice.reason.empty());
  const std::string text = choice.describe();
  EXPECT_NE(text.find(choice.widened ? "widened to fp32" : "native"), std::string::npos) << text;
  const char* forced = std::getenv("SHARDTRAIN_CPU_GEMM");
  if (forced != nullptr && std::string(forced) != "auto") {
    EXPECT_EQ(choice.widened, std::string(forced) == "widened") << text;
  } else if (!choice.native_bf16_cpu) {  // also under SHARDTRAIN_CPU_DISABLE_ONEDNN
    EXPECT_TRUE(choice.widened) << "a CPU without native bf16 must widen: " << text;
  }
}

// The choice is made once per process, so the overrides are checked in fresh
// processes: `shardtrain env` reports the path each one took.
TEST(UnitMixedGemm, OverridesChooseThePathAndABadValueIsNamed) {
  const std::string env = std::string(SHARDTRAIN_BIN_DIR) + "/shardtrain env --no-bench 2>&1";
  using shardtrain::testing::run_command;
  auto widened = run_command("SHARDTRAIN_CPU_GEMM=widened " + env, std::chrono::seconds(60));
  EXPECT_EQ(widened.exit_code, 0) << widened.output;
  EXPECT_NE(widened.output.find("widened to fp32 (fp32 GEMM, one rounding): SHARDTRAIN_CPU_GEMM=widened"),
            std::string::npos) << widened.output;
  auto no_onednn = run_command("SHARDTRAIN_CPU_GEMM=auto SHARDTRAIN_CPU_DISABLE_ONEDNN=1 " + env,
                               std::chrono::seconds(60));
  EXPECT_EQ(no_onednn.exit_code, 0) << no_onednn.output;
  EXPECT_NE(no_onednn.output.find("widened to fp32 (fp32 GEMM, one rounding): SHARDTRAIN_CPU_DISABLE_ONEDNN=1"),
            std::string::npos) << no_onednn.output;
  auto bad = run_command("SHARDTRAIN_CPU_GEMM=bogus " + env, std::chrono::seconds(60));
  EXPECT_NE(bad.exit_code, 0) << bad.output;
  EXPECT_NE(bad.output.find("SHARDTRAIN_CPU_GEMM='bogus' is not one of auto, native, widened"), std::string::npos)
      << bad.output;
}

// ---- attention ---------------------------------------------------------------

/// q, k, v [B, heads, T, d] in bf16 and a causal mask [B, 1, T, T] that
/// leaves every query at least one key (a row with none would be NaN).
struct AttentionInputs {
  at::Tensor q, k, v, attend;
};

AttentionInputs attention_inputs(int64_t batch, int64_t heads, int64_t tokens, int64_t head_dim) {
  AttentionInputs in;
  in.q = random_bf16({batch, heads, tokens, head_dim});
  in.k = random_bf16({batch, heads, tokens, head_dim});
  in.v = random_bf16({batch, heads, tokens, head_dim});
  in.attend = at::ones({tokens, tokens}, at::kBool).tril().expand({batch, 1, tokens, tokens});
  return in;
}

at::Tensor fp32_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& attend) {
  return at::scaled_dot_product_attention(q, k, v, attend, 0.0, false);
}

TEST(UnitMixedAttention, WidenedAttentionIsTheFp32AttentionRoundedOnce) {
  torch::manual_seed(11);
  AttentionInputs in = attention_inputs(2, 3, 40, 16);
  for (at::Tensor* t : {&in.q, &in.k, &in.v}) t->requires_grad_();
  at::Tensor out = kernels::widened_attention(in.q, in.k, in.v, in.attend);
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  // The same attention by autograd through the casts: it keeps fp32 copies
  // for backward, which the widened path recomputes instead; the values and
  // the gradients must not differ by a bit.
  at::Tensor q32 = in.q.detach().to(at::kFloat).requires_grad_(), k32 = in.k.detach().to(at::kFloat).requires_grad_(),
             v32 = in.v.detach().to(at::kFloat).requires_grad_();
  at::Tensor out32 = fp32_sdpa(q32, k32, v32, in.attend);
  EXPECT_TRUE(at::equal(out, out32.to(at::kBFloat16)));
  at::Tensor g = random_bf16(out.sizes().vec());
  out.backward(g);
  out32.backward(g.to(at::kFloat));
  EXPECT_TRUE(at::equal(in.q.grad(), q32.grad().to(at::kBFloat16)));
  EXPECT_TRUE(at::equal(in.k.grad(), k32.grad().to(at::kBFloat16)));
  EXPECT_TRUE(at::equal(in.v.grad(), v32.grad().to(at::kBFloat16)));
  EXPECT_EQ(in.q.grad().scalar_type(), at::kBFloat16);
}

// Inside a recomputation (selective checkpointing reruns the attention in
// backward) the widened attention builds its plain graph through the casts
// rather than its recomputing function, so it is computed once there, not
// twice; the gradients are the same bits either way.
TEST(UnitMixedAttention, InsideARecomputationItIsDifferentiatedWithoutRecomputingAgain) {
  torch::manual_seed(15);
  AttentionInputs in = attention_inputs(2, 2, 20, 8);
  for (at::Tensor* t : {&in.q, &in.k, &in.v}) t->requires_grad_();
  const at::Tensor direct = kernels::widened_attention(in.q, in.k, in.v, in.attend);
  EXPECT_NE(direct.grad_fn()->name().find("WidenedAttention"), std::string::npos) << direct.grad_fn()->name();
  const at::Tensor g = random_bf16(direct.sizes().vec());
  direct.backward(g);
  std::string node_inside;
  const at::NoGradGuard as_in_backward;  // the autograd engine runs backward so
  const std::vector<at::Tensor> recomputed = kernels::recomputed_gradients(
      {in.q, in.k, in.v},
      [&](const std::vector<at::Tensor>& qkv) {
        EXPECT_TRUE(kernels::in_recomputation());
        at::Tensor out = kernels::widened_attention(qkv[0], qkv[1], qkv[2], in.attend);
        node_inside = out.grad_fn()->name();
        return out;
      },
      g, "the test's attention");
  EXPECT_EQ(node_inside.find("WidenedAttention"), std::string::npos) << node_inside;
  EXPECT_FALSE(kernels::in_recomputation());
  EXPECT_TRUE(at::equal(recomputed[0], in.q.grad()));
  EXPECT_TRUE(at::equal(recomputed[1], in.k.grad()));
  EXPECT_TRUE(at::equal(recomputed[2], in.v.grad()));
}

TEST(UnitMixedAttention, AnInputWithoutGradientGetsNoneAndTheOthersStillFlow) {
  torch::manual_seed(12);
  AttentionInputs in = attention_inputs(1, 2, 12, 8);
  in.q.requires_grad_();
  kernels::widened_attention(in.q, in.k, in.v, in.attend).sum().backward();
  ASSERT_TRUE(in.q.grad().defined());
  EXPECT_FALSE(in.k.grad().defined());
  EXPECT_FALSE(in.v.grad().defined());
}

// The widened attention keeps the probabilities in fp32, so its only coarse
// error is the final rounding to bf16: |out - exact| <= 2^-8 |exact| + delta,
// with delta the fp32 pipeline's error, bounded per output row i by
//   max_j |v_j| * (expm1(2 E_i) + 2 (S + 8) u) + gamma_S * max_j |v_j|
// where u = 2^-24, gamma_n = n u / (1 - n u) (Higham eq. 3.5), S the number of
// keys and E_i = gamma_d * scale * max_j sum_t |q_it k_jt| the error of one
// score: a score error E moves a softmax probability by a factor within
// exp(+-2E); the exponentials, the online-softmax rescalings (one per block of
// keys, at most S) and the division add at most (S + 8) roundings of u to
// each probability, doubled for the normalising sum; the P v product errs by
// gamma_S sum_j p_j |v_j|. Rounding the probabilities to bf16 (what LibTorch's
// bf16 kernel does) errs by ~2^-9 sum_j p_j |v_j|, far over delta: this bound
// tells the two apart.
TEST(UnitMixedAttention, WidenedAttentionErrsOnlyByTheFinalBf16Rounding) {
  torch::manual_seed(13);
  const int64_t tokens = 256, head_dim = 64;
  AttentionInputs in = attention_inputs(2, 2, tokens, head_dim);
  const at::Tensor q = in.q.to(at::kDouble), k = in.k.to(at::kDouble), v = in.v.to(at::kDouble);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  const at::Tensor exact = fp32_sdpa(q, k, v, in.attend);
  const double u = std::ldexp(1.0, -24);
  auto gamma = [&](double n) { return n * u / (1 - n * u); };
  const at::Tensor score_error = gamma(head_dim) * scale * at::matmul(q.abs(), k.abs().transpose(-2, -1)).amax(-1, true);
  const at::Tensor v_max = v.abs().amax({-2, -1}, true);
  const at::Tensor delta =
      v_max * (at::expm1(2 * score_error) + 2 * (tokens + 8) * u) + gamma(tokens) * v_max;
  const at::Tensor bound = std::ldexp(1.0, -8) * exact.abs() + (1 + std::ldexp(1.0, -8)) * delta;
  const at::Tensor error = (kernels::widened_attention(in.q, in.k, in.v, in.attend).to(at::kDouble) - exact).abs();
  EXPECT_TRUE((error <= bound).all().item<bool>())
      << "worst error/bound " << (error / bound).max().item<double>();
}

TEST(UnitMixedAttention, ThePublicAttentionFollowsThisProcessesGemmChoice) {
  torch::manual_seed(14);
  AttentionInputs in = attention_inputs(1, 2, 24, 8);
  const at::Tensor ours = shardtrain::nn::scaled_dot_product_attention(in.q, in.k, in.v, in.attend);
  const at::Tensor expected = kernels::widens_gemm(in.q) ? kernels::widened_attention(in.q, in.k, in.v, in.attend)
                                                          : fp32_sdpa(in.q, in.k, in.v, in.attend);
  EXPECT_TRUE(at::equal(ours, expected));
  // fp16 on the CPU is always widened; fp32 goes straight to LibTorch's.
  const at::Tensor qh = in.q.to(at::kHalf), kh = in.k.to(at::kHalf), vh = in.v.to(at::kHalf);
  EXPECT_TRUE(at::equal(shardtrain::nn::scaled_dot_product_attention(qh, kh, vh, in.attend),
                        fp32_sdpa(qh.to(at::kFloat), kh.to(at::kFloat), vh.to(at::kFloat), in.attend).to(at::kHalf)));
  const at::Tensor q32 = in.q.to(at::kFloat), k32 = in.k.to(at::kFloat), v32 = in.v.to(at::kFloat);
  EXPECT_TRUE(at::equal(shardtrain::nn::scaled_dot_product_attention(q32, k32, v32, in.attend),
                        fp32_sdpa(q32, k32, v32, in.attend)));
}

/// Forward and the q, k, v gradients of `attention` for an upstream gradient g.
std::vector<at::Tensor> attention_and_grads(
    const std::function<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>& attention,
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g) {
  const at::Tensor q1 = q.detach().requires_grad_(), k1 = k.detach().requires_grad_(),
                   v1 = v.detach().requires_grad_();
  const at::Tensor out = attention(q1, k1, v1);
  std::vector<at::Tensor> result = torch::autograd::grad({out}, {q1, k1, v1}, {g});
  result.insert(result.begin(), out.detach());
  return result;
}

// Causal attention without a mask tensor is the masked call with the causal
// triangle, bit for bit, grouped key/value heads included, in every dtype and
// through either path (LibTorch's kernel, the widened one): zero tolerance,
// because both calls run one kernel over the same blocks of keys in the same
// order, and a block the causal call skips adds to the masked call's sums
// only exp(-inf) = 0 and products with it, exact zeros that change no bit.
// A causal call that attended one key too many or too few moves the output
// by the weight of that key, far beyond a bit.
TEST(UnitMixedAttention, CausalAttentionIsTheMaskedCallBitForBit) {
  torch::manual_seed(16);
  const int64_t batch = 2, heads = 8, kv_heads = 2, tokens = 80, head_dim = 32;
  const at::Tensor mask = at::ones({tokens, tokens}, at::kBool).tril().expand({batch, 1, tokens, tokens});
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const at::Tensor q = random_bf16({batch, heads, tokens, head_dim}).to(dtype);
    const at::Tensor k = random_bf16({batch, kv_heads, tokens, head_dim}).to(dtype);
    const at::Tensor v = random_bf16({batch, kv_heads, tokens, head_dim}).to(dtype);
    const at::Tensor g = random_bf16({batch, heads, tokens, head_dim}).to(dtype);
    const auto causal = attention_and_grads(shardtrain::nn::causal_scaled_dot_product_attention, q, k, v, g);
    const auto masked = attention_and_grads(
        [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
          return shardtrain::nn::scaled_dot_product_attention(a, b, c, mask);
        },
        q, k, v, g);
    const char* names[] = {"output", "q gradient", "k gradient", "v gradient"};
    for (std::size_t i = 0; i < causal.size(); ++i) {
      EXPECT_TRUE(at::equal(causal[i], masked[i])) << dtype << " " << names[i] << ": largest difference "
                                                   << (causal[i] - masked[i]).abs().max().item<double>();
    }
    EXPECT_EQ(causal[2].sizes(), k.sizes()) << "the grouped heads' gradient has their shape";
  }
}

// Grouped key/value heads serve their query heads as Llama groups them (key
// head j: query heads j*g .. j*g+g-1), on the CPU by repeating them, which is
// SDPA's own grouping (enable_gqa, what a GPU's FlashAttention gets) bit for
// bit in the forward: each query head meets the same key/value values either
// way, only where they are read from differs.
TEST(UnitMixedAttention, GroupedHeadsServeTheirQueryHeadsAsSdpaGroupsThem) {
  torch::manual_seed(17);
  const int64_t batch = 2, heads = 6, kv_heads = 3, tokens = 24, head_dim = 16, group = heads / kv_heads;
  const at::Tensor q = at::randn({batch, heads, tokens, head_dim});
  const at::Tensor k = at::randn({batch, kv_heads, tokens, head_dim});
  const at::Tensor v = at::randn({batch, kv_heads, tokens, head_dim});
  EXPECT_FALSE(kernels::attention_takes_grouped_heads(q, k, v, at::Tensor())) << "the CPU repeats the heads";
  const at::Tensor ours = shardtrain::nn::causal_scaled_dot_product_attention(q, k, v);
  const at::Tensor sdpa_grouped = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, /*is_causal=*/true,
                                                                   std::nullopt, /*enable_gqa=*/true);
  EXPECT_TRUE(at::equal(ours, sdpa_grouped));
  // Query head h alone against its key/value head h / group.
  for (int64_t h = 0; h < heads; ++h) {
    const at::Tensor one = at::scaled_dot_product_attention(
        q.narrow(1, h, 1), k.narrow(1, h / group, 1), v.narrow(1, h / group, 1), std::nullopt, 0.0, true);
    EXPECT_TRUE(at::equal(ours.narrow(1, h, 1), one)) << "query head " << h;
  }
}

TEST(UnitMixedAttention, ShapesThatDoNotFitAreRefusedNamingThem) {
  const at::Tensor q = at::randn({1, 6, 8, 4}), k = at::randn({1, 4, 8, 4}), v = at::randn({1, 4, 8, 4});
  const at::Tensor mask = at::ones({1, 1, 8, 8}, at::kBool);
  using shardtrain::testing::error_message_of;
  const std::string heads = error_message_of([&] { shardtrain::nn::scaled_dot_product_attention(q, k, v, mask); });
  EXPECT_NE(heads.find("divides"), std::string::npos) << heads;
  const at::Tensor k2 = at::randn({1, 2, 5, 4}), v2 = at::randn({1, 2, 5, 4});
  const std::string causal = error_message_of([&] { shardtrain::nn::causal_scaled_dot_product_attention(q, k2, v2); });
  EXPECT_NE(causal.find("8 queries over 5 keys"), std::string::npos) << causal;
  const std::string uncovered =
      error_message_of([&] { shardtrain::nn::scaled_dot_product_attention(q, k2, v2, mask); });
  EXPECT_NE(uncovered.find("does not cover 8 queries over 5 keys"), std::string::npos) << uncovered;
  const std::string undefined =
      error_message_of([&] { shardtrain::nn::scaled_dot_product_attention(q, k2, v2, at::Tensor()); });
  EXPECT_NE(undefined.find("causal_scaled_dot_product_attention"), std::string::npos) << undefined;
}

}  // namespace
