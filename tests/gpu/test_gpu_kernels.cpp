// GPU tests of the kernel layer: every CUDA kernel, reached through the
// device dispatch (shardtrain/kernels.h), gives the bits of element_math.h's
// fused-multiply-add lanes, which are the CPU kernels' bits on an FMA CPU; the
// gradient norm is bitwise the CPU kernel's; casts are ATen's. Views at every
// offset mod 4 exercise the launch plan's head, packs and tail.
//
// scripts/gpu-check runs them on a GPU node, where a skip counts as a failure,
// and in its dry run with the CPU standing in for cuda:0 (gpu_test_device.h).

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/element_math.h"
#include "shardtrain/kernels.h"
#include "gpu_test_device.h"
#include "support/awkward_values.h"
#include "shardtrain/error.h"

namespace {

namespace k = shardtrain::kernels;
namespace kmath = shardtrain::kernels::math;
using Fused = kmath::ScalarOps<true>;

at::Device gpu0() { return shardtrain::testing::test_device(); }

/// A CUDA copy of `cpu` starting `offset` elements into its allocation, so
/// the streams' pack alignment (and the plan's head) varies with the offset.
at::Tensor gpu_copy(const at::Tensor& cpu, int64_t offset) {
  at::Tensor storage = at::empty({cpu.numel() + offset}, cpu.options().device(gpu0()));
  at::Tensor view = storage.narrow(0, offset, cpu.numel());
  view.copy_(cpu);
  return view;
}

using shardtrain::testing::same_bits;

/// Bitwise equality where both are numbers; NaN where either is NaN. NaN
/// payloads differ by design between x86 (the first operand's, quieted) and
/// CUDA (one canonical NaN); every other bit must agree.
bool same_bits_up_to_nan_payload(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor nan_a = at::isnan(a), nan_b = at::isnan(b);
  return at::equal(nan_a, nan_b) && same_bits(a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0));
}

using shardtrain::testing::awkward_values;

/// element_math.h's Adam lanes on the host, fused: what every CUDA thread computes.
void host_adam(at::Tensor& p, at::Tensor& m, at::Tensor& v, const at::Tensor& g, const k::AdamParams& params) {
  const kmath::AdamScalars c = k::adam_scalars(params);
  const at::Tensor g32 = g.to(at::kFloat);
  float* pp = p.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  for (int64_t i = 0; i < p.numel(); ++i) kmath::adam_update<Fused>(pp[i], mp[i], vp[i], g32.data_ptr<float>()[i], c);
}

constexpr int64_t kN = 100003;  // several thousand packs and a 3-element tail

TEST(GpuKernels, AdamStepIsTheSharedFusedMathBitForBit) {
  REQUIRE_TEST_DEVICE();
  for (const bool adam_w : {true, false}) {
    for (const double wd : {0.0, 0.1}) {
      for (const at::ScalarType grad_type : {at::kFloat, at::kBFloat16, at::kHalf}) {
        for (const at::ScalarType out_type : {at::kFloat /* none */, at::kBFloat16, at::kHalf}) {
          for (const int64_t offset : {0, 1, 2, 3}) {
            SCOPED_TRACE(::testing::Message() << (adam_w ? "AdamW" : "Adam") << " wd " << wd << " grad " << grad_type
                                              << " out " << out_type << " offset " << offset);
            at::Tensor p = awkward_values(kN, 1, true), m = awkward_values(kN, 2, false) * 1e-3;
            at::Tensor v = awkward_values(kN, 3, false).abs() * 1e-6;
            const at::Tensor grad = awkward_values(kN, 4, true).to(grad_type);
            at::Tensor gp = gpu_copy(p, offset), gm = gpu_copy(m, offset), gv = gpu_copy(v, offset);
            const at::Tensor gg = gpu_copy(grad, offset);
            at::Tensor gout;
            if (out_type != at::kFloat) gout = gpu_copy(at::zeros({kN}, out_type), offset);
            k::AdamParams params;
            params.lr = 1e-2;
            params.weight_decay = wd;
            params.adam_w_mode = adam_w;
            params.step = 3;
            params.grad_scale = 0.25;
            k::adam_step(gp, gm, gv, gg, gout.defined() ? &gout : nullptr, params);
            host_adam(p, m, v, grad, params);
            EXPECT_TRUE(same_bits_up_to_nan_payload(gp.cpu(), p));
            EXPECT_TRUE(same_bits_up_to_nan_payload(gm.cpu(), m));
            EXPECT_TRUE(same_bits_up_to_nan_payload(gv.cpu(), v));
            if (out_type != at::kFloat) EXPECT_TRUE(same_bits_up_to_nan_payload(gout.cpu(), p.to(out_type)));
          }
        }
      }
    }
  }
}

