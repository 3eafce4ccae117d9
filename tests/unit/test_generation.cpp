// KV-cached decoding and generation (shardtrain/models/generation.h): cached
// logits against the full forward, greedy with and without the cache, seeded
// sampling, and greedy ids against transformers' own generate() on the same
// weights (scripts/hf_golden.py's greedy.json), through the library and the
// `generate` program.

#include <gtest/gtest.h>

#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "build_config.h"
#include "shardtrain/error.h"
#include "shardtrain/models/generation.h"
#include "shardtrain/models/llama.h"
#include "support/llama_golden.h"
#include "shardtrain/safetensors.h"
#include "shardtrain/tokenizer.h"
#include "support/multirank.h"
#include "support/scratch_dir.h"

namespace fs = std::filesystem;
namespace sm = shardtrain::models;

namespace {

using shardtrain::testing::fp64_logit_tolerance;
using shardtrain::testing::golden_dir;
using shardtrain::testing::load_golden_case;


struct GreedyGolden {
  std::vector<int64_t> prompt, ids;
  int64_t max_new_tokens = 0;
  int64_t eos = 0;
};

GreedyGolden read_greedy(const std::string& name) {
  std::ifstream in(shardtrain::testing::golden_reference_dir(name) + "/greedy.json");
  EXPECT_TRUE(in.good()) << "missing greedy.json for " << name << ": the build runs scripts/hf_golden.py";
  nlohmann::json j;
  in >> j;
  GreedyGolden g;
  g.prompt = j.at("prompt_ids").get<std::vector<int64_t>>();
  g.ids = j.at("greedy_ids").get<std::vector<int64_t>>();
  g.max_new_tokens = j.at("max_new_tokens").get<int64_t>();
  g.eos = j.at("eos_token_id").get<int64_t>();
  return g;
}

/// Feeds `ids` [1, T] to the cache in chunks of the given sizes; returns the concatenated logits.
at::Tensor cached_logits(sm::LlamaForCausalLM& model, const at::Tensor& ids, const std::vector<int64_t>& chunks,
                         sm::KVCache& cache) {
  std::vector<at::Tensor> parts;
  int64_t at_pos = 0;
  for (int64_t n : chunks) {
    parts.push_back(model->forward_cached(ids.slice(1, at_pos, at_pos + n), cache));
    at_pos += n;
    EXPECT_EQ(cache.length, at_pos);
  }
  EXPECT_EQ(at_pos, ids.size(1)) << "chunks must cover the sequence";
  return at::cat(parts, 1);
}

/// Generation without a cache: the whole sequence so far, recomputed every step.
sm::StepFunction recompute_step(sm::LlamaForCausalLM model) {
  auto history = std::make_shared<std::vector<at::Tensor>>();
  return [model, history](const at::Tensor& new_ids, sm::KVCache& cache) mutable {
    history->push_back(new_ids);
    at::Tensor all = at::cat(*history, 1);
    cache.length = all.size(1);  // only the bookkeeping: nothing is cached
    return model->forward(all).slice(1, all.size(1) - new_ids.size(1));
  };
}

// Prefill, single tokens and a multi-token chunk after a cache, against one
// forward over the whole sequence.
// In fp64, where the two differ only by summation order (see
// fp64_logit_tolerance); a cache error moves logits by > 1e-3.
TEST(UnitGeneration, CachedLogitsMatchFullForwardLlamaGqa) {
  auto model = load_golden_case("llama");
  model->to(at::kDouble);
  ASSERT_LT(model->config.num_key_value_heads, model->config.num_attention_heads) << "the case must use GQA";
  torch::NoGradGuard no_grad;
  at::Tensor ids = at::randint(model->config.vocab_size, {1, 16}, at::TensorOptions().dtype(at::kLong));
  at::Tensor full = model->forward(ids);
  sm::KVCache cache;
  at::Tensor cached = cached_logits(model, ids, {5, 1, 1, 1, 3, 1, 4}, cache);
  ASSERT_EQ(cached.sizes(), full.sizes());
  EXPECT_LE((cached - full).abs().max().item<double>(),
            fp64_logit_tolerance(model->config, 16, full.abs().max().item<double>()));
  // Without a window every key stays: one per token per layer.
  ASSERT_EQ(cache.keys.size(), 2u);
  EXPECT_EQ(cache.keys[0].size(2), 16);
  EXPECT_EQ(cache.keys[0].size(1), model->config.num_key_value_heads) << "cached before the GQA repeat";
  EXPECT_EQ(cache.start, 0);

  // Batch 2 works the same way (the mask broadcasts over the batch).
  at::Tensor ids2 = at::randint(model->config.vocab_size, {2, 9}, at::TensorOptions().dtype(at::kLong));
  sm::KVCache cache2;
  at::Tensor cached2 = cached_logits(model, ids2, {4, 1, 4}, cache2);
  const at::Tensor full2 = model->forward(ids2);
  EXPECT_LE((cached2 - full2).abs().max().item<double>(),
            fp64_logit_tolerance(model->config, 9, full2.abs().max().item<double>()));
  // A cache filled at batch 2 refuses batch 1.
  EXPECT_THROW(model->forward_cached(ids.slice(1, 0, 1), cache2), shardtrain::Error);
}

TEST(UnitGeneration, CachedLogitsMatchFullForwardMistralSlidingWindow) {
  auto model = load_golden_case("mistral_swa");
  model->to(at::kDouble);  // as above
  ASSERT_TRUE(model->config.sliding_window.has_value());
  const int64_t W = *model->config.sliding_window;
  const int64_t T = 17;
  ASSERT_LT(W, T) << "the window must be smaller than the sequence";
  torch::NoGradGuard no_grad;
  at::Tensor ids = at::randint(model->config.vocab_size, {1, T}, at::TensorOptions().dtype(at::kLong));
  at::Tensor full = model->forward(ids);
  // A prefill longer than the window, single steps, and a chunk of W + 1 after a cache.
  const std::vector<std::vector<int64_t>> schedules = {{6, 1, 1, 1, 5, 1, 1, 1}, {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                                                                 1, 1, 1, 1, 1, 1}, {T}};
  for (const auto& chunks : schedules) {
    sm::KVCache cache;
    at::Tensor cached = cached_logits(model, ids, chunks, cache);
    EXPECT_LE((cached - full).abs().max().item<double>(),
              fp64_logit_tolerance(model->config, T, full.abs().max().item<double>()))
        << "first chunk " << chunks[0];
    // Keys older than the window were dropped: W - 1 remain, ending at the last position.
    EXPECT_EQ(cache.keys[0].size(2), W - 1);
    EXPECT_EQ(cache.start, T - (W - 1));
    EXPECT_EQ(cache.cached_tokens(), W - 1);
  }
  // The window matters here: the same weights without it give other logits,
  // so the equality above is not the unwindowed attention by accident.
  auto config = model->config;
  config.sliding_window.reset();
  sm::LlamaForCausalLM unwindowed(config);
  sm::load_hf_weights(unwindowed, golden_dir("mistral_swa"));
  unwindowed->to(at::kDouble);
  EXPECT_GT((unwindowed->forward(ids) - full).abs().max().item<double>(), 1e-3);
}

TEST(UnitGeneration, GreedyWithCacheEqualsGreedyWithoutCache) {
  for (const std::string name : {"llama", "mistral_swa", "llama_tied_llama3"}) {
    auto model = load_golden_case(name);
    torch::NoGradGuard no_grad;
    sm::GenerationOptions options;
    options.max_new_tokens = 14;
    const std::vector<int64_t> prompt = {1, 7, 19, 3, 30};
    const auto cached = sm::generate(sm::cached_step(model), prompt, options);
    const auto recomputed = sm::generate(recompute_step(model), prompt, options);
    EXPECT_EQ(cached.tokens, recomputed.tokens) << name;
    EXPECT_EQ(cached.tokens.size(), 14u) << name;
    EXPECT_EQ(cached.forward_calls, 14) << name << ": N new tokens take N steps";
  }
}

TEST(UnitGeneration, GreedyMatchesTransformersGenerate) {
  for (const std::string name : {"llama", "mistral_swa"}) {
    const GreedyGolden golden = read_greedy(name);
    auto model = load_golden_case(name);
    torch::NoGradGuard no_grad;
    sm::GenerationOptions options;
    options.max_new_tokens = golden.max_new_tokens;
    options.stop_ids = {golden.eos};
    const auto result = sm::generate(sm::cached_step(model), golden.prompt, options);
    EXPECT_EQ(result.tokens, golden.ids) << name;
  }
}

TEST(UnitGeneration, SamplingIsReproducibleAndTinyTopPIsGreedy) {
  auto model = load_golden_case("llama");
  torch::NoGradGuard no_grad;
  const std::vector<int64_t> prompt = {1, 5, 9};
  sm::GenerationOptions sample;
  sample.max_new_tokens = 20;
  sample.temperature = 1.5;  // flat enough that different seeds differ
  sample.top_p = 0.95;
  sample.seed = 1234;
  const auto a = sm::generate(sm::cached_step(model), prompt, sample);
  const auto b = sm::generate(sm::cached_step(model), prompt, sample);
  EXPECT_EQ(a.tokens, b.tokens) << "same seed, same tokens";
  // The sampler's generator is its own: the global torch seed does not matter.
  torch::manual_seed(99);
  EXPECT_EQ(sm::generate(sm::cached_step(model), prompt, sample).tokens, a.tokens);
  bool any_differs = false;
  for (uint64_t seed : {1ULL, 2ULL, 3ULL}) {
    sample.seed = seed;
    any_differs = any_differs || sm::generate(sm::cached_step(model), prompt, sample).tokens != a.tokens;
  }
  EXPECT_TRUE(any_differs) << "the seed must change the samples";

  sm::GenerationOptions greedy;
  greedy.max_new_tokens = 20;
  const auto reference = sm::generate(sm::cached_step(model), prompt, greedy);
  sm::GenerationOptions nucleus = greedy;
  nucleus.temperature = 1.5;
  nucleus.top_p = 1e-6;  // only the most probable token remains
  for (uint64_t seed : {5ULL, 6ULL}) {
    nucleus.seed = seed;
    EXPECT_EQ(sm::generate(sm::cached_step(model), prompt, nucleus).tokens, reference.tokens);
  }
}

TEST(UnitGeneration, TopPKeepsTheSmallestNucleus) {
  // probabilities 0.5, 0.3, 0.15, 0.05 (token order shuffled)
  at::Tensor logits = at::log(at::tensor({0.15, 0.5, 0.05, 0.3}, at::kFloat));
  auto draw = [&](double top_p) {
    sm::Sampler sampler(1.0, /*top_k=*/0, top_p, 7);
    std::set<int64_t> seen;
    for (int i = 0; i < 400; ++i) seen.insert(sampler.next(logits));
    return seen;
  };
  EXPECT_EQ(draw(0.45), (std::set<int64_t>{1}));         // 0.5 alone reaches 0.45
  EXPECT_EQ(draw(0.6), (std::set<int64_t>{1, 3}));       // 0.5 + 0.3
  EXPECT_EQ(draw(0.85), (std::set<int64_t>{0, 1, 3}));   // 0.5 + 0.3 + 0.15 (0.8 < 0.85)
  EXPECT_EQ(draw(0.97), (std::set<int64_t>{0, 1, 2, 3}));  // 0.95 < 0.97: the last one too
  EXPECT_EQ(draw(1.0), (std::set<int64_t>{0, 1, 2, 3}));
  sm::Sampler greedy(0.0, 50, 1.0, 0);
  EXPECT_EQ(greedy.next(logits), 1);
  EXPECT_THROW(sm::Sampler(-1.0, 50, 1.0, 0), shardtrain::ConfigError);
  EXPECT_THROW(sm::Sampler(1.0, 50, 0.0, 0), shardtrain::ConfigError);
  EXPECT_THROW(sm::Sampler(1.0, 50, 1.5, 0), shardtrain::ConfigError);
  EXPECT_THROW(sm::Sampler(1.0, -1, 1.0, 0), shardtrain::ConfigError);
}

TEST(UnitGeneration, TopKComesBeforeTopPAsInTransformers) {
  // probabilities 0.5, 0.3, 0.15, 0.05 (token order shuffled)
  at::Tensor logits = at::log(at::tensor({0.15, 0.5, 0.05, 0.3}, at::kFloat));
  auto draw = [&](int64_t top_k, double top_p) {
    sm::Sampler sampler(1.0, top_k, top_p, 11);
    std::set<int64_t> seen;
    for (int i = 0; i < 400; ++i) seen.insert(sampler.next(logits));
    return seen;
  };
  EXPECT_EQ(draw(2, 1.0), (std::set<int64_t>{1, 3}));     // the two most probable
  EXPECT_EQ(draw(3, 1.0), (std::set<int64_t>{0, 1, 3}));
  EXPECT_EQ(draw(1, 1.0), (std::set<int64_t>{1}));        // top_k 1 is greedy
  EXPECT_EQ(draw(0, 1.0), (std::set<int64_t>{0, 1, 2, 3}));  // 0: no top-k
  // Top-p over the renormalised top 2 (0.625, 0.375): 0.6 keeps the first alone,
  // where over all four (0.5 + 0.3) it keeps two.
  EXPECT_EQ(draw(2, 0.6), (std::set<int64_t>{1}));
  EXPECT_EQ(draw(0, 0.6), (std::set<int64_t>{1, 3}));
  // transformers' default top_k of 50 on a flat 1000-token vocabulary: no draw outside the 50 most probable.
  const at::Tensor flat = at::linspace(0.0, 1.0, 1000);
  sm::Sampler sampler(1.0, 50, 1.0, 3);
  for (int i = 0; i < 400; ++i) EXPECT_GE(sampler.next(flat), 950);
}

// A step that returns fixed logits, counting its calls.
sm::StepFunction scripted_step(const std::vector<int64_t>& favourites, int64_t vocab, int* calls) {
  return [favourites, vocab, calls](const at::Tensor& new_ids, sm::KVCache& cache) {
    const int64_t i = std::min<int64_t>(*calls, static_cast<int64_t>(favourites.size()) - 1);
    ++*calls;
    cache.length += new_ids.size(1);
    at::Tensor logits = at::zeros({1, new_ids.size(1), vocab});
    logits[0][new_ids.size(1) - 1][favourites[i]] = 10.0;
    return logits;
  };
}

TEST(UnitGeneration, StopIdsFixedStepsAndAgreement) {
  const std::vector<int64_t> favourites = {4, 5, 2, 6, 7, 8};  // 2 is the stop id
  sm::GenerationOptions options;
  options.max_new_tokens = 6;
  options.stop_ids = {2};
  int calls = 0;
  auto result = sm::generate(scripted_step(favourites, 10, &calls), {1}, options);
  EXPECT_EQ(result.tokens, (std::vector<int64_t>{4, 5, 2})) << "the stop id ends the result and is part of it";
  EXPECT_TRUE(result.stopped);
  EXPECT_EQ(calls, 3);

  // fixed_steps: every rank calls the model max_new_tokens times; the result still ends at the stop id.
  options.fixed_steps = true;
  calls = 0;
  result = sm::generate(scripted_step(favourites, 10, &calls), {1}, options);
  EXPECT_EQ(result.tokens, (std::vector<int64_t>{4, 5, 2}));
  EXPECT_EQ(calls, 6);
  EXPECT_EQ(result.forward_calls, 6);

  // agree_on_token replaces each token (a distributed caller's broadcast): here it never lets 2 through.
  options.fixed_steps = false;
  options.agree_on_token = [](int64_t token) { return token == 2 ? int64_t{3} : token; };
  calls = 0;
  result = sm::generate(scripted_step(favourites, 10, &calls), {1}, options);
  EXPECT_EQ(result.tokens, (std::vector<int64_t>{4, 5, 3, 6, 7, 8}));
  EXPECT_FALSE(result.stopped);

  options.max_new_tokens = 0;
  calls = 0;
  EXPECT_TRUE(sm::generate(scripted_step(favourites, 10, &calls), {1}, options).tokens.empty());
  EXPECT_EQ(calls, 0);
  EXPECT_THROW(sm::generate(scripted_step(favourites, 10, &calls), {}, options), shardtrain::Error);
}

TEST(UnitGeneration, PaddedVocabularyIdsAreNeverProduced) {
  // A model whose embedding has 10 rows for a tokenizer of 8: its favourites
  // 8 and 9 are ids the tokenizer cannot decode.
  const std::vector<int64_t> favourites = {4, 9, 8, 5};
  sm::GenerationOptions options;
  options.max_new_tokens = 4;
  options.vocab_limit = 8;
  int calls = 0;
  // Greedy over ids 0..7: where the favourite is out of range every allowed
  // logit is 0, and argmax takes the first.
  EXPECT_EQ(sm::generate(scripted_step(favourites, 10, &calls), {1}, options).tokens,
            (std::vector<int64_t>{4, 0, 0, 5}));
  options.temperature = 1.0;
  options.seed = 3;
  calls = 0;
  for (int64_t token : sm::generate(scripted_step(favourites, 10, &calls), {1}, options).tokens) {
    EXPECT_LT(token, 8);
  }
}

std::string generate_bin() { return std::string(SHARDTRAIN_BIN_DIR) + "/generate"; }

std::string join_ids(const std::vector<int64_t>& ids) {
  std::string out;
  for (std::size_t i = 0; i < ids.size(); ++i) out += (i ? "," : "") + std::to_string(ids[i]);
  return out;
}

/// The last non-empty line of a program's output.
std::string last_line(const std::string& output) {
  std::istringstream in(output);
  std::string line, last;
  while (std::getline(in, line)) {
    if (!line.empty()) last = line;
  }
  return last;
}

TEST(UnitGenerateProgram, PrintIdsMatchTransformersGenerate) {
  for (const std::string name : {"llama", "mistral_swa"}) {
    const GreedyGolden golden = read_greedy(name);
    const std::string command = generate_bin() + " --model-dir " + golden_dir(name) + " --prompt-ids " +
                                join_ids(golden.prompt) + " --max-new-tokens " + std::to_string(golden.max_new_tokens) +
                                " --print-ids 2>/dev/null";
    const auto run = shardtrain::testing::run_command(command, std::chrono::seconds(120));
    ASSERT_EQ(run.exit_code, 0) << command << "\n" << run.output;
    EXPECT_EQ(last_line(run.output), join_ids(golden.ids)) << name;
  }
}

TEST(UnitGeneration, GenerationConfigJsonIsReadAsTransformersWritesIt) {
  const shardtrain::testing::ScratchDir scratch;
  const fs::path dir = scratch.path();
  EXPECT_FALSE(sm::read_generation_config(dir.string()).has_value());
  std::ofstream(dir / "generation_config.json")
      << R"({"bos_token_id": 1, "eos_token_id": [128001, 128009], "do_sample": true, "temperature": 0.6,
            "top_p": 0.9, "transformers_version": "4.40.0"})";
  const auto read = sm::read_generation_config(dir.string());
  ASSERT_TRUE(read.has_value());
  EXPECT_EQ(read->eos_token_ids, (std::vector<int64_t>{128001, 128009}));
  EXPECT_TRUE(read->do_sample);
  EXPECT_EQ(read->temperature, std::optional<double>(0.6));
  EXPECT_EQ(read->top_p, std::optional<double>(0.9));
  EXPECT_FALSE(read->top_k.has_value());
  // eos_token_id follows config.json's rule (LlamaConfig's): an id past int64 is refused, not wrapped.
  std::ofstream(dir / "generation_config.json") << R"({"eos_token_id": [2, 18446744073709551615]})";
  try {
    (void)sm::read_generation_config(dir.string());
    ADD_FAILURE() << "an eos id past int64 was accepted";
  } catch (const shardtrain::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("field 'eos_token_id' must be an integer or a list of integers (in range)"),
              std::string::npos)
        << e.what();
  }
  std::ofstream(dir / "generation_config.json") << R"({"eos_token_id": 2, "top_k": "fifty"})";
  try {
    (void)sm::read_generation_config(dir.string());
    ADD_FAILURE() << "a top_k of \"fifty\" was accepted";
  } catch (const shardtrain::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("generation_config.json: field 'top_k' must be an integer"), std::string::npos)
        << e.what();
  }
}

