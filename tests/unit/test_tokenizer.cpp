// The sentencepiece tokenizer through libshardtrain_spm.so, in the test binary
// that also runs LibTorch: Debian's libsentencepiece linked next to Debian's
// LibTorch crashes before main (clashing protobuf copies), so these tests are
// also the check that the dlopen(RTLD_DEEPBIND) shim keeps them apart.

#include <gtest/gtest.h>

#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "build_config.h"
#include "shardtrain/error.h"
#include "shardtrain/models/llama.h"
#include "shardtrain/tokenizer.h"
#include "support/scratch_dir.h"
#include "support/contains.h"

namespace {

using shardtrain::testing::ScratchDir;

const std::string kTinyLlamaDir = std::string(SHARDTRAIN_SOURCE_DIR) + "/examples/tiny_llama";
const std::string kModel = kTinyLlamaDir + "/tokenizer.model";
const std::string kLibDir = std::string(SHARDTRAIN_BIN_DIR) + "/../lib";

/// Sets (or unsets, with nullopt) an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::optional<std::string>& value) : name_(name) {
    if (const char* old = getenv(name)) old_ = old;
    if (value) {
      setenv(name, value->c_str(), 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

std::string tokenizer_error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const shardtrain::Error& e) {
    return e.what();
  }
  return "<no shardtrain::Error thrown>";
}

std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  std::vector<nlohmann::json> records;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) records.push_back(nlohmann::json::parse(line));
  }
  return records;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

using shardtrain::testing::contains;

std::unique_ptr<shardtrain::Tokenizer> bundled() {
  ScopedEnv no_override("SHARDTRAIN_SPM_SHIM", std::nullopt);
  return shardtrain::load_sentencepiece(kModel);
}

TEST(UnitTokenizer, LoadsAndEncodesInAProcessThatRunsLibTorch) {
  // A LibTorch op before loading (LibTorch's protobuf is initialised and in
  // the global scope), then the tokenizer, then LibTorch again.
  const at::Tensor a = torch::arange(6, torch::kFloat).reshape({2, 3});
  const at::Tensor before = torch::matmul(a, a.t());
  EXPECT_EQ(before[1][1].item<float>(), 9.f + 16.f + 25.f);

  auto tokenizer = bundled();
  const std::vector<int64_t> ids = tokenizer->encode("Reverse the digits 90210");
  ASSERT_FALSE(ids.empty());

  const at::Tensor t = torch::tensor(ids, torch::kLong);
  const at::Tensor embedded = torch::nn::functional::one_hot(t, tokenizer->vocab_size()).sum(0);
  EXPECT_EQ(embedded.sum().item<int64_t>(), static_cast<int64_t>(ids.size()));
  EXPECT_EQ(embedded[0].item<int64_t>(), 0) << "no unknown pieces in a string made of trained words";
  const at::Tensor after = torch::matmul(a, a.t());
  EXPECT_TRUE(torch::equal(before, after));
}

TEST(UnitTokenizer, SpecialIdsFollowLlamaAndMatchTheBundledConfig) {
  auto tokenizer = bundled();
  EXPECT_EQ(tokenizer->unk_id(), 0);
  EXPECT_EQ(tokenizer->bos_id(), 1);
  EXPECT_EQ(tokenizer->eos_id(), 2);
  EXPECT_EQ(tokenizer->pad_id(), -1);
  EXPECT_EQ(tokenizer->vocab_size(), 384);

  // The model's embedding table is sized from config.json: it must agree
  // with the tokenizer it is trained with.
  std::ifstream in(kTinyLlamaDir + "/config.json");
  ASSERT_TRUE(in.good()) << kTinyLlamaDir << "/config.json";
  const auto config = nlohmann::json::parse(in);
  EXPECT_EQ(config.at("vocab_size").get<int64_t>(), tokenizer->vocab_size());
  EXPECT_EQ(config.at("bos_token_id").get<int64_t>(), tokenizer->bos_id());
  EXPECT_EQ(config.at("eos_token_id").get<int64_t>(), tokenizer->eos_id());
}

