// Instruction data for fine-tuning: JSONL records, chat formats, tokenising
// with the prompt masked out of the loss, truncation and packing into rows
// (instruction_data.h).
#include "shardtrain/models/instruction_data.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "config/config_tree.h"
#include "json_depth.h"
#include "shardtrain/device.h"
#include "shardtrain/error.h"
#include "shardtrain/logging.h"

namespace shardtrain::models {

using json = nlohmann::json;

// ---- names -------------------------------------------------------------------

ChatFormat parse_chat_format(const std::string& name) {
  if (name == "none" || name == "plain") return ChatFormat::kNone;
  if (name == "llama2" || name == "llama-2") return ChatFormat::kLlama2;
  if (name == "mistral") return ChatFormat::kMistral;
  ST_THROW(ConfigError, "unknown chat format '", name, "'; use one of: none, llama2, mistral");
}

std::string chat_format_name(ChatFormat format) {
  switch (format) {
    case ChatFormat::kNone:
      return "none";
    case ChatFormat::kLlama2:
      return "llama2";
    case ChatFormat::kMistral:
      return "mistral";
  }
  return "?";
}

TruncationPolicy parse_truncation_policy(const std::string& name) {
  if (name == "drop") return TruncationPolicy::kDrop;
  if (name == "truncate") return TruncationPolicy::kTruncate;
  ST_THROW(ConfigError, "unknown truncation policy '", name, "'; use drop or truncate");
}

std::string InstructionDataStats::summary() const {
  std::ostringstream out;
  out << records << " records (" << instruction_records << " prompt/response, " << text_records << " text, "
      << pretokenized_records << " pre-tokenized) -> " << examples << " examples, " << tokens << " tokens";
  if (truncated > 0) out << ", " << truncated << " truncated";
  if (dropped_too_long > 0) out << ", " << dropped_too_long << " dropped as too long";
  if (dropped_no_loss > 0) out << ", " << dropped_no_loss << " dropped without trained tokens";
  if (!ignored_fields.empty()) {
    out << "; fields ignored:";
    for (const std::string& field : ignored_fields) out << " " << field;
  }
  if (rows > 0) {
    out << "; " << rows << " rows, " << padding_tokens << " padding tokens, " << loss_tokens << " loss tokens";
  }
  return out.str();
}

int64_t default_pad_id(const Tokenizer* tokenizer) {
  if (tokenizer == nullptr) return 0;
  if (tokenizer->pad_id() >= 0) return tokenizer->pad_id();
  if (tokenizer->eos_id() >= 0) return tokenizer->eos_id();
  return 0;
}

// ---- reading -----------------------------------------------------------------

namespace {

void add_once(std::vector<std::string>& names, const std::string& name) {
  if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
}

const char* json_type_name(const json& value) {
  if (value.is_number_integer()) return "integer";
  if (value.is_number_float()) return "number with a fraction";
  return value.type_name();
}

std::string string_field(const json& object, const char* key, const std::string& where) {
  const json& value = object.at(key);
  if (!value.is_string()) {
    ST_THROW(Error, where, ": field \"", key, "\" must be a string, got ", json_type_name(value));
  }
  return value.get<std::string>();
}

/// An array of integers; `allow_ignore` admits -100 (labels). ids must be >= 0
/// and, when vocab_size > 0, < vocab_size.
std::vector<int64_t> id_array_field(const json& object, const char* key, const std::string& where,
                                    int64_t vocab_size, bool allow_ignore) {
  const json& value = object.at(key);
  if (!value.is_array()) {
    ST_THROW(Error, where, ": field \"", key, "\" must be an array of integers, got ", json_type_name(value));
  }
  std::vector<int64_t> ids;
  ids.reserve(value.size());
  for (size_t i = 0; i < value.size(); ++i) {
    const json& item = value[i];
    // is_number_integer() is false for 3.0 and for booleans: a float id is a
    // sign of a broken export, not something to round silently.
    if (!item.is_number_integer()) {
      ST_THROW(Error, where, ": ", key, "[", i, "] must be an integer, got ", json_type_name(item));
    }
    int64_t id = 0;
    if (item.is_number_unsigned()) {
      const auto u = item.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) {
        ST_THROW(Error, where, ": ", key, "[", i, "] = ", u, " is out of range");
      }
      id = static_cast<int64_t>(u);
    } else {
      id = item.get<int64_t>();
    }
    if (allow_ignore && id == kIgnoreIndex) {
      ids.push_back(id);
      continue;
    }
    if (id < 0 || (vocab_size > 0 && id >= vocab_size)) {
      std::ostringstream range;
      range << "[0, " << (vocab_size > 0 ? std::to_string(vocab_size) : std::string("inf")) << ")";
      ST_THROW(Error, where, ": ", key, "[", i, "] = ", id, " is outside the vocabulary range ", range.str(),
               allow_ignore ? " (labels may also be -100 for no loss)" : "",
               "; the ids must come from the same tokenizer as the model");
    }
    ids.push_back(id);
  }
  return ids;
}

InstructionRecord parse_record(const json& object, const std::string& where, int64_t vocab_size) {
  if (!object.is_object()) {
    ST_THROW(Error, where, ": each line must be a JSON object, got ", json_type_name(object));
  }
  const bool has_prompt = object.contains("prompt");
  const bool has_response = object.contains("response");
  const bool has_text = object.contains("text");
  const bool has_ids = object.contains("input_ids");
  const bool has_labels = object.contains("labels");
  // Other fields (an id, a category) are ignored, as datasets and TRL drop
  // the columns they do not use; one a slip away from a field of the
  // record's format that the record lacks ("respone", "label") is refused,
  // since ignoring it would train on something else than meant.
  static const std::vector<std::string> kFields = {"prompt", "response", "text", "input_ids", "labels"};
  const std::vector<std::string> format_fields =
      has_prompt || has_response ? std::vector<std::string>{"prompt", "response"}
      : has_text                 ? std::vector<std::string>{"text"}
      : has_ids || has_labels    ? std::vector<std::string>{"input_ids", "labels"}
                                 : kFields;
  std::vector<std::string> ignored;
  for (const auto& item : object.items()) {
    const std::string& key = item.key();
    if (std::find(kFields.begin(), kFields.end(), key) != kFields.end()) continue;
    // One slip in a short name, two from eight letters on: "levels" is no "labels".
    const std::size_t slips = key.size() >= 8 ? 2 : 1;
    for (const std::string& field : format_fields) {
      if (!object.contains(field) && config_detail::edit_distance(key, field) <= slips) {
        ST_THROW(Error, where, ": unknown field \"", key, "\" (did you mean \"", field,
                 "\"?); a record is {\"prompt\", \"response\"}, {\"text\"} or {\"input_ids\", \"labels\" "
                 "(optional)}, and other fields are ignored");
      }
    }
    ignored.push_back(key);
  }
  const int formats = int(has_prompt || has_response) + int(has_text) + int(has_ids || has_labels);
  if (formats == 0) {
    std::string found;
    for (const std::string& key : ignored) found += (found.empty() ? "" : ", ") + key;
    ST_THROW(Error, where, ": ", found.empty() ? "empty record" : "no field this reads (found " + found + ")",
             "; a record is {\"prompt\", \"response\"}, {\"text\"} or {\"input_ids\", \"labels\" (optional)}",
             found.empty() ? "" : ": rename the fields, e.g. instruction and output to prompt and response");
  }
  if (formats > 1) {
    ST_THROW(Error, where,
             ": record mixes the fields of different formats (prompt/response, text, input_ids/labels); use one "
             "format per record");
  }

  InstructionRecord record;
  record.source = where;
  record.ignored_fields = std::move(ignored);
  if (has_prompt || has_response) {
    if (!has_prompt) ST_THROW(Error, where, ": missing field \"prompt\" (a \"response\" needs its \"prompt\")");
    if (!has_response) ST_THROW(Error, where, ": missing field \"response\" (a \"prompt\" needs its \"response\")");
    record.format = RecordFormat::kInstruction;
    record.prompt = string_field(object, "prompt", where);
    record.response = string_field(object, "response", where);
  } else if (has_text) {
    record.format = RecordFormat::kText;
    record.text = string_field(object, "text", where);
  } else {
    if (!has_ids) ST_THROW(Error, where, ": missing field \"input_ids\" (\"labels\" alone is not a record)");
    record.format = RecordFormat::kPretokenized;
    record.input_ids = id_array_field(object, "input_ids", where, vocab_size, /*allow_ignore=*/false);
    ST_CHECK(!record.input_ids.empty(), where, ": \"input_ids\" is empty");
    if (has_labels) {
      record.labels = id_array_field(object, "labels", where, vocab_size, /*allow_ignore=*/true);
      ST_CHECK(record.labels.size() == record.input_ids.size(), where, ": \"labels\" has ", record.labels.size(),
               " entries but \"input_ids\" has ", record.input_ids.size(), "; they must have the same length");
    } else {
      record.labels = record.input_ids;
    }
  }
  return record;
}

}  // namespace

