// The kernel layer's shared pieces, checked on the CPU: the per-element math
// of element_math.h (which the CUDA kernels compile too) against the CPU
// kernels bit for bit, the CUDA launch plan's coverage of every element, the
// fixed order of the gradient-norm sum, and the device dispatch.

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/launch_plan.h"
#include "kernels/element_math.h"
#include "shardtrain/kernels.h"
#include "support/awkward_values.h"
#include "shardtrain/error.h"

namespace {

namespace kcpu = shardtrain::kernels::cpu;
namespace kmath = shardtrain::kernels::math;
namespace kcuda = shardtrain::kernels::cuda;
using shardtrain::kernels::AdamParams;
using shardtrain::kernels::SgdParams;

uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
}

using shardtrain::testing::awkward_values;

/// Bitwise equality of two float tensors, NaN payloads included.
void expect_tensor_bits_equal(const at::Tensor& a, const at::Tensor& b, const std::string& what) {
  ASSERT_EQ(a.numel(), b.numel()) << what;
  const at::Tensor x = a.contiguous(), y = b.contiguous();
  ASSERT_EQ(std::memcmp(x.data_ptr(), y.data_ptr(), static_cast<size_t>(x.numel() * x.element_size())), 0)
      << what << ": first difference at "
      << (x.view(at::kInt) != y.view(at::kInt)).nonzero().flatten().slice(0, 0, 1);
}

/// The element loop every CUDA kernel runs, on the host: one lane at a time.
template <bool kFused>
void scalar_adam(at::Tensor& p, at::Tensor& m, at::Tensor& v, const at::Tensor& g, const AdamParams& params) {
  const kmath::AdamScalars c = shardtrain::kernels::adam_scalars(params);
  const at::Tensor g32 = g.to(at::kFloat);
  for (int64_t i = 0; i < p.numel(); ++i) {
    float pi = p.data_ptr<float>()[i], mi = m.data_ptr<float>()[i], vi = v.data_ptr<float>()[i];
    kmath::adam_update<kmath::ScalarOps<kFused>>(pi, mi, vi, g32.data_ptr<float>()[i], c);
    p.data_ptr<float>()[i] = pi;
    m.data_ptr<float>()[i] = mi;
    v.data_ptr<float>()[i] = vi;
  }
}

template <bool kFused>
void scalar_sgd(at::Tensor& p, at::Tensor& buf, const at::Tensor& g, const SgdParams& params) {
  const kmath::SgdScalars c = shardtrain::kernels::sgd_scalars(params);
  for (int64_t i = 0; i < p.numel(); ++i) {
    float pi = p.data_ptr<float>()[i];
    float bi = c.use_momentum && !c.first_step ? buf.data_ptr<float>()[i] : 0.0f;
    kmath::sgd_update<kmath::ScalarOps<kFused>>(pi, bi, g.data_ptr<float>()[i], c);
    p.data_ptr<float>()[i] = pi;
    if (c.use_momentum) buf.data_ptr<float>()[i] = bi;
  }
}

// 3 * 4099 + 5: not a multiple of any vector width; the CPU kernel splits it
// into several parallel chunks only with more threads, so sizes stay small.
constexpr int64_t kN = 12302;

TEST(UnitKernelMath, SharedAdamMathIsTheCpuKernelBitForBit) {
  const bool fused = kcpu::fuses_multiply_add();
  for (const bool adam_w : {true, false}) {
    for (const double wd : {0.0, 0.1}) {
      for (const at::ScalarType grad_type : {at::kFloat, at::kBFloat16, at::kHalf}) {
        const std::string what = std::string(adam_w ? "AdamW" : "Adam") + " wd " + std::to_string(wd) + " grad " +
                                 std::string(c10::toString(grad_type));
        at::Tensor p_kernel = awkward_values(kN, 1, true);
        at::Tensor m_kernel = awkward_values(kN, 2, false) * 1e-3;
        at::Tensor v_kernel = awkward_values(kN, 3, false).abs() * 1e-6;
        at::Tensor p_scalar = p_kernel.clone(), m_scalar = m_kernel.clone(), v_scalar = v_kernel.clone();
        at::Tensor lp = at::empty({kN}, at::kBFloat16);
        for (int64_t step = 1; step <= 3; ++step) {
          const at::Tensor grad = awkward_values(kN, 10 + step, step == 2).to(grad_type);
          AdamParams params;
          params.lr = 1e-2;
          params.weight_decay = wd;
          params.adam_w_mode = adam_w;
          params.step = step;
          params.grad_scale = 0.5;
          kcpu::fused_adam(p_kernel, m_kernel, v_kernel, grad, &lp, params);
          if (fused) {
            scalar_adam<true>(p_scalar, m_scalar, v_scalar, grad, params);
          } else {
            scalar_adam<false>(p_scalar, m_scalar, v_scalar, grad, params);
          }
          expect_tensor_bits_equal(p_kernel, p_scalar, what + " master step " + std::to_string(step));
          expect_tensor_bits_equal(m_kernel, m_scalar, what + " exp_avg step " + std::to_string(step));
          expect_tensor_bits_equal(v_kernel, v_scalar, what + " exp_avg_sq step " + std::to_string(step));
          // The compute copy is element_math's bf16 rounding of the master.
          for (int64_t i = 0; i < kN; ++i) {
            ASSERT_EQ(lp.data_ptr<c10::BFloat16>()[i].x, kmath::bf16_bits_from_float(p_kernel.data_ptr<float>()[i]))
                << what << " element " << i;
          }
        }
      }
    }
  }
}