TEST(GpuKernels, AdamStepMatchesTheCpuKernelOnThisFmaCpu) {
  REQUIRE_TEST_DEVICE();
  // The claim the shared math makes: both devices, one set of bits. Every x86
  // CPU that runs a current CUDA driver has FMA, so the CPU kernel fuses too.
  ASSERT_TRUE(k::cpu::fuses_multiply_add()) << "this CPU runs LibTorch's unfused kernels; compare against the "
                                               "shared math instead (GpuKernels.AdamStepIsTheSharedFusedMath...)";
  at::Tensor p = at::randn({kN}), m = at::zeros({kN}), v = at::zeros({kN});
  at::Tensor gp = p.to(gpu0()), gm = m.to(gpu0()), gv = v.to(gpu0());
  for (int64_t step = 1; step <= 5; ++step) {
    const at::Tensor grad = at::randn({kN});
    k::AdamParams params;
    params.weight_decay = 0.01;
    params.step = step;
    k::adam_step(p, m, v, grad, nullptr, params);
    const at::Tensor gg = grad.to(gpu0());
    k::adam_step(gp, gm, gv, gg, nullptr, params);
    ASSERT_TRUE(same_bits(gp.cpu(), p)) << "step " << step;
    ASSERT_TRUE(same_bits(gv.cpu(), v)) << "step " << step;
  }
}

TEST(GpuKernels, PureLowPrecisionAdamRoundsEachStateOnce) {
  REQUIRE_TEST_DEVICE();
  for (const at::ScalarType type : {at::kBFloat16, at::kHalf}) {
    for (const at::ScalarType grad_type : {type, at::kFloat}) {
      SCOPED_TRACE(::testing::Message() << type << " grad " << grad_type);
      at::manual_seed(5);
      const at::Tensor p0 = (at::randn({kN}) * 0.1).to(type);
      at::Tensor gp = gpu_copy(p0, 1), gm = gpu_copy(at::zeros({kN}, type), 1), gv = gpu_copy(at::zeros({kN}, type), 1);
      at::Tensor ps = p0.to(at::kFloat), ms = at::zeros({kN}), vs = at::zeros({kN});
      for (int64_t step = 1; step <= 3; ++step) {
        const at::Tensor grad = (at::randn({kN}) * 1e-2).to(grad_type);
        k::AdamParams params;
        params.lr = 1e-3;
        params.weight_decay = 0.01;
        params.step = step;
        k::adam_step_low_precision(gp, gm, gv, gpu_copy(grad, 1), params);
        host_adam(ps, ms, vs, grad, params);
        ps = ps.to(type).to(at::kFloat);
        ms = ms.to(type).to(at::kFloat);
        vs = vs.to(type).to(at::kFloat);
        EXPECT_TRUE(same_bits(gp.cpu().to(at::kFloat), ps)) << "step " << step;
        EXPECT_TRUE(same_bits(gm.cpu().to(at::kFloat), ms)) << "step " << step;
        EXPECT_TRUE(same_bits(gv.cpu().to(at::kFloat), vs)) << "step " << step;
      }
    }
  }
}

