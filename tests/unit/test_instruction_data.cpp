// Instruction-data pipeline (shardtrain/models/instruction_data.h): JSONL
// parsing, chat templates and loss masks, truncation, packing, batches, and a
// check with a real (small, random) LlamaForCausalLM that packing + masking +
// document_ids give the same loss as the documents run one at a time.

#include <gtest/gtest.h>

#include <torch/torch.h>

#include <spdlog/sinks/ostream_sink.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "shardtrain/error.h"
#include "shardtrain/logging.h"
#include "support/log_capture.h"
#include "shardtrain/models/instruction_data.h"
#include "shardtrain/models/llama.h"
#include "shardtrain/tokenizer.h"
#include "support/llama_golden.h"
#include "support/scratch_dir.h"

namespace sm = shardtrain::models;
using shardtrain::testing::ScratchDir;

namespace {

constexpr int64_t kIgnore = -100;

/// One id per byte (4 + byte), pad 0 / bos 1 / eos 2 / unk 3 by default, and
/// sentencepiece's dummy prefix: encode(text) starts with the id of ' '. The
/// special ids can be switched off (-1) to model tokenizers without them.
class CharTokenizer : public shardtrain::Tokenizer {
 public:
  explicit CharTokenizer(int64_t bos = 1, int64_t eos = 2, int64_t pad = 0) : bos_(bos), eos_(eos), pad_(pad) {}
  std::vector<int64_t> encode(const std::string& text) const override {
    std::vector<int64_t> ids{char_id(' ')};
    for (char c : text) ids.push_back(char_id(c));
    return ids;
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string out;
    for (int64_t id : ids) {
      if (id >= 4) out.push_back(static_cast<char>(id - 4));
    }
    return out;
  }
  int64_t vocab_size() const override { return 260; }
  int64_t bos_id() const override { return bos_; }
  int64_t eos_id() const override { return eos_; }
  int64_t pad_id() const override { return pad_; }
  int64_t unk_id() const override { return 3; }
  int64_t piece_to_id(const std::string& piece) const override {
    return piece.size() == 1 ? char_id(piece[0]) : unk_id();
  }
  static int64_t char_id(char c) { return 4 + static_cast<unsigned char>(c); }

