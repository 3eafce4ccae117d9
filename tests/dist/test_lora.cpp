// LoRA under the sharding engines at world 2, against the real peer: the
// adapter shardtrain trains and saves (save_lora_adapter) loads in Hugging
// Face PEFT (PeftModel.from_pretrained, scripts/peer_peft.py) and computes
// the same logits as shardtrain's own load of it; the merged export
// (save_model of a LoRA model) equals PEFT's merge_and_unload within the
// rounding of one fp32 merge and loads as a plain LlamaForCausalLM; the base
// weights do not move while the adapters train. Under FSDP pure low
// precision the adapters keep fp32 masters on a base held in bf16 alone.

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shardtrain/accelerator.h"
#include "shardtrain/error.h"
#include "shardtrain/lora.h"
#include "shardtrain/models/llama.h"
#include "shardtrain/precision_plan.h"
#include "shardtrain/safetensors.h"
#include "support/llama_golden.h"
#include "support/log_capture.h"
#include "support/multirank.h"
#include "support/peer_python.h"
#include "support/test_scratch.h"
#include "support/tiny_compare.h"
#include "tiny/tiny_model.h"

namespace {

namespace fs = std::filesystem;
namespace st = shardtrain::safetensors;
using shardtrain::models::LlamaForCausalLM;
using shardtrain::testing::attention_lora_r8;
using shardtrain::testing::RankContext;

constexpr int kLoraWorld = 2;
const char* const kLoraCase = "llama";

shardtrain::TrainingConfig lora_engine_config(bool fsdp) {
  shardtrain::TrainingConfig config = shardtrain::testing::fp32_llama_engine_config(fsdp);
  shardtrain::testing::use_plain_sgd(config);
  return config;
}

/// lora_engine_config(true) under another FSDP strategy.
shardtrain::TrainingConfig lora_fsdp_config(shardtrain::ShardingStrategy strategy) {
  shardtrain::TrainingConfig config = lora_engine_config(true);
  config.fsdp.sharding_strategy = strategy;
  return config;
}

/// The small GQA Llama (vocab 64) with `layers` layers, seeded alike on every
/// rank, with attention_lora_r8()'s adapters, in training mode.
LlamaForCausalLM adapted_small_llama(int64_t layers) {
  shardtrain::models::LlamaConfig model_config = shardtrain::testing::small_gqa_llama_config(64);
  model_config.num_hidden_layers = layers;
  torch::manual_seed(3);
  LlamaForCausalLM model(model_config);
  shardtrain::apply_lora(*model, attention_lora_r8());
  model->train();
  return model;
}

/// The adapters' full values, by name (collective).
std::map<std::string, at::Tensor> adapter_values(shardtrain::Accelerator& accelerator) {
  std::map<std::string, at::Tensor> adapters;
  for (const auto& [name, value] : accelerator.full_state_dict()) {
    if (name.find("lora_") != std::string::npos) adapters[name] = value;
  }
  return adapters;
}

/// Both runs ended with the same tensors under the same names, bit for bit.
void expect_same_values(const std::map<std::string, at::Tensor>& ours,
                        const std::map<std::string, at::Tensor>& reference) {
  ASSERT_EQ(ours.size(), reference.size());
  for (const auto& [name, value] : reference) EXPECT_TRUE(at::equal(ours.at(name), value)) << name;
}

/// fp64_logit_tolerance (llama_golden.h) counts the reductions of the base
/// model; the adapters add, per adapted projection, a product over the input
/// (H terms) and one over the rank (r terms), bounded by the same argument.
double lora_logit_tolerance(const shardtrain::models::LlamaConfig& c, int64_t seq_len, double max_abs_logit,
                            int64_t r, int adapted_per_layer) {
  const double extra = static_cast<double>(c.num_hidden_layers) * adapted_per_layer *
                       static_cast<double>(c.hidden_size + r);
  return shardtrain::testing::fp64_logit_tolerance(c, seq_len, max_abs_logit) +
         2 * extra * std::ldexp(1.0, -53) * 1e4 * std::max(1.0, max_abs_logit);
}

class DistLora : public ::testing::TestWithParam<bool> {};

}  // namespace

