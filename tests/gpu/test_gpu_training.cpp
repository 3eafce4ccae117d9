// Training on a GPU against the same run on the CPU, at world 1, 20 steps:
// the plain loop, zero-3, fsdp standard and fsdp pure, on train_tiny's model
// and on the tiny Llama; the lost-update audit on both devices; a checkpoint
// saved on the GPU resumed on the CPU, and one that restores the GPU's
// random stream; optimizer offload on the GPU against the run without it. The CPU run of every comparison comes
// first, so a dry run with the CPU standing in for the GPU
// (gpu_test_device.h) runs it too, and records its numbers.

#include <cmath>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/CachingHostAllocator.h>
#include <gtest/gtest.h>

#include "accelerator_internals.h"
#include "data_dir.h"
#include "engine/sharded_engine.h"
#include "finetune/finetune.h"
#include "gpu_test_device.h"
#include "shardtrain/accelerator.h"
#include "shardtrain/device.h"
#include "shardtrain/error.h"
#include "support/scratch_dir.h"
#include "tiny/tiny_model.h"
#include "tiny/tiny_train.h"
#include "torch_cuda.h"

namespace {

using shardtrain::testing::test_device;
using shardtrain::testing::test_device_name;

constexpr int kSteps = 20;

// Why these bounds. Both runs start from the same weights (initialised on the
// CPU, then moved) and see the same batches; only the order of additions
// inside the kernels differs: cuBLAS against MKL's or oneDNN's blocking, the
// GPU's against the CPU's reductions in softmax, norms and the loss.
//
// fp32, TF32 off (set below): unit roundoff u = 2^-24 = 6e-8. A sum of K
// terms in another order differs by about sqrt(K) u relative (K u at worst);
// the longest reductions are K = 688 (the Llama's FFN width; train_tiny's is
// 256), so each step adds a difference of about sqrt(688) u = 1.6e-6. Adam
// normalises every update (m / sqrt(v)), so a relative difference of the
// gradients reaches the parameters at most in proportion, never scaled up by
// the gradient's size, and the differences of s steps add at most linearly:
// 20 x 1.6e-6 = 3.2e-5 after the last step. The loss, a mean over
// micro-batch x sequence tokens, averages independent roundings further.
// Bound: 5e-5 relative. A real defect (a wrong mask, a missed gradient, a
// stale parameter) moves the loss by 1e-3 or more within a few steps.
constexpr double kFp32LossBound = 5e-5;
// Pure bf16 (fsdp pure low precision): parameters, gradients and optimizer
// state are bf16, one ulp 2^-8 relative. Where two fp32 accumulations differ
// in their last bits, an output near a bf16 rounding boundary rounds the
// other way, off by one ulp; the loss's relative change is at most the
// logits' largest relative change, one ulp if every element moved the same
// way: 2^-8 = 3.9e-3.
constexpr double kPureLossBound = 3.9e-3;
// The audit's fraction counts sampled elements whose update is lost (below
// half an ulp of the parameter). An element changes sides only when its
// update lies within the runs' relative difference of that threshold, and
// the updates' magnitudes spread over decades: with the fp32 runs' 5e-5 that
// is far below 1e-3 of the sample; the pure runs' one-ulp differences move
// the threshold by 2^-8 of an element, up to about 1e-2 of the sample.
constexpr double kFp32AuditBound = 1e-3;
constexpr double kPureAuditBound = 1e-2;

struct EngineCase {
  const char* name;
  const char* tiny_config;   ///< relative to the data dir; "" for the plain loop
  const char* llama_config;  ///< relative to the data dir; "" for the plain loop
  bool pure;                 ///< fsdp pure low precision: a bf16 load, bf16 everything
};

const EngineCase kCases[] = {
    {"plain", "", "", false},
    {"zero3", "configs/zero3_fp32.json", "configs/llama/zero3_fp32.json", false},
    {"fsdp_standard", "configs/fsdp_fp32.yaml", "configs/llama/fsdp_fp32.yaml", false},
    {"fsdp_pure", "configs/fsdp_pure_bf16.yaml", "configs/llama/fsdp_pure_bf16.yaml", true},
};

std::string data_path(const char* relative) {
  return *relative == '\0' ? std::string() : shardtrain_data_dir() + "/" + relative;
}

void strict_cublas_math() {
  // The CPU has no TF32: an fp32 comparison must not let cuBLAS drop to it.
  at::globalContext().setAllowTF32CuBLAS(false);
  at::globalContext().setAllowTF32CuDNN(false);
  // The pure-bf16 bound assumes fp32 accumulation throughout; torch lets
  // cuBLAS's split-K reduce partial sums in bf16/fp16 unless told not to.
  at::globalContext().setAllowBF16ReductionCuBLAS(false);
  at::globalContext().setAllowFP16ReductionCuBLAS(false);
}

struct DeviceRun {
  std::vector<double> losses, audit, audit_if_bf16;
};

/// Step by step: the device's losses within `loss_bound` (relative) of the
/// CPU's, the audits within `audit_bound` where both measured; the device's
/// run learned. Records the largest differences as test properties.
void expect_follows(const DeviceRun& cpu, const DeviceRun& device, double loss_bound, double audit_bound,
                    ::testing::Test& test) {
  ASSERT_EQ(device.losses.size(), cpu.losses.size());
  double worst_loss = 0, worst_audit = 0;
  for (std::size_t step = 0; step < cpu.losses.size(); ++step) {
    ASSERT_TRUE(std::isfinite(device.losses[step]) && std::isfinite(cpu.losses[step]))
        << "step " << step + 1 << ": cpu " << cpu.losses[step] << ", device " << device.losses[step];
    const double relative = std::abs(device.losses[step] - cpu.losses[step]) / std::abs(cpu.losses[step]);
    worst_loss = std::max(worst_loss, relative);
    EXPECT_LE(relative, loss_bound) << "step " << step + 1 << ": cpu " << cpu.losses[step] << ", "
                                    << test_device() << " " << device.losses[step];
  }
  for (const auto& [c, d] :
       {std::pair{&cpu.audit, &device.audit}, std::pair{&cpu.audit_if_bf16, &device.audit_if_bf16}}) {
    ASSERT_EQ(c->size(), d->size());
    for (std::size_t step = 0; step < c->size(); ++step) {
      EXPECT_EQ((*c)[step] < 0, (*d)[step] < 0) << "the audit ran on one device only, step " << step + 1;
      if ((*c)[step] < 0 || (*d)[step] < 0) continue;
      worst_audit = std::max(worst_audit, std::abs((*c)[step] - (*d)[step]));
      EXPECT_LE(std::abs((*c)[step] - (*d)[step]), audit_bound)
          << "lost-update fraction of step " << step + 1 << ": cpu " << (*c)[step] << ", device " << (*d)[step];
    }
  }
  EXPECT_LT(device.losses.back(), device.losses.front()) << "the run on " << test_device() << " did not learn";
  test.RecordProperty("cpu_first_loss", std::to_string(cpu.losses.front()));
  test.RecordProperty("cpu_last_loss", std::to_string(cpu.losses.back()));
  test.RecordProperty("device_last_loss", std::to_string(device.losses.back()));
  test.RecordProperty("max_relative_loss_difference", std::to_string(worst_loss));
  test.RecordProperty("max_audit_difference", std::to_string(worst_audit));
}

tiny::TinyRunOptions tiny_options(const EngineCase& c, const std::string& device) {
  tiny::TinyRunOptions options;
  options.device = device;
  options.steps = kSteps;
  options.micro_batch = 4;
  options.seed = 1;
  options.quiet = true;
  if (*c.tiny_config != '\0') options.config_path = data_path(c.tiny_config);
  if (c.pure) options.load_dtype = "bf16";
  return options;
}

DeviceRun run_tiny_on(const EngineCase& c, const std::string& device) {
  const tiny::TinyRunResult r = tiny::run_tiny(tiny_options(c, device));
  return {r.losses, r.lost_update_fracs, r.lost_update_fracs_if_bf16};
}

DeviceRun run_llama_on(const EngineCase& c, const std::string& device, const std::string& output_dir) {
  finetune::FinetuneOptions options;
  const std::string model = shardtrain_data_dir() + "/examples/tiny_llama";
  options.config_path = data_path(c.llama_config);
  options.model_config = model + "/config.json";
  options.tokenizer = model + "/tokenizer.model";
  options.data = model + "/data/train.jsonl";
  options.seq_len = 64;
  options.micro_batch = 4;
  options.max_steps = kSteps;
  options.warmup = 2;
  options.lr = 1e-3;
  options.device = device;
  options.output_dir = output_dir;
  options.no_export = true;
  options.no_save = true;
  options.no_progress = true;
  options.quiet = true;
  const finetune::FinetuneSummary s = finetune::run_finetune(options);
  return {s.losses, s.lost_update_fracs, s.lost_update_fracs_if_bf16};
}

class GpuEngines : public ::testing::TestWithParam<EngineCase> {};

TEST_P(GpuEngines, TinyModelFollowsTheCpuRunStepByStep) {
  const EngineCase c = GetParam();
  const DeviceRun cpu = run_tiny_on(c, "cpu");
  RecordProperty("cpu_last_loss", std::to_string(cpu.losses.back()));
  REQUIRE_TEST_DEVICE();
  strict_cublas_math();
  expect_follows(cpu, run_tiny_on(c, test_device_name()), c.pure ? kPureLossBound : kFp32LossBound,
                 c.pure ? kPureAuditBound : kFp32AuditBound, *this);
}

TEST_P(GpuEngines, TinyLlamaFollowsTheCpuRunStepByStep) {
  const EngineCase c = GetParam();
  shardtrain::testing::ScratchDir scratch;
  const DeviceRun cpu = run_llama_on(c, "cpu", scratch.file("cpu"));
  RecordProperty("cpu_last_loss", std::to_string(cpu.losses.back()));
  REQUIRE_TEST_DEVICE();
  strict_cublas_math();
  expect_follows(cpu, run_llama_on(c, test_device_name(), scratch.file("device")),
                 c.pure ? kPureLossBound : kFp32LossBound, c.pure ? kPureAuditBound : kFp32AuditBound, *this);
}

INSTANTIATE_TEST_SUITE_P(GpuTraining, GpuEngines, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// A checkpoint is the fp32 master, the optimizer state and the counters,
// written as CPU tensors: whatever device saved it, a CPU run that loads it
// holds the same bits, under the engine that saved it and under the other.
TEST(GpuTrainingCheckpoint, SavedOnTheDeviceResumesOnTheCpuBitwise) {
  shardtrain::testing::ScratchDir scratch;
  const EngineCase zero3 = kCases[1];
  REQUIRE_TEST_DEVICE();
  strict_cublas_math();
  tiny::TinyRunOptions on_device = tiny_options(zero3, test_device_name());
  on_device.save_dir = scratch.file("ckpt");
  on_device.save_every = kSteps / 2;
  on_device.stop_after = kSteps / 2;
  const tiny::TinyRunResult saved = tiny::run_tiny(on_device);
  ASSERT_EQ(saved.losses.size(), static_cast<std::size_t>(kSteps / 2));

  for (const EngineCase& engine : {kCases[1], kCases[2]}) {
    SCOPED_TRACE(engine.name);
    // Resumed at step 10 of 10: nothing trains, the state is what was loaded.
    tiny::TinyRunOptions loaded = tiny_options(engine, "cpu");
    loaded.resume_dir = scratch.file("ckpt");
    loaded.steps = kSteps / 2;
    const tiny::TinyRunResult resumed = tiny::run_tiny(loaded);
    EXPECT_TRUE(resumed.losses.empty());
    std::map<std::string, at::Tensor> saved_params;
    for (const auto& [name, value] : saved.final_params) saved_params[name] = value.cpu();
    ASSERT_EQ(resumed.final_params.size(), saved_params.size());
    for (const auto& [name, value] : resumed.final_params) {
      ASSERT_TRUE(saved_params.count(name)) << name << " is not in the saved state";
      EXPECT_TRUE(at::equal(value.cpu(), saved_params[name]))
          << name << ": max |difference| " << (value.cpu() - saved_params[name]).abs().max().item<double>();
    }
  }

  // And it goes on from there: the CPU's steps 11-20 follow the device's own.
  tiny::TinyRunOptions whole = tiny_options(zero3, test_device_name());
  const tiny::TinyRunResult uninterrupted = tiny::run_tiny(whole);
  tiny::TinyRunOptions continued = tiny_options(zero3, "cpu");
  continued.resume_dir = scratch.file("ckpt");
  const tiny::TinyRunResult rest = tiny::run_tiny(continued);
  ASSERT_EQ(rest.losses.size(), static_cast<std::size_t>(kSteps / 2));
  for (int k = 0; k < kSteps / 2; ++k) {
    const double device_loss = uninterrupted.losses[kSteps / 2 + k];
    EXPECT_LE(std::abs(rest.losses[k] - device_loss) / std::abs(device_loss), kFp32LossBound)
        << "step " << kSteps / 2 + k + 1 << ": resumed on the cpu " << rest.losses[k] << ", device "
        << device_loss;
  }
}

// The offloads keep model states in pinned host memory and step them there
// with the CPU kernels, which round exactly as the GPU's do: the same run
// with and without offload is the same to the bit.
// - offload_optimizer: the fp32 master, the optimizer state and the gradient
//   partition (each reduction's result comes down as it is added); in fp32
//   the parameters stay on the GPU and the host master is uploaded after
//   each step, in bf16 the step writes a rounded host copy.
// - offload_param as well: the bf16 (or fp32) partition itself stays on the
//   host, where the step writes it, and each gather uploads its shard.
// - FSDP pure bf16 with fsdp_offload_params: its bf16 partition, gradient
//   and moments live on the host.
// The memory report says what moved: everything but the parameter
// partition, and that too under the parameter offload. The run ends by
// gathering the full state dict, which reads the host values. In the dry
// run, with the model on the CPU, the offload has nothing to move, so the
// runs are the same run and nothing counts as offloaded: only the GPU run
// tests the offload here (DistOffload.* forces its copies on the CPU).
TEST(GpuTrainingOffload, OptimizerAndParameterOffloadTrainAsTheRunWithoutThem) {
  shardtrain::testing::ScratchDir scratch;
  REQUIRE_TEST_DEVICE();
  const bool moves = shardtrain::testing::test_device().is_cuda();
  auto expect_same_run = [](const tiny::TinyRunResult& offloaded, const tiny::TinyRunResult& on_device) {
    EXPECT_EQ(offloaded.losses, on_device.losses);
    ASSERT_EQ(offloaded.final_params.size(), on_device.final_params.size());
    for (std::size_t k = 0; k < on_device.final_params.size(); ++k) {
      const auto& [name, value] = on_device.final_params[k];
      EXPECT_EQ(offloaded.final_params[k].first, name);
      EXPECT_TRUE(at::equal(offloaded.final_params[k].second.cpu(), value.cpu())) << name;
    }
  };
  // On the GPU at rest: the parameter partition unless it moved, nothing else.
  auto expect_offloaded = [&](const shardtrain::MemoryReport& m, bool params_moved, int64_t device_partition_bytes) {
    EXPECT_EQ(m.offloaded,
              moves ? m.params + m.grads + m.master + m.optimizer - (params_moved ? 0 : device_partition_bytes) : 0);
  };
  {
    SCOPED_TRACE("fsdp pure bf16");
    const EngineCase& pure = kCases[3];
    std::ifstream file(data_path(pure.tiny_config));
    const std::string yaml((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
    const std::string off = "fsdp_offload_params: false";
    const std::size_t at_key = yaml.find(off);
    ASSERT_NE(at_key, std::string::npos) << pure.tiny_config << " no longer says " << off;
    const std::string offload_yaml = std::string(yaml).replace(at_key, off.size(), "fsdp_offload_params: true");
    tiny::TinyRunOptions options = tiny_options(pure, test_device_name());
    options.steps = 5;
    const tiny::TinyRunResult on_device = tiny::run_tiny(options);
    options.config_path = scratch.write("pure_offload.yaml", offload_yaml);
    const tiny::TinyRunResult offloaded = tiny::run_tiny(options);
    expect_same_run(offloaded, on_device);
    EXPECT_EQ(on_device.memory.offloaded, 0);
    expect_offloaded(offloaded.memory, true, 0);
  }
  for (const bool bf16 : {false, true}) {
    for (const std::string offload : {"offload_optimizer", "offload_param"}) {
      SCOPED_TRACE(std::string(bf16 ? "bf16, " : "fp32, ") + offload);
      const bool params_too = offload == "offload_param";
      auto config = [&](bool offloaded) {
        std::string blocks;
        if (offloaded) blocks += R"(, "offload_optimizer": {"device": "cpu", "pin_memory": true})";
        if (offloaded && params_too) blocks += R"(, "offload_param": {"device": "cpu", "pin_memory": true})";
        const std::string text = std::string(R"({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "bf16": {"enabled": )") +
                                 (bf16 ? "true" : "false") + R"(}, "zero_optimization": {"stage": 3)" + blocks + "}}";
        return scratch.write(std::string(bf16 ? "bf16_" : "fp32_") + (offloaded ? offload : "none") + ".json", text);
      };
      tiny::TinyRunOptions options = tiny_options(kCases[1], test_device_name());
      options.steps = 5;
      options.config_path = config(false);
      const tiny::TinyRunResult on_device = tiny::run_tiny(options);
      options.config_path = config(true);
      const tiny::TinyRunResult offloaded = tiny::run_tiny(options);
      expect_same_run(offloaded, on_device);
      EXPECT_EQ(on_device.memory.offloaded, 0);
      // Without the parameter offload the device keeps the model's partition:
      // in bf16 half of params (the host copy the step writes is the other
      // half), in fp32 all of it (the master, its own entry, is the host copy).
      const int64_t device_partition = bf16 ? offloaded.memory.params / 2 : offloaded.memory.params;
      expect_offloaded(offloaded.memory, params_too, device_partition);
    }
  }
}

// Where the states live, read from the engine itself rather than from its
// report: under offload_param the bf16 partition, the fp32 master and the
// gradient partition are in host memory, and the module's gathered
// parameters on the GPU, where a step then runs. Pinned by default, each
// partition its exact size: none of it comes from LibTorch's caching host
// allocator, which would round each up to a power of two (its bytes in use
// are the same before prepare() and after it). With pin_memory: false they
// are pageable and the step is the same. (In the dry run the CPU is the
// device: nothing moves.)
TEST(GpuTrainingOffload, UnderOffloadParamThePartitionAndTheMasterAreInHostMemoryPinnedToTheirSize) {
  shardtrain::testing::ScratchDir scratch;
  REQUIRE_TEST_DEVICE();
  const at::Device device = shardtrain::testing::test_device();
  const bool moves = device.is_cuda();
  auto cached_pinned_bytes = [&] {
    return moves ? at::getHostAllocator(at::kCUDA)->get_stats().allocated_bytes.current : int64_t{0};
  };
  for (const bool pin : {true, false}) {
    SCOPED_TRACE(pin ? "pin_memory: true" : "pin_memory: false");
    const std::string pin_memory = pin ? "true" : "false";
    shardtrain::AcceleratorOptions options;
    options.config_path = scratch.write("offload_param_" + pin_memory + ".json",
                                        R"({"train_micro_batch_size_per_gpu": "auto",
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bf16": {"enabled": true},
      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": )" +
                                            pin_memory + R"(}, "offload_param": {"device": "cpu"}}})");
    options.init.backend = shardtrain::backend_for(device);
    options.print_plan = false;
    shardtrain::Accelerator accelerator(options);
    tiny::TinyConfig model_config;
    tiny::TinyModel model(model_config);
    model->to(device);
    shardtrain::RunInfo run;
    run.micro_batch_size = 2;
    const int64_t cached_before = cached_pinned_bytes();
    auto prepared = accelerator.prepare(model, {}, run);
    EXPECT_EQ(cached_pinned_bytes(), cached_before) << "a partition came from the caching host allocator";
    auto& engine =
        dynamic_cast<shardtrain::engine::ShardedEngine&>(shardtrain::AcceleratorInternals::engine(accelerator));
    for (const auto& [what, partition] :
         {std::pair{"bf16 partition", engine.low_precision_partition()}, std::pair{"master", engine.master_partition()},
          std::pair{"gradient partition", engine.gradient_partition()}}) {
      EXPECT_EQ(partition.device(), moves ? at::Device(at::kCPU) : device) << what;
      EXPECT_EQ(partition.is_pinned(), moves && pin) << what;
    }
    const at::Tensor tokens =
        at::stack({tiny::synthetic_sample(1, 0, model_config), tiny::synthetic_sample(1, 1, model_config)}).to(device);
    const at::Tensor logits = prepared(tokens);
    EXPECT_EQ(logits.device(), device);
    const int64_t vocab = logits.size(-1), positions = tokens.size(1) - 1;
    const at::Tensor loss = at::cross_entropy_loss(logits.narrow(1, 0, positions).reshape({-1, vocab}),
                                                   tokens.narrow(1, 1, positions).reshape({-1}));
    const at::Tensor before = engine.low_precision_partition().clone();
    accelerator.backward(loss);
    accelerator.step();
    EXPECT_FALSE(at::equal(engine.low_precision_partition(), before)) << "the step did not write the host partition";
    EXPECT_EQ(engine.low_precision_partition().device(), moves ? at::Device(at::kCPU) : device);
  }
}

// A checkpoint keeps each rank's random streams, the device's included (LoRA
// dropout on GPU tensors draws from the GPU's): after a load, the device
// draws what it drew right after the save.
TEST(GpuTrainingCheckpoint, LoadingRestoresTheDevicesRandomStream) {
  shardtrain::testing::ScratchDir scratch;
  REQUIRE_TEST_DEVICE();
  const at::Device device = shardtrain::testing::test_device();
  shardtrain::AcceleratorOptions options;
  options.config_path = data_path(kCases[1].tiny_config);
  options.init.backend = shardtrain::backend_for(device);
  options.print_plan = false;
  shardtrain::Accelerator accelerator(options);
  tiny::TinyModel model(tiny::TinyConfig{});
  model->to(device);
  shardtrain::RunInfo run;
  run.micro_batch_size = 4;
  auto prepared = accelerator.prepare(model, {}, run);
  accelerator.save_state(scratch.file("ckpt"));
  const at::Tensor after_save = at::rand({64}, at::TensorOptions().device(device));
  at::rand({1000}, at::TensorOptions().device(device));  // the stream moves on
  accelerator.load_state(scratch.file("ckpt"));
  const at::Tensor after_load = at::rand({64}, at::TensorOptions().device(device));
  EXPECT_TRUE(at::equal(after_load.cpu(), after_save.cpu()));
}

// The offload's host buffers: zeroed, page-locked, exactly the size asked
// for, and usable by an asynchronous copy both ways. A size no machine can
// pin (1 PiB, beyond x86-64's user address space) is refused with the
// driver's reason and the size, and leaves the device usable.
TEST(GpuTrainingMemory, PinnedHostBuffersAreZeroedAndARefusalNamesTheSize) {
  REQUIRE_CUDA();
  const c10::Device gpu = shardtrain::resolve_device("cuda", 0);
  const at::Tensor buffer = shardtrain::torch_cuda::pinned_host_zeros(1000, at::kFloat, gpu.index());
  EXPECT_TRUE(buffer.is_pinned());
  EXPECT_EQ(buffer.device(), at::Device(at::kCPU));
  EXPECT_EQ(buffer.nbytes(), 4000u);
  EXPECT_TRUE(at::equal(buffer, at::zeros({1000})));
  const at::Tensor values = at::arange(1000, at::TensorOptions().dtype(at::kFloat).device(gpu));
  buffer.copy_(values, /*non_blocking=*/true);
  const at::Tensor back = at::empty({1000}, values.options()).copy_(buffer, /*non_blocking=*/true);
  EXPECT_TRUE(at::equal(back.cpu(), values.cpu()));
  try {
    (void)shardtrain::torch_cuda::pinned_host_zeros(int64_t{1} << 48, at::kFloat, gpu.index());
    ADD_FAILURE() << "pinning 1 PiB succeeded";
  } catch (const shardtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot pin 1125899906842624 bytes of host memory"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(at::ones({4}, values.options()).sum().item<float>(), 4.0f);
}

TEST(GpuTrainingMemory, PeakMemoryComesFromTheCachingAllocator) {
  REQUIRE_CUDA();
  const c10::Device gpu = shardtrain::resolve_device("cuda", 0);
  shardtrain::reset_device_peak_memory(gpu);
  const int64_t before = shardtrain::device_memory(gpu).peak_allocated;
  {
    at::Tensor block = at::empty({64 << 20}, at::TensorOptions().dtype(at::kByte).device(gpu));
    EXPECT_GE(shardtrain::device_memory(gpu).allocated, int64_t{64} << 20);
  }
  EXPECT_GE(shardtrain::device_memory(gpu).peak_allocated, before + (int64_t{64} << 20));
  EXPECT_FALSE(shardtrain::device_name(gpu).empty());
}

}  // namespace