std::vector<InstructionRecord> read_instruction_jsonl(const std::string& path, int64_t vocab_size) {
  std::ifstream in(path, std::ios::binary);
  ST_CHECK(in.good(), "cannot open instruction data file '", path, "'");
  std::vector<InstructionRecord> records;
  std::string line;
  int64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    // A UTF-8 byte-order mark (some editors write one) is not JSON.
    if (line_no == 1 && line.rfind("\xEF\xBB\xBF", 0) == 0) line.erase(0, 3);
    if (line.find_first_not_of(" \t\r\n\f\v") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(line_no);
    json object;
    try {
      object = parse_json_within_depth<Error, json>(line, where);
    } catch (const json::exception& e) {
      // parse_error for bad syntax; out_of_range for a number beyond double's range (found by tests/fuzz).
      ST_THROW(Error, where, ": not valid JSON (", e.what(), "); each line must hold one JSON object");
    }
    records.push_back(parse_record(object, where, vocab_size));
  }
  ST_CHECK(!in.bad(), "error reading instruction data file '", path, "'");
  return records;
}

// ---- formatting --------------------------------------------------------------

namespace {

/// Python's str.isspace(): what the chat templates' strip() removes.
bool is_python_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

/// The code point whose UTF-8 starts at text[at] and its length in bytes; an
/// ill-formed sequence is one byte that is no space. Hand-written: it is the
/// only decoding this file needs.
std::pair<char32_t, std::size_t> code_point_at(const std::string& text, std::size_t at) {
  const auto lead = static_cast<unsigned char>(text[at]);
  const std::size_t length = lead < 0x80           ? 1
                             : (lead >> 5) == 0x6  ? 2
                             : (lead >> 4) == 0xe  ? 3
                             : (lead >> 3) == 0x1e ? 4
                                                   : 0;
  if (length == 0 || at + length > text.size()) return {0xfffd, 1};
  char32_t c = length == 1 ? lead : lead & (0x7f >> length);
  for (std::size_t i = 1; i < length; ++i) {
    const auto next = static_cast<unsigned char>(text[at + i]);
    if ((next & 0xc0) != 0x80) return {0xfffd, 1};
    c = (c << 6) | (next & 0x3f);
  }
  // An overlong form ("\xC0\xA0" for a space) is ill-formed, as Python's decoder says.
  const char32_t shortest[] = {0, 0, 0x80, 0x800, 0x10000};
  if (c < shortest[length]) return {0xfffd, 1};
  return {c, length};
}

}  // namespace

