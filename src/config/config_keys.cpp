// The reading machinery the Accelerate and DeepSpeed readers share, so that
// both check values and report keys alike: Field's value readers, Section's
// key table (unknown, not-implemented and deprecated keys), and the enum
// values both formats spell the same way.
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>

#include "config/config_keys.h"

namespace shardtrain::config_detail {

// ---------------------------------------------------------------- one value

std::optional<Node> Field::numeric() const {
  if (node.kind == Kind::kInteger || node.kind == Kind::kFloat) return node;
  if (node.kind != Kind::kString) return std::nullopt;
  const std::string& text = node.text;
  if (text.empty()) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long long integer = std::strtoll(text.c_str(), &end, 10);
  if (end == text.c_str() + text.size() && errno == 0) return Node::of(static_cast<int64_t>(integer));
  const double number = std::strtod(text.c_str(), &end);
  if (end == text.c_str() + text.size() && std::isfinite(number)) return Node::of(number);
  return std::nullopt;
}

int64_t Field::integer(const std::string& expectation) const {
  const auto value = numeric();
  if (!value) expected(expectation);
  if (value->kind == Kind::kInteger) return value->integer;
  // JSON writes 2e8 as a float; DeepSpeed takes it for an integer key.
  const double number = value->number;
  constexpr double kInt64Limit = 9.2e18;
  if (!std::isfinite(number) || std::floor(number) != number || std::fabs(number) > kInt64Limit) {
    expected(expectation);
  }
  return static_cast<int64_t>(number);
}

int64_t Field::integer_in(int64_t low, int64_t high, const std::string& expectation) const {
  const int64_t value = integer(expectation);
  if (value < low || value > high) expected(expectation);
  return value;
}

int64_t Field::integer_at_least(int64_t low, const std::string& expectation) const {
  return integer_in(low, std::numeric_limits<int64_t>::max(), expectation);
}

double Field::number(const std::string& expectation) const {
  const auto value = numeric();
  if (!value || !std::isfinite(value->number)) expected(expectation);
  return value->number;
}

double Field::number_in(double low, bool low_inclusive, double high, const std::string& expectation) const {
  const double value = number(expectation);
  if (value < low || (!low_inclusive && value == low) || value > high) expected(expectation);
  return value;
}

bool Field::boolean() const {
  if (node.kind == Kind::kBool) return node.boolean;
  // Accelerate passes settings through environment variables as "true"/"false",
  // and YAML 1.1 (PyYAML, which wrote many of these files) reads yes/no/on/off.
  if (node.kind == Kind::kString) {
    const std::string lower = lowercase(node.text);
    if (lower == "true" || lower == "yes" || lower == "on") return true;
    if (lower == "false" || lower == "no" || lower == "off") return false;
  }
  if (node.kind == Kind::kInteger && (node.integer == 0 || node.integer == 1)) return node.integer == 1;
  expected("true or false");
}

std::string Field::text() const {
  if (!node.is_scalar()) expected("a single value");
  return node.text;
}

std::vector<std::string> Field::names() const {
  std::vector<std::string> result;
  auto add = [&](const std::string& part) {
    const auto first = part.find_first_not_of(" \t");
    if (first == std::string::npos) return;
    const auto last = part.find_last_not_of(" \t");
    result.push_back(part.substr(first, last - first + 1));
  };
  if (node.kind == Kind::kList) {
    for (const auto& item : node.items) {
      if (!item.is_scalar()) expected("a comma-separated string or a list of names");
      add(item.text);
    }
    return result;
  }
  std::stringstream parts(text());
  std::string part;
  while (std::getline(parts, part, ',')) add(part);
  return result;
}

// ---------------------------------------------------------------- sections

Section& Section::on(const std::string& key, Handler handler) {
  entries_.push_back({key, Entry::kHandle, "", std::move(handler)});
  return *this;
}

Section& Section::accept(std::initializer_list<const char*> keys) {
  for (const char* key : keys) entries_.push_back({key, Entry::kAccept, "", nullptr});
  return *this;
}

Section& Section::accept_prefix(const std::string& prefix) {
  accepted_prefixes_.push_back(prefix);
  return *this;
}

Section& Section::not_implemented(std::initializer_list<const char*> keys) {
  for (const char* key : keys) entries_.push_back({key, Entry::kNotImplemented, "", nullptr});
  return *this;
}

Section& Section::deprecated(const std::string& key, const std::string& replacement, Handler handler) {
  entries_.push_back({key, Entry::kDeprecated, replacement, std::move(handler)});
  return *this;
}

void Section::read(const Node& map) {
  for (const auto& [key, value] : map.members) {
    // "_comment", "_note": JSON has no comments, so configs carry them as keys.
    if (!key.empty() && key[0] == '_') continue;
    const Entry* entry = find(key);
    Field field{source_, key_prefix_ + key, path_prefix_ + key, value};
    if (entry == nullptr) {
      if (!accepted_by_prefix(key)) report_unknown(key, value);
      continue;
    }
    // Accelerate writes `key: null` for settings it did not ask about.
    if (value.kind == Kind::kNull) continue;
    switch (entry->kind) {
      case Entry::kHandle: entry->handler(field); break;
      case Entry::kAccept: break;
      case Entry::kNotImplemented:
        // `wall_clock_breakdown: false` asks for nothing shardtrain lacks.
        if (!switched_off(value)) {
          state_.warn(field.key + " is recognised but not implemented by shardtrain; it is ignored (" +
                      field.where() + ")");
        }
        break;
      case Entry::kDeprecated:
        state_.warn(field.key + " is deprecated; use " + key_prefix_ + entry->replacement + " (" + field.where() +
                    ")");
        entry->handler(field);
        break;
    }
  }
}

bool Section::switched_off(const Node& value) {
  if (value.kind == Kind::kMap) return value.members.empty();
  if (value.kind == Kind::kBool) return !value.boolean;
  if (value.kind == Kind::kInteger) return value.integer == 0;
  if (value.kind == Kind::kString) {
    const std::string lower = lowercase(value.text);
    return lower == "false" || lower == "none" || lower == "no";
  }
  return false;
}

const Section::Entry* Section::find(const std::string& key) const {
  for (const auto& entry : entries_) {
    if (entry.key == key) return &entry;
  }
  return nullptr;
}

bool Section::accepted_by_prefix(const std::string& key) const {
  for (const auto& prefix : accepted_prefixes_) {
    if (key.rfind(prefix, 0) == 0) return true;
  }
  return false;
}

void Section::report_unknown(const std::string& key, const Node& value) {
  std::vector<std::string> known;
  for (const auto& entry : entries_) known.push_back(entry.key);
  std::string message = "unknown key '" + key_prefix_ + key + "' in " + source_;
  if (auto suggestion = nearest(key, known)) {
    message += "; did you mean '" + key_prefix_ + *suggestion + "'?";
  } else {
    message += "; it is ignored";
  }
  if (value.line > 0) message += " (line " + std::to_string(value.line) + ")";
  state_.unknown_keys.push_back(message);
  state_.warn(message);
}

void require_map(const Field& field, const std::string& example) {
  if (field.node.kind != Kind::kMap) field.expected("a mapping such as " + example);
}

// ---------------------------------------------------------------- values both formats read

OffloadDevice read_offload_device(const Field& field) {
  return choose<OffloadDevice>(
      field, {{"none", OffloadDevice::kNone}, {"cpu", OffloadDevice::kCpu}, {"nvme", OffloadDevice::kNvme}},
      {"none", "cpu", "nvme"});
}

DType read_dtype(const Field& field) {
  if (field.node.is_scalar() && field.node.kind != Kind::kNull) {
    if (auto dtype = config_detail::dtype_from_name(field.node.text)) return *dtype;
  }
  const std::vector<std::string> canonical = {"fp32", "bf16", "fp16"};
  std::string message = field.key + ": " + describe(field.node) +
                        " is not one of fp32, bf16, fp16 (also float32, bfloat16, float16)";
  if (field.node.is_scalar()) {
    if (auto suggestion = nearest(field.node.text, canonical)) message += " (did you mean " + *suggestion + "?)";
  }
  field.fail(message);
}

void refuse_parallelism(const Field& f, int64_t size, const std::string& kind, const std::string& fix) {
  if (size > 1) {
    f.fail(f.key + ": " + std::to_string(size) + " asks for " + kind +
           ", which shardtrain recognises but does not implement; " + fix);
  }
}

}  // namespace shardtrain::config_detail