// generation_config.json beside config.json: its eos ids stop the generation
// (config.json's are not used then), and when it samples its values are the
// defaults, as transformers' generate() reads it.
TEST(UnitGenerateProgram, GenerationConfigJsonSetsTheStopIdsAndSamplingDefaults) {
  const GreedyGolden golden = read_greedy("llama");
  const shardtrain::testing::ScratchDir scratch;
  const fs::path dir = scratch.path();
  for (const char* file : {"config.json", "model.safetensors"}) {
    fs::copy_file(fs::path(golden_dir("llama")) / file, dir / file);
  }
  // The first greedy id not seen before it, from the second on: the run must stop right after it.
  std::size_t stop_at = 1;
  while (stop_at < golden.ids.size() &&
         std::find(golden.ids.begin(), golden.ids.begin() + stop_at, golden.ids[stop_at]) !=
             golden.ids.begin() + stop_at) {
    ++stop_at;
  }
  ASSERT_LT(stop_at, golden.ids.size());
  const std::string command = generate_bin() + " --model-dir " + dir.string() + " --prompt-ids " +
                              join_ids(golden.prompt) + " --max-new-tokens " +
                              std::to_string(golden.max_new_tokens) + " --print-ids 2>" +
                              (dir / "stderr.txt").string();
  std::ofstream(dir / "generation_config.json") << R"({"eos_token_id": [)" << golden.ids[stop_at] << "]}";
  auto run = shardtrain::testing::run_command(command, std::chrono::seconds(120));
  ASSERT_EQ(run.exit_code, 0) << command << "\n" << run.output;
  EXPECT_EQ(last_line(run.output),
            join_ids(std::vector<int64_t>(golden.ids.begin(), golden.ids.begin() + stop_at + 1)));
  // A file that samples, with top_k 1: sampling, yet only the most probable token can come.
  std::ofstream(dir / "generation_config.json") << R"({"do_sample": true, "temperature": 1.5, "top_k": 1})";
  run = shardtrain::testing::run_command(command, std::chrono::seconds(120));
  ASSERT_EQ(run.exit_code, 0) << command << "\n" << run.output;
  std::stringstream said;
  said << std::ifstream(dir / "stderr.txt").rdbuf();
  EXPECT_NE(said.str().find("generation_config.json's defaults under the flags given: temperature 1.5, top_k 1"),
            std::string::npos)
      << said.str();
  EXPECT_EQ(last_line(run.output), join_ids(golden.ids));
}