 private:
  int64_t bos_, eos_, pad_;
};

/// The ids of `s`, one per character, with no dummy prefix added: expected
/// sequences below spell the dummy-prefix space out explicitly.
std::vector<int64_t> chars(const std::string& s) {
  std::vector<int64_t> ids;
  for (char c : s) ids.push_back(CharTokenizer::char_id(c));
  return ids;
}

std::vector<int64_t> cat(std::initializer_list<std::vector<int64_t>> parts) {
  std::vector<int64_t> out;
  for (const auto& part : parts) out.insert(out.end(), part.begin(), part.end());
  return out;
}

std::vector<int64_t> ignored(size_t n) { return std::vector<int64_t>(n, kIgnore); }

std::vector<int64_t> row_vector(const at::Tensor& t, int64_t row) {
  at::Tensor r = t[row].contiguous();
  return std::vector<int64_t>(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel());
}

/// The message of the shardtrain::Error that `fn` throws ("" if none).
template <typename Fn>
std::string data_error_of(Fn&& fn) {
  try {
    fn();
  } catch (const shardtrain::Error& e) {
    return e.what();
  }
  return "";
}

using shardtrain::testing::LogCapture;

// ---- parsing -------------------------------------------------------------------

TEST(UnitInstructionData, ParsesTheThreeRecordFormats) {
  ScratchDir dir;
  const std::string path = dir.write("mixed.jsonl",
                                     "{\"prompt\": \"Say hi\", \"response\": \"hi\"}\n"
                                     "\n"
                                     "   \r\n"
                                     "{\"text\": \"plain words\"}\n"
                                     "{\"input_ids\": [5, 6, 7], \"labels\": [-100, 6, 7]}\n"
                                     "{\"input_ids\": [8, 9]}\r\n");
  const auto records = sm::read_instruction_jsonl(path, /*vocab_size=*/260);
  ASSERT_EQ(records.size(), 4u);
  EXPECT_EQ(records[0].format, sm::RecordFormat::kInstruction);
  EXPECT_EQ(records[0].prompt, "Say hi");
  EXPECT_EQ(records[0].response, "hi");
  EXPECT_EQ(records[0].source, path + ":1");
  EXPECT_EQ(records[1].format, sm::RecordFormat::kText);
  EXPECT_EQ(records[1].text, "plain words");
  EXPECT_EQ(records[1].source, path + ":4");  // blank lines still count as lines
  EXPECT_EQ(records[2].format, sm::RecordFormat::kPretokenized);
  EXPECT_EQ(records[2].input_ids, (std::vector<int64_t>{5, 6, 7}));
  EXPECT_EQ(records[2].labels, (std::vector<int64_t>{-100, 6, 7}));
  EXPECT_EQ(records[3].format, sm::RecordFormat::kPretokenized);
  EXPECT_EQ(records[3].labels, (std::vector<int64_t>{8, 9}));  // absent labels = input_ids
  EXPECT_EQ(records[3].source, path + ":6");
}

TEST(UnitInstructionData, TextRecordsTrainOnEveryTokenAndPretokenizedAreTakenAsIs) {
  CharTokenizer tok;
  sm::InstructionRecord text;
  text.format = sm::RecordFormat::kText;
  text.text = "ab";
  const auto t = sm::tokenize_record(text, &tok, sm::ChatFormat::kLlama2);
  EXPECT_EQ(t.input_ids, cat({{1}, chars(" ab"), {2}}));
  // Every token but BOS (which nothing predicts) is a target, EOS included.
  EXPECT_EQ(t.labels, cat({{kIgnore}, chars(" ab"), {2}}));

  sm::InstructionRecord pre;
  pre.format = sm::RecordFormat::kPretokenized;
  pre.input_ids = {9, 8, 7};
  pre.labels = {kIgnore, 8, 7};
  // No tokenizer needed, no BOS/EOS added.
  const auto p = sm::tokenize_record(pre, nullptr, sm::ChatFormat::kLlama2);
  EXPECT_EQ(p.input_ids, pre.input_ids);
  EXPECT_EQ(p.labels, pre.labels);
}

// ---- chat templates --------------------------------------------------------------

TEST(UnitInstructionTemplate, Llama2StripsAndMatchesTheHfTemplate) {
  CharTokenizer tok;
  // `<s>[INST] {prompt.strip()} [/INST] {response.strip()} </s>`: the prompt
  // part is encode("[INST] What? [/INST]") (dummy prefix first), the response
  // part encode("Four ") whose dummy prefix is the space after [/INST].
  const auto ex = sm::format_instruction(tok, sm::ChatFormat::kLlama2, "  What?\n", "\tFour \n");
  const auto prompt_part = cat({{1}, chars(" [INST] What? [/INST]")});
  const auto response_part = cat({chars(" Four "), {2}});
  EXPECT_EQ(ex.input_ids, cat({prompt_part, response_part}));
  // Loss only on the response and EOS.
  EXPECT_EQ(ex.labels, cat({ignored(prompt_part.size()), response_part}));
  EXPECT_EQ(tok.decode(ex.input_ids), " [INST] What? [/INST] Four ");
}

TEST(UnitInstructionTemplate, StripRemovesWhatPythonsStrStripRemoves) {
  // The Llama-2 template's strip() is Python's: Unicode spaces go too.
  EXPECT_EQ(sm::strip("\u3000\u00a0 hi\u2028x \u0085\x1f"), "hi\u2028x");
  EXPECT_EQ(sm::strip("\u2000\u200a\u202f\u205f\u1680\u2029"), "");
  EXPECT_EQ(sm::strip("\t\u00e9\u00a0"), "\u00e9");  // a letter of two bytes ends the text
  EXPECT_EQ(sm::strip("\u200b a"), "\u200b a");       // a zero-width space is no space to Python
  // Ill-formed bytes are kept, whitespace or not around them.
  EXPECT_EQ(sm::strip(" \xff a \xe3"), "\xff a \xe3");
  EXPECT_EQ(sm::strip("\x80\u3000"), "\x80");
  // Overlong spaces are no spaces (the literals are split so that "a" does not extend the hex escape).
  EXPECT_EQ(sm::strip("\xc0\xa0" "a" "\xe0\x80\xa0"), "\xc0\xa0" "a" "\xe0\x80\xa0");
  CharTokenizer tok;
  const auto plain = sm::format_instruction(tok, sm::ChatFormat::kLlama2, "What?", "Four");
  EXPECT_EQ(sm::format_instruction(tok, sm::ChatFormat::kLlama2, "\u3000What?\u00a0", "Four\u3000").input_ids,
            plain.input_ids);
}

TEST(UnitInstructionTemplate, MistralKeepsWhitespaceAndMatchesTheV01Template) {
  CharTokenizer tok;
  // `<s>[INST] {prompt} [/INST]{response}</s>`, no strip; the response's first
  // id is the dummy-prefix space (see the header on why).
  const auto ex = sm::format_instruction(tok, sm::ChatFormat::kMistral, " hi ", "yo");
  const auto prompt_part = cat({{1}, chars(" [INST]  hi  [/INST]")});
  const auto response_part = cat({chars(" yo"), {2}});
  EXPECT_EQ(ex.input_ids, cat({prompt_part, response_part}));
  EXPECT_EQ(ex.labels, cat({ignored(prompt_part.size()), response_part}));
}

TEST(UnitInstructionTemplate, NoneFormatIsBosPromptResponseEos) {
  CharTokenizer tok;
  const auto ex = sm::format_instruction(tok, sm::ChatFormat::kNone, "Q", "A");
  EXPECT_EQ(ex.input_ids, cat({{1}, chars(" Q"), chars(" A"), {2}}));
  EXPECT_EQ(ex.labels, cat({ignored(3), chars(" A"), {2}}));

  // A tokenizer without BOS/EOS: nothing is inserted; chat formats refuse it.
  CharTokenizer bare(/*bos=*/-1, /*eos=*/-1, /*pad=*/-1);
  const auto plain = sm::format_instruction(bare, sm::ChatFormat::kNone, "Q", "A");
  EXPECT_EQ(plain.input_ids, cat({chars(" Q"), chars(" A")}));
  EXPECT_EQ(plain.labels, cat({ignored(2), chars(" A")}));
  const std::string message =
      data_error_of([&] { sm::format_instruction(bare, sm::ChatFormat::kLlama2, "Q", "A"); });
  EXPECT_NE(message.find("chat format 'llama2' needs BOS and EOS ids"), std::string::npos) << message;
  EXPECT_NE(message.find("use chat format 'none'"), std::string::npos) << message;
}

TEST(UnitInstructionTemplate, FormatPromptIsExactlyTheTrainingPrefix) {
  CharTokenizer tok;
  for (auto format : {sm::ChatFormat::kNone, sm::ChatFormat::kLlama2, sm::ChatFormat::kMistral}) {
    const std::string prompt = " Name a colour. ";
    const auto prefix = sm::format_prompt(tok, format, prompt);
    const auto ex = sm::format_instruction(tok, format, prompt, " Red");
    ASSERT_LT(prefix.size(), ex.input_ids.size()) << sm::chat_format_name(format);
    // Generation continues from the prefix the model was trained on...
    EXPECT_TRUE(std::equal(prefix.begin(), prefix.end(), ex.input_ids.begin())) << sm::chat_format_name(format);
    // ...and that prefix is exactly the masked part.
    const auto first_trained = std::find_if(ex.labels.begin(), ex.labels.end(), [](int64_t l) { return l != kIgnore; });
    EXPECT_EQ(static_cast<size_t>(first_trained - ex.labels.begin()), prefix.size()) << sm::chat_format_name(format);
    EXPECT_TRUE(std::all_of(first_trained, ex.labels.end(), [](int64_t l) { return l != kIgnore; }));
  }
  EXPECT_EQ(sm::parse_chat_format("llama-2"), sm::ChatFormat::kLlama2);
  EXPECT_EQ(sm::parse_chat_format("plain"), sm::ChatFormat::kNone);
  EXPECT_THROW(sm::parse_chat_format("chatml"), shardtrain::ConfigError);
}

// ---- malformed input ---------------------------------------------------------------

TEST(UnitInstructionData, MalformedRecordsNameFileLineAndProblem) {
  struct Case {
    std::string line;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"{\"prompt\": \"a\", \"response\": ", "not valid JSON"},
      {"[1, 2]", "each line must be a JSON object, got array"},
      {"{}", "empty record"},
      {"{\"prompt\": \"a\"}", "missing field \"response\""},
      {"{\"response\": \"a\"}", "missing field \"prompt\""},
      {"{\"labels\": [1]}", "missing field \"input_ids\""},
      {"{\"prompt\": \"a\", \"respone\": \"b\"}", "unknown field \"respone\" (did you mean \"response\"?)"},
      {"{\"input_ids\": [1], \"label\": [1]}", "unknown field \"label\" (did you mean \"labels\"?)"},
      {"{\"txt\": \"a\"}", "unknown field \"txt\" (did you mean \"text\"?)"},
      {"{\"instruction\": \"a\", \"output\": \"b\"}", "no field this reads (found instruction, output)"},
      {"{\"text\": \"a\", \"prompt\": \"b\", \"response\": \"c\"}", "mixes the fields of different formats"},
      {"{\"text\": 5}", "field \"text\" must be a string, got integer"},
      {"{\"prompt\": \"a\", \"response\": null}", "field \"response\" must be a string, got null"},
      {"{\"input_ids\": \"1 2\"}", "field \"input_ids\" must be an array of integers, got string"},
      {"{\"input_ids\": [1, 2.5]}", "input_ids[1] must be an integer, got number with a fraction"},
      {"{\"input_ids\": [1, true]}", "input_ids[1] must be an integer, got boolean"},
      {"{\"input_ids\": []}", "\"input_ids\" is empty"},
      {"{\"input_ids\": [1, 2], \"labels\": [1]}", "\"labels\" has 1 entries but \"input_ids\" has 2"},
  };
  ScratchDir dir;
  for (const Case& c : cases) {
    // The bad record is on line 3, after a good record and a blank line.
    const std::string path = dir.write("bad.jsonl", "{\"text\": \"fine\"}\n\n" + c.line + "\n");
    const std::string message = data_error_of([&] { sm::read_instruction_jsonl(path); });
    EXPECT_NE(message.find(path + ":3: "), std::string::npos) << c.line << " -> " << message;
    EXPECT_NE(message.find(c.expected), std::string::npos) << c.line << " -> " << message;
  }
  const std::string missing = data_error_of([&] { sm::read_instruction_jsonl(dir.path() + "/nope.jsonl"); });
  EXPECT_NE(missing.find("cannot open instruction data file"), std::string::npos) << missing;
}

