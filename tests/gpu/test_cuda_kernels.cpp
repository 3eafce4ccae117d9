// GPU tests: the CUDA kernels against ATen CPU references, and the NCCL backend.
//
// Built only against a CUDA LibTorch; every test skips itself when no GPU is
// visible. Run with tests/gpu/gpu_check.sh (ctest -L gpu) on a GPU machine.
// Tests that need two GPUs skip on one.

#include <chrono>
#include "build_config.h"  // SHARDTRAIN_WITH_NCCL, SHARDTRAIN_WITH_CUDA_KERNELS
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/nccl_factory.h"
#include "compat/torch_compat.h"
#include "kernels/cuda/cuda_kernels.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/error.h"

#if defined(SHARDTRAIN_WITH_NCCL)
#include "comm/nccl/nccl_communicator.h"
#endif

namespace {

namespace kcuda = shardtrain::kernels::cuda;
namespace comm = shardtrain::comm;
using Clock = std::chrono::steady_clock;

const at::Device kGpu0(at::kCUDA, 0);

cudaStream_t current_stream() { return shardtrain::compat::current_cuda_stream(0); }

at::ScalarType aten_type(kcuda::DType dtype) {
  switch (dtype) {
    case kcuda::DType::kF32: return at::kFloat;
    case kcuda::DType::kBF16: return at::kBFloat16;
    case kcuda::DType::kF16: return at::kHalf;
  }
  return at::kFloat;
}

/// A CUDA copy of `cpu` that starts `offset` elements into its allocation:
/// offset 1 breaks the 16-byte alignment, so the kernels take their scalar path.
at::Tensor gpu_copy(const at::Tensor& cpu, int64_t offset) {
  at::Tensor storage = at::empty({cpu.numel() + offset}, cpu.options().device(kGpu0));
  at::Tensor view = storage.narrow(0, offset, cpu.numel());
  view.copy_(cpu);
  return view;
}

/// Bitwise equality (at::equal would call -0 == +0 equal and NaN unequal).
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::ScalarType bits = a.element_size() == 4 ? at::kInt : at::kShort;
  return at::equal(a.contiguous().view(bits), b.contiguous().view(bits));
}

// ---- fused Adam(W) -----------------------------------------------------------------

struct AdamState {
  at::Tensor master, exp_avg, exp_avg_sq;
};

/// The step written out in fp64 from the formula in cuda_kernels.h.
AdamState adam_reference(const AdamState& in, const at::Tensor& grad, const kcuda::AdamWParams& p) {
  at::Tensor master = in.master.to(at::kDouble);
  at::Tensor m = in.exp_avg.to(at::kDouble);
  at::Tensor v = in.exp_avg_sq.to(at::kDouble);
  at::Tensor g = grad.to(at::kDouble) * static_cast<double>(p.grad_scale);
  const double lr = p.lr, wd = p.weight_decay, b1 = p.beta1, b2 = p.beta2, eps = p.eps;
  if (p.adam_w_mode) {
    master = master * (1.0 - lr * wd);
  } else {
    g = g + wd * master;
  }
  m = b1 * m + (1.0 - b1) * g;
  v = b2 * v + (1.0 - b2) * g * g;
  const double bc1 = p.bias_correction ? 1.0 - std::pow(b1, static_cast<double>(p.step)) : 1.0;
  const double bc2 = p.bias_correction ? 1.0 - std::pow(b2, static_cast<double>(p.step)) : 1.0;
  master = master - lr * (m / bc1) / ((v / bc2).sqrt() + eps);
  return {master, m, v};
}

