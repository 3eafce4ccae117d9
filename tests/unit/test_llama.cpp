// Llama / Mistral models against golden logits that Hugging Face transformers
// computes on the same weights at build time (scripts/hf_golden.py).

#include <gtest/gtest.h>

#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "build_config.h"
#include "shardtrain/error.h"
#include "shardtrain/models/llama.h"
#include "support/llama_golden.h"
#include "support/log_capture.h"
#include "support/scratch_dir.h"
#include "shardtrain/safetensors.h"

namespace fs = std::filesystem;
namespace sm = shardtrain::models;
namespace st = shardtrain::safetensors;

namespace {

using shardtrain::testing::fp64_logit_tolerance;
using shardtrain::testing::fp64_loss_tolerance;
using shardtrain::testing::golden_dir;
using shardtrain::testing::load_golden_case;


class UnitLlamaGolden : public ::testing::TestWithParam<std::string> {};

// Compared in fp64 (the Python side ran the same weights in fp64), where the
// two implementations may differ only by summation order: the bound is
// derived in fp64_logit_tolerance. In fp32 the two differ by ~4e-6 here, a
// figure that depends on the BLAS kernels, so the fp32 run is checked for
// what it must be (dtype, shape, the same code) rather than against a tuned
// tolerance.
TEST_P(UnitLlamaGolden, LogitsAndLossMatch) {
  const std::string name = GetParam();
  auto model = load_golden_case(name);
  st::Reader golden(shardtrain::testing::golden_reference_dir(name) + "/golden.safetensors");
  at::Tensor input_ids = golden.read("input_ids");
  torch::NoGradGuard no_grad;
  at::Tensor logits32 = model->forward(input_ids);
  ASSERT_EQ(logits32.scalar_type(), at::kFloat);
  ASSERT_EQ(logits32.sizes(), golden.read("logits").sizes());

  model->to(at::kDouble);
  at::Tensor expected = golden.read("logits_fp64");
  ASSERT_EQ(expected.scalar_type(), at::kDouble);
  at::Tensor logits = model->forward(input_ids);
  ASSERT_EQ(logits.scalar_type(), at::kDouble);
  ASSERT_EQ(logits.sizes(), expected.sizes());
  const double max_logit = expected.abs().max().item<double>();
  const int64_t T = input_ids.size(1);
  EXPECT_LE((logits - expected).abs().max().item<double>(), fp64_logit_tolerance(model->config, T, max_logit))
      << name;
  const double loss = sm::causal_lm_loss(logits, input_ids).item<double>();
  const double expected_loss = golden.read("loss_fp64").item<double>();
  EXPECT_NEAR(loss, expected_loss,
              fp64_loss_tolerance(model->config, T, max_logit, expected_loss, input_ids.numel()))
      << name;
}

// Prefix "UnitLlama" so the suite matches the Unit* label filter.
INSTANTIATE_TEST_SUITE_P(UnitLlama, UnitLlamaGolden,
                         ::testing::Values("llama", "llama_tied_llama3", "llama_linear_mha", "mistral_swa"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

TEST(UnitLlama, ConfigParsesHfFields) {
  auto tied = sm::LlamaConfig::from_json_file(golden_dir("llama_tied_llama3") + "/config.json");
  EXPECT_TRUE(tied.tie_word_embeddings);
  ASSERT_TRUE(tied.rope_scaling.has_value());
  EXPECT_EQ(tied.rope_scaling->type, "llama3");
  EXPECT_DOUBLE_EQ(tied.rope_scaling->factor, 8.0);
  EXPECT_EQ(tied.rope_scaling->original_max_position_embeddings, 1024);
  EXPECT_EQ(tied.eos_token_id, 2);  // first of [2, 3]
  EXPECT_EQ(tied.other_eos_token_ids, std::vector<int64_t>{3});
  EXPECT_DOUBLE_EQ(tied.rope_theta, 500000.0);  // the top-level rope_theta of transformers < 5
  EXPECT_FALSE(tied.sliding_window.has_value());
  EXPECT_EQ(tied.num_key_value_heads, 2);
  auto mistral = sm::LlamaConfig::from_json_file(golden_dir("mistral_swa") + "/config.json");
  EXPECT_EQ(mistral.model_type, "mistral");
  ASSERT_TRUE(mistral.sliding_window.has_value());
  EXPECT_EQ(*mistral.sliding_window, 4);
  EXPECT_EQ(mistral.decoder_layer_class_name(), "MistralDecoderLayer");
  // transformers >= 5 writes the rotary settings in rope_parameters, with no top-level rope_theta.
  EXPECT_DOUBLE_EQ(mistral.rope_theta, 1000000.0);
  EXPECT_FALSE(mistral.rope_scaling.has_value());  // rope_type "default"
  auto linear = sm::LlamaConfig::from_json_file(golden_dir("llama_linear_mha") + "/config.json");
  EXPECT_DOUBLE_EQ(linear.rope_theta, 50000.0);
  ASSERT_TRUE(linear.rope_scaling.has_value());
  EXPECT_EQ(linear.rope_scaling->type, "linear");
  EXPECT_DOUBLE_EQ(linear.rope_scaling->factor, 2.0);
  EXPECT_THROW(sm::LlamaConfig::from_json_string(
                   R"({"vocab_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "hidden_size": 30, "num_attention_heads": 4})"),
               shardtrain::ConfigError);
  EXPECT_THROW(sm::LlamaConfig::from_json_string("{not json"), shardtrain::ConfigError);
}

TEST(UnitLlama, AModelConfigWithoutItsSizesIsRefusedByName) {
  // `--model-config '{"x":1}'` had built a 7B model from transformers' defaults.
  try {
    (void)sm::LlamaConfig::from_json_string(R"({"x": 1, "hidden_size": 16})", "cfg.json");
    FAIL() << "a config without its sizes was accepted";
  } catch (const shardtrain::ConfigError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("cfg.json: a model config needs vocab_size, intermediate_size, num_hidden_layers, "
                           "num_attention_heads"),
              std::string::npos)
        << message;
    EXPECT_EQ(message.find("hidden_size,"), std::string::npos) << message;  // given, so not named
  }
  // And a config.json nested beyond the JSON depth limit is refused by name, not by a crash.
  const std::string deep = std::string(5000, '[') + std::string(5000, ']');
  try {
    (void)sm::LlamaConfig::from_json_string(deep, "deep.json");
    FAIL() << "a config nested 5000 deep was accepted";
  } catch (const shardtrain::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("deep.json nests objects and arrays deeper than 64 levels"),
              std::string::npos)
        << e.what();
  }
}