TEST(UnitTokenizer, PieceToId) {
  auto tokenizer = bundled();
  EXPECT_EQ(tokenizer->piece_to_id("<unk>"), 0);
  EXPECT_EQ(tokenizer->piece_to_id("<s>"), 1);
  EXPECT_EQ(tokenizer->piece_to_id("</s>"), 2);
  // The chat template's markers are single user-defined pieces.
  EXPECT_EQ(tokenizer->piece_to_id("[INST]"), 3);
  EXPECT_EQ(tokenizer->piece_to_id("[/INST]"), 4);
  // Byte-fallback pieces follow: <0x00> .. <0xFF>.
  EXPECT_EQ(tokenizer->piece_to_id("<0x00>"), 5);
  EXPECT_EQ(tokenizer->piece_to_id("<0xFF>"), 260);
  EXPECT_EQ(tokenizer->piece_to_id("\xe2\x96\x81What"), 278);  // "▁What"
  EXPECT_EQ(tokenizer->piece_to_id("\xe2\x96\x81"), 342);      // "▁"
  // Pieces are looked up as is, not normalised: without the "▁" it is unknown.
  EXPECT_EQ(tokenizer->piece_to_id("What"), tokenizer->unk_id());
  EXPECT_EQ(tokenizer->piece_to_id("no such piece"), tokenizer->unk_id());
}

TEST(UnitTokenizer, EncodeGivesTheIdsOfTheCommittedModel) {
  // From `spm_encode --model=examples/tiny_llama/tokenizer.model --output_format=id`.
  auto tokenizer = bundled();
  EXPECT_EQ(tokenizer->encode("Reverse the digits 90210"),
            (std::vector<int64_t>{308, 272, 286, 342, 348, 350, 352, 351, 350}));
  EXPECT_EQ(tokenizer->encode("[INST] What is 27 + 5? [/INST]"),
            (std::vector<int64_t>{342, 3, 278, 282, 342, 352, 356, 291, 342, 359, 367, 342, 4}));
  // Characters outside the vocabulary become their UTF-8 bytes (id = 5 + byte),
  // never <unk>: "é" is C3 A9, "✓" is E2 9C 93.
  EXPECT_EQ(tokenizer->encode("caf\xc3\xa9 \xe2\x9c\x93"),
            (std::vector<int64_t>{342, 372, 346, 370, 5 + 0xC3, 5 + 0xA9, 342, 5 + 0xE2, 5 + 0x9C, 5 + 0x93}));
  // Identity normalisation (as Llama 2): repeated spaces are kept.
  EXPECT_EQ(tokenizer->encode("  two  spaces"),
            (std::vector<int64_t>{342, 342, 264, 376, 353, 342, 342, 347, 368, 346, 372, 268}));
  EXPECT_TRUE(tokenizer->encode("").empty());
}

TEST(UnitTokenizer, EncodeAgreesWithTheSpmEncodeTool) {
  // The reference is sentencepiece's own command-line tool (Debian package
  // `sentencepiece`), run on strings the committed ids above do not cover.
  if (system("command -v spm_encode >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "spm_encode not installed (Debian package sentencepiece)";
  }
  const std::vector<std::string> texts = {
      "How many times does 7 appear in 1737277?", "Write 00042 backwards", "Compute 99 + 9",
      "Unseen words: zebra, quixotic; tabs\tand UTF-8 \xc3\xbc\xc3\x9f \xf0\x9f\x99\x82"};
  ScratchDir scratch;
  std::string joined;
  for (const auto& t : texts) joined += t + "\n";
  const std::string input = scratch.write("input.txt", joined);
  const std::string command = "spm_encode --model='" + kModel + "' --output_format=id < '" + input + "'";
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr) << command;
  std::string output;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) output.append(buffer, n);
  ASSERT_EQ(pclose(pipe), 0) << command;

  auto tokenizer = bundled();
  std::istringstream lines(output);
  std::string line;
  for (const auto& text : texts) {
    ASSERT_TRUE(std::getline(lines, line)) << "spm_encode printed fewer lines than inputs";
    std::vector<int64_t> expected;
    std::istringstream ids(line);
    for (int64_t id; ids >> id;) expected.push_back(id);
    EXPECT_EQ(tokenizer->encode(text), expected) << text;
  }
}