TEST_P(DistLora, AdapterTrainedAtWorldTwoLoadsInPeftWithTheSameLogitsAndMergesAsPeft) {
  const bool fsdp = GetParam();
  const fs::path dir = shardtrain::testing::test_scratch_dir();
  shardtrain::testing::MultiRankOptions harness;
  harness.timeout = std::chrono::seconds(300);
  shardtrain::testing::run_on_ranks(kLoraWorld, [fsdp, work = dir](RankContext& ctx) {
    LlamaForCausalLM model = shardtrain::testing::load_golden_case(kLoraCase);
    std::map<std::string, at::Tensor> base_before;
    for (const auto& item : model->named_parameters()) base_before[item.key()] = item.value().detach().clone();
    const shardtrain::LoraConfig lora = attention_lora_r8();
    shardtrain::apply_lora(*model, lora);
    model->train();
    auto accelerator = shardtrain::testing::accelerator_for(lora_engine_config(fsdp), ctx);
    auto prepared = accelerator->prepare(model, {}, shardtrain::testing::micro_batch(2));
    torch::manual_seed(100 + ctx.rank());
    for (int step = 0; step < 3; ++step) {
      const at::Tensor ids = torch::randint(0, 48, {2, 12}, torch::kLong);
      accelerator->backward(shardtrain::models::causal_lm_loss(prepared(ids), ids));
      accelerator->step();
      accelerator->zero_grad();
    }
    // The base did not move; the adapters did (lora_B started at zero).
    bool adapters_moved = false;
    for (const auto& [name, value] : accelerator->full_state_dict()) {
      if (base_before.count(name)) {
        EXPECT_TRUE(at::equal(value, base_before.at(name))) << "the frozen base weight " << name << " changed";
      } else if (name.find("lora_B") != std::string::npos) {
        adapters_moved = adapters_moved || !value.eq(0).all().item<bool>();
      }
    }
    EXPECT_TRUE(adapters_moved) << "training did not move any lora_B";
    shardtrain::LoraConfig not_applied = lora;
    not_applied.lora_alpha = 32;  // a config other than the one applied would tell PEFT another scaling
    EXPECT_THROW(accelerator->save_lora_adapter((work / "wrong").string(), not_applied), shardtrain::ConfigError);
    accelerator->save_lora_adapter((work / "adapter").string(), lora);
    accelerator->save_model((work / "merged").string(), "fp32", 5000000000ULL,
                            shardtrain::testing::golden_dir(kLoraCase) + "/config.json");
    if (ctx.rank() != 0) return;
    // shardtrain's own load of what it saved, in fp64.
    LlamaForCausalLM reloaded = shardtrain::testing::load_golden_case(kLoraCase);
    shardtrain::load_lora_adapter(*reloaded, (work / "adapter").string());
    reloaded->to(torch::kDouble);
    reloaded->eval();
    const at::Tensor ids = st::Reader(shardtrain::testing::golden_dir(kLoraCase) + "/inputs.safetensors").read("input_ids");
    at::Tensor logits;
    {
      at::NoGradGuard no_grad;
      logits = reloaded(ids);
    }
    st::write_file((work / "shardtrain.safetensors").string(), {{"input_ids", ids}, {"logits", logits}});
  }, harness);
  if (shardtrain::testing::is_rank_process() || ::testing::Test::HasFatalFailure()) return;

  const std::string command = "OMP_NUM_THREADS=1 TRANSFORMERS_VERBOSITY=error " +
                              shardtrain::testing::peer_python() + " " +
                              SHARDTRAIN_SOURCE_DIR + "/scripts/peer_peft.py " +
                              shardtrain::testing::golden_dir(kLoraCase) + " " + dir.string();
  // A bound against a hang, far above what this small peer takes.
  const auto peer = shardtrain::testing::run_peer_command(command, dir / "peer.log", std::chrono::seconds(300));
  ASSERT_EQ(peer.result.exit_code, 0) << "the PEFT peer failed: " << command << "\n" << peer.result.output;

  const st::Reader ours((dir / "shardtrain.safetensors").string());
  const st::Reader peft((dir / "peft.safetensors").string());
  const at::Tensor our_logits = ours.read("logits");
  const at::Tensor peft_logits = peft.read("peft_logits");
  ASSERT_EQ(our_logits.sizes(), peft_logits.sizes());
  const auto config =
      shardtrain::models::LlamaConfig::from_json_file(shardtrain::testing::golden_dir(kLoraCase) + "/config.json");
  const double max_abs = peft_logits.abs().max().item<double>();
  const double tolerance = lora_logit_tolerance(config, our_logits.size(1), max_abs, 8, 4);
  const double diff = (our_logits - peft_logits).abs().max().item<double>();
  EXPECT_LE(diff, tolerance) << "shardtrain's and PEFT's logits of the saved adapter";
  std::cout << "logits: max |shardtrain - PEFT| " << diff << " (bound " << tolerance << ")\n";

  // The merged export against PEFT's merge_and_unload, weight by weight. Both
  // compute W + s * (B @ A) in fp32: each is within (r + 1) roundings of the
  // product's magnitude plus one rounding of the sum from the exact value
  // (a dot product of r terms, the scaling, the add), so they differ by at
  // most twice that. Weights that carry no adapter are copied, bit for bit.
  const st::Reader merged((dir / "merged" / "model.safetensors").string());
  const st::Reader adapter((dir / "adapter" / "adapter_model.safetensors").string());
  const double u = std::ldexp(1.0, -24);
  const double scaling = attention_lora_r8().scaling();
  int adapted = 0;
  for (const auto& name : merged.names()) {
    ASSERT_EQ(name.find("lora_"), std::string::npos) << "the merged export holds an adapter tensor: " << name;
    const at::Tensor w = merged.read(name).to(at::kDouble);
    const at::Tensor reference = peft.read("peft_merged." + name).to(at::kDouble);
    const std::string layer = name.substr(0, name.size() - std::string(".weight").size());
    const std::string a_key = shardtrain::peft_adapter_key(layer + ".lora_A.weight");
    if (!adapter.contains(a_key)) {
      EXPECT_TRUE(at::equal(w, reference)) << name;
      continue;
    }
    ++adapted;
    const at::Tensor a = adapter.read(a_key).to(at::kDouble);
    const at::Tensor b = adapter.read(shardtrain::peft_adapter_key(layer + ".lora_B.weight")).to(at::kDouble);
    const at::Tensor bound = 2 * ((8 + 1) * u * scaling * at::matmul(b.abs(), a.abs()) + u * reference.abs());
    EXPECT_TRUE((w - reference).abs().le(bound).all().item<bool>())
        << name << ": max |ours - PEFT's merge| " << (w - reference).abs().max().item<double>();
  }
  EXPECT_EQ(adapted, 8);  // 2 layers x q, k, v, o
}