TEST(UnitLlama, ArchitectureVariantsThisModelDoesNotBuildAreRefusedByName) {
  // transformers builds each of these; the plain model on their weights would be another model, silently.
  const std::string sizes =
      R"("vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2)";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"("attention_bias": true)", "'attention_bias': true (biased projections) is not implemented"},
      {R"("mlp_bias": true)", "'mlp_bias': true (biased projections) is not implemented"},
      {R"("hidden_act": "gelu")", "'hidden_act': \"gelu\" is not implemented"},
      {R"("rope_parameters": {"rope_type": "yarn", "factor": 4.0})", "rope type 'yarn'"},
      {R"("rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5})", "partial_rotary_factor 0.5"},
      {R"("rope_parameters": 10000)", "field 'rope_parameters' must be an object or null"},
      {R"("partial_rotary_factor": 0.5)", "partial_rotary_factor 0.5"},  // top-level, no rope object
      {R"("attention_dropout": 0.1)", "'attention_dropout': 0.1 is not implemented"},
      {R"("rope_scaling": {"factor": 8.0})", "rope_scaling needs 'type' or 'rope_type'"},
  };
  for (const auto& [field, expected] : cases) {
    try {
      (void)sm::LlamaConfig::from_json_string("{" + sizes + ", " + field + "}", "cfg.json");
      ADD_FAILURE() << field << " was accepted";
    } catch (const shardtrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  }
  // What the plain model is, said explicitly, is accepted.
  const auto plain = sm::LlamaConfig::from_json_string(
      "{" + sizes + R"(, "attention_bias": false, "mlp_bias": false, "hidden_act": "silu", "rope_scaling": null,
         "attention_dropout": 0.0,
         "rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}, "rope_theta": 30000.0})");
  EXPECT_DOUBLE_EQ(plain.rope_theta, 20000.0);  // rope_parameters' own value wins, as in transformers
  // A non-empty rope_scaling wins over rope_parameters (transformers' convert_rope_params_to_dict).
  const auto legacy = sm::LlamaConfig::from_json_string(
      "{" + sizes + R"(, "rope_theta": 30000.0, "rope_scaling": {"type": "linear", "factor": 3.0},
         "rope_parameters": {"rope_type": "default"}})");
  EXPECT_DOUBLE_EQ(legacy.rope_theta, 30000.0);
  ASSERT_TRUE(legacy.rope_scaling.has_value());
  EXPECT_DOUBLE_EQ(legacy.rope_scaling->factor, 3.0);
}