std::string strip(const std::string& s) {
  std::size_t begin = 0, end = s.size();
  while (begin < end) {
    const auto [c, length] = code_point_at(s, begin);
    if (!is_python_space(c)) break;
    begin += length;
  }
  while (end > begin) {
    std::size_t last = end - 1;  // back over continuation bytes to the last code point's start
    while (last > begin && (static_cast<unsigned char>(s[last]) & 0xc0) == 0x80 && end - last < 4) --last;
    const auto [c, length] = code_point_at(s, last);
    if (last + length != end || !is_python_space(c)) break;
    end = last;
  }
  return s.substr(begin, end - begin);
}

namespace {

void require_special(const Tokenizer& tokenizer, ChatFormat format) {
  if (format == ChatFormat::kNone) return;
  ST_CHECK(tokenizer.bos_id() >= 0 && tokenizer.eos_id() >= 0, "chat format '", chat_format_name(format),
           "' needs BOS and EOS ids but the tokenizer defines bos_id=", tokenizer.bos_id(),
           " eos_id=", tokenizer.eos_id(), "; use chat format 'none' for this tokenizer");
}

void append(std::vector<int64_t>& out, const std::vector<int64_t>& ids) { out.insert(out.end(), ids.begin(), ids.end()); }

/// The text of the trained part (response, plus the template's trailing text).
std::string response_text(ChatFormat format, const std::string& response) {
  return format == ChatFormat::kLlama2 ? strip(response) + " " : response;
}

}  // namespace