INSTANTIATE_TEST_SUITE_P(DistEngines, DistLora, ::testing::Values(false, true),
                         [](const auto& info) { return std::string(info.param ? "fsdp_standard" : "zero3"); });

namespace {

/// What one LoRA run at world 2 ends with (the state dict on every rank).
struct AdapterRun {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> state;
  shardtrain::MemoryReport memory;
  shardtrain::PrecisionPlan plan;
  /// What the logger said while the run's checkpoint was saved and loaded back.
  std::string round_trip_log;
};

/// LoRA r 8 on q/k/v/o of the golden Llama, kAdapterSteps AdamW steps at
/// world 2 under `config`; `bf16_base`: the model arrives in bf16 (as
/// from_pretrained(torch_dtype=bfloat16)) before the adapters are added, which
/// then are fp32 (PEFT's autocast_adapter_dtype).
constexpr int kAdapterSteps = 4;
/// `bf16_values_in_fp32`: a bf16 base widened back to fp32 (values a bf16 copy holds exactly).
LlamaForCausalLM adapted_golden_llama(bool bf16_base, bool bf16_values_in_fp32 = false) {
  LlamaForCausalLM model = shardtrain::testing::load_golden_case(kLoraCase);
  if (bf16_base || bf16_values_in_fp32) model->to(torch::kBFloat16);
  if (bf16_values_in_fp32) model->to(torch::kFloat);
  torch::manual_seed(7);  // the same adapter initialisation in every run
  shardtrain::apply_lora(*model, attention_lora_r8());
  model->train();
  return model;
}

/// bf16 mixed precision, AdamW lr 1e-3 without weight decay: the adapter
/// runs' settings, under fsdp FULL_SHARD or else DeepSpeed ZeRO-3.
shardtrain::TrainingConfig bf16_adapter_config(bool fsdp) {
  shardtrain::TrainingConfig config = shardtrain::testing::fp32_llama_engine_config(fsdp);
  config.optimizer.type = "AdamW";
  config.optimizer.lr = 1e-3;
  config.optimizer.weight_decay = 0.0;
  config.mixed_precision = shardtrain::MixedPrecision::kBf16;
  return config;
}

AdapterRun train_adapters(RankContext& ctx, const shardtrain::TrainingConfig& config, bool bf16_base,
                          const fs::path& save_dir) {
  LlamaForCausalLM model = adapted_golden_llama(bf16_base);
  auto accelerator = shardtrain::testing::accelerator_for(config, ctx);
  auto prepared = accelerator->prepare(model, {}, shardtrain::testing::micro_batch(2));
  AdapterRun run;
  torch::manual_seed(100 + ctx.rank());
  for (int step = 0; step < kAdapterSteps; ++step) {
    const at::Tensor ids = torch::randint(0, 48, {2, 12}, torch::kLong);
    const at::Tensor loss = shardtrain::models::causal_lm_loss(prepared(ids), ids);
    run.losses.push_back(loss.item<double>());
    accelerator->backward(loss);
    accelerator->step();
    accelerator->zero_grad();
  }
  run.memory = accelerator->memory();
  run.plan = accelerator->precision_plan();
  for (const auto& [name, value] : accelerator->full_state_dict()) run.state[name] = value;
  if (!save_dir.empty()) {
    // The adapter saves in fp32, and a checkpoint of the run (the bf16 base
    // and the adapters' fp32 masters and moments) loads back unchanged.
    accelerator->save_lora_adapter((save_dir / "adapter").string(), attention_lora_r8());
    shardtrain::testing::LogCapture log;
    accelerator->save_state((save_dir / "checkpoint").string());
    accelerator->load_state((save_dir / "checkpoint").string());
    run.round_trip_log = log.text();
    for (const auto& [name, value] : accelerator->full_state_dict()) {
      EXPECT_TRUE(at::equal(value, run.state.at(name))) << name << " changed in a checkpoint round trip";
    }
  }
  return run;
}

}  // namespace

