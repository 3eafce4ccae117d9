// QLoRA under the sharding engines at world 2: the NF4 base is sharded and
// all-gathered as its bytes (the frozen weights' traffic per step drops by
// exactly the difference between bf16 and NF4 bytes of the quantized
// weights), the adapters train on it, the base's bytes never change, a
// checkpoint of the run saves and loads without the base, and under rank-0-only
// loading the other ranks receive their NF4 shards from rank 0.

#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shardtrain/accelerator.h"
#include "shardtrain/error.h"
#include "shardtrain/kernels.h"
#include "shardtrain/lora.h"
#include "shardtrain/models/llama.h"
#include "shardtrain/models/hf_weights.h"
#include "shardtrain/quantization.h"
#include "shardtrain/weight_loading.h"
#include "support/llama_golden.h"
#include "support/multirank.h"
#include "support/test_scratch.h"
#include "support/tiny_compare.h"

namespace {

namespace fs = std::filesystem;
using shardtrain::models::LlamaForCausalLM;
using shardtrain::testing::attention_lora_r8;
using shardtrain::testing::RankContext;
using shardtrain::testing::use_plain_sgd;

constexpr int kQloraWorld = 2;
constexpr int kQloraSteps = 3;

shardtrain::models::LlamaConfig qlora_model_config() { return shardtrain::testing::small_gqa_llama_config(64); }

/// kQloraSteps steps on random ids, seeded per rank; the per-step losses.
template <typename Prepared>
std::vector<double> train_steps(RankContext& ctx, shardtrain::Accelerator& accelerator, Prepared& prepared) {
  std::vector<double> losses;
  torch::manual_seed(100 + ctx.rank());
  for (int step = 0; step < kQloraSteps; ++step) {
    const at::Tensor ids = torch::randint(0, 64, {2, 16}, torch::kLong);
    const at::Tensor loss = shardtrain::models::causal_lm_loss(prepared(ids), ids);
    accelerator.backward(loss);
    accelerator.step();
    accelerator.zero_grad();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

struct RunResult {
  std::vector<double> losses;
  shardtrain::TrafficReport traffic;  // over kQloraSteps steps
  shardtrain::MemoryReport memory;
  int64_t quantized_weights = 0, nf4_bytes = 0;
};

/// LoRA r 8 on q/k/v/o, bf16 mixed precision (`bf16_base`: the model built
/// in bf16 and mixed_precision no, FSDP's pure low precision), kQloraSteps SGD
/// steps; with `quantize`, the frozen base in NF4 (lm_head kept, as by
/// default: every quantized weight is then in a decoder layer's unit).
RunResult train_qlora(RankContext& ctx, shardtrain::TrainingConfig config, bool quantize, const fs::path& checkpoint_dir,
                bool bf16_base = false) {
  torch::manual_seed(11);
  LlamaForCausalLM model(qlora_model_config());
  if (bf16_base) model->to(torch::kBFloat16);
  const shardtrain::LoraConfig lora = attention_lora_r8();
  shardtrain::apply_lora(*model, lora);
  RunResult result;
  std::map<std::string, at::Tensor> base_bytes;
  if (quantize) {
    const auto summary = shardtrain::quantize_frozen_base(*model);
    result.nf4_bytes = summary.bytes_after;
    result.quantized_weights = summary.quantized_parameters;
    for (const auto& item : model->named_parameters()) {
      if (item.value().scalar_type() == at::kByte) base_bytes[item.key()] = item.value().detach().clone();
    }
  }
  config.mixed_precision = bf16_base ? shardtrain::MixedPrecision::kNo : shardtrain::MixedPrecision::kBf16;
  use_plain_sgd(config);
  auto accelerator = shardtrain::testing::accelerator_for(config, ctx);
  auto prepared = accelerator->prepare(model, {}, shardtrain::testing::micro_batch(2));
  accelerator->reset_traffic();
  result.losses = train_steps(ctx, *accelerator, prepared);
  for (const double loss : result.losses) EXPECT_TRUE(std::isfinite(loss));
  result.traffic = accelerator->traffic();
  result.memory = accelerator->memory();
  if (!quantize) return result;

  bool adapters_moved = false;
  int base_seen = 0;
  for (const auto& [name, value] : accelerator->full_state_dict()) {
    if (base_bytes.count(name)) {
      ++base_seen;
      EXPECT_TRUE(at::equal(value.reshape({-1}), base_bytes.at(name))) << "the NF4 base " << name << " changed";
    } else if (name.find("lora_B") != std::string::npos) {
      adapters_moved = adapters_moved || !value.eq(0).all().item<bool>();
    }
  }
  EXPECT_EQ(base_seen, static_cast<int>(base_bytes.size()));
  EXPECT_TRUE(adapters_moved) << "training on the NF4 base did not move any lora_B";

  // No full export of a quantized base; the adapter saves as for LoRA.
  EXPECT_THROW(accelerator->save_model((checkpoint_dir / "merged").string()), shardtrain::ConfigError);
  accelerator->save_lora_adapter((checkpoint_dir / "adapter").string(), lora);
  EXPECT_TRUE(fs::exists(checkpoint_dir / "adapter" / "adapter_model.safetensors"));

  // A checkpoint holds the adapters and their optimizer state, not the base;
  // it loads back into the same quantized model.
  const std::string saved = accelerator->save_state(checkpoint_dir.string());
  EXPECT_FALSE(saved.empty());
  accelerator->load_state(checkpoint_dir.string());
  for (const auto& [name, value] : accelerator->full_state_dict()) {
    if (base_bytes.count(name)) EXPECT_TRUE(at::equal(value.reshape({-1}), base_bytes.at(name))) << name;
  }
  return result;
}

/// zero3, fsdp_standard, fsdp_pure (the base loaded in bf16).
class DistQlora : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(DistQlora, TheNf4BaseIsGatheredAsItsBytesAndTheAdaptersTrainOnIt) {
  const std::string mode = GetParam();
  const fs::path dir = shardtrain::testing::test_scratch_dir();
  shardtrain::testing::MultiRankOptions harness;
  harness.timeout = std::chrono::seconds(300);
  shardtrain::testing::run_on_ranks(kQloraWorld, [mode, work = dir](RankContext& ctx) {
    const bool pure = mode == "fsdp_pure";
    const shardtrain::TrainingConfig config = shardtrain::testing::fp32_llama_engine_config(mode != "zero3");
    const RunResult bf16 = train_qlora(ctx, config, false, work / "unused", pure);
    const RunResult nf4 = train_qlora(ctx, config, true, work / "checkpoints", pure);
    if (pure) {
      // No fp32 copy of the frozen base (the bf16 embeddings, norms and
      // lm_head): the fp32 masters are the adapters' alone, 4 B per trained
      // element beside SGD's 2 B bf16 shard of it. The NF4 run holds the
      // same adapters, and its frozen shards are smaller.
      EXPECT_EQ(nf4.memory.master, bf16.memory.master);
      EXPECT_LT(nf4.memory.params, bf16.memory.params);
    }
    // The adapters (and everything trainable) travel the same in both runs.
    EXPECT_EQ(bf16.traffic.param_gather_bytes - bf16.traffic.frozen_gather_bytes,
              nf4.traffic.param_gather_bytes - nf4.traffic.frozen_gather_bytes);
    // Every quantized weight lives in a decoder layer, and each layer is
    // gathered the same number of times per step in both runs: the frozen
    // traffic falls by exactly (2 bytes - NF4 bytes) per quantized weight per
    // gather of the layers. The layouts pad nothing here (every
    // entry is an even number of elements, world 2).
    const int64_t saved = bf16.traffic.frozen_gather_bytes - nf4.traffic.frozen_gather_bytes;
    const int64_t per_gather = 2 * nf4.quantized_weights - nf4.nf4_bytes;
    ASSERT_GT(saved, 0) << "the NF4 base did not travel as bytes";
    EXPECT_EQ(saved % per_gather, 0) << "saved " << saved << " bytes, not whole gathers of " << per_gather;
    const double ratio = static_cast<double>(nf4.nf4_bytes) / static_cast<double>(2 * nf4.quantized_weights);
    EXPECT_LE(ratio, 0.5 / 2 + 1.0 / 128 + 6.0 / 2048);  // 4 bits + the absmax byte per 64 + scale, offset, padding
    if (ctx.rank() == 0) {
      std::cout << mode << " per step: frozen weights gathered " << bf16.traffic.frozen_gather_bytes / kQloraSteps
                << " B with a bf16 base, " << nf4.traffic.frozen_gather_bytes / kQloraSteps
                << " B with the NF4 base (the quantized weights: " << ratio << " of their bf16 bytes); all parameters "
                << bf16.traffic.param_gather_bytes / kQloraSteps << " -> " << nf4.traffic.param_gather_bytes / kQloraSteps << " B\n";
    }
  }, harness);
}

INSTANTIATE_TEST_SUITE_P(DistEngines, DistQlora, ::testing::Values("zero3", "fsdp_standard", "fsdp_pure"),
                         [](const auto& info) { return info.param; });

// Under ZeRO-3's parameter offload (its copies forced on the CPU, as in
// DistOffload.*) the NF4 base's shards live in host memory with the
// adapters' partition and each gather uploads them as bytes: the same
// losses, the same traffic, the base unchanged through a checkpoint round
// trip (train_qlora() checks it), and no model state left on the device at rest.
TEST(DistQloraOffload, TheNf4BaseMovesToTheHostAndTrainsAsWithoutOffload) {
  const fs::path dir = shardtrain::testing::test_scratch_dir();
  shardtrain::testing::MultiRankOptions harness;
  harness.env["SHARDTRAIN_OFFLOAD_ON_CPU"] = "1";
  harness.timeout = std::chrono::seconds(300);
  shardtrain::testing::run_on_ranks(kQloraWorld, [work = dir](RankContext& ctx) {
    shardtrain::TrainingConfig config = shardtrain::testing::fp32_llama_engine_config(false);
    const RunResult on_device = train_qlora(ctx, config, true, work / "on_device");
    config.zero.offload_param = shardtrain::OffloadDevice::kCpu;
    config.zero.offload_optimizer = shardtrain::OffloadDevice::kCpu;
    const RunResult offloaded = train_qlora(ctx, config, true, work / "offloaded");
    EXPECT_EQ(offloaded.losses, on_device.losses);
    EXPECT_EQ(offloaded.traffic.param_gather_bytes, on_device.traffic.param_gather_bytes);
    EXPECT_EQ(offloaded.traffic.frozen_gather_bytes, on_device.traffic.frozen_gather_bytes);
    const shardtrain::MemoryReport& before = on_device.memory;
    const shardtrain::MemoryReport& after = offloaded.memory;
    EXPECT_EQ(after.params, before.params);  // the NF4 shards among them, moved, not copied
    EXPECT_EQ(after.grads, before.grads);
    EXPECT_EQ(after.offloaded, after.params + after.master + after.optimizer + after.grads);
  }, harness);
}

// ---- QLoRA with rank-0-only loading ----------------------------------------------

struct LoadedRun {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> state;  ///< after training: adapters, NF4 bytes, the rest
  int64_t held_after_quantizing = 0;        ///< parameter storage before prepare()
  int64_t adapter_bytes = 0;                ///< the LoRA parameters'
};

/// The QLoRA run of train_qlora(), with `rank0_loads` (fsdp_cpu_ram_efficient_loading
/// or zero3_init_flag): the ranks where materialize_full_weights() is false
/// build the model without weights and quantize that.
LoadedRun train_loading(RankContext& ctx, const std::string& mode, bool rank0_loads,
                        const shardtrain::RunInfo& run = shardtrain::testing::micro_batch(2)) {
  const bool pure = mode == "fsdp_pure";
  shardtrain::TrainingConfig config = shardtrain::testing::fp32_llama_engine_config(mode != "zero3");
  config.zero3_init_flag = rank0_loads && mode == "zero3";
  config.fsdp.cpu_ram_efficient_loading = rank0_loads && mode != "zero3";
  config.mixed_precision = pure ? shardtrain::MixedPrecision::kNo : shardtrain::MixedPrecision::kBf16;
  use_plain_sgd(config);
  auto accelerator = shardtrain::testing::accelerator_for(config, ctx);
  EXPECT_EQ(accelerator->materialize_full_weights(), !rank0_loads || ctx.rank() == 0);
  torch::manual_seed(11);
  const at::ScalarType dtype = pure ? at::kBFloat16 : at::kFloat;
  LlamaForCausalLM model = accelerator->materialize_full_weights()
                               ? LlamaForCausalLM(qlora_model_config())
                               : shardtrain::models::make_llama_without_weights(qlora_model_config(), dtype);
  if (accelerator->materialize_full_weights()) model->to(dtype);
  const shardtrain::LoraConfig lora = attention_lora_r8();
  shardtrain::apply_lora(*model, lora);
  shardtrain::quantize_frozen_base(*model);
  LoadedRun result;
  for (const auto& item : model->named_parameters()) {
    const at::Tensor& p = item.value();
    if (item.key().find("lora_") != std::string::npos) result.adapter_bytes += p.numel() * p.element_size();
  }
  result.held_after_quantizing = shardtrain::parameter_storage_bytes(*model);
  auto prepared = accelerator->prepare(model, {}, run);
  result.losses = train_steps(ctx, *accelerator, prepared);
  for (const auto& [name, value] : accelerator->full_state_dict()) result.state[name] = value;
  return result;
}

/// zero3, fsdp_standard, fsdp_pure (the base loaded in bf16).
class DistQloraRankZeroLoading : public ::testing::TestWithParam<std::string> {};

// Rank 0 loads the base and quantizes it; rank 1 builds it without weights,
// quantizes only its shapes, holds no base at all before prepare(), and
// receives its shards of rank 0's NF4 bytes: the training is the same, to the
// bit, as when every rank loads and quantizes the whole base.
TEST_P(DistQloraRankZeroLoading, RankOneHoldsNoBaseAndTrainsAsWhenEveryRankLoadsIt) {
  shardtrain::testing::run_on_ranks(kQloraWorld, [mode = GetParam()](RankContext& ctx) {
    const LoadedRun everyone = train_loading(ctx, mode, false);
    const LoadedRun rank0 = train_loading(ctx, mode, true);
    if (ctx.rank() == 0) {
      EXPECT_EQ(rank0.held_after_quantizing, everyone.held_after_quantizing);
    } else {
      // Only the adapters, which apply_lora made here, have values.
      EXPECT_GT(rank0.adapter_bytes, 0);
      EXPECT_EQ(rank0.held_after_quantizing, rank0.adapter_bytes);
    }
    EXPECT_EQ(rank0.losses, everyone.losses);
    ASSERT_EQ(rank0.state.size(), everyone.state.size());
    for (const auto& [name, value] : everyone.state) {
      ASSERT_EQ(rank0.state.count(name), 1u) << name;
      EXPECT_TRUE(at::equal(rank0.state.at(name), value)) << name;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(DistEngines, DistQloraRankZeroLoading,
                         ::testing::Values("zero3", "fsdp_standard", "fsdp_pure"),
                         [](const auto& info) { return info.param; });

// A weight source reads a checkpoint's original values, not NF4 bytes: a
// quantized weight that no rank holds is refused on every rank, by name, and
// so is one that rank 0 quantized without its values.
TEST(DistQloraRankZeroLoadingErrors, Nf4WeightsWithoutValuesOnRankZeroAreRefusedOnEveryRank) {
  shardtrain::testing::run_on_ranks(kQloraWorld, [](RankContext& ctx) {
    shardtrain::RunInfo run = shardtrain::testing::micro_batch(2);
    run.weight_source = [](const std::string&, int64_t, int64_t, at::Tensor) {};
    try {
      train_loading(ctx, "fsdp_standard", true, run);
      ADD_FAILURE() << "prepare() accepted a weight source for NF4 weights";
    } catch (const shardtrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("a weight source reads the original values, not NF4 bytes"),
                std::string::npos)
          << e.what();
    }

    shardtrain::TrainingConfig config = shardtrain::testing::fp32_llama_engine_config(true);
    config.fsdp.cpu_ram_efficient_loading = true;
    auto accelerator = shardtrain::testing::accelerator_for(config, ctx);
    torch::manual_seed(11);
    LlamaForCausalLM model(qlora_model_config());
    shardtrain::apply_lora(*model, shardtrain::LoraConfig());
    // Every rank, rank 0 too, quantizes the projections without their values.
    for (const auto& item : model->named_parameters()) {
      const bool base_projection =
          item.key().find("_proj.weight") != std::string::npos && item.key().find("lora_") == std::string::npos;
      if (base_projection) shardtrain::release_storage(item.value());
    }
    shardtrain::quantize_frozen_base(*model);
    try {
      accelerator->prepare(model, {}, shardtrain::testing::micro_batch(2));
      ADD_FAILURE() << "prepare() accepted NF4 weights that rank 0 has no values of";
    } catch (const shardtrain::Error& e) {
      EXPECT_NE(std::string(e.what()).find("' has no values on rank 0. Build the model with its weights"),
                std::string::npos)
          << e.what();
    }
  });
}

// Where parameters are not sharded (ZeRO-2 at world 2, zero-0 at world 1)
// the NF4 bytes are replicated: the parameters view the (whole) shard, the
// base is never gathered, and the adapters still train on the unchanged base,
// save and resume (train_qlora() checks each).
TEST(DistQloraUnsharded, ZeroTwoAtWorldTwoAndZeroZeroAtWorldOneTrainOnTheNf4Base) {
  for (const int world : {2, 1}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const fs::path dir = shardtrain::testing::test_scratch_subdir("world" + std::to_string(world));
    shardtrain::testing::MultiRankOptions harness;
    harness.timeout = std::chrono::seconds(300);
    shardtrain::testing::run_on_ranks(world, [world, dir](RankContext& ctx) {
      const shardtrain::TrainingConfig config =
          shardtrain::testing::zero_test_config(world == 2 ? 2 : 0, shardtrain::MixedPrecision::kBf16);
      const RunResult nf4 = train_qlora(ctx, config, true, dir / "checkpoints");
      // ZeRO-2 all-gathers the adapters' stepped shards after each step, as
      // DeepSpeed does; the frozen base is never sent.
      EXPECT_EQ(nf4.traffic.frozen_gather_bytes, 0) << "the replicated NF4 base was gathered";
    }, harness);
  }
}