TEST(UnitLlama, DecoderLayersAreNamedUnits) {
  auto llama = sm::LlamaConfig::from_json_file(golden_dir("llama") + "/config.json");
  sm::LlamaForCausalLM model(llama);
  ASSERT_EQ(model->model->layers->size(), 2u);
  for (auto& layer : *model->model->layers) {
    auto* unit = dynamic_cast<shardtrain::Unit*>(layer.get());
    ASSERT_NE(unit, nullptr);
    EXPECT_EQ(unit->unit_class_name(), "LlamaDecoderLayer");
  }
}

TEST(UnitLlama, HfNamesRoundTrip) {
  for (const std::string name : {"llama", "llama_tied_llama3", "mistral_swa"}) {
    auto model = load_golden_case(name);
    st::Reader weights(golden_dir(name) + "/model.safetensors");
    auto state = sm::hf_state_dict(model);
    std::set<std::string> model_names, file_names;
    for (auto& [n, t] : state) model_names.insert(n);
    for (auto& n : weights.names()) file_names.insert(n);
    EXPECT_EQ(model_names, file_names) << name;
    EXPECT_EQ(state.size(), model_names.size()) << name;
    const bool has_head = model_names.count("lm_head.weight") > 0;
    EXPECT_EQ(has_head, !model->config.tie_word_embeddings) << name;
    for (auto& [n, t] : state) {
      ASSERT_TRUE(weights.contains(n)) << n;
      EXPECT_TRUE(at::equal(t, weights.read(n))) << name << ": " << n;
    }
  }
}

TEST(UnitLlama, DocumentPackingMatchesSeparateRuns) {
  for (const std::string name : {"llama", "mistral_swa"}) {
    auto model = load_golden_case(name);
    model->to(at::kDouble);  // see fp64_logit_tolerance
    torch::NoGradGuard no_grad;
    const int64_t V = model->config.vocab_size;
    const std::vector<int64_t> lengths = {5, 3, 7};  // 7 > sliding_window 4
    at::Tensor ids = at::randint(V, {1, 15}, at::TensorOptions().dtype(at::kLong));
    std::vector<at::Tensor> docs, positions;
    for (size_t d = 0; d < lengths.size(); ++d) {
      docs.push_back(at::full({lengths[d]}, static_cast<int64_t>(d), at::kLong));
      positions.push_back(at::arange(lengths[d], at::kLong));
    }
    at::Tensor doc_ids = at::cat(docs).unsqueeze(0);
    at::Tensor pos_ids = at::cat(positions).unsqueeze(0);
    EXPECT_TRUE(at::equal(sm::positions_from_document_ids(doc_ids), pos_ids));
    at::Tensor packed = model->forward(ids, pos_ids, doc_ids);
    at::Tensor packed_default_pos = model->forward(ids, {}, doc_ids);
    EXPECT_TRUE(at::equal(packed, packed_default_pos)) << name;
    int64_t start = 0;
    for (int64_t len : lengths) {
      at::Tensor alone = model->forward(ids.slice(1, start, start + len));
      const double diff = (packed.slice(1, start, start + len) - alone).abs().max().item<double>();
      const double bound = fp64_logit_tolerance(model->config, ids.size(1), alone.abs().max().item<double>());
      EXPECT_LE(diff, bound) << name << " document at " << start;
      start += len;
    }
    // Without document ids the later documents see earlier ones: logits differ.
    at::Tensor unpacked = model->forward(ids);
    EXPECT_GT((unpacked.slice(1, 5) - packed.slice(1, 5)).abs().max().item<double>(), 1e-3) << name;
  }
}

