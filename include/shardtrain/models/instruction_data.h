#pragma once
/// @file models/instruction_data.h
/// Instruction-tuning data for the Llama / Mistral fine-tune examples: JSONL
/// records -> token ids with loss masks -> fixed-length (packed) rows -> batches.
///
/// Input: JSONL, one JSON object per line (blank lines are skipped). The format
/// is detected per record from its fields:
///  * {"prompt": str, "response": str}       instruction pair, formatted with a
///    ChatFormat; loss only on the response tokens and the EOS.
///  * {"text": str}                          plain text: BOS (if the tokenizer
///    has one) + encode(text) + EOS (if it has one); loss on every token.
///  * {"input_ids": [int], "labels": [int]}  pre-tokenized with any tokenizer
///    and taken as is (no BOS/EOS added); "labels" is optional (defaults to
///    input_ids), must have the same length, and uses -100 for "no loss".
/// Other fields, or fields from two formats in one record, are errors: a typo
/// ("respone") must not silently turn into a different format or lose data.
///
/// Labels are aligned with input_ids (labels[i] is the target *at* position i);
/// causal_lm_loss() does the shift (logits[:, :-1] against labels[:, 1:]).
///
/// Chat formats. Prompt and response are encoded separately (Tokenizer::encode,
/// so each part gets sentencepiece's "▁" dummy prefix) and concatenated, which
/// makes the boundary between masked prompt and trained response exact. BOS/EOS
/// are inserted as ids, never as text (text "<s>" would be split into pieces).
/// strip() below removes whitespace from both ends, as Python's str.strip().
///  * kLlama2 (Llama-2-chat's HF template
///    `<s>[INST] {prompt.strip()} [/INST] {response.strip()} </s>`):
///      [bos] + encode("[INST] " + strip(prompt) + " [/INST]")   (prompt, no loss)
///      + encode(strip(response) + " ") + [eos]                  (trained)
///    The response's dummy prefix is the template's space after "[/INST]"; the
///    trailing space before </s> is kept as in the template (and in Meta's
///    reference code, which encodes the same string).
///  * kMistral (Mistral-7B-Instruct-v0.1's template
///    `<s>[INST] {prompt} [/INST]{response}</s>`, no stripping):
///      [bos] + encode("[INST] " + prompt + " [/INST]") + encode(response) + [eos]
///    The template string has no space between "[/INST]" and the response, but a
///    separately encoded response starts with the "▁" dummy prefix; this is the
///    closest the token level permits (the Tokenizer interface has no
///    encode-without-dummy-prefix), and it is how the response is tokenized when
///    each message is encoded on its own, as Mistral's reference tokenizer does.
///  * kNone (tokenizers without a chat convention):
///      [bos if any] + encode(prompt) + encode(response) + [eos if any]
///    The response's dummy prefix separates it from the prompt.
/// format_prompt() returns exactly the masked prefix of these sequences (BOS +
/// prompt part), which is what generation must continue from.
///
/// Truncation (examples longer than seq_len):
///  * TruncationPolicy::kDrop (default): the example is skipped and counted;
///    one warning per file names the count, the longest length and the first
///    offending lines. Every trained example then keeps its EOS.
///  * TruncationPolicy::kTruncate: the first seq_len tokens are kept. For an
///    instruction pair that keeps the whole prompt and cuts the response's end
///    (and its EOS); a pair whose prompt alone leaves no response token within
///    seq_len is dropped (counted as too long) instead.
/// Examples left without any trained token after position 0 (e.g. pre-tokenized
/// records whose labels are all -100) are dropped and counted: a row or batch of
/// them would make the mean loss 0/0 = NaN.
///
/// Packing (pack_examples): examples are placed in file order; an example goes
/// into the current row if it fits in the space left, otherwise the row is
/// closed (padded) and a new one started ("next fit"). No example is ever split
/// across rows, and the result is deterministic. Within a row the documents get
/// document_ids 0, 1, 2, ... and the padding gets the next id of its own, so
/// LlamaForCausalLM::forward(input_ids, {}, document_ids) blocks attention
/// between documents and restarts positions at each. The label at each
/// document's first token is -100 (it would otherwise be predicted from the
/// previous document's last token); padding is pad_id with label -100. With
/// packing off each example gets its own row, padded the same way.

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "shardtrain/tokenizer.h"

