// QLoRA's NF4 in one process: the quantization equals bitsandbytes 0.50.2's
// quantize_4bit (NF4, blocksize 64, compress_statistics) bit for bit — the
// codes, the double-quantized absmax values, the offset, the map and both
// decodings — on tensors chosen to reach its edge cases; the dequantizing
// layer is the decoded weight's product, forward and backward; quantizing a
// model built without weights, with or without reading its weights as it
// goes; and the refusals of quantize_frozen_base.

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "build_config.h"
#include "kernels/nf4_format.h"
#include "shardtrain/error.h"
#include "shardtrain/kernels.h"
#include "shardtrain/lora.h"
#include "shardtrain/models/hf_weights.h"
#include "shardtrain/models/llama.h"
#include "shardtrain/nn/linear.h"
#include "shardtrain/quantization.h"
#include "shardtrain/safetensors.h"
#include "shardtrain/weight_loading.h"
#include "support/llama_golden.h"
#include "support/peer_python.h"
#include "support/scratch_dir.h"

namespace {

namespace st = shardtrain::safetensors;
namespace nf4 = shardtrain::kernels::nf4;

/// Tensors that reach each branch of the quantization.
std::vector<std::pair<std::string, at::Tensor>> awkward_weights() {
  torch::manual_seed(7);
  std::vector<std::pair<std::string, at::Tensor>> weights;
  // 480 blocks: two absmax blocks, the second partial.
  weights.emplace_back("normal_f32", torch::randn({96, 320}) * 0.02);
  weights.emplace_back("normal_bf16", (torch::randn({128, 64}) * 0.05).to(torch::kBFloat16));
  // A layer's size (the 58M Llama's MLP): 11,264 blocks, 44 absmax blocks,
  // enough centred absmax values near 0 that bitsandbytes' CPU table and the
  // nearest map entry part (0.19%: 21 or 22 in each of three such draws;
  // the 480 above hit none).
  weights.emplace_back("layer_f32", torch::randn({1408, 512}) * 0.02);
  // 256 blocks of equal absmax: the centred values are all 0 (scale 0).
  weights.emplace_back("equal_absmax", torch::full({256, 64}, 0.25f));
  // Block by block: all zero (absmax 0); every value exactly a level midpoint
  // with absmax 1 (bucketize's ties go to the lower level); tiny values;
  // the absmax negative; a large spread.
  std::vector<float> values(64 * 6, 0.0f);
  for (int j = 0; j < 64; ++j) {
    const int k = j % 15;
    values[64 + j] = (nf4::value(k) + nf4::value(k + 1)) / 2.0f;
  }
  values[64 + 63] = 1.0f;
  for (int j = 0; j < 64; ++j) values[128 + j] = 1e-30f * static_cast<float>(j - 32);
  for (int j = 0; j < 64; ++j) values[192 + j] = 0.3f * std::sin(static_cast<float>(j));
  values[192 + 5] = -0.9f;
  for (int j = 0; j < 64; ++j) values[256 + j] = std::ldexp(1.0f, (j % 20) - 10) * (j % 2 ? 1.0f : -1.0f);
  for (int j = 0; j < 64; ++j) values[320 + j] = 1e4f * static_cast<float>(j - 31);
  weights.emplace_back("edges", torch::tensor(values).reshape({6, 64}));
  return weights;
}

TEST(UnitNf4, QuantizationEqualsBitsandbytesBitForBit) {
  const shardtrain::testing::ScratchDir dir;
  const auto weights = awkward_weights();
  std::vector<std::pair<std::string, at::Tensor>> inputs(weights.begin(), weights.end());
  st::write_file((dir.path() + "/in.safetensors"), inputs);
  const std::string command = "OMP_NUM_THREADS=1 " + shardtrain::testing::peer_python() + " " +
                              SHARDTRAIN_SOURCE_DIR + "/scripts/peer_bnb_nf4.py " + (dir.path() + "/in.safetensors") + " " +
                              (dir.path() + "/bnb.safetensors");
  // A bound against a hang, far above what this small peer takes.
  const auto peer = shardtrain::testing::run_peer_command(command, dir.path() + "/peer.log", std::chrono::seconds(300));
  ASSERT_EQ(peer.result.exit_code, 0) << "the bitsandbytes peer failed: " << command << "\n" << peer.result.output;
  const st::Reader bnb((dir.path() + "/bnb.safetensors"));
  for (const auto& [name, weight] : weights) {
    SCOPED_TRACE(name);
    const at::Tensor buffer = shardtrain::kernels::nf4_quantize(weight);
    ASSERT_EQ(buffer.numel(), shardtrain::kernels::nf4_buffer_bytes(weight.numel()));
    const shardtrain::kernels::Nf4State state = shardtrain::kernels::nf4_state(buffer, weight.numel());
    EXPECT_TRUE(at::equal(state.codes, bnb.read(name + ".codes"))) << "the 4-bit codes";
    EXPECT_TRUE(at::equal(state.absmax, bnb.read(name + ".absmax"))) << "the absmax codes";
    EXPECT_TRUE(at::equal(state.nested_absmax, bnb.read(name + ".nested_absmax"))) << "the nested absmax";
    EXPECT_TRUE(at::equal(state.offset.reshape({1}), bnb.read(name + ".offset"))) << "the offset";
    EXPECT_TRUE(at::equal(state.nested_quant_map, bnb.read(name + ".nested_quant_map"))) << "the absmax map";
    for (const auto& [suffix, dtype] : {std::pair{"dequant_f32", at::kFloat}, {"dequant_bf16", at::kBFloat16}}) {
      const at::Tensor ours = shardtrain::kernels::nf4_dequantize(buffer, weight.numel(), dtype);
      const at::Tensor theirs = bnb.read(name + "." + suffix);
      EXPECT_TRUE(at::equal(ours, theirs)) << suffix << ": max |diff| "
                                           << (ours.to(at::kDouble) - theirs.to(at::kDouble)).abs().max().item<double>();
    }
  }
}

TEST(UnitNf4, TheBytesDoNotDependOnTheThreadCount) {
  // 33,792 blocks: above the 32K elements where ATen's reductions go
  // parallel, so the absmax mean (the offset) would round by thread count.
  // Every rank quantizes its own copy of the base and must get the same bytes.
  const at::Tensor weight = torch::randn({2048, 1056});
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const at::Tensor one = shardtrain::kernels::nf4_quantize(weight);
  at::set_num_threads(std::max(2, threads));
  const at::Tensor several = shardtrain::kernels::nf4_quantize(weight);
  at::set_num_threads(threads);
  const auto a = shardtrain::kernels::nf4_state(one, weight.numel());
  const auto b = shardtrain::kernels::nf4_state(several, weight.numel());
  EXPECT_TRUE(at::equal(a.codes, b.codes)) << "codes";
  EXPECT_TRUE(at::equal(a.absmax, b.absmax)) << "absmax codes";
  EXPECT_TRUE(at::equal(a.nested_absmax, b.nested_absmax)) << "nested absmax";
  EXPECT_TRUE(at::equal(a.offset, b.offset)) << "offset " << a.offset.item<float>() << " " << b.offset.item<float>();
  EXPECT_TRUE(at::equal(one, several));
}

TEST(UnitNf4, TheBufferHoldsFourBitsAndAFewPercentPerWeight) {
  // 4 bits + one absmax byte per 64 + 4 bytes per 256 blocks + the offset.
  const int64_t n = 4096 * 4096;
  EXPECT_EQ(shardtrain::kernels::nf4_buffer_bytes(n), n / 2 + n / 64 + 4 * (n / 64 / 256) + 4);
  const at::Tensor w = torch::randn({64, 128});
  const at::Tensor buffer = shardtrain::kernels::nf4_quantize(w);
  // Decoding is within half a level spacing of the value, scaled by the
  // block's absmax (up to the absmax's own 8-bit error: the largest spacing
  // of the NF4 levels is 1 - 0.7230, the map's relative step at most 2^-5).
  const at::Tensor decoded = shardtrain::kernels::nf4_dequantize(buffer, w.numel(), at::kFloat).view({64, 128});
  const at::Tensor absmax = w.reshape({-1, 64}).abs().amax(1, true);
  const at::Tensor error = (decoded.reshape({-1, 64}) - w.reshape({-1, 64})).abs() / absmax;
  EXPECT_LE(error.max().item<double>(), (1.0 - 0.7229568362236023) / 2 + 1.0 / 32);
}

TEST(UnitNf4, TheQuantizedLayerIsTheProductWithTheDecodedWeightForwardAndBackward) {
  torch::manual_seed(3);
  shardtrain::nn::Linear layer(torch::nn::LinearOptions(128, 64).bias(false));
  layer->weight.set_requires_grad(false);
  layer->quantize_weight_nf4(at::kBFloat16);
  ASSERT_EQ(layer->weight.scalar_type(), at::kByte);
  const at::Tensor decoded =
      shardtrain::kernels::nf4_dequantize(layer->weight, 64 * 128, at::kBFloat16).view({64, 128});

  const at::Tensor x = torch::randn({3, 5, 128}).requires_grad_(true);
  const at::Tensor y = layer(x);
  ASSERT_EQ(y.scalar_type(), at::kFloat);
  const at::Tensor x_ref = x.detach().clone().requires_grad_(true);
  const at::Tensor y_ref = shardtrain::nn::linear(x_ref.to(at::kBFloat16), decoded).to(at::kFloat);
  EXPECT_TRUE(at::equal(y, y_ref));
  const at::Tensor g = torch::randn({3, 5, 64});
  y.backward(g);
  y_ref.backward(g);
  EXPECT_TRUE(at::equal(x.grad(), x_ref.grad()));
  EXPECT_FALSE(layer->weight.grad().defined()) << "the quantized base got a gradient";
}

shardtrain::models::LlamaConfig qlora_test_config() { return shardtrain::testing::small_gqa_llama_config(64); }

TEST(UnitNf4, QuantizeFrozenBaseQuantizesTheFrozenLinearsButTheSkippedOnes) {
  torch::manual_seed(1);
  shardtrain::models::LlamaForCausalLM model(qlora_test_config());
  shardtrain::LoraConfig lora;
  lora.target_modules = {"q_proj", "v_proj"};
  shardtrain::apply_lora(*model, lora);
  const shardtrain::QuantizationSummary summary = shardtrain::quantize_frozen_base(*model);
  // 2 layers x 7 projections; lm_head skipped; the adapters train, so stay.
  EXPECT_EQ(summary.quantized_modules.size(), 14u);
  for (const auto& item : model->named_parameters()) {
    const bool base_linear = item.key().find("_proj.weight") != std::string::npos &&
                             item.key().find("lora_") == std::string::npos;
    EXPECT_EQ(item.value().scalar_type() == at::kByte, base_linear) << item.key();
  }
  // Per weight: 1/2 byte of codes, 1/64 of absmax codes, and per weight at
  // most 12 bytes of scale, offset and padding over the smallest (k_proj, 2,048 weights).
  EXPECT_EQ(summary.bytes_before, 4 * summary.quantized_parameters);  // fp32
  EXPECT_LE(static_cast<double>(summary.bytes_after) / static_cast<double>(summary.quantized_parameters),
            0.5 + 1.0 / 64 + 12.0 / 2048);
  const at::Tensor ids = torch::randint(0, 64, {2, 8});
  const at::Tensor loss = shardtrain::models::causal_lm_loss(model(ids), ids);
  loss.backward();
  for (const auto& item : model->named_parameters()) {
    if (item.key().find("lora_A") != std::string::npos) {
      EXPECT_TRUE(item.value().grad().defined()) << item.key();
    }
  }
}

// A rank that does not load under rank-0-only loading quantizes the model it
// built without weights: each weight becomes a byte buffer of the size rank
// 0's NF4 bytes have, holding nothing, for the engine to fill from rank 0.
TEST(UnitNf4, QuantizingAModelBuiltWithoutWeightsGivesItsNf4ShapesWithoutValues) {
  torch::manual_seed(1);
  shardtrain::models::LlamaForCausalLM loaded(qlora_test_config());
  shardtrain::models::LlamaForCausalLM empty = shardtrain::models::make_llama_without_weights(qlora_test_config());
  for (auto* model : {&loaded, &empty}) {
    shardtrain::apply_lora(**model, shardtrain::LoraConfig());
    shardtrain::quantize_frozen_base(**model);
  }
  const auto want = loaded->named_parameters();
  const auto have = empty->named_parameters();
  ASSERT_EQ(have.size(), want.size());
  int quantized = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(have[i].key(), want[i].key());
    EXPECT_EQ(have[i].value().sizes(), want[i].value().sizes()) << want[i].key();
    EXPECT_EQ(have[i].value().scalar_type(), want[i].value().scalar_type()) << want[i].key();
    if (want[i].value().scalar_type() != at::kByte) continue;
    ++quantized;
    EXPECT_TRUE(shardtrain::is_storage_released(have[i].value())) << have[i].key();
  }
  EXPECT_EQ(quantized, 14);  // 2 layers x 7 projections