// A forward without packed documents (or with a sliding window no shorter
// than the sequence) attends causally without a mask tensor
// (AttentionMask::causal(): the kernels skip the masked half, a GPU may run
// FlashAttention); the same tokens as one packed document go through the
// mask tensor. On the CPU the two are the same bits, logits and every
// parameter gradient, in fp32 and bf16 (the zero tolerance is argued at
// UnitMixedAttention.CausalAttentionIsTheMaskedCallBitForBit).
TEST(UnitLlama, TheMasklessCausalPathIsTheOneDocumentMaskBitForBit) {
  for (const std::string name : {"llama", "mistral_swa"}) {
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      auto model = load_golden_case(name);
      model->to(dtype);
      const int64_t T = name == "mistral_swa" ? 4 : 15;  // mistral_swa's window is 4
      ASSERT_TRUE(!model->config.sliding_window || *model->config.sliding_window >= T);
      const at::Tensor ids = at::randint(model->config.vocab_size, {2, T}, at::TensorOptions().dtype(at::kLong));
      auto logits_and_grads = [&](const at::Tensor& document_ids) {
        model->zero_grad();
        const at::Tensor logits = model->forward(ids, {}, document_ids);
        sm::causal_lm_loss(logits.to(at::kFloat), ids).backward();
        std::vector<at::Tensor> out{logits.detach()};
        for (const auto& p : model->named_parameters()) out.push_back(p.value().grad().clone());
        return out;
      };
      const std::vector<at::Tensor> causal = logits_and_grads(at::Tensor());
      const std::vector<at::Tensor> masked = logits_and_grads(at::zeros_like(ids));
      ASSERT_EQ(causal.size(), masked.size());
      for (std::size_t i = 0; i < causal.size(); ++i) {
        EXPECT_TRUE(at::equal(causal[i], masked[i]))
            << name << " " << dtype << (i == 0 ? " logits" : " gradient " + std::to_string(i - 1));
      }
    }
  }
}