std::vector<int64_t> format_prompt(const Tokenizer& tokenizer, ChatFormat format, const std::string& prompt) {
  require_special(tokenizer, format);
  std::vector<int64_t> ids;
  if (tokenizer.bos_id() >= 0) ids.push_back(tokenizer.bos_id());
  switch (format) {
    case ChatFormat::kNone:
      append(ids, tokenizer.encode(prompt));
      break;
    case ChatFormat::kLlama2:
      append(ids, tokenizer.encode("[INST] " + strip(prompt) + " [/INST]"));
      break;
    case ChatFormat::kMistral:
      append(ids, tokenizer.encode("[INST] " + prompt + " [/INST]"));
      break;
  }
  return ids;
}

TokenizedExample format_instruction(const Tokenizer& tokenizer, ChatFormat format, const std::string& prompt,
                                    const std::string& response) {
  TokenizedExample example;
  example.input_ids = format_prompt(tokenizer, format, prompt);
  example.labels.assign(example.input_ids.size(), kIgnoreIndex);
  std::vector<int64_t> trained = tokenizer.encode(response_text(format, response));
  if (tokenizer.eos_id() >= 0) trained.push_back(tokenizer.eos_id());
  append(example.input_ids, trained);
  append(example.labels, trained);
  return example;
}

TokenizedExample tokenize_record(const InstructionRecord& record, const Tokenizer* tokenizer, ChatFormat format) {
  if (record.format == RecordFormat::kPretokenized) {
    return TokenizedExample{record.input_ids, record.labels};
  }
  ST_CHECK(tokenizer != nullptr, record.source, ": a ",
           record.format == RecordFormat::kText ? "{\"text\"}" : "{\"prompt\", \"response\"}",
           " record needs a tokenizer but none was given; pass the model's tokenizer or pre-tokenize the data "
           "as {\"input_ids\", \"labels\"}");
  if (record.format == RecordFormat::kInstruction) {
    return format_instruction(*tokenizer, format, record.prompt, record.response);
  }
  TokenizedExample example;
  if (tokenizer->bos_id() >= 0) example.input_ids.push_back(tokenizer->bos_id());
  append(example.input_ids, tokenizer->encode(record.text));
  if (tokenizer->eos_id() >= 0) example.input_ids.push_back(tokenizer->eos_id());
  example.labels = example.input_ids;
  // BOS is never a target (nothing precedes it); mark it so explicitly.
  if (tokenizer->bos_id() >= 0) example.labels[0] = kIgnoreIndex;
  return example;
}

// ---- loading -----------------------------------------------------------------

namespace {

/// True when some label after position 0 is trained. Position 0's label never
/// reaches the loss: it is a document's first token (masked when packed) and
/// causal_lm_loss compares from position 1 on.
bool has_loss(const TokenizedExample& example) {
  return std::any_of(example.labels.begin() + std::min<size_t>(1, example.labels.size()), example.labels.end(),
                     [](int64_t label) { return label != kIgnoreIndex; });
}

}  // namespace