  // Such a layer refuses to run until prepare() has filled it.
  shardtrain::nn::Linear layer(torch::nn::LinearOptions(64, 64).bias(false));
  layer->weight.set_requires_grad(false);
  shardtrain::release_storage(layer->weight);
  layer->quantize_weight_nf4(at::kBFloat16);
  try {
    layer(torch::randn({2, 64}));
    ADD_FAILURE() << "a quantized layer without values ran";
  } catch (const shardtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the quantized weight has no values"), std::string::npos) << e.what();
  }
}

// A rank that loads a QLoRA base reads each weight and quantizes it at once
// (transformers' load_in_4bit): the bytes are those of loading the whole
// model, then quantizing, and it never holds more than one weight
// unquantized beside what it keeps.
TEST(UnitNf4, QuantizingWhileLoadingGivesTheBytesOfLoadingWholeAndHoldsOneWeightUnquantized) {
  const shardtrain::testing::ScratchDir dir;
  {
    torch::manual_seed(21);
    shardtrain::models::LlamaForCausalLM original(qlora_test_config());
    st::write_file(dir.file("model.safetensors"), shardtrain::models::hf_state_dict(original));
  }
  shardtrain::models::LlamaForCausalLM whole(qlora_test_config());
  shardtrain::models::load_hf_weights(whole, dir.path());
  torch::manual_seed(5);
  shardtrain::apply_lora(*whole, shardtrain::LoraConfig());
  shardtrain::quantize_frozen_base(*whole);

  auto checkpoint = std::make_shared<const shardtrain::models::HfCheckpoint>(dir.path());
  shardtrain::models::LlamaForCausalLM streamed = shardtrain::models::make_llama_without_weights(qlora_test_config());
  torch::manual_seed(5);
  shardtrain::apply_lora(*streamed, shardtrain::LoraConfig());
  // The parameters' storage as each read begins, with the buffer it fills.
  int64_t peak = 0, largest_read = 0, reads = 0;
  const shardtrain::WeightSource counting = [&](const std::string& name, int64_t begin, int64_t length,
                                                at::Tensor out) {
    const int64_t bytes = out.numel() * static_cast<int64_t>(out.element_size());
    peak = std::max(peak, shardtrain::parameter_storage_bytes(*streamed) + bytes);
    largest_read = std::max(largest_read, bytes);
    ++reads;
    checkpoint->read_slice(name, begin, length, out);
  };
  const shardtrain::QuantizationSummary summary = shardtrain::quantize_frozen_base(*streamed, counting);
  EXPECT_EQ(summary.quantized_modules.size(), 14u);

  const auto want = whole->named_parameters();
  const auto have = streamed->named_parameters();
  ASSERT_EQ(have.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(have[i].key(), want[i].key());
    EXPECT_FALSE(shardtrain::is_storage_released(have[i].value())) << have[i].key();
    EXPECT_TRUE(at::equal(have[i].value(), want[i].value())) << have[i].key();
  }
  EXPECT_EQ(reads, static_cast<int64_t>(checkpoint->names().size()));
  const int64_t kept = shardtrain::parameter_storage_bytes(*streamed);
  EXPECT_LE(peak, kept + largest_read);
  // Loading whole holds every fp32 weight to quantize at once, at the least.
  EXPECT_LT(peak, summary.bytes_before);

  // A source that returns without writing is caught, not quantized.
  shardtrain::models::LlamaForCausalLM unwritten = shardtrain::models::make_llama_without_weights(qlora_test_config());
  shardtrain::apply_lora(*unwritten, shardtrain::LoraConfig());
  try {
    shardtrain::quantize_frozen_base(*unwritten, [](const std::string&, int64_t, int64_t, at::Tensor) {});
    ADD_FAILURE() << "quantized weights the source never wrote";
  } catch (const shardtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the weight source left elements of 'model.layers.0."), std::string::npos)
        << e.what();
  }
}

