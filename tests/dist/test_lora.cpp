// LoRA under the sharding engines at world 2, against the real peer: the
// adapter shardtrain trains and saves (save_lora_adapter) loads in Hugging
// Face PEFT (PeftModel.from_pretrained, scripts/peer_peft.py) and computes
// the same logits as shardtrain's own load of it; the merged export
// (save_model of a LoRA model) equals PEFT's merge_and_unload within the
// rounding of one fp32 merge and loads as a plain LlamaForCausalLM; the base
// weights do not move while the adapters train.

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shardtrain/accelerator.h"
#include "shardtrain/error.h"
#include "shardtrain/lora.h"
#include "shardtrain/models/llama.h"
#include "shardtrain/safetensors.h"
#include "support/llama_golden.h"
#include "support/multirank.h"
#include "support/peer_python.h"
#include "support/tiny_compare.h"

namespace {

namespace fs = std::filesystem;
namespace st = shardtrain::safetensors;
using shardtrain::models::LlamaForCausalLM;
using shardtrain::testing::RankContext;

constexpr int kWorld = 2;
const char* const kCase = "llama";

shardtrain::LoraConfig test_lora() {
  shardtrain::LoraConfig config;
  config.r = 8;
  config.lora_alpha = 16;
  config.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj"};
  return config;
}

shardtrain::TrainingConfig engine_config(bool fsdp) {
  shardtrain::TrainingConfig config = shardtrain::testing::fp32_llama_engine_config(fsdp);
  config.optimizer.type = "SGD";
  config.optimizer.lr = 0.5;
  config.optimizer.weight_decay = 0.0;
  return config;
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
  const fs::path dir = fs::path(::testing::TempDir()) /
                       ("shardtrain-lora-peft-" + std::string(fsdp ? "fsdp" : "zero3") + "-" + std::to_string(::getpid()));
  shardtrain::testing::MultiRankOptions harness;
  harness.env["LORA_DIR"] = dir.string();
  harness.timeout = std::chrono::seconds(300);
  shardtrain::testing::run_on_ranks(kWorld, [fsdp](RankContext& ctx) {
    const fs::path work = std::getenv("LORA_DIR");
    LlamaForCausalLM model = shardtrain::testing::load_golden_case(kCase);
    std::map<std::string, at::Tensor> base_before;
    for (const auto& item : model->named_parameters()) base_before[item.key()] = item.value().detach().clone();
    const shardtrain::LoraConfig lora = test_lora();
    shardtrain::apply_lora(*model, lora);
    model->train();
    auto accelerator = shardtrain::testing::accelerator_for(engine_config(fsdp), ctx);
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
                            shardtrain::testing::golden_dir(kCase) + "/config.json");
    if (ctx.rank() != 0) return;
    // shardtrain's own load of what it saved, in fp64.
    LlamaForCausalLM reloaded = shardtrain::testing::load_golden_case(kCase);
    shardtrain::load_lora_adapter(*reloaded, (work / "adapter").string());
    reloaded->to(torch::kDouble);
    reloaded->eval();
    const at::Tensor ids = st::Reader(shardtrain::testing::golden_dir(kCase) + "/inputs.safetensors").read("input_ids");
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
                              shardtrain::testing::golden_dir(kCase) + " " + dir.string() + " > " +
                              (dir / "peer.log").string() + " 2>&1";
  const int status = std::system(command.c_str());
  std::ifstream log(dir / "peer.log");
  const std::string output((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  ASSERT_EQ(status, 0) << "the PEFT peer failed: " << command << "\n" << output;

  const st::Reader ours((dir / "shardtrain.safetensors").string());
  const st::Reader peft((dir / "peft.safetensors").string());
  const at::Tensor our_logits = ours.read("logits");
  const at::Tensor peft_logits = peft.read("peft_logits");
  ASSERT_EQ(our_logits.sizes(), peft_logits.sizes());
  const auto config =
      shardtrain::models::LlamaConfig::from_json_file(shardtrain::testing::golden_dir(kCase) + "/config.json");
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
  const double scaling = test_lora().scaling();
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
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(DistEngines, DistLora, ::testing::Values(false, true),
                         [](const auto& info) { return std::string(info.param ? "fsdp_standard" : "zero3"); });

TEST(DistLoraRefusals, PureLowPrecisionWouldTrainAdaptersWithoutAnFp32MasterAndIsRefused) {
  shardtrain::testing::run_on_ranks(kWorld, [](RankContext& ctx) {
    const shardtrain::TrainingConfig pure =
        shardtrain::load_config(std::string(SHARDTRAIN_SOURCE_DIR) + "/configs/llama/fsdp_pure_bf16.yaml");
    LlamaForCausalLM model = shardtrain::testing::load_golden_case(kCase);
    shardtrain::apply_lora(*model, test_lora());
    auto accelerator = shardtrain::testing::accelerator_for(pure, ctx);
    try {
      accelerator->prepare(model, {}, shardtrain::testing::micro_batch(2));
      ADD_FAILURE() << "LoRA was prepared under pure low precision";
    } catch (const shardtrain::ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("LoRA adapters must train on fp32 masters"), std::string::npos) << what;
      EXPECT_NE(what.find("fsdp_standard_bf16.yaml"), std::string::npos) << what;
    }
  });
}