std::vector<TokenizedExample> load_instruction_examples(const std::string& path, const Tokenizer* tokenizer,
                                                        const InstructionDataOptions& options,
                                                        InstructionDataStats* stats) {
  ST_CHECK_T(ConfigError, options.seq_len >= 2, "instruction data: seq_len must be at least 2, got ",
             options.seq_len);
  const int64_t vocab_size =
      options.vocab_size > 0 ? options.vocab_size : (tokenizer != nullptr ? tokenizer->vocab_size() : 0);
  const std::vector<InstructionRecord> records = read_instruction_jsonl(path, vocab_size);

  InstructionDataStats local;
  std::vector<TokenizedExample> examples;
  std::vector<std::string> too_long_sources;  // the first few, for the warning
  for (const InstructionRecord& record : records) {
    ++local.records;
    for (const std::string& field : record.ignored_fields) add_once(local.ignored_fields, field);
    switch (record.format) {
      case RecordFormat::kInstruction:
        ++local.instruction_records;
        break;
      case RecordFormat::kText:
        ++local.text_records;
        break;
      case RecordFormat::kPretokenized:
        ++local.pretokenized_records;
        break;
    }
    TokenizedExample example = tokenize_record(record, tokenizer, options.chat_format);
    const int64_t length = static_cast<int64_t>(example.input_ids.size());
    ST_CHECK(length > 0, record.source, ": the tokenizer produced no tokens");
    local.longest = std::max(local.longest, length);
    bool cut = false;
    if (length > options.seq_len) {
      if (options.truncation == TruncationPolicy::kDrop) {
        ++local.dropped_too_long;
        if (too_long_sources.size() < 3) too_long_sources.push_back(record.source);
        continue;
      }
      example.input_ids.resize(options.seq_len);
      example.labels.resize(options.seq_len);
      cut = true;
    }
    if (!has_loss(example)) {
      // After a cut this means the prompt filled seq_len: too long, not empty.
      if (cut) {
        ++local.dropped_too_long;
        if (too_long_sources.size() < 3) too_long_sources.push_back(record.source);
      } else {
        ++local.dropped_no_loss;
      }
      continue;
    }
    if (cut) ++local.truncated;
    local.tokens += static_cast<int64_t>(example.input_ids.size());
    examples.push_back(std::move(example));
  }
  local.examples = static_cast<int64_t>(examples.size());

  if (local.dropped_too_long > 0) {
    std::string first;
    for (const auto& source : too_long_sources) first += (first.empty() ? "" : ", ") + source;
    ST_LOG_WARN("{}: dropped {} of {} records longer than seq_len {} (longest {} tokens; first: {}){}", path,
                local.dropped_too_long, local.records, options.seq_len, local.longest, first,
                options.truncation == TruncationPolicy::kDrop
                    ? "; raise seq_len (llama_finetune --seq-len) or truncate them (InstructionDataOptions::truncation "
                      "kTruncate, llama_finetune --truncation truncate)"
                    : " because their prompt leaves no response token within seq_len");
  }
  if (local.truncated > 0) {
    ST_LOG_WARN("{}: truncated {} of {} records to seq_len {} (their ends and EOS are not trained)", path,
                local.truncated, local.records, options.seq_len);
  }
  if (local.dropped_no_loss > 0) {
    ST_LOG_WARN("{}: dropped {} records without any trained token (all labels -100)", path, local.dropped_no_loss);
  }

  if (stats != nullptr) {
    stats->records += local.records;
    stats->instruction_records += local.instruction_records;
    stats->text_records += local.text_records;
    stats->pretokenized_records += local.pretokenized_records;
    stats->examples += local.examples;
    stats->tokens += local.tokens;
    stats->truncated += local.truncated;
    stats->dropped_too_long += local.dropped_too_long;
    stats->dropped_no_loss += local.dropped_no_loss;
    stats->longest = std::max(stats->longest, local.longest);
    for (const std::string& field : local.ignored_fields) add_once(stats->ignored_fields, field);
  }
  return examples;
}

// ---- packing -----------------------------------------------------------------