TEST(UnitKernelMath, WithoutWeightDecayAnInfiniteParameterStaysInfinite) {
  // torch skips both decay forms at wd == 0; computing 0 * inf there would
  // turn the parameter (or its gradient) into NaN. Both element loops skip.
  for (const bool adam_w : {true, false}) {
    at::Tensor p = at::full({8}, std::numeric_limits<float>::infinity());
    at::Tensor m = at::zeros({8}), v = at::zeros({8});
    AdamParams params;
    params.adam_w_mode = adam_w;
    params.weight_decay = 0.0;
    kcpu::fused_adam(p, m, v, at::ones({8}), nullptr, params);
    EXPECT_TRUE(at::isinf(p).all().item<bool>()) << (adam_w ? "AdamW" : "Adam");
    EXPECT_FALSE(at::isnan(m).any().item<bool>());
    at::Tensor ps = at::full({8}, std::numeric_limits<float>::infinity()), ms = at::zeros({8}), vs = at::zeros({8});
    scalar_adam<true>(ps, ms, vs, at::ones({8}), params);
    EXPECT_TRUE(at::isinf(ps).all().item<bool>());
  }
}

TEST(UnitKernelMath, SharedSgdMathIsTheCpuKernelBitForBit) {
  const bool fused = kcpu::fuses_multiply_add();
  for (const double momentum : {0.0, 0.9}) {
    for (const bool nesterov : {false, true}) {
      if (nesterov && momentum == 0.0) continue;
      for (const double wd : {0.0, 1e-3}) {
        at::Tensor p_kernel = awkward_values(kN, 4, true);
        at::Tensor p_scalar = p_kernel.clone();
        at::Tensor b_kernel = at::empty({kN}), b_scalar = at::empty({kN});
        for (int step = 1; step <= 3; ++step) {
          const at::Tensor grad = awkward_values(kN, 20 + step, false);
          SgdParams params;
          params.lr = 0.05;
          params.momentum = momentum;
          params.nesterov = nesterov;
          params.weight_decay = wd;
          params.grad_scale = 0.25;
          params.first_step = step == 1;
          kcpu::fused_sgd(p_kernel, &b_kernel, grad, nullptr, params);
          if (fused) {
            scalar_sgd<true>(p_scalar, b_scalar, grad, params);
          } else {
            scalar_sgd<false>(p_scalar, b_scalar, grad, params);
          }
          const std::string what = "momentum " + std::to_string(momentum) + " nesterov " + std::to_string(nesterov) +
                                   " wd " + std::to_string(wd) + " step " + std::to_string(step);
          expect_tensor_bits_equal(p_kernel, p_scalar, what);
          if (momentum != 0.0) expect_tensor_bits_equal(b_kernel, b_scalar, what + " buffer");
        }
      }
    }
  }
}