TEST(UnitTokenizer, DecodeInvertsEncodeAndDropsControlTokens) {
  auto tokenizer = bundled();
  for (const std::string text :
       {"Sort the digits 553720", "[INST] Add one to 8686 [/INST] 8687", "  leading, inner   and trailing  ",
        "caf\xc3\xa9 \xe2\x9c\x93 \xf0\x9f\x99\x82", "", "0"}) {
    EXPECT_EQ(tokenizer->decode(tokenizer->encode(text)), text);
  }
  std::vector<int64_t> ids = tokenizer->encode("8687");
  ids.insert(ids.begin(), tokenizer->bos_id());
  ids.push_back(tokenizer->eos_id());
  EXPECT_EQ(tokenizer->decode(ids), "8687");
  // An unknown piece decodes to sentencepiece's " ⁇ " marker, not to nothing.
  EXPECT_EQ(tokenizer->decode({tokenizer->unk_id()}), " \xe2\x81\x87 ");
}

TEST(UnitTokenizer, DecodeRejectsIdsOutsideTheVocabulary) {
  auto tokenizer = bundled();
  const std::string message = tokenizer_error_of([&] { tokenizer->decode({308, 384}); });
  EXPECT_TRUE(contains(message, "token id 384 at position 1")) << message;
  EXPECT_TRUE(contains(message, "[0, 384)")) << message;
  EXPECT_TRUE(contains(tokenizer_error_of([&] { tokenizer->decode({-1}); }), "token id -1"));
}

TEST(UnitTokenizer, MissingModelFileIsNamed) {
  const std::string path = kTinyLlamaDir + "/no-such-tokenizer.model";
  const std::string message = tokenizer_error_of([&] { shardtrain::load_sentencepiece(path); });
  EXPECT_TRUE(contains(message, "tokenizer model '" + path + "' does not exist")) << message;
}

TEST(UnitTokenizer, GarbageFileIsNotASentencepieceModel) {
  ScratchDir scratch;
  ScopedEnv no_override("SHARDTRAIN_SPM_SHIM", std::nullopt);
  for (const std::string content : {std::string("{\"version\": \"1.0\", \"model\": {\"type\": \"BPE\"}}"),
                                    std::string("\x08\x96\x01\xff\xff\xff garbage", 14)}) {
    const std::string path = scratch.write("tokenizer.model", content);
    const std::string message = tokenizer_error_of([&] { shardtrain::load_sentencepiece(path); });
    EXPECT_TRUE(contains(message, "cannot load '" + path + "' as a sentencepiece model")) << message;
    // sentencepiece's own reason comes through the shim.
    EXPECT_TRUE(contains(message, "ParseFromArray")) << message;
    EXPECT_TRUE(contains(message, "tokenizer.json")) << message;
  }
}

TEST(UnitTokenizer, BadShimOverrideIsReported) {
  {
    const std::string path = "/nonexistent/libshardtrain_spm.so";
    ScopedEnv env("SHARDTRAIN_SPM_SHIM", path);
    const std::string message = tokenizer_error_of([&] { shardtrain::load_sentencepiece(kModel); });
    EXPECT_TRUE(contains(message, "SHARDTRAIN_SPM_SHIM='" + path + "' does not name a file")) << message;
  }
  {
    // A file that is not a shared library: dlopen's reason is passed on.
    ScratchDir scratch;
    const std::string path = scratch.write("libshardtrain_spm.so", "not an ELF file");
    ScopedEnv env("SHARDTRAIN_SPM_SHIM", path);
    const std::string message = tokenizer_error_of([&] { shardtrain::load_sentencepiece(kModel); });
    EXPECT_TRUE(contains(message, "cannot load the sentencepiece shim '" + path + "' (from SHARDTRAIN_SPM_SHIM)"))
        << message;
    EXPECT_TRUE(contains(message, "invalid ELF header") || contains(message, "file too short")) << message;
  }
  {
    // A real shared library without the shim's entry points.
    const std::string path = kLibDir + "/libshardtrain.so";
    ScopedEnv env("SHARDTRAIN_SPM_SHIM", path);
    const std::string message = tokenizer_error_of([&] { shardtrain::load_sentencepiece(kModel); });
    EXPECT_TRUE(contains(message, "is not a shardtrain sentencepiece shim")) << message;
    EXPECT_TRUE(contains(message, "st_spm_abi_version")) << message;
  }
  {
    // The override naming the real shim works (the path the build put it at).
    ScopedEnv env("SHARDTRAIN_SPM_SHIM", kLibDir + "/libshardtrain_spm.so");
    EXPECT_EQ(shardtrain::load_sentencepiece(kModel)->vocab_size(), 384);
  }
  {
    // A relative override is relative to the working directory (dlopen alone
    // would search the library path for a name without "/").
    ScratchDir scratch;
    std::filesystem::copy_file(kLibDir + "/libshardtrain_spm.so", scratch.path() + "/renamed_spm_shim.so");
    const auto cwd = std::filesystem::current_path();
    std::filesystem::current_path(scratch.path());
    ScopedEnv env("SHARDTRAIN_SPM_SHIM", "renamed_spm_shim.so");
    std::string message;
    try {
      EXPECT_EQ(shardtrain::load_sentencepiece(kModel)->vocab_size(), 384);
    } catch (const shardtrain::Error& e) {
      message = e.what();
    }
    std::filesystem::current_path(cwd);
    EXPECT_EQ(message, "");
  }
}