TEST(UnitInstructionData, OtherFieldsAreIgnoredAndNamedInTheSummary) {
  // As datasets and TRL drop the columns they do not use; "test" beside a
  // "text" is no slip of it, "input" none of "input_ids", "levels" none of "labels".
  ScratchDir dir;
  const std::string path = dir.write(
      "extra.jsonl",
      "{\"id\": 1, \"category\": \"qa\", \"prompt\": \"p\", \"response\": \"r\"}\n"
      "{\"text\": \"t\", \"test\": [1]}\n{\"input_ids\": [5, 6], \"input\": \"x\", \"id\": 2, \"levels\": 1}\n");
  const std::vector<sm::InstructionRecord> records = sm::read_instruction_jsonl(path);
  ASSERT_EQ(records.size(), 3u);
  EXPECT_EQ(records[0].ignored_fields, (std::vector<std::string>{"category", "id"}));
  EXPECT_EQ(records[0].prompt, "p");
  EXPECT_EQ(records[1].ignored_fields, (std::vector<std::string>{"test"}));
  EXPECT_EQ(records[2].ignored_fields, (std::vector<std::string>{"id", "input", "levels"}));
  CharTokenizer tok;
  sm::InstructionDataOptions options;
  options.seq_len = 32;
  sm::InstructionDataStats stats;
  EXPECT_EQ(sm::load_instruction_examples(path, &tok, options, &stats).size(), 3u);
  EXPECT_EQ(stats.ignored_fields, (std::vector<std::string>{"category", "id", "test", "input", "levels"}));
  EXPECT_NE(stats.summary().find("; fields ignored: category id test input levels"), std::string::npos)
      << stats.summary();
}