void check_adam(bool adam_w_mode, kcuda::LowPrecision kind, int64_t offset) {
  SCOPED_TRACE(::testing::Message() << "adam_w_mode=" << adam_w_mode << " low_precision=" << static_cast<int>(kind)
                                    << " offset=" << offset);
  const int64_t n = 100003;  // not a multiple of 4: exercises the tail loop
  at::manual_seed(7);
  AdamState cpu{at::randn({n}), at::randn({n}) * 0.1, at::rand({n}) * 0.01};
  const at::Tensor grad = at::randn({n});
  kcuda::AdamWParams params;
  params.lr = 1e-2f;
  params.weight_decay = 0.1f;
  params.step = 3;
  params.adam_w_mode = adam_w_mode;
  params.grad_scale = 0.25f;  // e.g. 1/loss_scale times a clip coefficient

  at::Tensor master = gpu_copy(cpu.master, offset);
  at::Tensor m = gpu_copy(cpu.exp_avg, offset);
  at::Tensor v = gpu_copy(cpu.exp_avg_sq, offset);
  at::Tensor g = gpu_copy(grad, offset);
  const at::ScalarType low = kind == kcuda::LowPrecision::kBF16 ? at::kBFloat16 : at::kHalf;
  at::Tensor out;
  if (kind != kcuda::LowPrecision::kNone) out = gpu_copy(at::zeros({n}, low), offset);

  ASSERT_EQ(kcuda::launch_fused_adamw(master.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
                                      g.data_ptr<float>(), out.defined() ? out.data_ptr() : nullptr, kind, n,
                                      params, current_stream()),
            cudaSuccess);

  const AdamState expected = adam_reference(cpu, grad, params);
  const at::Tensor got_master = master.cpu();
  EXPECT_TRUE(at::allclose(got_master.to(at::kDouble), expected.master, 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(m.cpu().to(at::kDouble), expected.exp_avg, 1e-5, 1e-7));
  EXPECT_TRUE(at::allclose(v.cpu().to(at::kDouble), expected.exp_avg_sq, 1e-5, 1e-9));
  if (out.defined()) {
    // The compute copy is exactly the rounded master (both round to nearest even).
    EXPECT_TRUE(same_bits(out.cpu(), got_master.to(low)));
  }
}

TEST(CudaKernels, FusedAdamWMatchesCpuFormula) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  for (bool adam_w_mode : {true, false}) {
    for (auto kind : {kcuda::LowPrecision::kNone, kcuda::LowPrecision::kBF16, kcuda::LowPrecision::kF16}) {
      for (int64_t offset : {0, 1}) check_adam(adam_w_mode, kind, offset);
    }
  }
}

TEST(CudaKernels, FusedAdamWRejectsBadArguments) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  at::Tensor buf = at::zeros({8}, at::TensorOptions().device(kGpu0));
  float* p = buf.data_ptr<float>();
  kcuda::AdamWParams params;
  params.step = 0;  // steps are 1-based; 0 would divide by a zero bias correction
  EXPECT_EQ(kcuda::launch_fused_adamw(p, p, p, p, nullptr, kcuda::LowPrecision::kNone, 8, params, current_stream()),
            cudaErrorInvalidValue);
  params.step = 1;
  EXPECT_EQ(kcuda::launch_fused_adamw(p, p, p, p, p, kcuda::LowPrecision::kNone, 8, params, current_stream()),
            cudaErrorInvalidValue);
  EXPECT_EQ(kcuda::launch_fused_adamw(p, p, p, p, nullptr, kcuda::LowPrecision::kNone, 0, params, current_stream()),
            cudaSuccess);
}

// ---- reductions ------------------------------------------------------------------

TEST(CudaKernels, SumOfSquaresMatchesFp64Reference) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t n = (1 << 20) + 3;
  at::manual_seed(11);
  const at::Tensor base = at::randn({n}) * 3.0;
  at::Tensor out = at::full({1}, -1.0, at::TensorOptions().dtype(at::kDouble).device(kGpu0));
  for (auto dtype : {kcuda::DType::kF32, kcuda::DType::kBF16, kcuda::DType::kF16}) {
    for (int64_t offset : {0, 1}) {
      SCOPED_TRACE(::testing::Message() << kcuda::to_string(dtype) << " offset=" << offset);
      const at::Tensor cpu = base.to(aten_type(dtype));
      const double expected = cpu.to(at::kDouble).square().sum().item<double>();
      at::Tensor data = gpu_copy(cpu, offset);
      ASSERT_EQ(kcuda::launch_sum_of_squares(data.data_ptr(), dtype, n, out.data_ptr<double>(), current_stream()),
                cudaSuccess);
      EXPECT_NEAR(out.item<double>(), expected, expected * 1e-10);

      // accumulate: two halves into one scalar give the same total.
      const int64_t half = n / 2;
      ASSERT_EQ(kcuda::launch_sum_of_squares(data.data_ptr(), dtype, half, out.data_ptr<double>(), current_stream()),
                cudaSuccess);
      ASSERT_EQ(kcuda::launch_sum_of_squares(data.narrow(0, half, n - half).data_ptr(), dtype, n - half,
                                             out.data_ptr<double>(), current_stream(), /*accumulate=*/true),
                cudaSuccess);
      EXPECT_NEAR(out.item<double>(), expected, expected * 1e-10);
    }
  }
  // Empty input: the scalar is still overwritten.
  ASSERT_EQ(kcuda::launch_sum_of_squares(nullptr, kcuda::DType::kF32, 0, out.data_ptr<double>(), current_stream()),
            cudaSuccess);
  EXPECT_EQ(out.item<double>(), 0.0);
}