// The packed form of a batch, what FlashAttention's variable-length kernel
// takes on a GPU (the kernel itself is GpuAttention.*): a sequence starts at
// each row and wherever the document id changes, so a row's padding (a
// document of its own) is a sequence too.
TEST(UnitLlama, PackedSequencesStartAtEachRowAndEachNewDocument) {
  const at::Tensor docs = at::tensor({0, 0, 1, 1, 1, 0, 0, 0, 0, 1}, at::kLong).view({2, 5});
  const sm::PackedSequences packed = sm::packed_sequences(docs, 2, 5, at::kCPU, 4);
  EXPECT_TRUE(at::equal(packed.cu_seqlens, at::tensor({0, 2, 5, 9, 10}, at::kInt)));
  EXPECT_EQ(packed.max_seqlen, 4);
  EXPECT_EQ(packed.window, std::optional<int64_t>(4));
  // The same id in the next row is a new sequence: rows never attend to each other.
  const at::Tensor same = at::zeros({3, 4}, at::kLong);
  const sm::PackedSequences rows = sm::packed_sequences(same, 3, 4, at::kCPU, std::nullopt);
  EXPECT_TRUE(at::equal(rows.cu_seqlens, at::tensor({0, 4, 8, 12}, at::kInt)));
  EXPECT_EQ(rows.max_seqlen, 4);
  const sm::PackedSequences none = sm::packed_sequences(at::Tensor(), 3, 4, at::kCPU, std::nullopt);
  EXPECT_TRUE(at::equal(none.cu_seqlens, rows.cu_seqlens));
  EXPECT_FALSE(none.window.has_value());
  // A document is a run of equal ids: an id that recurs starts a new one,
  // for the packed sequences and for the mask (and the positions) alike.
  const at::Tensor recurring = at::tensor({0, 0, 1, 1, 0, 0}, at::kLong).view({1, 6});
  const at::Tensor renumbered = at::tensor({0, 0, 1, 1, 2, 2}, at::kLong).view({1, 6});
  EXPECT_TRUE(at::equal(sm::packed_sequences(recurring, 1, 6, at::kCPU, std::nullopt).cu_seqlens,
                        at::tensor({0, 2, 4, 6}, at::kInt)));
  {
    auto model = load_golden_case("llama");
    torch::NoGradGuard no_grad;
    const at::Tensor ids = at::randint(model->config.vocab_size, {1, 6}, at::TensorOptions().dtype(at::kLong));
    EXPECT_TRUE(at::equal(model->forward(ids, {}, recurring), model->forward(ids, {}, renumbered)));
  }
  EXPECT_THROW(sm::packed_sequences(docs, 5, 2, at::kCPU, std::nullopt), shardtrain::Error);
  EXPECT_THROW(sm::packed_sequences(docs, 2, 5, at::kCPU, 0), shardtrain::Error);
  // Where the variable-length kernel does not run (the CPU), a packed mask
  // is its tensor: the same bits as the plain mask. The tensor is built on
  // first use, once for every copy of the mask (every layer's).
  const int64_t T = 5;
  const at::Tensor allowed = at::ones({2, 1, T, T}, at::kBool).tril();
  int builds = 0;
  const sm::AttentionMask mask = sm::AttentionMask::packed(packed, [&] {
    ++builds;
    return allowed;
  });
  ASSERT_NE(mask.packed_sequences(), nullptr);
  EXPECT_FALSE(mask.is_causal());
  EXPECT_EQ(builds, 0);
  const sm::AttentionMask copy = mask;
  const at::Tensor q = at::randn({2, 4, T, 8}), k = at::randn({2, 2, T, 8}), v = at::randn({2, 2, T, 8});
  EXPECT_TRUE(at::equal(sm::core_attention(q, k, v, mask), sm::core_attention(q, k, v, allowed)));
  EXPECT_TRUE(at::equal(sm::core_attention(q, k, v, copy), sm::core_attention(q, k, v, allowed)));
  EXPECT_EQ(builds, 1);
  EXPECT_TRUE(copy.allowed().is_same(mask.allowed()));
}

class UnitLlamaLoad : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = sm::LlamaConfig::from_json_file(golden_dir("llama") + "/config.json");
  }

  std::vector<std::pair<std::string, at::Tensor>> golden_weights() {
    st::Reader reader(golden_dir("llama") + "/model.safetensors");
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (auto& n : reader.names()) out.emplace_back(n, reader.read(n));
    return out;
  }

  const shardtrain::testing::ScratchDir scratch_;
  const fs::path dir_ = scratch_.path();
  sm::LlamaConfig config_;
};