TEST(UnitInstructionData, RecordsNeedingATokenizerAreRejectedWithoutOne) {
  ScratchDir dir;
  const std::string path =
      dir.write("t.jsonl", "{\"input_ids\": [1, 2, 3]}\n{\"prompt\": \"p\", \"response\": \"r\"}\n");
  sm::InstructionDataOptions options;
  options.seq_len = 16;
  const std::string message = data_error_of([&] { sm::load_instruction_examples(path, nullptr, options); });
  EXPECT_NE(message.find(path + ":2: a {\"prompt\", \"response\"} record needs a tokenizer but none was given"),
            std::string::npos)
      << message;
}

TEST(UnitInstructionData, PretokenizedIdsOutsideTheVocabularyAreRejected) {
  ScratchDir dir;
  CharTokenizer tok;  // vocab_size 260
  sm::InstructionDataOptions options;
  options.seq_len = 16;
  auto load_error = [&](const std::string& line, const shardtrain::Tokenizer* tokenizer, int64_t vocab) {
    options.vocab_size = vocab;
    const std::string path = dir.write("ids.jsonl", line + "\n");
    return data_error_of([&] { sm::load_instruction_examples(path, tokenizer, options); });
  };
  // The tokenizer's vocab_size bounds the ids...
  std::string message = load_error("{\"input_ids\": [1, 260]}", &tok, 0);
  EXPECT_NE(message.find(":1: input_ids[1] = 260 is outside the vocabulary range [0, 260)"), std::string::npos)
      << message;
  // ...or options.vocab_size (e.g. the model's) when given.
  message = load_error("{\"input_ids\": [1, 100]}", nullptr, 100);
  EXPECT_NE(message.find("input_ids[1] = 100 is outside the vocabulary range [0, 100)"), std::string::npos)
      << message;
  message = load_error("{\"input_ids\": [-1, 2]}", nullptr, 0);
  EXPECT_NE(message.find("input_ids[0] = -1 is outside the vocabulary range [0, inf)"), std::string::npos)
      << message;
  // -100 means "no loss" in labels only.
  message = load_error("{\"input_ids\": [-100, 2]}", nullptr, 0);
  EXPECT_NE(message.find("input_ids[0] = -100 is outside"), std::string::npos) << message;
  message = load_error("{\"input_ids\": [1, 2], \"labels\": [-100, -5]}", &tok, 0);
  EXPECT_NE(message.find("labels[1] = -5 is outside the vocabulary range [0, 260) (labels may also be -100"),
            std::string::npos)
      << message;
  message = load_error("{\"input_ids\": [1, 2], \"labels\": [-100, 300]}", &tok, 0);
  EXPECT_NE(message.find("labels[1] = 300 is outside"), std::string::npos) << message;
  // In range, and with no known vocabulary any id >= 0 passes.
  EXPECT_EQ(load_error("{\"input_ids\": [0, 259], \"labels\": [-100, 259]}", &tok, 0), "");
  EXPECT_EQ(load_error("{\"input_ids\": [0, 100000]}", nullptr, 0), "");
}