TEST(CudaKernels, HasInfOrNanFindsEveryNonFiniteValue) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t n = 100001;
  at::Tensor flag = at::full({1}, 7, at::TensorOptions().dtype(at::kInt).device(kGpu0));
  int* flag_ptr = flag.data_ptr<int>();
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (auto dtype : {kcuda::DType::kF32, kcuda::DType::kBF16, kcuda::DType::kF16}) {
    for (int64_t offset : {0, 1}) {
      SCOPED_TRACE(::testing::Message() << kcuda::to_string(dtype) << " offset=" << offset);
      const at::Tensor clean = (at::randn({n}) * 100.0).to(aten_type(dtype));
      at::Tensor data = gpu_copy(clean, offset);
      ASSERT_EQ(kcuda::launch_has_inf_or_nan(data.data_ptr(), dtype, n, flag_ptr, current_stream()), cudaSuccess);
      EXPECT_EQ(flag.item<int>(), 0);
      // accumulate over a clean buffer keeps an earlier overflow.
      flag.fill_(1);
      ASSERT_EQ(kcuda::launch_has_inf_or_nan(data.data_ptr(), dtype, n, flag_ptr, current_stream(), true),
                cudaSuccess);
      EXPECT_EQ(flag.item<int>(), 1);

      for (const auto& [index, value] : std::vector<std::pair<int64_t, double>>{
               {n - 1, inf}, {n / 2, nan}, {0, -inf}, {n - 2, nan}}) {
        at::Tensor dirty = clean.clone();
        dirty[index] = value;
        at::Tensor d = gpu_copy(dirty, offset);
        ASSERT_EQ(kcuda::launch_has_inf_or_nan(d.data_ptr(), dtype, n, flag_ptr, current_stream()), cudaSuccess);
        EXPECT_EQ(flag.item<int>(), 1) << "non-finite value at " << index << " missed";
      }
    }
  }
  // fp16 overflow: 70000 does not fit in half and becomes inf on the cast,
  // which is the loss-scaler case.
  at::Tensor overflow = at::full({5}, 70000.0).to(at::kHalf).to(kGpu0);
  ASSERT_EQ(kcuda::launch_has_inf_or_nan(overflow.data_ptr(), kcuda::DType::kF16, 5, flag_ptr, current_stream()),
            cudaSuccess);
  EXPECT_EQ(flag.item<int>(), 1);
}

// ---- casts -----------------------------------------------------------------------

TEST(CudaKernels, CastMatchesAtenRoundingBitForBit) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t n = 65539;
  at::manual_seed(3);
  at::Tensor values = at::randn({n}) * 1000.0;
  // Rounding ties, an fp16 subnormal, overflow and infinities. No NaN (its
  // payload after a cast is implementation-defined) and no fp32 subnormals
  // (CPUs with AVX512-BF16 may convert those with denormals-are-zero).
  values.narrow(0, 0, 8).copy_(at::tensor({1.0f + 1.0f / 256.0f, 1.0f + 3.0f / 256.0f, 1e-5f, -1e-7f, 70000.0f,
                                           3.0e38f, std::numeric_limits<float>::infinity(), -0.0f}));
  for (auto src : {kcuda::DType::kF32, kcuda::DType::kBF16, kcuda::DType::kF16}) {
    for (auto dst : {kcuda::DType::kF32, kcuda::DType::kBF16, kcuda::DType::kF16}) {
      for (int64_t offset : {0, 1}) {
        SCOPED_TRACE(::testing::Message() << kcuda::to_string(src) << " -> " << kcuda::to_string(dst)
                                          << " offset=" << offset);
        const at::Tensor cpu_src = values.to(aten_type(src));
        at::Tensor gpu_src = gpu_copy(cpu_src, offset);
        at::Tensor gpu_dst = gpu_copy(at::zeros({n}, aten_type(dst)), offset);
        ASSERT_EQ(kcuda::launch_cast(gpu_src.data_ptr(), src, gpu_dst.data_ptr(), dst, n, current_stream()),
                  cudaSuccess);
        EXPECT_TRUE(same_bits(gpu_dst.cpu(), cpu_src.to(aten_type(dst))));
      }
    }
  }
}