// FSDP pure low precision with LoRA: the frozen base stays in bf16 alone (no
// fp32 copy), the adapters keep fp32 masters and fp32 Adam state. FSDP's
// standard bf16 mode on the same base computes with the same bf16 base values
// (its fp32 copy rounded to bf16 for the gather, the load's rounding), the
// same bf16 views of the same fp32 adapters, reduces in bf16 alike and steps
// the same fp32 masters, so the two runs are the same arithmetic: their
// losses and adapters are equal bit for bit, and only the frozen copy's
// memory differs.
TEST(DistLoraPure, AdaptersKeepFp32MastersAndTrainExactlyAsInStandardModeOnABf16OnlyBase) {
  const fs::path dir = shardtrain::testing::test_scratch_dir();
  shardtrain::testing::MultiRankOptions harness;
  harness.timeout = std::chrono::seconds(300);
  shardtrain::testing::run_on_ranks(kLoraWorld, [dir](RankContext& ctx) {
    const shardtrain::TrainingConfig standard = bf16_adapter_config(true);
    // Accelerate's rule: mixed_precision no with a bf16 model is pure low precision.
    shardtrain::TrainingConfig pure = standard;
    pure.mixed_precision = shardtrain::MixedPrecision::kNo;

    const AdapterRun reference = train_adapters(ctx, standard, false, {});
    const AdapterRun run = train_adapters(ctx, pure, true, dir);

    EXPECT_NE(run.plan.engine.find("pure low precision, fp32 adapters"), std::string::npos) << run.plan.engine;
    EXPECT_EQ(run.plan.master_dtype, "fp32");
    EXPECT_EQ(run.plan.optimizer_dtype, "fp32");
    EXPECT_EQ(run.plan.shard_dtype, "bf16");
    EXPECT_EQ(run.plan.frozen_copy_bytes, 0.0);
    EXPECT_EQ(reference.plan.frozen_copy_bytes, 4.0 / kLoraWorld);
    EXPECT_NE(run.plan.to_string().find("frozen base is held in bf16 only"), std::string::npos)
        << run.plan.to_string();

    ASSERT_EQ(run.losses.size(), reference.losses.size());
    for (std::size_t k = 0; k < run.losses.size(); ++k) {
      EXPECT_EQ(run.losses[k], reference.losses[k]) << "step " << k + 1;
    }
    bool adapters_moved = false;
    for (const auto& [name, value] : reference.state) {
      const at::Tensor& ours = run.state.at(name);
      if (name.find("lora_") != std::string::npos) {
        EXPECT_TRUE(at::equal(ours, value)) << name;
        adapters_moved = adapters_moved || (name.find("lora_B") != std::string::npos && !value.eq(0).all().item<bool>());
      } else {
        // full_state_dict widens every value to fp32: the pure run's base is
        // the bf16 load, the standard run's the fp32 weights themselves.
        EXPECT_TRUE(at::equal(ours, value.to(at::kBFloat16).to(at::kFloat))) << name;
        EXPECT_FALSE(at::equal(ours, value)) << name << ": the fp32 base should not be bf16-representable";
      }
    }
    EXPECT_TRUE(adapters_moved) << "training did not move any lora_B";

    // Memory, exactly: AdamW holds 8 B per trained element (fp32 m and v) and
    // the master 4, so a run without a frozen copy has master == optimizer / 2;
    // the bf16 shards are 2 B per trained element (optimizer / 4) plus the
    // frozen base's, whose fp32 copy is twice its bf16 bytes.
    EXPECT_EQ(run.memory.params, reference.memory.params);
    EXPECT_EQ(run.memory.optimizer, reference.memory.optimizer);
    EXPECT_EQ(run.memory.master * 2, run.memory.optimizer);
    const int64_t frozen_bf16_bytes = reference.memory.params - reference.memory.optimizer / 4;
    EXPECT_GT(frozen_bf16_bytes, 0);
    EXPECT_EQ(reference.memory.master, reference.memory.optimizer / 2 + 2 * frozen_bf16_bytes);
  }, harness);
  if (shardtrain::testing::is_rank_process() || ::testing::Test::HasFatalFailure()) return;
  const st::Reader adapter((dir / "adapter" / "adapter_model.safetensors").string());
  for (const auto& name : adapter.names()) EXPECT_EQ(adapter.read(name).scalar_type(), at::kFloat) << name;
}