// ---- truncation and statistics ---------------------------------------------------------

TEST(UnitInstructionData, DropPolicySkipsAndCountsLongExamples) {
  ScratchDir dir;
  CharTokenizer tok;
  // Lengths with format none: bos + " p" + " rr..." + eos.
  const std::string path = dir.write("d.jsonl",
                                     "{\"prompt\": \"p\", \"response\": \"r\"}\n"             // 6 tokens
                                     "{\"prompt\": \"p\", \"response\": \"rrrrrrrrrr\"}\n"    // 15 tokens
                                     "{\"text\": \"t\"}\n"                                     // 4 tokens
                                     "{\"input_ids\": [5, 6], \"labels\": [-100, -100]}\n");  // no loss
  sm::InstructionDataOptions options;
  options.seq_len = 10;
  sm::InstructionDataStats stats;
  std::vector<sm::TokenizedExample> examples;
  std::string log;
  {
    LogCapture capture;
    examples = sm::load_instruction_examples(path, &tok, options, &stats);
    log = capture.text();
  }
  ASSERT_EQ(examples.size(), 2u);
  EXPECT_EQ(examples[0].input_ids.size(), 6u);
  EXPECT_EQ(examples[1].input_ids.size(), 4u);
  EXPECT_EQ(stats.records, 4);
  EXPECT_EQ(stats.instruction_records, 2);
  EXPECT_EQ(stats.text_records, 1);
  EXPECT_EQ(stats.pretokenized_records, 1);
  EXPECT_EQ(stats.examples, 2);
  EXPECT_EQ(stats.tokens, 10);
  EXPECT_EQ(stats.dropped_too_long, 1);
  EXPECT_EQ(stats.dropped_no_loss, 1);
  EXPECT_EQ(stats.truncated, 0);
  EXPECT_EQ(stats.longest, 15);
  if (shardtrain::logger().should_log(spdlog::level::warn)) {
    EXPECT_NE(log.find("dropped 1 of 4 records longer than seq_len 10 (longest 15 tokens; first: " + path + ":2)"),
              std::string::npos)
        << log;
    EXPECT_NE(log.find("dropped 1 records without any trained token"), std::string::npos) << log;
    // The fix it names exists where the user runs: llama_finetune has --truncation.
    EXPECT_NE(log.find("llama_finetune --truncation truncate"), std::string::npos) << log;
  }
}

TEST(UnitInstructionData, TruncatePolicyKeepsThePromptAndCutsTheResponse) {
  ScratchDir dir;
  CharTokenizer tok;
  const std::string path = dir.write("t.jsonl",
                                     "{\"prompt\": \"pp\", \"response\": \"abcdefgh\"}\n"  // 1+3+9+1 = 14
                                     "{\"prompt\": \"ppppppppppp\", \"response\": \"a\"}\n"  // prompt part 13 > 10
                                     "{\"text\": \"abcdefghijkl\"}\n");                      // 1+13+1 = 15
  sm::InstructionDataOptions options;
  options.seq_len = 10;
  options.truncation = sm::TruncationPolicy::kTruncate;
  sm::InstructionDataStats stats;
  const auto examples = sm::load_instruction_examples(path, &tok, options, &stats);
  ASSERT_EQ(examples.size(), 2u);
  // Whole prompt, then the first response tokens; no EOS (the answer was cut).
  EXPECT_EQ(examples[0].input_ids, cat({{1}, chars(" pp"), chars(" abcde")}));
  EXPECT_EQ(examples[0].labels, cat({ignored(4), chars(" abcde")}));
  EXPECT_EQ(examples[1].input_ids, cat({{1}, chars(" abcdefgh")}));
  EXPECT_EQ(stats.truncated, 2);
  // The prompt alone fills seq_len: no response token would be trained.
  EXPECT_EQ(stats.dropped_too_long, 1);
  EXPECT_EQ(stats.examples, 2);
  EXPECT_EQ(stats.tokens, 20);
  EXPECT_EQ(sm::parse_truncation_policy("truncate"), sm::TruncationPolicy::kTruncate);
  EXPECT_THROW(sm::parse_truncation_policy("cut"), shardtrain::ConfigError);
}

// ---- packing -------------------------------------------------------------------