PackedRows pack_examples(const std::vector<TokenizedExample>& examples, int64_t seq_len, int64_t pad_id,
                         bool packing, InstructionDataStats* stats) {
  ST_CHECK(seq_len >= 2, "pack_examples: seq_len must be at least 2, got ", seq_len);
  ST_CHECK(pad_id >= 0, "pack_examples: pad_id must be a valid token id, got ", pad_id,
           " (default_pad_id() picks one)");

  // Assign examples to rows first (next fit, in order), then fill flat buffers.
  std::vector<std::vector<size_t>> row_members;
  int64_t used = seq_len;  // forces a new row for the first example
  for (size_t i = 0; i < examples.size(); ++i) {
    const TokenizedExample& example = examples[i];
    const int64_t length = static_cast<int64_t>(example.input_ids.size());
    ST_CHECK(length > 0 && example.labels.size() == example.input_ids.size(), "pack_examples: example ", i,
             " has ", example.input_ids.size(), " input_ids and ", example.labels.size(),
             " labels; both must be the same, non-zero length");
    ST_CHECK(length <= seq_len, "pack_examples: example ", i, " has ", length, " tokens, more than seq_len ",
             seq_len, "; load_instruction_examples() drops or truncates such examples");
    if (!packing || used + length > seq_len) {
      row_members.emplace_back();
      used = 0;
    }
    row_members.back().push_back(i);
    used += length;
  }

  const int64_t num_rows = static_cast<int64_t>(row_members.size());
  std::vector<int64_t> ids(static_cast<size_t>(num_rows * seq_len), pad_id);
  std::vector<int64_t> labels(ids.size(), kIgnoreIndex);
  std::vector<int64_t> docs(ids.size(), 0);
  int64_t padding = 0, loss_tokens = 0;
  for (int64_t r = 0; r < num_rows; ++r) {
    const size_t base = static_cast<size_t>(r * seq_len);
    size_t pos = 0;
    int64_t doc = 0;
    for (size_t member : row_members[r]) {
      const TokenizedExample& example = examples[member];
      for (size_t k = 0; k < example.input_ids.size(); ++k, ++pos) {
        ids[base + pos] = example.input_ids[k];
        // The first token would be "predicted" from the previous document's
        // last token (or, at position 0, is never compared): no loss there.
        labels[base + pos] = k == 0 ? kIgnoreIndex : example.labels[k];
        docs[base + pos] = doc;
        if (labels[base + pos] != kIgnoreIndex) ++loss_tokens;
      }
      ++doc;
    }
    // Padding: pad_id, no loss, and a document of its own so no real token
    // attends to it and it restarts positions.
    for (; pos < static_cast<size_t>(seq_len); ++pos) {
      docs[base + pos] = doc;
      ++padding;
    }
  }

  auto to_tensor = [&](std::vector<int64_t>& values) {
    if (num_rows == 0) return at::empty({0, seq_len}, at::TensorOptions().dtype(at::kLong));
    return at::from_blob(values.data(), {num_rows, seq_len}, at::TensorOptions().dtype(at::kLong)).clone();
  };
  PackedRows rows;
  rows.seq_len = seq_len;
  rows.input_ids = to_tensor(ids);
  rows.labels = to_tensor(labels);
  rows.document_ids = to_tensor(docs);
  if (stats != nullptr) {
    stats->rows += num_rows;
    stats->padding_tokens += padding;
    stats->loss_tokens += loss_tokens;
  }
  return rows;
}

PackedRows build_instruction_rows(const std::string& path, const Tokenizer* tokenizer,
                                  const InstructionDataOptions& options, InstructionDataStats* stats) {
  const std::vector<TokenizedExample> examples = load_instruction_examples(path, tokenizer, options, stats);
  ST_CHECK(!examples.empty(), path, ": no usable examples (see the warnings above); the file is empty or every ",
           "record was dropped");
  const int64_t pad_id = options.pad_id >= 0 ? options.pad_id : default_pad_id(tokenizer);
  return pack_examples(examples, options.seq_len, pad_id, options.packing, stats);
}

InstructionBatch InstructionBatch::to(const at::Device& device) const {
  return {to_device_without_waiting(input_ids, device), to_device_without_waiting(labels, device), document_ids};
}

InstructionBatch make_batch(const PackedRows& rows, const std::vector<int64_t>& row_indices) {
  ST_CHECK(!row_indices.empty(), "make_batch: no row indices");
  const int64_t n = rows.num_rows();
  for (size_t i = 0; i < row_indices.size(); ++i) {
    ST_CHECK(row_indices[i] >= 0 && row_indices[i] < n, "make_batch: row index ", row_indices[i], " (entry ", i,
             ") is outside [0, ", n, "); the sampler's dataset size must be rows.num_rows()");
  }
  at::Tensor index =
      at::tensor(at::ArrayRef<int64_t>(row_indices.data(), row_indices.size()), at::TensorOptions().dtype(at::kLong));
  return InstructionBatch{rows.input_ids.index_select(0, index), rows.labels.index_select(0, index),
                          rows.document_ids.index_select(0, index)};
}

}  // namespace shardtrain::models