// Where a backend's peer holds a frozen base in 16 bits alone, so does
// shardtrain: DeepSpeed's ZeRO at every stage, 0 to 3 (DeepSpeed casts the
// whole module to bf16 and gives only the trained partitions fp32 masters)
// and FSDP standard on a base that arrives in bf16 (FSDP keeps a frozen flat
// parameter in the dtype it arrives in; Accelerate upcasts only the trained
// ones). FSDP standard and Accelerate's DDP (MULTI_CPU) on an fp32 base keep
// an fp32 copy, so that the base is saved as it was loaded. Every run computes with the same bf16 base (the fp32 weights
// rounded once), the same bf16 views of the same fp32 adapters, and steps the
// same fp32 masters; at world 2 ZeRO's fp32 sum and one division by 2 round
// to FSDP's bf16 reduction and division by 2 exactly (a division by 2 is
// exact in binary). So losses and adapters are equal bit for bit, and the
// memory differs by exactly the fp32 copy.
TEST(DistLoraFrozenBase, IsHeldInBf16AloneWhereThePeerHoldsItSoAndTrainsAsWithAnFp32Copy) {
  const fs::path dir = shardtrain::testing::test_scratch_dir();
  shardtrain::testing::MultiRankOptions harness;
  harness.timeout = std::chrono::seconds(300);
  shardtrain::testing::run_on_ranks(kLoraWorld, [out = dir](RankContext& ctx) {
    const shardtrain::TrainingConfig fsdp = bf16_adapter_config(true);
    const shardtrain::TrainingConfig zero3 = bf16_adapter_config(false);
    auto zero_stage = [&](int stage) {
      shardtrain::TrainingConfig config = zero3;
      config.zero.stage = stage;
      return config;
    };

    const AdapterRun reference = train_adapters(ctx, fsdp, false, out / "fsdp");
    EXPECT_EQ(reference.plan.frozen_copy_bytes, 4.0 / kLoraWorld);
    const int64_t frozen_bf16_bytes = reference.memory.params - reference.memory.optimizer / 4;
    EXPECT_GT(frozen_bf16_bytes, 0);
    // AdamW holds 8 B per trained element and the master 4, the copy 4 per frozen one (twice its bf16 shard).
    EXPECT_EQ(reference.memory.master, reference.memory.optimizer / 2 + 2 * frozen_bf16_bytes);

    const std::vector<std::pair<std::string, AdapterRun>> runs = {
        {"zero-3, fp32 base", train_adapters(ctx, zero3, false, out / "zero3")},
        {"zero-2, fp32 base", train_adapters(ctx, zero_stage(2), false, {})},
        {"zero-1, fp32 base", train_adapters(ctx, zero_stage(1), false, {})},
        {"zero-0 (ddp), fp32 base", train_adapters(ctx, zero_stage(0), false, {})},
        {"fsdp standard, bf16 base", train_adapters(ctx, fsdp, true, {})},
    };
    for (const auto& [what, run] : runs) {
      SCOPED_TRACE(what);
      EXPECT_EQ(run.plan.frozen_copy_bytes, 0.0);
      EXPECT_NE(run.plan.to_string().find("frozen base is held in bf16 only"), std::string::npos)
          << run.plan.to_string();
      EXPECT_EQ(run.memory.master * 2, run.memory.optimizer) << "a frozen fp32 copy is still held";
      ASSERT_EQ(run.losses.size(), reference.losses.size());
      for (std::size_t k = 0; k < run.losses.size(); ++k) {
        EXPECT_EQ(run.losses[k], reference.losses[k]) << "step " << k + 1;
      }
      for (const auto& [name, value] : reference.state) {
        // full_state_dict widens every value to fp32: the base held in bf16 gives the fp32 weights' rounding.
        const bool adapter = name.find("lora_") != std::string::npos;
        EXPECT_TRUE(at::equal(run.state.at(name), adapter ? value : value.to(at::kBFloat16).to(at::kFloat)))
            << name;
      }
    }
    EXPECT_EQ(runs[0].second.round_trip_log.find("rounded"), std::string::npos) << runs[0].second.round_trip_log;
    EXPECT_EQ(reference.round_trip_log.find("rounded"), std::string::npos) << reference.round_trip_log;

    // Accelerate's DDP leaves the module as loaded: the fp32 copy stays (4 B a
    // frozen parameter, unsharded), and the state dict gives the fp32 base.
    shardtrain::TrainingConfig ddp = zero3;
    ddp.distributed_type = shardtrain::DistributedType::kMultiCpu;
    const AdapterRun accelerate_ddp = train_adapters(ctx, ddp, false, {});
    EXPECT_EQ(accelerate_ddp.plan.frozen_copy_bytes, 4.0);
    EXPECT_EQ(accelerate_ddp.losses, reference.losses);
    for (const auto& [name, value] : reference.state) {
      EXPECT_TRUE(at::equal(accelerate_ddp.state.at(name), value)) << "ddp: " << name;
    }

    // FSDP's checkpoint holds the fp32 base: ZeRO resumes from it on the
    // base's rounding, and says so.
    auto zero3_loading = [&](const fs::path& checkpoint, std::string& said) {
      LlamaForCausalLM model = adapted_golden_llama(false);
      auto accelerator = shardtrain::testing::accelerator_for(zero3, ctx);
      accelerator->prepare(model, {}, shardtrain::testing::micro_batch(2));
      shardtrain::testing::LogCapture log;
      accelerator->load_state(checkpoint.string());
      said = log.text();
      return accelerator->full_state_dict();
    };
    std::string said;
    for (const auto& [name, value] : zero3_loading(out / "fsdp" / "checkpoint", said)) {
      EXPECT_TRUE(at::equal(value, runs[0].second.state.at(name))) << name;
    }
    if (ctx.rank() == 0) EXPECT_NE(said.find("were rounded to BFloat16"), std::string::npos) << said;
    // An fp32 checkpoint whose base values bf16 holds exactly loads without a word.
    {
      LlamaForCausalLM model = adapted_golden_llama(false, true);
      auto accelerator = shardtrain::testing::accelerator_for(fsdp, ctx);
      accelerator->prepare(model, {}, shardtrain::testing::micro_batch(2));
      EXPECT_GT(accelerator->precision_plan().frozen_copy_bytes, 0.0);
      accelerator->save_state((out / "fsdp_bf16_values").string());
    }
    zero3_loading(out / "fsdp_bf16_values", said);
    EXPECT_EQ(said.find("rounded"), std::string::npos) << said;
  }, harness);
}