// ---- the bundled tiny Llama (examples/tiny_llama) -----------------------------

TEST(UnitTinyLlamaBundle, ConfigIsASmallLlamaSizedForTheTokenizer) {
  const auto config = shardtrain::models::LlamaConfig::from_json_file(kTinyLlamaDir + "/config.json");
  EXPECT_EQ(config.model_type, "llama");
  EXPECT_EQ(config.vocab_size, bundled()->vocab_size());
  shardtrain::models::LlamaForCausalLM model(config);
  int64_t parameters = 0;
  for (const auto& p : model->parameters()) parameters += p.numel();
  // Small enough to fine-tune from scratch on two CPU cores in minutes; the
  // README quotes this number.
  EXPECT_EQ(parameters, 3098880);
}

TEST(UnitTinyLlamaBundle, EvalQuestionsAreHeldOutAndFitTheRows) {
  const auto train = read_jsonl(kTinyLlamaDir + "/data/train.jsonl");
  const auto eval = read_jsonl(kTinyLlamaDir + "/data/eval.jsonl");
  ASSERT_GE(train.size(), 10000u);
  ASSERT_GE(eval.size(), 100u);
  std::set<std::string> train_prompts;
  for (const auto& r : train) train_prompts.insert(r.at("prompt").get<std::string>());
  auto tokenizer = bundled();
  size_t longest = 0;
  for (const auto& r : eval) {
    const auto prompt = r.at("prompt").get<std::string>();
    // Exact match on eval then measures generalisation, not recall.
    EXPECT_EQ(train_prompts.count(prompt), 0u) << "eval prompt also in train: " << prompt;
    const size_t answer = tokenizer->encode(r.at("response").get<std::string>() + " ").size();
    EXPECT_LE(answer, 12u) << r.dump();
    longest = std::max(longest, 2 + tokenizer->encode("[INST] " + prompt + " [/INST]").size() + answer);
  }
  // Whole examples pack into the fine-tune's default 128-token rows.
  EXPECT_LE(longest, 64u);
}

TEST(UnitTinyLlamaBundle, ScriptReproducesTheCommittedFiles) {
  // The committed data and tokenizer are exactly what the documented command
  // makes (fixed seed, single-threaded spm_train).
  if (system("command -v python3 >/dev/null 2>&1 && command -v spm_train >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "python3 or spm_train (Debian package sentencepiece) not installed";
  }
  ScratchDir scratch;
  const std::string command = "python3 '" + std::string(SHARDTRAIN_SOURCE_DIR) +
                              "/scripts/make_tiny_instruct.py' --out-dir '" + scratch.path() + "' 2>/dev/null";
  ASSERT_EQ(system(command.c_str()), 0) << command;
  for (const std::string file : {"data/train.jsonl", "data/eval.jsonl", "tokenizer.model"}) {
    const std::string made = read_bytes(scratch.path() + "/" + file);
    EXPECT_FALSE(made.empty()) << file;
    EXPECT_TRUE(made == read_bytes(kTinyLlamaDir + "/" + file)) << file << " differs from what the script makes";
  }
}

}  // namespace