std::vector<sm::TokenizedExample> examples_of_lengths(const std::vector<int64_t>& lengths) {
  // Example e has ids 10*(e+1) + k and labels equal to the ids except -100 at
  // k == 1 (a "prompt" token). The first label is *not* -100, so the rows show
  // that packing masks each document's first token itself.
  std::vector<sm::TokenizedExample> examples;
  for (size_t e = 0; e < lengths.size(); ++e) {
    sm::TokenizedExample ex;
    for (int64_t k = 0; k < lengths[e]; ++k) {
      ex.input_ids.push_back(10 * static_cast<int64_t>(e + 1) + k);
      ex.labels.push_back(k == 1 ? kIgnore : ex.input_ids.back());
    }
    examples.push_back(ex);
  }
  return examples;
}

TEST(UnitInstructionPacking, NextFitInOrderWithDocumentIdsAndMasks) {
  // seq_len 10: [5 + 4] [3 + 6] [2] -- 3 does not fit after 5 + 4, so the row closes.
  const auto examples = examples_of_lengths({5, 4, 3, 6, 2});
  sm::InstructionDataStats stats;
  const auto rows = sm::pack_examples(examples, /*seq_len=*/10, /*pad_id=*/7, /*packing=*/true, &stats);
  ASSERT_EQ(rows.num_rows(), 3);
  ASSERT_EQ(rows.input_ids.sizes(), (at::IntArrayRef{3, 10}));
  EXPECT_EQ(rows.input_ids.scalar_type(), at::kLong);
  EXPECT_EQ(rows.labels.scalar_type(), at::kLong);
  EXPECT_EQ(rows.document_ids.scalar_type(), at::kLong);

  EXPECT_EQ(row_vector(rows.input_ids, 0), (std::vector<int64_t>{10, 11, 12, 13, 14, 20, 21, 22, 23, 7}));
  EXPECT_EQ(row_vector(rows.document_ids, 0), (std::vector<int64_t>{0, 0, 0, 0, 0, 1, 1, 1, 1, 2}));
  EXPECT_EQ(row_vector(rows.labels, 0),
            (std::vector<int64_t>{kIgnore, kIgnore, 12, 13, 14, kIgnore, kIgnore, 22, 23, kIgnore}));
  EXPECT_EQ(row_vector(rows.input_ids, 2), (std::vector<int64_t>{50, 51, 7, 7, 7, 7, 7, 7, 7, 7}));
  EXPECT_EQ(row_vector(rows.document_ids, 2), (std::vector<int64_t>{0, 0, 1, 1, 1, 1, 1, 1, 1, 1}));

  // Walk every row by document: each document is one whole example, in order
  // (nothing split across rows); its first label is -100 and the rest are the
  // example's labels; everything after the documents is padding.
  size_t next = 0;
  for (int64_t r = 0; r < rows.num_rows(); ++r) {
    const auto ids = row_vector(rows.input_ids, r), labels = row_vector(rows.labels, r),
               docs = row_vector(rows.document_ids, r);
    size_t pos = 0;
    int64_t doc = 0;
    while (pos < ids.size() && next < examples.size()) {
      const auto& ex = examples[next];
      if (pos + ex.input_ids.size() > ids.size() || docs[pos] != doc || ids[pos] != ex.input_ids[0]) break;
      for (size_t k = 0; k < ex.input_ids.size(); ++k) {
        EXPECT_EQ(ids[pos + k], ex.input_ids[k]);
        EXPECT_EQ(docs[pos + k], doc);
        EXPECT_EQ(labels[pos + k], k == 0 ? kIgnore : ex.labels[k]);
      }
      pos += ex.input_ids.size();
      ++doc;
      ++next;
    }
    ASSERT_GT(doc, 0) << "row " << r << " holds no complete example";
    for (; pos < ids.size(); ++pos) {
      EXPECT_EQ(ids[pos], 7) << "row " << r << " pos " << pos;
      EXPECT_EQ(labels[pos], kIgnore);
      EXPECT_EQ(docs[pos], doc);  // padding: a document id of its own
    }
  }
  EXPECT_EQ(next, examples.size());
  EXPECT_EQ(stats.rows, 3);
  EXPECT_EQ(stats.padding_tokens, 1 + 1 + 8);
  EXPECT_EQ(stats.loss_tokens, 3 + 2 + 1 + 4 + 0);
}

TEST(UnitInstructionPacking, WithoutPackingEachExampleGetsItsOwnPaddedRow) {
  const auto examples = examples_of_lengths({5, 4, 6});
  const auto rows = sm::pack_examples(examples, /*seq_len=*/6, /*pad_id=*/0, /*packing=*/false);
  ASSERT_EQ(rows.num_rows(), 3);
  EXPECT_EQ(row_vector(rows.input_ids, 1), (std::vector<int64_t>{20, 21, 22, 23, 0, 0}));
  EXPECT_EQ(row_vector(rows.labels, 1), (std::vector<int64_t>{kIgnore, kIgnore, 22, 23, kIgnore, kIgnore}));
  EXPECT_EQ(row_vector(rows.document_ids, 1), (std::vector<int64_t>{0, 0, 0, 0, 1, 1}));
  EXPECT_EQ(row_vector(rows.document_ids, 2), (std::vector<int64_t>{0, 0, 0, 0, 0, 0}));  // full row, no padding
  // An example longer than seq_len is the loader's job, not something to split here.
  const std::string message = data_error_of([&] { sm::pack_examples(examples, 5, 0, true); });
  EXPECT_NE(message.find("example 2 has 6 tokens, more than seq_len 5"), std::string::npos) << message;
}