// Under the parameter offload (its copies forced on the CPU, as in
// DistOffload.*) the frozen base's shards live in host memory beside the
// adapters' partition, and each gather uploads them first. ZeRO-3 (the base
// held in bf16 alone) and FSDP standard (with its fp32 copy of the fp32 base)
// train bit for bit as without offload, across a checkpoint round trip
// (train_adapters checks it), and the device keeps no model state at rest.
TEST(DistLoraOffload, TheFrozenBaseMovesToTheHostWithTheAdaptersAndTrainsBitForBitAsWithoutOffload) {
  const fs::path dir = shardtrain::testing::test_scratch_dir();
  shardtrain::testing::MultiRankOptions harness;
  harness.env["SHARDTRAIN_OFFLOAD_ON_CPU"] = "1";
  harness.timeout = std::chrono::seconds(300);
  shardtrain::testing::run_on_ranks(kLoraWorld, [out = dir](RankContext& ctx) {
    for (const bool fsdp : {false, true}) {
      SCOPED_TRACE(fsdp ? "fsdp standard" : "zero-3");
      shardtrain::TrainingConfig config = bf16_adapter_config(fsdp);
      const AdapterRun on_device = train_adapters(ctx, config, false, {});
      config.fsdp.offload_params = fsdp;
      if (!fsdp) {
        config.zero.offload_param = shardtrain::OffloadDevice::kCpu;
        config.zero.offload_optimizer = shardtrain::OffloadDevice::kCpu;
      }
      const AdapterRun offloaded = train_adapters(ctx, config, false, out / (fsdp ? "fsdp" : "zero3"));
      EXPECT_EQ(offloaded.losses, on_device.losses);
      expect_same_values(offloaded.state, on_device.state);
      const shardtrain::MemoryReport& before = on_device.memory;
      const shardtrain::MemoryReport& after = offloaded.memory;
      // AdamW's 8 B per trained element against the adapters' 2 B bf16 shard: the rest of params is the base.
      EXPECT_GT(before.params - before.optimizer / 4, 0) << "no frozen base";
      EXPECT_EQ(after.params, before.params);
      EXPECT_EQ(after.master, before.master);
      EXPECT_EQ(after.optimizer, before.optimizer);
      EXPECT_EQ(after.grads, before.grads);
      EXPECT_EQ(after.offloaded, after.params + after.master + after.optimizer + after.grads);
      // The precision plan's split, the frozen base included, up to the
      // shards' padding; on the device nothing, up to a few ulps of the total
      // (the same binary fractions subtracted in another order).
      const shardtrain::PrecisionPlan& plan = offloaded.plan;
      EXPECT_NEAR(static_cast<double>(after.offloaded), plan.host_bytes_per_rank(), 0.05 * plan.host_bytes_per_rank());
      EXPECT_NEAR(plan.device_bytes_per_rank(), 0.0, 4 * 0x1p-52 * plan.total_bytes_per_rank());
    }
  }, harness);
}