TEST(GpuKernels, SgdStepIsTheSharedFusedMathBitForBit) {
  REQUIRE_TEST_DEVICE();
  for (const double momentum : {0.0, 0.9}) {
    for (const bool nesterov : {false, true}) {
      if (nesterov && momentum == 0.0) continue;
      for (const int64_t offset : {0, 3}) {
        SCOPED_TRACE(::testing::Message() << "momentum " << momentum << " nesterov " << nesterov << " offset " << offset);
        at::Tensor p = awkward_values(kN, 6, true), buf = at::zeros({kN});
        at::Tensor gp = gpu_copy(p, offset), gbuf = gpu_copy(buf, offset);
        at::Tensor gout = gpu_copy(at::zeros({kN}, at::kBFloat16), offset);
        for (int step = 1; step <= 3; ++step) {
          const at::Tensor grad = awkward_values(kN, 10 + step, false);
          k::SgdParams params;
          params.lr = 0.05;
          params.momentum = momentum;
          params.nesterov = nesterov;
          params.weight_decay = 1e-3;
          params.grad_scale = 0.5;
          params.first_step = step == 1;
          k::sgd_step(gp, &gbuf, gpu_copy(grad, offset), &gout, params);
          const kmath::SgdScalars c = k::sgd_scalars(params);
          for (int64_t i = 0; i < kN; ++i) {
            float b = c.use_momentum && !c.first_step ? buf.data_ptr<float>()[i] : 0.0f;
            kmath::sgd_update<Fused>(p.data_ptr<float>()[i], b, grad.data_ptr<float>()[i], c);
            if (c.use_momentum) buf.data_ptr<float>()[i] = b;
          }
          EXPECT_TRUE(same_bits_up_to_nan_payload(gp.cpu(), p)) << "step " << step;
          if (momentum != 0.0) EXPECT_TRUE(same_bits_up_to_nan_payload(gbuf.cpu(), buf)) << "step " << step;
          EXPECT_TRUE(same_bits_up_to_nan_payload(gout.cpu(), p.to(at::kBFloat16))) << "step " << step;
        }
      }
    }
  }
}

TEST(GpuKernels, LostUpdateCountsAreTheCpuKernelsOnThisFmaCpu) {
  REQUIRE_TEST_DEVICE();
  // The audit counts integer outcomes of the same per-element arithmetic, so
  // the two devices' counts are equal, not close: same bits, same comparisons
  // (NaN payloads do not matter, NaN never equals anything).
  ASSERT_TRUE(k::cpu::fuses_multiply_add()) << "this CPU runs LibTorch's unfused kernels";
  auto counts_of = [](const k::UpdateAudit& audit) { return audit.counts.cpu(); };
  for (const at::ScalarType state : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const int64_t period : {int64_t{1}, int64_t{3}}) {
      for (const int64_t offset : {int64_t{0}, int64_t{1}, int64_t{3}}) {
        const at::Tensor p0 = awkward_values(kN, 1, true).to(state);
        const at::Tensor m0 = (awkward_values(kN, 2, false) * 1e-3).to(state);
        const at::Tensor v0 = (awkward_values(kN, 3, false).abs() * 1e-6).to(state);
        const at::Tensor g = awkward_values(kN, 4, true).to(state);
        k::AdamParams params;
        params.lr = 1e-3;
        params.weight_decay = 0.1;
        params.step = 3;
        at::Tensor p = p0.clone(), m = m0.clone(), v = v0.clone();
        at::Tensor gp = gpu_copy(p0, offset), gm = gpu_copy(m0, offset), gv = gpu_copy(v0, offset);
        const at::Tensor gg = gpu_copy(g, offset);
        k::UpdateAudit cpu_audit{at::zeros({3}, at::kLong), period};
        k::UpdateAudit gpu_audit{at::zeros({3}, at::TensorOptions().dtype(at::kLong).device(gpu0())), period};
        if (state == at::kFloat) {
          k::adam_step(p, m, v, g, nullptr, params, &cpu_audit);
          k::adam_step(gp, gm, gv, gg, nullptr, params, &gpu_audit);
        } else {
          k::adam_step_low_precision(p, m, v, g, params, &cpu_audit);
          k::adam_step_low_precision(gp, gm, gv, gg, params, &gpu_audit);
        }
        EXPECT_TRUE(at::equal(counts_of(gpu_audit), counts_of(cpu_audit)))
            << c10::toString(state) << " period " << period << " offset " << offset << ": gpu "
            << counts_of(gpu_audit) << " cpu " << counts_of(cpu_audit);
        EXPECT_GT(counts_of(cpu_audit)[0].item<int64_t>(), 0);
      }
    }
  }
  // SGD on an fp32 master.
  at::Tensor p = awkward_values(kN, 5, true), gp = gpu_copy(p, 1);
  const at::Tensor g = awkward_values(kN, 6, true);
  k::SgdParams sgd;
  sgd.lr = 1e-3;
  k::UpdateAudit cpu_audit{at::zeros({3}, at::kLong), 1};
  k::UpdateAudit gpu_audit{at::zeros({3}, at::TensorOptions().dtype(at::kLong).device(gpu0())), 1};
  k::sgd_step(p, nullptr, g, nullptr, sgd, &cpu_audit);
  k::sgd_step(gp, nullptr, gpu_copy(g, 1), nullptr, sgd, &gpu_audit);
  EXPECT_TRUE(at::equal(counts_of(gpu_audit), counts_of(cpu_audit)))
      << "sgd: gpu " << counts_of(gpu_audit) << " cpu " << counts_of(cpu_audit);
}