TEST(UnitInstructionPacking, PadIdFallsBackFromPadToEosToZero) {
  CharTokenizer with_pad(1, 2, 0), eos_only(1, 2, -1), neither(-1, -1, -1);
  EXPECT_EQ(sm::default_pad_id(&with_pad), 0);
  EXPECT_EQ(sm::default_pad_id(&eos_only), 2);
  EXPECT_EQ(sm::default_pad_id(&neither), 0);
  EXPECT_EQ(sm::default_pad_id(nullptr), 0);
}

TEST(UnitInstructionPacking, MakeBatchStacksTheChosenRows) {
  const auto rows = sm::pack_examples(examples_of_lengths({5, 4, 3, 6, 2}), 10, 7);
  const auto batch = sm::make_batch(rows, {2, 0, 2});
  ASSERT_EQ(batch.input_ids.sizes(), (at::IntArrayRef{3, 10}));
  ASSERT_EQ(batch.labels.sizes(), (at::IntArrayRef{3, 10}));
  ASSERT_EQ(batch.document_ids.sizes(), (at::IntArrayRef{3, 10}));
  for (int64_t b = 0; b < 3; ++b) {
    const int64_t r = std::vector<int64_t>{2, 0, 2}[b];
    EXPECT_EQ(row_vector(batch.input_ids, b), row_vector(rows.input_ids, r));
    EXPECT_EQ(row_vector(batch.labels, b), row_vector(rows.labels, r));
    EXPECT_EQ(row_vector(batch.document_ids, b), row_vector(rows.document_ids, r));
  }
  std::string message = data_error_of([&] { sm::make_batch(rows, {0, 3}); });
  EXPECT_NE(message.find("row index 3 (entry 1) is outside [0, 3)"), std::string::npos) << message;
  message = data_error_of([&] { sm::make_batch(rows, {}); });
  EXPECT_NE(message.find("no row indices"), std::string::npos) << message;
}

// ---- with the model --------------------------------------------------------------