// ---- NCCL backend ----------------------------------------------------------------

comm::CommOptions options_with_timeout(std::chrono::milliseconds timeout) {
  comm::CommOptions options;
  options.timeout = timeout;
  return options;
}

at::TensorOptions on_gpu(int device, at::ScalarType dtype) {
  return at::TensorOptions().dtype(dtype).device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
}

TEST(NcclBackend, ReportsItselfUsableOnAGpuMachine) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (comm::nccl_version_string().empty()) GTEST_SKIP() << "NCCL backend not compiled";
  EXPECT_TRUE(comm::nccl_usable()) << comm::nccl_unavailable_reason();
  EXPECT_TRUE(comm::nccl_unavailable_reason().empty());
}

TEST(NcclBackend, WorldOfOneThroughThePublicApi) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (comm::nccl_version_string().empty()) GTEST_SKIP() << "NCCL backend not compiled";
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto nccl = comm::make_nccl_communicator(store, 0, 1, {0}, options_with_timeout(std::chrono::seconds(60)), 0);
  EXPECT_EQ(nccl->backend(), "nccl");
  EXPECT_EQ(nccl->device_type(), at::kCUDA);

  std::vector<comm::CollectiveEvent> seen;
  nccl->set_observer([&](const comm::CollectiveEvent& e) { seen.push_back(e); });

  at::Tensor input = at::arange(7, on_gpu(0, at::kFloat)).to(at::kBFloat16);
  at::Tensor output = at::empty({7}, on_gpu(0, at::kBFloat16));
  nccl->all_gather(output, input);
  EXPECT_TRUE(same_bits(output.cpu(), input.cpu()));
  nccl->reduce_scatter(output, input, comm::ReduceOp::kAvg);
  EXPECT_TRUE(same_bits(output.cpu(), input.cpu()));
  nccl->all_reduce(output, comm::ReduceOp::kMax);
  nccl->broadcast(output, 0);
  nccl->barrier();
  ASSERT_EQ(seen.size(), 5u);
  EXPECT_EQ(seen[0].op, "all_gather");
  EXPECT_EQ(seen[0].dtype, at::kBFloat16);
  EXPECT_EQ(seen[1].op, "reduce_scatter");

  // CPU tensors belong to gloo: a clear error, not a crash inside NCCL.
  try {
    nccl->all_reduce(at::ones({4}));
    ADD_FAILURE() << "a CPU tensor was accepted by the nccl backend";
  } catch (const shardtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cuda"), std::string::npos) << e.what();
  }

  // Sub-groups make their own NCCL communicators through the same store.
  auto sub = nccl->new_group({0});
  ASSERT_NE(sub, nullptr);
  sub->all_reduce(output);
  auto part = nccl->split({{0}});
  ASSERT_NE(part, nullptr);
  EXPECT_EQ(part->world_size(), 1);
}

#if defined(SHARDTRAIN_WITH_NCCL)
/// Exposes the backend hooks: with one GPU the group has one rank, and the
/// public API answers world-size-1 collectives itself without reaching NCCL.
class NcclProbe : public comm::NcclCommunicator {
 public:
  using comm::NcclCommunicator::NcclCommunicator;
  using comm::NcclCommunicator::do_all_gather;
  using comm::NcclCommunicator::do_all_reduce;
  using comm::NcclCommunicator::do_barrier;
  using comm::NcclCommunicator::do_broadcast;
  using comm::NcclCommunicator::do_reduce_scatter;
};

comm::CollectiveEvent event_for(const char* op, const at::Tensor& t, comm::ReduceOp reduce = comm::ReduceOp::kSum) {
  comm::CollectiveEvent event{op, t.scalar_type(), t.numel(), t.numel(), reduce};
  return event;
}