// --prompt: tokenized with the directory's tokenizer.model, BOS prepended,
// optionally wrapped as "[INST] ... [/INST]"; ids and text match the library.
TEST(UnitGenerateProgram, PromptTextIsTokenizedWithBosAndChatFormat) {
  // The bundled fine-tune example's tokenizer (scripts/make_tiny_instruct.py).
  const fs::path tokenizer_file = fs::path(SHARDTRAIN_SOURCE_DIR) / "examples/tiny_llama/tokenizer.model";
  ASSERT_TRUE(fs::exists(tokenizer_file)) << "no " << tokenizer_file << " (committed with the example)";
  auto tokenizer = shardtrain::load_sentencepiece(tokenizer_file.string());
  const shardtrain::testing::ScratchDir scratch;
  const fs::path dir = scratch.path();
  // A small random model over the tokenizer's vocabulary; large weights so greedy steps are not near ties.
  const std::string config_json = R"({"model_type": "llama", "vocab_size": )" +
                                  std::to_string(tokenizer->vocab_size()) +
                                  R"(, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
      "num_attention_heads": 2, "num_key_value_heads": 1, "initializer_range": 0.5, "bos_token_id": 1,
      "eos_token_id": 2})";
  std::ofstream(dir / "config.json") << config_json;
  torch::manual_seed(3);
  sm::LlamaForCausalLM model(sm::LlamaConfig::from_json_string(config_json));
  shardtrain::safetensors::write_file((dir / "model.safetensors").string(), sm::hf_state_dict(model), {}, false);
  fs::copy_file(tokenizer_file, dir / "tokenizer.model");

  const std::string text = "12 34";
  struct Case {
    std::string flags, wrapped;
  };
  for (const Case& c : {Case{"", text}, Case{"--chat-format llama2", "[INST] " + text + " [/INST]"}}) {
    std::vector<int64_t> prompt = {model->config.bos_token_id};
    for (int64_t id : tokenizer->encode(c.wrapped)) prompt.push_back(id);
    sm::GenerationOptions options;
    options.max_new_tokens = 6;
    torch::NoGradGuard no_grad;
    const auto expected = sm::generate(sm::cached_step(model), prompt, options);
    const std::string base = generate_bin() + " --model-dir " + dir.string() + " --prompt '" + text +
                             "' --max-new-tokens 6 --ignore-eos " + c.flags;
    auto run = shardtrain::testing::run_command(base + " --print-ids 2>/dev/null", std::chrono::seconds(60));
    ASSERT_EQ(run.exit_code, 0) << base << "\n" << run.output;
    EXPECT_EQ(last_line(run.output), join_ids(expected.tokens)) << c.flags;
    run = shardtrain::testing::run_command(base + " 2>/dev/null", std::chrono::seconds(60));
    ASSERT_EQ(run.exit_code, 0) << base << "\n" << run.output;
    EXPECT_EQ(run.output, tokenizer->decode(expected.tokens) + "\n") << c.flags;
  }
}