TEST(UnitInstructionPacking, PackedLossEqualsTokenWeightedPerDocumentLosses) {
  ScratchDir dir;
  CharTokenizer tok;
  const std::string path = dir.write("train.jsonl",
                                     "{\"prompt\": \"2+2?\", \"response\": \"4\"}\n"
                                     "{\"prompt\": \"Capital of France?\", \"response\": \"Paris.\"}\n"
                                     "{\"text\": \"hello world\"}\n"
                                     "{\"input_ids\": [40, 41, 42, 43, 44], \"labels\": [-100, -100, 42, 43, 44]}\n"
                                     "{\"prompt\": \"Colour of the sky?\", \"response\": \"Blue, mostly.\"}\n"
                                     // Labels default to the ids: the first label is a real id here,
                                     // which packing must mask (it would be predicted from the EOS
                                     // before it, in the middle of the last row).
                                     "{\"input_ids\": [50, 51, 52, 53]}\n");
  sm::InstructionDataOptions options;
  options.chat_format = sm::ChatFormat::kLlama2;
  options.seq_len = 64;
  const auto examples = sm::load_instruction_examples(path, &tok, options);
  ASSERT_EQ(examples.size(), 6u);
  sm::InstructionDataStats stats;
  const auto rows = sm::pack_examples(examples, options.seq_len, sm::default_pad_id(&tok), true, &stats);
  ASSERT_GE(rows.num_rows(), 2);  // several rows, some with several documents and padding
  ASSERT_LT(rows.num_rows(), 6);
  ASSERT_GT(stats.padding_tokens, 0);

  sm::LlamaConfig config;
  config.vocab_size = tok.vocab_size();
  config.hidden_size = 32;
  config.intermediate_size = 64;
  config.num_hidden_layers = 2;
  config.num_attention_heads = 4;
  config.num_key_value_heads = 2;
  config.max_position_embeddings = 64;
  // A larger init than HF's 0.02 so the logits (and losses) differ clearly
  // between contexts; with near-uniform logits every variant would agree.
  config.initializer_range = 0.5;
  torch::manual_seed(0);
  sm::LlamaForCausalLM model(config);
  model->eval();
  // fp64: the packed and the separate forwards differ only in summation
  // order there, far below what a masking error moves (fp64_loss_tolerance).
  model->to(at::kDouble);
  torch::NoGradGuard no_grad;

  // Each document on its own: mean loss and the number of targets it has.
  double weighted = 0.0;
  int64_t targets = 0;
  for (const auto& ex : examples) {
    const int64_t n = static_cast<int64_t>(ex.input_ids.size());
    at::Tensor ids = at::tensor(ex.input_ids, at::kLong).view({1, n});
    at::Tensor labels = at::tensor(ex.labels, at::kLong).view({1, n});
    const int64_t count = (labels.slice(1, 1) != kIgnore).sum().item<int64_t>();
    ASSERT_GT(count, 0);
    weighted += sm::causal_lm_loss(model->forward(ids), labels).item<double>() * count;
    targets += count;
  }
  weighted /= targets;
  EXPECT_EQ(targets, stats.loss_tokens);

  std::vector<int64_t> all_rows(rows.num_rows());
  for (int64_t r = 0; r < rows.num_rows(); ++r) all_rows[r] = r;
  const auto batch = sm::make_batch(rows, all_rows);
  at::Tensor logits = model->forward(batch.input_ids, {}, batch.document_ids);
  const double packed = sm::causal_lm_loss(logits, batch.labels).item<double>();
  const double max_logit = logits.abs().max().item<double>();
  EXPECT_NEAR(packed, weighted,
              shardtrain::testing::fp64_loss_tolerance(config, options.seq_len, max_logit, weighted, targets));

  // Controls: the equality depends on document_ids and on the first-token
  // masks. Without document_ids, later documents see earlier ones (and other
  // positions); with a document's first label unmasked, a cross-document
  // prediction enters the loss. Either changes the loss.
  const double no_docs =
      sm::causal_lm_loss(model->forward(batch.input_ids), batch.labels).item<double>();
  EXPECT_GT(std::abs(no_docs - weighted), 1e-3);
  at::Tensor leaky = batch.labels.clone();
  bool unmasked = false;
  for (int64_t r = 0; r < leaky.size(0) && !unmasked; ++r) {
    for (int64_t t = 1; t < leaky.size(1); ++t) {
      const bool starts_doc = batch.document_ids[r][t].item<int64_t>() != batch.document_ids[r][t - 1].item<int64_t>();
      if (starts_doc && batch.input_ids[r][t].item<int64_t>() != sm::default_pad_id(&tok)) {
        leaky[r][t] = batch.input_ids[r][t];
        unmasked = true;
        break;
      }
    }
  }
  ASSERT_TRUE(unmasked) << "no row holds two documents";
  const double with_leak = sm::causal_lm_loss(logits, leaky).item<double>();
  EXPECT_GT(std::abs(with_leak - weighted), 1e-3);
}

TEST(UnitInstructionPacking, BuildRowsEndToEnd) {
  ScratchDir dir;
  CharTokenizer tok(1, 2, -1);  // no pad id: padding uses EOS
  const std::string path = dir.write("e.jsonl",
                                     "{\"prompt\": \"a\", \"response\": \"b\"}\n"
                                     "{\"prompt\": \"c\", \"response\": \"d\"}\n");
  sm::InstructionDataOptions options;
  options.chat_format = sm::ChatFormat::kMistral;
  options.seq_len = 48;
  sm::InstructionDataStats stats;
  const auto rows = sm::build_instruction_rows(path, &tok, options, &stats);
  ASSERT_EQ(rows.num_rows(), 1);  // 2 x 21 tokens packed into one row
  const auto ex0 = sm::format_instruction(tok, sm::ChatFormat::kMistral, "a", "b");
  const auto ex1 = sm::format_instruction(tok, sm::ChatFormat::kMistral, "c", "d");
  auto first_masked = [](std::vector<int64_t> labels) {
    labels[0] = kIgnore;
    return labels;
  };
  EXPECT_EQ(row_vector(rows.input_ids, 0), cat({ex0.input_ids, ex1.input_ids, {2, 2, 2, 2, 2, 2}}));
  EXPECT_EQ(row_vector(rows.labels, 0), cat({first_masked(ex0.labels), first_masked(ex1.labels), ignored(6)}));
  EXPECT_EQ(stats.rows, 1);
  EXPECT_EQ(stats.padding_tokens, 6);
  EXPECT_EQ(stats.loss_tokens, 2 * 3);  // " b" + EOS, twice
  EXPECT_NE(stats.summary().find("2 records (2 prompt/response, 0 text, 0 pre-tokenized) -> 2 examples"),
            std::string::npos)
      << stats.summary();

  // A file without usable examples is an error, not an empty dataset.
  const std::string empty = dir.write("empty.jsonl", "\n\n");
  const std::string message = data_error_of([&] { sm::build_instruction_rows(empty, &tok, options); });
  EXPECT_NE(message.find("no usable examples"), std::string::npos) << message;
}

}  // namespace