TEST(UnitKernelMath, SharedPureLowPrecisionAdamIsTheCpuKernelBitForBit) {
  const bool fused = kcpu::fuses_multiply_add();
  for (const at::ScalarType type : {at::kBFloat16, at::kHalf}) {
    const at::Tensor p0 = (at::randn({kN}) * 0.1).to(type);
    at::Tensor p = p0.clone(), m = at::zeros({kN}, type), v = at::zeros({kN}, type);
    at::Tensor ps = p0.to(at::kFloat), ms = at::zeros({kN}), vs = at::zeros({kN});
    for (int64_t step = 1; step <= 3; ++step) {
      const at::Tensor grad = (at::randn({kN}) * 1e-2).to(type);
      AdamParams params;
      params.lr = 1e-3;
      params.weight_decay = 0.01;
      params.step = step;
      kcpu::fused_adam_low_precision(p, m, v, grad, params);
      // Reference: one float step, then each state rounded back to the 16-bit type.
      if (fused) {
        scalar_adam<true>(ps, ms, vs, grad, params);
      } else {
        scalar_adam<false>(ps, ms, vs, grad, params);
      }
      ps = ps.to(type).to(at::kFloat);
      ms = ms.to(type).to(at::kFloat);
      vs = vs.to(type).to(at::kFloat);
      const std::string what = std::string(c10::toString(type)) + " step " + std::to_string(step);
      expect_tensor_bits_equal(p.to(at::kFloat), ps, what + " param");
      expect_tensor_bits_equal(m.to(at::kFloat), ms, what + " exp_avg");
      expect_tensor_bits_equal(v.to(at::kFloat), vs, what + " exp_avg_sq");
    }
  }
}

TEST(UnitKernelMath, Bf16RoundingIsAtensBitForBit) {
  // Every bf16 boundary case lives in the low 16 bits; sweep them for a set
  // of upper halves covering signs, subnormals, normals, the largest finite
  // values (which round to inf), inf and NaN.
  const uint32_t uppers[] = {0x0000, 0x0001, 0x007f, 0x0080, 0x3f80, 0x3f81, 0x7f7f, 0x7f80,
                             0x7fc0, 0x7f81, 0x8000, 0x8001, 0xbf80, 0xff7f, 0xff80, 0xffc0};
  for (const uint32_t upper : uppers) {
    for (uint32_t lower = 0; lower <= 0xffff; ++lower) {
      const uint32_t bits = (upper << 16) | lower;
      float x;
      std::memcpy(&x, &bits, sizeof(x));
      ASSERT_EQ(kmath::bf16_bits_from_float(x), c10::BFloat16(x).x) << std::hex << bits;
    }
  }
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const float widened = kmath::float_from_bf16_bits(static_cast<uint16_t>(b));
    c10::BFloat16 h;
    h.x = static_cast<uint16_t>(b);
    ASSERT_EQ(bits_of(widened), bits_of(static_cast<float>(h))) << std::hex << b;
  }
}

/// element_math.h's order, written out plainly.
double sum_of_squares_in_the_shared_order(const at::Tensor& t) {
  const at::Tensor x = t.to(at::kFloat);
  const float* data = x.data_ptr<float>();
  const int64_t n = x.numel();
  double total = 0.0;
  for (int64_t b = 0; b < kmath::sum_blocks(n); ++b) {
    std::vector<double> lanes(kmath::kSumLanes, 0.0);
    for (int lane = 0; lane < kmath::kSumLanes; ++lane) {
      kcuda::for_each_lane_element(n, b, lane, [&](int64_t i) { lanes[lane] = kmath::add_square(lanes[lane], data[i]); });
    }
    for (int s = kmath::kSumLanes / 2; s > 0; s /= 2) {
      for (int l = 0; l < s; ++l) lanes[l] = kmath::add_rn(lanes[l], lanes[l + s]);
    }
    total = kmath::add_rn(total, lanes[0]);
  }
  return total;
}

TEST(UnitKernelMath, SumOfSquaresFollowsTheSharedOrderAtAnyThreadCount) {
  const int threads_before = at::get_num_threads();
  for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{255}, int64_t{256}, int64_t{257}, int64_t{16383},
                          int64_t{16384}, int64_t{16385}, int64_t{3 * 16384 + 77}}) {
    for (const at::ScalarType type : {at::kFloat, at::kBFloat16, at::kHalf}) {
      at::manual_seed(n);
      // Magnitudes over 12 decades: the order of additions shows in the last bits.
      const at::Tensor t = (at::randn({n}) * at::pow(10.0, at::randint(-6, 6, {n}).to(at::kFloat))).to(type);
      const double expected = sum_of_squares_in_the_shared_order(t);
      for (const int threads : {1, 2}) {
        at::set_num_threads(threads);
        const double got = kcpu::sum_of_squares(t);
        EXPECT_EQ(std::memcmp(&got, &expected, sizeof(double)), 0)
            << "n " << n << " " << type << " threads " << threads << ": " << got << " vs " << expected;
      }
    }
  }
  at::set_num_threads(threads_before);
}

