// Mixed-precision GEMM dispatch (mixed_gemm.h) and the widened CPU path as
// autograd functions. Each function saves its low-precision inputs and widens
// them again in backward: saving the fp32 copies instead would keep a second,
// fp32 copy of every gathered weight alive until backward and defeat sharding.
#include "kernels/mixed_gemm.h"

#include <vector>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "kernels/cpu/cpu_gemm_choice.h"
#include "shardtrain/error.h"

namespace shardtrain::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor widen(const at::Tensor& t) { return t.to(at::kFloat); }

/// The gradient products of double backward are not written; the engine's
/// hooks never need them and silently wrong ones would be worse than none.
void check_no_double_backward() {
  ST_CHECK(!at::GradMode::is_enabled(),
           "double backward (create_graph) through shardtrain's widened bf16/fp16 GEMM is not supported");
}

/// x @ w^T in forward; the gradient products of backward. Shared by the two
/// autograd functions below: LibTorch's Function::apply rejects an undefined
/// tensor argument ("tensor does not have a device", 2.11 too), so "no bias"
/// needs a function of its own.
at::Tensor widened_linear_forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                                  const at::Tensor& b) {
  ctx->save_for_backward({x, w});
  ctx->saved_data["x_grad"] = x.requires_grad();
  ctx->saved_data["w_grad"] = w.requires_grad();
  ctx->saved_data["b_grad"] = b.defined() && b.requires_grad();
  return at::linear(widen(x), widen(w), b.defined() ? widen(b) : at::Tensor()).to(x.scalar_type());
}

/// Gradients of x, w and (when `with_bias`) b; the bias shares w's dtype.
variable_list widened_linear_backward(AutogradContext* ctx, const variable_list& grads, bool with_bias) {
  check_no_double_backward();
  auto saved = ctx->get_saved_variables();
  const at::Tensor& x = saved[0];
  const at::Tensor& w = saved[1];
  variable_list result(with_bias ? 3 : 2);
  if (!grads[0].defined()) return result;
  const at::Tensor g = widen(grads[0]);
  const int64_t out_features = w.size(0), in_features = w.size(1);
  if (ctx->saved_data["x_grad"].toBool()) result[0] = at::matmul(g, widen(w)).to(x.scalar_type());
  const at::Tensor g2 = g.reshape({-1, out_features});
  if (ctx->saved_data["w_grad"].toBool()) {
    result[1] = at::mm(g2.t(), widen(x).reshape({-1, in_features})).to(w.scalar_type());
  }
  if (with_bias && ctx->saved_data["b_grad"].toBool()) result[2] = g2.sum(0).to(w.scalar_type());
  return result;
}

struct WidenedLinear : torch::autograd::Function<WidenedLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w) {
    return widened_linear_forward(ctx, x, w, at::Tensor());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return widened_linear_backward(ctx, grads, false);
  }
};

struct WidenedLinearWithBias : torch::autograd::Function<WidenedLinearWithBias> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
    return widened_linear_forward(ctx, x, w, b);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return widened_linear_backward(ctx, grads, true);
  }
};

at::Tensor apply_widened_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  return b.defined() ? WidenedLinearWithBias::apply(x, w, b) : WidenedLinear::apply(x, w);
}

/// a [..., n, k] @ b [..., k, m] with identical batch dimensions; other shapes
/// take the broadcasting fallback in mixed_matmul.
struct WidenedBatchedMatmul : torch::autograd::Function<WidenedBatchedMatmul> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b) {
    ctx->save_for_backward({a, b});
    ctx->saved_data["a_grad"] = a.requires_grad();
    ctx->saved_data["b_grad"] = b.requires_grad();
    return at::matmul(widen(a), widen(b)).to(a.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    check_no_double_backward();
    auto saved = ctx->get_saved_variables();
    const at::Tensor& a = saved[0];
    const at::Tensor& b = saved[1];
    variable_list result(2);
    if (!grads[0].defined()) return result;
    const at::Tensor g = widen(grads[0]);
    if (ctx->saved_data["a_grad"].toBool()) result[0] = at::matmul(g, widen(b).transpose(-2, -1)).to(a.scalar_type());
    if (ctx->saved_data["b_grad"].toBool()) result[1] = at::matmul(widen(a).transpose(-2, -1), g).to(b.scalar_type());
    return result;
  }
};

bool is_low_precision(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

bool all_same_dtype(std::initializer_list<const at::Tensor*> tensors, at::ScalarType dtype) {
  for (const at::Tensor* t : tensors) {
    if (t->defined() && t->scalar_type() != dtype) return false;
  }
  return true;
}

}  // namespace

bool widens_gemm(const at::Tensor& t) {
  if (!t.is_cpu() || !is_low_precision(t.scalar_type())) return false;
  // fp16: LibTorch 2.11 multiplies it natively (oneDNN) only on CPUs with
  // AVX512-FP16 or AMX-FP16; elsewhere its scalar fallback ran at 2.1
  // against fp32's 141.8 GFLOP/s (512^3, one thread, oneDNN capped at AVX2,
  // Intel Xeon). fp16 training on a CPU is rare: one widened path on every
  // CPU rather than a second flag rule.
  if (t.scalar_type() == at::kHalf) return true;
  return cpu::low_precision_gemm_choice().widened;
}

at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  ST_CHECK(is_low_precision(x.scalar_type()) && all_same_dtype({&w, &b}, x.scalar_type()),
           "widened_linear: input, weight and bias must share one bf16/fp16 dtype, got ", x.scalar_type(), ", ",
           w.scalar_type());
  return apply_widened_linear(x, w, b);
}

at::Tensor mixed_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  // Mixed dtypes are an error either way: at::linear names it.
  if (!widens_gemm(x) || !all_same_dtype({&w, &b}, x.scalar_type())) return at::linear(x, w, b);
  return apply_widened_linear(x, w, b);
}

at::Tensor mixed_matmul(const at::Tensor& a, const at::Tensor& b) {
  if (!widens_gemm(a) || !all_same_dtype({&b}, a.scalar_type())) return at::matmul(a, b);
  return widened_matmul(a, b);
}

at::Tensor widened_matmul(const at::Tensor& a, const at::Tensor& b) {
  ST_CHECK(is_low_precision(a.scalar_type()) && all_same_dtype({&b}, a.scalar_type()),
           "widened_matmul: both operands must share one bf16/fp16 dtype, got ", a.scalar_type(), ", ",
           b.scalar_type());
  const bool same_batch = a.dim() >= 2 && a.dim() == b.dim() &&
                          a.sizes().slice(0, a.dim() - 2) == b.sizes().slice(0, b.dim() - 2);
  if (same_batch) return WidenedBatchedMatmul::apply(a, b);
  // Broadcasting shapes: autograd through the casts gives the same widened
  // arithmetic (at the cost of saving fp32 copies of the operands).
  return at::matmul(widen(a), widen(b)).to(a.scalar_type());
}

}  // namespace shardtrain::kernels