TEST(NcclBackend, SingleRankCollectivesRunThroughNccl) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  auto store = c10::make_intrusive<c10d::HashStore>();
  NcclProbe nccl(store, 0, 1, {0}, options_with_timeout(std::chrono::seconds(60)), 0, "probe/");

  // Ordering with the caller: the input is produced by kernels queued on a
  // side stream made current; the collective must start after them.
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, 0);
  c10::cuda::CUDAStreamGuard stream_guard(side);
  at::Tensor input = at::zeros({1 << 22}, on_gpu(0, at::kFloat));
  for (int i = 0; i < 20; ++i) input.add_(1.0);
  at::Tensor output = at::empty_like(input);
  comm::WorkPtr work = nccl.do_all_gather(output, input, event_for("all_gather", input));
  work->wait();
  work->wait();  // a second wait is a no-op
  EXPECT_TRUE(work->is_completed());
  EXPECT_TRUE(at::all(output == 20.0).item<bool>()) << "the collective read the input before it was written";

  // Every dtype and op, including the fp32-widened bf16/fp16 reductions
  // (with one rank each result equals the input, bit for bit).
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble, at::kLong}) {
    SCOPED_TRACE(c10::toString(dtype));
    const at::Tensor reference = (at::arange(1001, on_gpu(0, at::kFloat)) - 500.0).to(dtype);
    std::vector<comm::ReduceOp> ops{comm::ReduceOp::kSum, comm::ReduceOp::kMax};
    if (at::isFloatingType(dtype)) ops.push_back(comm::ReduceOp::kAvg);
    for (comm::ReduceOp op : ops) {
      at::Tensor t = reference.clone();
      nccl.do_all_reduce(t, op, event_for("all_reduce", t, op))->wait();
      EXPECT_TRUE(same_bits(t.cpu(), reference.cpu())) << "all_reduce " << comm::to_string(op);
      at::Tensor chunk = at::empty_like(reference);
      nccl.do_reduce_scatter(chunk, reference, op, event_for("reduce_scatter", reference, op))->wait();
      EXPECT_TRUE(same_bits(chunk.cpu(), reference.cpu())) << "reduce_scatter " << comm::to_string(op);
    }
    at::Tensor b = reference.clone();
    nccl.do_broadcast(b, 0, event_for("broadcast", b))->wait();
    EXPECT_TRUE(same_bits(b.cpu(), reference.cpu()));
  }
  nccl.do_barrier();

  // Async: several in flight, waited for out of order; dropping one unwaited is safe.
  at::Tensor a = at::ones({1 << 20}, on_gpu(0, at::kBFloat16));
  at::Tensor b = at::full({1 << 20}, 2.0, on_gpu(0, at::kHalf));
  auto wa = nccl.do_all_reduce(a, comm::ReduceOp::kSum, event_for("all_reduce", a));
  auto wb = nccl.do_all_reduce(b, comm::ReduceOp::kAvg, event_for("all_reduce", b, comm::ReduceOp::kAvg));
  (void)nccl.do_broadcast(at::ones({1000}, on_gpu(0, at::kFloat)), 0,
                          event_for("broadcast", at::ones({1000}, on_gpu(0, at::kFloat))));
  wb->wait();
  wa->wait();
  EXPECT_TRUE(at::all(a == 1.0).item<bool>());
  EXPECT_TRUE(at::all(b == 2.0).item<bool>());
}
#endif  // SHARDTRAIN_WITH_NCCL

TEST(NcclBackend, CreationTimesOutWhenAPeerNeverJoins) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (comm::nccl_version_string().empty()) GTEST_SKIP() << "NCCL backend not compiled";
  const auto timeout = std::chrono::milliseconds(2000);
  {
    // Rank 0 alone: it publishes the id, then NCCL's bootstrap waits for rank 1.
    auto store = c10::make_intrusive<c10d::HashStore>();
    const auto start = Clock::now();
    EXPECT_THROW(comm::make_nccl_communicator(store, 0, 2, {0, 1}, options_with_timeout(timeout), 0),
                 shardtrain::TimeoutError);
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 2.0 + 10.0);
  }
  {
    // Rank 1 alone: the unique id never appears in the store.
    auto store = c10::make_intrusive<c10d::HashStore>();
    const auto start = Clock::now();
    EXPECT_THROW(comm::make_nccl_communicator(store, 1, 2, {0, 1}, options_with_timeout(timeout), 0),
                 shardtrain::TimeoutError);
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 2.0 + 10.0);
  }
}