// ---- the CUDA launch plan -----------------------------------------------------

/// Runs every thread of a plan and counts visits per element; checks packs
/// start where the plan says and lie inside [0, n).
std::vector<int> visits(const kcuda::ElementwisePlan& plan) {
  std::vector<int> count(static_cast<size_t>(plan.n), 0);
  const int64_t stride = static_cast<int64_t>(plan.blocks) * plan.threads;
  for (int64_t thread = 0; thread < stride; ++thread) {
    kcuda::for_each_plan_item(
        plan, thread, stride, [&](int64_t i) { ++count.at(static_cast<size_t>(i)); },
        [&](int64_t first) {
          EXPECT_EQ((first - plan.head) % kcuda::kVec, 0) << "pack at " << first;
          for (int k = 0; k < kcuda::kVec; ++k) ++count.at(static_cast<size_t>(first + k));
        });
  }
  return count;
}

TEST(UnitLaunchPlan, EveryElementIsVisitedExactlyOnce) {
  for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{4}, int64_t{5}, int64_t{255}, int64_t{1024},
                          int64_t{1027}, int64_t{65536 + 3}, int64_t{600001}}) {
    for (const int64_t head : {int64_t{-1}, int64_t{0}, int64_t{1}, int64_t{2}, int64_t{3}}) {
      for (const int sms : {1, 2, 132}) {
        const kcuda::ElementwisePlan plan = kcuda::make_elementwise_plan(n, head, sms);
        const std::string what = "n " + std::to_string(n) + " head " + std::to_string(head) + " sms " +
                                 std::to_string(sms);
        ASSERT_LE(plan.blocks, static_cast<unsigned>(sms * kcuda::kBlocksPerSm)) << what;
        ASSERT_GE(plan.blocks, 1u) << what;
        ASSERT_LT(plan.head, kcuda::kVec) << what;
        if (head >= 0 && head < n) {
          // Aligned streams put everything but a short head and tail in packs.
          EXPECT_EQ(plan.head, head) << what;
          EXPECT_EQ(plan.packs, (n - head) / kcuda::kVec) << what;
        } else {
          EXPECT_EQ(plan.packs, 0) << what;
        }
        const std::vector<int> count = visits(plan);
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(count[static_cast<size_t>(i)], 1) << what << " element " << i;
      }
    }
  }
}

TEST(UnitLaunchPlan, HeadsComeFromTheStreamsOffsets) {
  alignas(64) static float floats[64];
  alignas(64) static uint16_t halves[64];
  for (int offset = 0; offset < 8; ++offset) {
    // A view starting `offset` elements into an aligned buffer needs
    // (kVec - offset % kVec) % kVec single elements to reach a pack boundary.
    const int64_t expected = (kcuda::kVec - offset % kcuda::kVec) % kcuda::kVec;
    EXPECT_EQ(kcuda::elements_to_pack_alignment(floats + offset, sizeof(float)), expected) << offset;
    EXPECT_EQ(kcuda::elements_to_pack_alignment(halves + offset, sizeof(uint16_t)), expected) << offset;
    // An fp32 master and a bf16 copy at the same element offset share the head.
    EXPECT_EQ(kcuda::common_head({kcuda::elements_to_pack_alignment(floats + offset, sizeof(float)),
                                  kcuda::elements_to_pack_alignment(halves + offset, sizeof(uint16_t)),
                                  kcuda::kNoStream}),
              expected);
  }
  // Streams at different offsets cannot share packs; a misaligned pointer has none.
  EXPECT_EQ(kcuda::common_head({kcuda::elements_to_pack_alignment(floats, 4),
                                kcuda::elements_to_pack_alignment(floats + 1, 4)}),
            -1);
  EXPECT_EQ(kcuda::elements_to_pack_alignment(reinterpret_cast<const char*>(floats) + 1, sizeof(float)), -1);
  EXPECT_EQ(kcuda::common_head({kcuda::kNoStream}), 0);
}