namespace shardtrain::models {

/// Label value that causal_lm_loss() skips (its default ignore_index).
constexpr int64_t kIgnoreIndex = -100;

enum class ChatFormat { kNone, kLlama2, kMistral };
/// "none" (or "plain"), "llama2" (or "llama-2"), "mistral"; throws
/// shardtrain::ConfigError naming the accepted values otherwise.
ChatFormat parse_chat_format(const std::string& name);
/// "none", "llama2", "mistral".
std::string chat_format_name(ChatFormat format);

enum class TruncationPolicy { kDrop, kTruncate };
/// "drop" or "truncate"; throws shardtrain::ConfigError otherwise.
TruncationPolicy parse_truncation_policy(const std::string& name);

enum class RecordFormat { kInstruction, kText, kPretokenized };

/// One JSONL record as read, before tokenization.
struct InstructionRecord {
  RecordFormat format = RecordFormat::kText;
  std::string prompt, response;        ///< kInstruction
  std::string text;                    ///< kText
  std::vector<int64_t> input_ids;      ///< kPretokenized
  std::vector<int64_t> labels;         ///< kPretokenized (filled from input_ids when absent)
  std::string source;                  ///< "file:line", for messages
  std::vector<std::string> ignored_fields;  ///< the record's fields no format reads (an id, a category)
};

/// One example: input_ids and labels of equal length; labels are kIgnoreIndex
/// where there is no loss.
struct TokenizedExample {
  std::vector<int64_t> input_ids;
  std::vector<int64_t> labels;
};

/// Counts collected while loading and packing (summary() for the log).
struct InstructionDataStats {
  int64_t records = 0;               ///< non-blank lines read
  int64_t instruction_records = 0;
  int64_t text_records = 0;
  int64_t pretokenized_records = 0;
  int64_t examples = 0;              ///< examples kept
  int64_t tokens = 0;                ///< tokens in the kept examples
  int64_t truncated = 0;             ///< kept, but cut to seq_len
  int64_t dropped_too_long = 0;      ///< skipped: longer than seq_len (kDrop, or no response fits)
  int64_t dropped_no_loss = 0;       ///< skipped: no trained token after position 0
  int64_t longest = 0;               ///< longest example before truncation
  std::vector<std::string> ignored_fields;  ///< fields no format reads, in the order first met
  // Filled by pack_examples():
  int64_t rows = 0;
  int64_t padding_tokens = 0;
  int64_t loss_tokens = 0;           ///< labels != -100 in the rows (tokens the loss uses)
  std::string summary() const;
};

struct InstructionDataOptions {
  ChatFormat chat_format = ChatFormat::kNone;
  /// Row length; examples longer than this follow `truncation`. Must be >= 2.
  int64_t seq_len = 2048;
  TruncationPolicy truncation = TruncationPolicy::kDrop;
  /// Upper bound for pre-tokenized ids: when > 0 this value (e.g. the model's
  /// vocab_size), else the tokenizer's vocab_size(), else no upper bound.
  int64_t vocab_size = 0;
  /// true: several examples per row; false: one example per row.
  bool packing = true;
  /// Padding id; < 0 picks default_pad_id(tokenizer).
  int64_t pad_id = -1;
};

/// tokenizer->pad_id() when defined, else eos_id() when defined, else 0
/// (padding never reaches the loss or, through document_ids, other tokens).
int64_t default_pad_id(const Tokenizer* tokenizer);

/// Reads and validates a JSONL file (fields, types, label lengths, ids >= 0 and,
/// when vocab_size > 0, < vocab_size). Throws shardtrain::Error naming
/// "file:line" and the problem.
std::vector<InstructionRecord> read_instruction_jsonl(const std::string& path, int64_t vocab_size = 0);

/// `text` (UTF-8) without whitespace at either end, as the chat templates'
/// strip() (Python's str.strip(): ASCII whitespace and the Unicode spaces,
/// U+00A0, U+3000, ...) strips prompts and responses; also how answers are compared.
std::string strip(const std::string& text);

/// The generation prefix: [bos] + the prompt part of `format` (see the file
/// comment). Identical to the masked prefix of format_instruction().
std::vector<int64_t> format_prompt(const Tokenizer& tokenizer, ChatFormat format, const std::string& prompt);

/// One instruction pair in `format`: prompt prefix with labels -100, then the
/// response ids and EOS with labels equal to the ids.
TokenizedExample format_instruction(const Tokenizer& tokenizer, ChatFormat format, const std::string& prompt,
                                    const std::string& response);

/// Tokenizes one record (kPretokenized needs no tokenizer; the others throw
/// naming record.source when `tokenizer` is null).
TokenizedExample tokenize_record(const InstructionRecord& record, const Tokenizer* tokenizer, ChatFormat format);

/// read_instruction_jsonl + tokenize_record + the truncation policy. `stats`
/// (optional) is added to. Logs one warning per file when examples are dropped
/// or truncated.
std::vector<TokenizedExample> load_instruction_examples(const std::string& path, const Tokenizer* tokenizer,
                                                        const InstructionDataOptions& options,
                                                        InstructionDataStats* stats = nullptr);

/// Fixed-length rows, each tensor [num_rows, seq_len] int64.
struct PackedRows {
  int64_t seq_len = 0;
  at::Tensor input_ids;
  at::Tensor labels;
  at::Tensor document_ids;
  int64_t num_rows() const { return input_ids.defined() ? input_ids.size(0) : 0; }
};

/// Packs (or, with packing false, pads) examples into rows as described in the
/// file comment. Every example must be non-empty and at most seq_len long.
PackedRows pack_examples(const std::vector<TokenizedExample>& examples, int64_t seq_len, int64_t pad_id,
                         bool packing = true, InstructionDataStats* stats = nullptr);

/// load_instruction_examples + pack_examples with options.packing / pad_id.
PackedRows build_instruction_rows(const std::string& path, const Tokenizer* tokenizer,
                                  const InstructionDataOptions& options, InstructionDataStats* stats = nullptr);

/// One training batch, each tensor [B, seq_len] int64.
struct InstructionBatch {
  at::Tensor input_ids;
  at::Tensor labels;
  at::Tensor document_ids;

  /// The batch for a model on `device`: input_ids and labels there (to a
  /// GPU through pinned memory, a copy that does not wait for the work
  /// queued before it), document_ids left on the host, where the model
  /// derives the positions, the mask and the packed offsets from them
  /// without a round trip through the GPU.
  InstructionBatch to(const at::Device& device) const;
};

/// Stacks rows[row_indices[0]], rows[row_indices[1]], ... (e.g. a
/// DistributedSampler's indices) into a batch. Throws shardtrain::Error for an
/// empty list or an index outside [0, num_rows).
InstructionBatch make_batch(const PackedRows& rows, const std::vector<int64_t>& row_indices);

}  // namespace shardtrain::models