/// Runs `body` on two ranks (threads), rank r on cuda:r, sharing one HashStore.
void run_on_two_gpus(const std::function<void(comm::Communicator&, int)>& body, std::chrono::milliseconds timeout) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        auto nccl = comm::make_nccl_communicator(store, r, 2, {0, 1}, options_with_timeout(timeout), r);
        body(*nccl, r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST(NcclBackend, TwoGpuCollectives) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (comm::nccl_version_string().empty()) GTEST_SKIP() << "NCCL backend not compiled";
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  run_on_two_gpus([](comm::Communicator& nccl, int rank) {
    // Uneven all-gather: chunks of 3, output of 5 (the last rank's tail is dropped).
    at::Tensor in = at::full({3}, rank + 1.0, on_gpu(rank, at::kFloat));
    at::Tensor out = at::empty({5}, on_gpu(rank, at::kFloat));
    nccl.all_gather(out, in);
    EXPECT_TRUE(at::equal(out.cpu(), at::tensor({1.0f, 1.0f, 1.0f, 2.0f, 2.0f})));

    // Reduce-scatter of 5 bf16 elements: chunks of 3, zero-padded tail.
    const at::Tensor rs_in = (at::arange(5, on_gpu(rank, at::kFloat)) * (rank + 1.0)).to(at::kBFloat16);
    at::Tensor rs_out = at::empty({3}, on_gpu(rank, at::kBFloat16));
    nccl.reduce_scatter(rs_out, rs_in, comm::ReduceOp::kSum);
    const at::Tensor sum = rank == 0 ? at::tensor({0.0f, 3.0f, 6.0f}) : at::tensor({9.0f, 12.0f, 0.0f});
    EXPECT_TRUE(at::equal(rs_out.cpu(), sum.to(at::kBFloat16)));
    nccl.reduce_scatter(rs_out, rs_in, comm::ReduceOp::kAvg);
    EXPECT_TRUE(at::equal(rs_out.cpu(), (sum / 2.0).to(at::kBFloat16)));

    at::Tensor mx = at::full({100}, rank == 0 ? -1.0 : 4.0, on_gpu(rank, at::kHalf));
    nccl.all_reduce(mx, comm::ReduceOp::kMax);
    EXPECT_TRUE(at::all(mx == 4.0).item<bool>());
    at::Tensor counts = at::full({10}, rank + 1, on_gpu(rank, at::kLong));
    nccl.all_reduce(counts);
    EXPECT_TRUE(at::all(counts == 3).item<bool>());

    at::Tensor b = at::full({64}, rank == 1 ? 42.0 : 0.0, on_gpu(rank, at::kDouble));
    nccl.broadcast(b, 1);
    EXPECT_TRUE(at::all(b == 42.0).item<bool>());
    nccl.barrier();

    // Sub-groups: list order is group-rank order, so global rank 1 is group rank 0 here.
    auto reversed = nccl.new_group({1, 0});
    ASSERT_NE(reversed, nullptr);
    EXPECT_EQ(reversed->rank(), 1 - rank);
    at::Tensor r = at::full({8}, rank == 1 ? 7.0 : 0.0, on_gpu(rank, at::kFloat));
    reversed->broadcast(r, 0);
    EXPECT_TRUE(at::all(r == 7.0).item<bool>());
    auto alone = nccl.split({{0}, {1}});
    ASSERT_NE(alone, nullptr);
    EXPECT_EQ(alone->world_size(), 1);
    EXPECT_EQ(alone->global_ranks(), std::vector<int>{rank});
  }, std::chrono::seconds(120));
}

TEST(NcclBackend, CollectiveThatOneRankNeverJoinsTimesOut) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (comm::nccl_version_string().empty()) GTEST_SKIP() << "NCCL backend not compiled";
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  run_on_two_gpus([](comm::Communicator& nccl, int rank) {
    if (rank == 1) {
      // Alive but absent until rank 0 has given up.
      std::this_thread::sleep_for(std::chrono::seconds(8));
      return;
    }
    at::Tensor t = at::ones({1000}, on_gpu(0, at::kBFloat16));
    const auto start = Clock::now();
    try {
      nccl.all_reduce(t);
      ADD_FAILURE() << "all_reduce returned although rank 1 never joined";
    } catch (const shardtrain::TimeoutError& e) {
      EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 2.0 + 5.0);
      const std::string what = e.what();
      EXPECT_NE(what.find("all_reduce(sum)"), std::string::npos) << what;
      EXPECT_NE(what.find("rank 0 of 2"), std::string::npos) << what;
      EXPECT_NE(what.find("BFloat16"), std::string::npos) << what;
      EXPECT_NE(what.find("1000 -> 1000 elements"), std::string::npos) << what;
      EXPECT_NE(what.find("2000 ms"), std::string::npos) << what;
    }
    // The aborted communicator says so instead of hanging.
    EXPECT_THROW(nccl.all_reduce(t), shardtrain::Error);
  }, std::chrono::milliseconds(2000));
}

}  // namespace