TEST(GpuKernels, SumOfSquaresIsTheCpuKernelsBitForBit) {
  REQUIRE_TEST_DEVICE();
  for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{255}, int64_t{16384}, int64_t{16385},
                          int64_t{7 * 16384 + 1001}, int64_t{3000017}}) {
    for (const at::ScalarType type : {at::kFloat, at::kBFloat16, at::kHalf}) {
      for (const int64_t offset : {0, 1}) {
        SCOPED_TRACE(::testing::Message() << "n " << n << " " << type << " offset " << offset);
        at::manual_seed(n);
        const at::Tensor t = (at::randn({n}) * at::pow(10.0, at::randint(-6, 6, {n}).to(at::kFloat))).to(type);
        const double cpu = k::cpu::sum_of_squares(t);
        const at::Tensor gpu = k::sum_of_squares(gpu_copy(t, offset));
        EXPECT_EQ(gpu.device(), gpu0());
        EXPECT_EQ(gpu.dim(), 0);
        const double got = gpu.item<double>();
        EXPECT_EQ(std::memcmp(&got, &cpu, sizeof(double)), 0) << got << " vs " << cpu;
        // And the same bits on every run (no atomics).
        EXPECT_EQ(k::sum_of_squares(gpu_copy(t, offset)).item<double>(), got);
      }
    }
  }
}

TEST(GpuKernels, NonFiniteFlagFindsEveryInfAndNan) {
  REQUIRE_TEST_DEVICE();
  for (const at::ScalarType type : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const at::Tensor clean = (at::randn({kN}) * 100.0).to(type);
    const at::Tensor flag = k::non_finite_flag(gpu_copy(clean, 2));
    EXPECT_EQ(flag.device(), gpu0());
    EXPECT_EQ(flag.item<float>(), 0.0f) << type;
    for (const int64_t where : {int64_t{0}, int64_t{1}, int64_t{4}, kN / 2, kN - 1}) {
      for (const double bad : {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                               std::numeric_limits<double>::quiet_NaN()}) {
        at::Tensor t = clean.clone();
        t[where] = bad;
        EXPECT_EQ(k::non_finite_flag(gpu_copy(t, where % 4)).item<float>(), 1.0f) << type << " at " << where;
      }
    }
  }
  // fp16 overflow: 65504 is the largest finite value; 1e5 is not representable.
  EXPECT_EQ(k::non_finite_flag(at::full({5}, 65504.0, at::TensorOptions().dtype(at::kHalf).device(gpu0()))).item<float>(),
            0.0f);
  EXPECT_EQ(k::non_finite_flag(at::full({5}, 1e5).to(gpu0()).to(at::kHalf)).item<float>(), 1.0f);
}