TEST(UnitGenerateProgram, ClearErrorsForMissingInputs) {
  const shardtrain::testing::ScratchDir scratch;
  const fs::path empty = scratch.path();
  struct Case {
    std::string args, expect;
  };
  const std::vector<Case> cases = {
      {"--model-dir " + (empty / "absent").string() + " --prompt-ids 1 --print-ids", "does not exist"},
      {"--model-dir " + empty.string() + " --prompt-ids 1 --print-ids", "no config.json"},
      {"--model-dir " + golden_dir("llama") + " --prompt hello", "no tokenizer at"},
      {"--model-dir " + golden_dir("llama") + " --prompt-ids 1,x --print-ids", "not a token id"},
      {"--model-dir " + golden_dir("llama") + " --prompt-ids 1,4800 --print-ids", "outside the model's vocabulary"},
  };
  for (const auto& c : cases) {
    const auto run = shardtrain::testing::run_command(generate_bin() + " " + c.args, std::chrono::seconds(60));
    EXPECT_NE(run.exit_code, 0) << c.args;
    EXPECT_NE(run.output.find(c.expect), std::string::npos) << c.args << "\n" << run.output;
  }
  // A config but no weights.
  fs::copy_file(golden_dir("llama") + "/config.json", empty / "config.json");
  const auto run = shardtrain::testing::run_command(
      generate_bin() + " --model-dir " + empty.string() + " --prompt-ids 1 --print-ids", std::chrono::seconds(60));
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("no model.safetensors"), std::string::npos) << run.output;
}

}  // namespace