TEST(UnitNf4, QuantizeFrozenBaseRefusesWhatItCannotQuantizeAndChangesNothing) {
  torch::manual_seed(1);
  {
    shardtrain::models::LlamaForCausalLM model(qlora_test_config());  // nothing frozen
    EXPECT_THROW(shardtrain::quantize_frozen_base(*model), shardtrain::ConfigError);
  }
  {
    shardtrain::models::LlamaForCausalLM model(qlora_test_config());
    shardtrain::apply_lora(*model, shardtrain::LoraConfig());
    shardtrain::QuantizationConfig config;
    config.compute_dtype = at::kInt;
    EXPECT_THROW(shardtrain::quantize_frozen_base(*model, config), shardtrain::ConfigError);
  }
  {
    shardtrain::models::LlamaConfig c = qlora_test_config();
    c.hidden_size = 24;  // k_proj: 12 x 24 = 288 elements, not whole 64-blocks
    c.intermediate_size = 32;
    shardtrain::models::LlamaForCausalLM model(c);
    shardtrain::apply_lora(*model, shardtrain::LoraConfig());
    try {
      shardtrain::quantize_frozen_base(*model);
      ADD_FAILURE() << "quantized a 288-element weight";
    } catch (const shardtrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("not a multiple of the NF4 block of 64"), std::string::npos) << e.what();
    }
    for (const auto& p : model->parameters()) EXPECT_NE(p.scalar_type(), at::kByte) << "a refusal changed the model";
  }
}

}  // namespace