TEST_F(UnitLlamaLoad, MissingParameterIsNamed) {
  auto weights = golden_weights();
  const std::string dropped = "model.layers.1.mlp.up_proj.weight";
  std::vector<std::pair<std::string, at::Tensor>> kept;
  for (auto& w : weights) if (w.first != dropped) kept.push_back(w);
  st::write_file((dir_ / "model.safetensors").string(), kept, {}, false);
  sm::LlamaForCausalLM model(config_);
  try {
    sm::load_hf_weights(model, dir_.string());
    FAIL() << "expected an error";
  } catch (const shardtrain::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(dropped), std::string::npos) << msg;
    EXPECT_NE(msg.find("model.safetensors"), std::string::npos) << msg;
  }
}

TEST_F(UnitLlamaLoad, TensorsTheModelLacksAreNamedInAWarning) {
  // The config says one layer; the file holds two (and the rotary table, which transformers ignores too).
  auto weights = golden_weights();
  weights.emplace_back("model.layers.0.self_attn.rotary_emb.inv_freq", at::ones({3}));
  st::write_file((dir_ / "model.safetensors").string(), weights, {}, false);
  sm::LlamaConfig one_layer = config_;
  one_layer.num_hidden_layers = 1;
  sm::LlamaForCausalLM model(one_layer);
  shardtrain::testing::LogCapture log;
  sm::load_hf_weights(model, dir_.string());
  const std::string text = log.text();
  EXPECT_NE(text.find("holds 9 tensor(s) the model has no parameter for (model.layers.1.input_layernorm.weight, "
                      "model.layers.1.mlp.down_proj.weight, model.layers.1.mlp.gate_proj.weight, "
                      "model.layers.1.mlp.up_proj.weight, ...)"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("inv_freq"), std::string::npos) << text;
}

TEST_F(UnitLlamaLoad, WrongShapeIsNamed) {
  auto weights = golden_weights();
  for (auto& w : weights) {
    if (w.first == "model.norm.weight") w.second = at::ones({3});
  }
  st::write_file((dir_ / "model.safetensors").string(), weights, {}, false);
  sm::LlamaForCausalLM model(config_);
  try {
    sm::load_hf_weights(model, dir_.string());
    FAIL() << "expected an error";
  } catch (const shardtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.norm.weight"), std::string::npos) << e.what();
  }
}

TEST_F(UnitLlamaLoad, ShardedIndexAndDtypeConversion) {
  auto weights = golden_weights();
  std::vector<std::pair<std::string, at::Tensor>> a, b;
  std::string map;
  for (size_t i = 0; i < weights.size(); ++i) {
    auto& w = weights[i];
    const bool first = i % 2 == 0;
    (first ? a : b).emplace_back(w.first, w.second.to(at::kDouble));
    map += std::string(map.empty() ? "" : ",") + "\"" + w.first + "\":\"" +
           (first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors") + "\"";
  }
  st::write_file((dir_ / "model-00001-of-00002.safetensors").string(), a, {}, false);
  st::write_file((dir_ / "model-00002-of-00002.safetensors").string(), b, {}, false);
  std::ofstream(dir_ / "model.safetensors.index.json") << "{\"metadata\":{},\"weight_map\":{" << map << "}}";
  sm::LlamaForCausalLM model(config_);
  sm::load_hf_weights(model, dir_.string());
  auto reference = load_golden_case("llama");
  auto got = sm::hf_state_dict(model);
  auto want = sm::hf_state_dict(reference);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].first, want[i].first);
    EXPECT_EQ(got[i].second.scalar_type(), at::kFloat);
    EXPECT_TRUE(at::equal(got[i].second, want[i].second)) << got[i].first;
  }
}

TEST_F(UnitLlamaLoad, BackwardThroughModel) {
  sm::LlamaForCausalLM model(config_);
  at::Tensor ids = at::randint(config_.vocab_size, {2, 6}, at::TensorOptions().dtype(at::kLong));
  at::Tensor loss = sm::causal_lm_loss(model->forward(ids), ids);
  loss.backward();
  for (auto& [n, p] : sm::hf_state_dict(model)) {
    ASSERT_TRUE(p.grad().defined()) << n;
  }
}

}  // namespace