// Under FULL_SHARD each adapted layer is freed once its backward is done,
// though its frozen base weights give backward no gradient to signal it: the
// gradient of the layer's input does (FSDP2's post-backward hook). Without
// that signal every layer stayed gathered to the end of backward: with every
// layer adapted, the whole model. Eight layers, so the two differ by four.
TEST(DistLoraMemory, UnderFullShardEachAdaptedLayerIsFreedAfterItsBackward) {
  shardtrain::testing::run_on_ranks(kLoraWorld, [](RankContext& ctx) {
    LlamaForCausalLM model = adapted_small_llama(8);
    int64_t root_numel = 0, layer_numel = 0, total_numel = 0;
    for (const auto& item : model->named_parameters()) {
      const std::string& name = item.key();
      total_numel += item.value().numel();
      if (name.rfind("model.layers.0.", 0) == 0) layer_numel += item.value().numel();
      if (name.find("layers.") == std::string::npos) root_numel += item.value().numel();
    }
    shardtrain::TrainingConfig config = lora_engine_config(true);
    config.mixed_precision = shardtrain::MixedPrecision::kBf16;
    config.optimizer.lr = 0.1;
    auto accelerator = shardtrain::testing::accelerator_for(config, ctx);
    auto prepared = accelerator->prepare(model, {}, shardtrain::testing::micro_batch(2));
    torch::manual_seed(100 + ctx.rank());
    for (int step = 0; step < 2; ++step) {
      const at::Tensor ids = torch::randint(0, 64, {2, 16}, torch::kLong);
      accelerator->backward(shardtrain::models::causal_lm_loss(prepared(ids), ids));
      accelerator->step();
      accelerator->zero_grad();
    }
    // bf16 buffers. At most: the root (gathered for the whole step), the
    // layer whose backward just ended (freed by the hook that fires as the
    // next one is gathered), that next layer and the one BACKWARD_PRE
    // prefetches, and a shard-sized staging buffer per gather in flight:
    // fewer than root + 4 layers. The whole model is root + 8.
    const int64_t bound = 2 * (root_numel + 4 * layer_numel);
    const int64_t peak = accelerator->memory().gathered_peak;
    EXPECT_LE(peak, bound) << "root " << root_numel << ", layer " << layer_numel << " elements";
    EXPECT_LT(peak, 2 * total_numel) << "the whole model was gathered at once";
  });
}