TEST(UnitLaunchPlan, NormLanesCoverEveryElementOnceInIncreasingOrder) {
  for (const int64_t n : {int64_t{1}, int64_t{256}, int64_t{16384}, int64_t{16385}, int64_t{2 * 16384 + 511}}) {
    std::vector<int> count(static_cast<size_t>(n), 0);
    for (int64_t b = 0; b < kmath::sum_blocks(n); ++b) {
      for (int lane = 0; lane < kmath::kSumLanes; ++lane) {
        int64_t previous = -1;
        kcuda::for_each_lane_element(n, b, lane, [&](int64_t i) {
          ASSERT_EQ(i / kmath::kSumBlock, b) << "a lane strays out of its block";
          ASSERT_EQ((i - b * kmath::kSumBlock) % kmath::kSumLanes, lane);
          ASSERT_GT(i, previous);
          previous = i;
          ++count.at(static_cast<size_t>(i));
        });
      }
    }
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(count[static_cast<size_t>(i)], 1) << "n " << n << " element " << i;
  }
}

// ---- the dispatch -------------------------------------------------------------

TEST(UnitKernelDispatch, CpuTensorsRunTheCpuKernelsAndResultsStayOnTheirDevice) {
  namespace k = shardtrain::kernels;
  EXPECT_TRUE(k::has_kernels_for(c10::DeviceType::CPU));
  at::manual_seed(3);
  const at::Tensor grad = at::randn({kN});
  at::Tensor master = at::randn({kN}), m = at::zeros({kN}), v = at::zeros({kN});
  at::Tensor master_ref = master.clone(), m_ref = m.clone(), v_ref = v.clone();
  at::Tensor lp = at::empty({kN}, at::kBFloat16), lp_ref = lp.clone();
  AdamParams params;
  params.weight_decay = 0.01;
  k::adam_step(master, m, v, grad, &lp, params);
  kcpu::fused_adam(master_ref, m_ref, v_ref, grad, &lp_ref, params);
  expect_tensor_bits_equal(master, master_ref, "adam_step");
  EXPECT_TRUE(at::equal(lp, lp_ref));

  const at::Tensor norm = k::sum_of_squares(grad);
  EXPECT_EQ(norm.dim(), 0);
  EXPECT_EQ(norm.scalar_type(), at::kDouble);
  EXPECT_TRUE(norm.device().is_cpu());
  EXPECT_EQ(norm.item<double>(), kcpu::sum_of_squares(grad));

  at::Tensor with_nan = grad.clone();
  const at::Tensor clean_flag = k::non_finite_flag(with_nan);
  EXPECT_EQ(clean_flag.scalar_type(), at::kFloat);
  EXPECT_EQ(clean_flag.item<float>(), 0.0f);
  with_nan[kN - 1] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(k::non_finite_flag(with_nan).item<float>(), 1.0f);

  at::Tensor half = at::empty({kN}, at::kHalf);
  k::cast_into(half, grad);
  EXPECT_TRUE(at::equal(half, grad.to(at::kHalf)));
  // The same contract as the CUDA kernel's: equal shapes (copy_ alone would broadcast), a contiguous destination.
  at::Tensor row = at::empty({1, kN}, at::kHalf);
  EXPECT_THROW(k::cast_into(row, grad), shardtrain::Error);
  at::Tensor strided = at::empty({2 * kN}, at::kHalf).slice(0, 0, 2 * kN, 2);
  EXPECT_THROW(k::cast_into(strided, grad), shardtrain::Error);
  // A 16-bit destination over part of its fp32 source's bytes (the kernel would
  // overwrite elements not yet read); the source onto itself is a no-op.
  at::Tensor buffer = grad.clone();
  at::Tensor halves = buffer.view(at::kBFloat16).slice(0, 2, 2 + kN / 2);
  try {
    k::cast_into(halves, buffer.slice(0, 0, kN / 2));
    ADD_FAILURE() << "a destination over part of the source was accepted";
  } catch (const shardtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cast_into: the destination (BFloat16) overlaps part of the source (Float)"),
              std::string::npos)
        << e.what();
  }
  k::cast_into(buffer, buffer);
  EXPECT_TRUE(at::equal(buffer, grad));
}

TEST(UnitKernelDispatch, TensorsOnADeviceWithoutKernelsAreAClearError) {
  namespace k = shardtrain::kernels;
  const at::Tensor meta = at::empty({16}, at::TensorOptions().device(at::kMeta));
  try {
    k::sum_of_squares(meta);
    FAIL() << "a meta tensor has no kernels";
  } catch (const shardtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no kernels for tensors on meta"), std::string::npos) << e.what();
  }
  at::Tensor cpu = at::zeros({16});
  at::Tensor half_meta = at::empty({16}, at::TensorOptions().dtype(at::kHalf).device(at::kMeta));
  EXPECT_THROW(k::cast_into(half_meta, cpu), shardtrain::Error);
}

}  // namespace