TEST(GpuKernels, CastIsAtensRoundingBitForBit) {
  REQUIRE_TEST_DEVICE();
  const int64_t n = 65539;
  at::manual_seed(3);
  at::Tensor values = at::randn({n}) * 1000.0;
  // Rounding ties, an fp16 subnormal, overflow, infinities and a negative zero.
  values.narrow(0, 0, 8).copy_(at::tensor({1.0f + 1.0f / 256.0f, 1.0f + 3.0f / 256.0f, 1e-5f, -1e-7f, 70000.0f,
                                           3.0e38f, std::numeric_limits<float>::infinity(), -0.0f}));
  for (const at::ScalarType src : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const at::ScalarType dst : {at::kFloat, at::kBFloat16, at::kHalf}) {
      for (const int64_t offset : {0, 1}) {
        SCOPED_TRACE(::testing::Message() << src << " -> " << dst << " offset " << offset);
        const at::Tensor cpu_src = values.to(src);
        at::Tensor gpu_dst = gpu_copy(at::zeros({n}, dst), offset);
        k::cast_into(gpu_dst, gpu_copy(cpu_src, offset));
        EXPECT_TRUE(same_bits(gpu_dst.cpu(), cpu_src.to(dst)));
      }
    }
  }
}

TEST(GpuKernels, BadArgumentsAreClearErrorsAndLaunchNothing) {
  REQUIRE_CUDA();
  at::Tensor master = at::zeros({8}, gpu0()), m = at::zeros({8}, gpu0()), v = at::zeros({8}, gpu0());
  const at::Tensor cpu_grad = at::zeros({8});
  try {
    k::adam_step(master, m, v, cpu_grad, nullptr, k::AdamParams{});
    ADD_FAILURE() << "a CPU gradient was accepted for a GPU master";
  } catch (const shardtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("grad is on cpu but the step runs on cuda:0"), std::string::npos) << e.what();
  }
  EXPECT_THROW(k::adam_step(master, m, v, at::zeros({7}, gpu0()), nullptr, k::AdamParams{}), shardtrain::Error);
  namespace kcuda = shardtrain::kernels::cuda;
  const kmath::AdamScalars c = k::adam_scalars(k::AdamParams{});
  float* p = master.data_ptr<float>();
  EXPECT_EQ(kcuda::launch_adam(p, p, p, p, kcuda::DType::kF32, {}, -1, c, {}, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(kcuda::launch_adam(nullptr, p, p, p, kcuda::DType::kF32, {}, 8, c, {}, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(kcuda::launch_adam(p, p, p, p, kcuda::DType::kF32, {}, 0, c, {}, nullptr), cudaSuccess);
  EXPECT_EQ(kcuda::launch_adam_low_precision(p, p, p, kcuda::DType::kF32, p, kcuda::DType::kF32, 8, c, {}, nullptr),
            cudaErrorInvalidValue);
}

}  // namespace

TEST(GpuKernels, Nf4DecodingIsTheCpuKernelsBitsAtEveryByteOffset) {
  REQUIRE_TEST_DEVICE();
  // 2 x 256 + 9 blocks: two full absmax blocks and a partial third. A
  // gathered buffer may start at any byte of its unit, so the GPU copy starts
  // at offsets 0..3 (the fp32 scales are read byte by byte).
  const at::Tensor weight = at::randn({521, 64}) * 0.02;
  const at::Tensor buffer = k::nf4_quantize(weight);
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const at::Tensor expected = k::nf4_dequantize(buffer, weight.numel(), dtype);
    for (int64_t offset = 0; offset < 4; ++offset) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " at byte offset " + std::to_string(offset));
      const at::Tensor decoded = k::nf4_dequantize(gpu_copy(buffer, offset), weight.numel(), dtype);
      EXPECT_TRUE(same_bits(decoded.cpu(), expected));
    }
  }
}