// Every layer runs twice before one backward (two forwards, their losses
// summed, as a preference-tuning step does): a layer is freed only after the
// gradients of both its inputs have arrived, so the first call's backward
// still finds its weights. FULL_SHARD frees and regathers around each use;
// NO_SHARD keeps everything, and sums the same two ranks' gradients the same
// way, so the adapters end equal bit for bit.
TEST(DistLoraMemory, ALayerRunTwicePerStepIsFreedOnlyAfterBothBackwards) {
  shardtrain::testing::run_on_ranks(kLoraWorld, [](RankContext& ctx) {
    auto train = [&](shardtrain::ShardingStrategy strategy) {
      LlamaForCausalLM model = adapted_small_llama(4);
      auto accelerator = shardtrain::testing::accelerator_for(lora_fsdp_config(strategy), ctx);
      auto prepared = accelerator->prepare(model, {}, shardtrain::testing::micro_batch(2));
      torch::manual_seed(100 + ctx.rank());
      for (int step = 0; step < 2; ++step) {
        const at::Tensor chosen = torch::randint(0, 64, {2, 16}, torch::kLong);
        const at::Tensor rejected = torch::randint(0, 64, {2, 16}, torch::kLong);
        const at::Tensor loss = shardtrain::models::causal_lm_loss(prepared(chosen), chosen) +
                                shardtrain::models::causal_lm_loss(prepared(rejected), rejected);
        accelerator->backward(loss);
        accelerator->step();
        accelerator->zero_grad();
      }
      return adapter_values(*accelerator);
    };
    expect_same_values(train(shardtrain::ShardingStrategy::kFullShard), train(shardtrain::ShardingStrategy::kNoShard));
  });
}

namespace {

/// Two tiny blocks on a float input: the first unit's input is whatever the
/// caller passes (a leaf that requires grad, below).
struct TwoBlocksImpl : torch::nn::Module {
  explicit TwoBlocksImpl(const tiny::TinyConfig& c) : blocks(register_module("blocks", torch::nn::ModuleList())) {
    for (int i = 0; i < 2; ++i) blocks->push_back(tiny::TinyBlock(c));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (const auto& block : *blocks) h = block->as<tiny::TinyBlockImpl>()->forward(h);
    return h;
  }
  torch::nn::ModuleList blocks;
};
TORCH_MODULE(TwoBlocks);

}  // namespace

// A unit whose input is a leaf that requires grad gets no input hook (it
// would collect one per step): it stays gathered to the end of backward,
// since its frozen weights are still read for the input's gradient after its
// adapter gradients are in. FULL_SHARD equals NO_SHARD bit for bit.
TEST(DistLoraMemory, AUnitFedALeafInputStaysGatheredUntilBackwardEnds) {
  shardtrain::testing::run_on_ranks(kLoraWorld, [](RankContext& ctx) {
    auto train = [&](shardtrain::ShardingStrategy strategy) {
      tiny::TinyConfig model_config;
      model_config.hidden = 32;
      model_config.ffn = 64;
      torch::manual_seed(5);
      TwoBlocks model(model_config);
      shardtrain::LoraConfig lora = attention_lora_r8();
      lora.target_modules = {"qkv", "proj"};
      shardtrain::apply_lora(*model, lora);
      model->train();
      shardtrain::TrainingConfig config = lora_fsdp_config(strategy);
      config.fsdp.transformer_layer_cls_to_wrap = {"TinyBlock"};
      auto accelerator = shardtrain::testing::accelerator_for(config, ctx);
      auto prepared = accelerator->prepare(model, {}, shardtrain::testing::micro_batch(2));
      torch::manual_seed(100 + ctx.rank());
      std::vector<at::Tensor> input_grads;
      for (int step = 0; step < 2; ++step) {
        const at::Tensor x = torch::randn({2, 8, 32}).requires_grad_(true);
        accelerator->backward(prepared(x).pow(2).mean());
        input_grads.push_back(x.grad().clone());
        accelerator->step();
        accelerator->zero_grad();
      }
      std::map<std::string, at::Tensor> result = adapter_values(*accelerator);
      for (std::size_t k = 0; k < input_grads.size(); ++k) result["input_grad_" + std::to_string(k)] = input_grads[k];
      return result;
    };
    expect_same_values(train(shardtrain::ShardingStrategy::kFullShard), train(shardtrain::ShardingStrategy::kNoShard));
  });
}
