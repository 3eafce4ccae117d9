// The document tree of config files: YAML (yaml-cpp) and JSON (nlohmann) read
// into config_detail::Node with line numbers, written back out as YAML or
// JSON, and the text helpers the config readers share.
#include "config/config_tree.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>
#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include "json_depth.h"
#include "shardtrain/error.h"

namespace shardtrain::config_detail {

Node Node::null() { return Node{}; }

Node Node::of(bool value) {
  Node node;
  node.kind = Kind::kBool;
  node.boolean = value;
  node.text = value ? "true" : "false";
  return node;
}

Node Node::of(int64_t value) {
  Node node;
  node.kind = Kind::kInteger;
  node.integer = value;
  node.number = static_cast<double>(value);
  node.text = std::to_string(value);
  return node;
}

Node Node::of(double value) {
  Node node;
  node.kind = Kind::kFloat;
  node.number = value;
  node.text = format_double(value);
  return node;
}

Node Node::of(std::string value) {
  Node node;
  node.kind = Kind::kString;
  node.text = std::move(value);
  return node;
}

Node Node::map() {
  Node node;
  node.kind = Kind::kMap;
  return node;
}

Node Node::list() {
  Node node;
  node.kind = Kind::kList;
  return node;
}

Node& Node::add(std::string key, Node value) {
  members.emplace_back(std::move(key), std::move(value));
  return *this;
}

Node& Node::push(Node value) {
  items.push_back(std::move(value));
  return *this;
}

const Node* Node::find(std::string_view key) const {
  for (const auto& [name, value] : members) {
    if (name == key) return &value;
  }
  return nullptr;
}

// ---------------------------------------------------------------- text helpers

std::string lowercase(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text;
}

std::string uppercase(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  return text;
}

std::string join(const std::vector<std::string>& parts, const std::string& separator) {
  std::string out;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    if (i > 0) out += separator;
    out += parts[i];
  }
  return out;
}

std::size_t edit_distance(std::string_view a, std::string_view b) {
  // Levenshtein plus swaps of neighbours ("stgae"), the commonest typing slip.
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t substitution = d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, substitution});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

std::optional<std::string> nearest(const std::string& word, const std::vector<std::string>& candidates) {
  const std::string lower_word = lowercase(word);
  if (lower_word.empty()) return std::nullopt;
  // Three edits catch the usual slips (zero_optimisation, stgae, bf61), but
  // in a short word a few edits reach unrelated keys ("foo" -> "aio"): the
  // edits must also leave most of the word as written.
  const std::size_t allowed =
      std::min<std::size_t>({3, lower_word.size() / 3 + 1, (lower_word.size() - 1) / 2});
  std::optional<std::string> best;
  std::size_t best_distance = allowed + 1;
  for (const auto& candidate : candidates) {
    const std::size_t distance = edit_distance(lower_word, lowercase(candidate));
    if (distance < best_distance) {
      best_distance = distance;
      best = candidate;
    }
  }
  if (best) return best;
  constexpr std::size_t kShortestUsefulPrefix = 4;
  for (const auto& candidate : candidates) {
    const std::string lower_candidate = lowercase(candidate);
    const std::size_t shorter = std::min(lower_candidate.size(), lower_word.size());
    if (shorter < kShortestUsefulPrefix) continue;
    if (lower_candidate.compare(0, shorter, lower_word, 0, shorter) == 0) return candidate;
  }
  return std::nullopt;
}

std::string format_double(double value) {
  if (std::isnan(value)) return ".nan";
  if (std::isinf(value)) return value > 0 ? ".inf" : "-.inf";
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, result.ptr);
}

std::string describe(const Node& node) {
  switch (node.kind) {
    case Node::Kind::kNull: return "null";
    case Node::Kind::kString: return "\"" + node.text + "\"";
    case Node::Kind::kMap: return "a mapping";
    case Node::Kind::kList: return "a list";
    default: return node.text;
  }
}

// ---------------------------------------------------------------- YAML in

namespace {

bool is_yaml_null_word(const std::string& text) {
  return text.empty() || text == "~" || text == "null" || text == "Null" || text == "NULL";
}

/// Parses `text` completely as an integer or a float in YAML 1.2's core
/// schema (plus 2e8 without a dot, which DeepSpeed users write).
std::optional<Node> number_from_text(const std::string& text) {
  if (text.empty()) return std::nullopt;
  const char* begin = text.c_str();
  const char* end = begin + text.size();
  const char first = text.front();
  const bool numeric_start = std::isdigit(static_cast<unsigned char>(first)) || first == '-' ||
                             first == '+' || first == '.';
  if (!numeric_start) return std::nullopt;
  const std::string lower = lowercase(text);
  if (lower == ".inf" || lower == "+.inf") return Node::of(std::numeric_limits<double>::infinity());
  if (lower == "-.inf") return Node::of(-std::numeric_limits<double>::infinity());
  if (lower == ".nan") return Node::of(std::numeric_limits<double>::quiet_NaN());

  const bool looks_integer = text.find_first_of(".eE") == std::string::npos;
  if (looks_integer) {
    int64_t integer = 0;
    const char* digits = first == '+' ? begin + 1 : begin;
    const auto [ptr, error] = std::from_chars(digits, end, integer);
    if (error == std::errc() && ptr == end) {
      Node node = Node::of(integer);
      node.text = text;
      return node;
    }
    // Out of int64 range: still a number, read as a float below so the
    // integer reader can report the range.
  }
  char* parsed_end = nullptr;
  const double value = std::strtod(begin, &parsed_end);
  if (parsed_end != end) return std::nullopt;
  // strtod also reads "inf", "nan" and hex floats, which YAML does not.
  if (lower.find_first_not_of("0123456789+-.e") != std::string::npos) return std::nullopt;
  Node node = Node::of(value);
  node.text = text;
  return node;
}

Node scalar_from_yaml(const YAML::Node& yaml) {
  const std::string& text = yaml.Scalar();
  // yaml-cpp tags a quoted scalar "!" and a plain one "?"; only plain
  // scalars are typed, so `'no'` and `"3"` stay strings as the user meant.
  const std::string& tag = yaml.Tag();
  const bool plain = tag == "?" || tag.empty();
  const bool explicit_string = tag == "!" || tag == "tag:yaml.org,2002:str";
  Node node;
  if (!explicit_string && plain) {
    if (is_yaml_null_word(text)) {
      node = Node::null();
    } else if (text == "true" || text == "True" || text == "TRUE") {
      node = Node::of(true);
    } else if (text == "false" || text == "False" || text == "FALSE") {
      node = Node::of(false);
    } else if (auto number = number_from_text(text)) {
      node = *number;
    } else {
      node = Node::of(text);
    }
  } else {
    node = Node::of(text);
  }
  node.text = text;
  return node;
}

/// What a YAML document has expanded to so far (see kMaxConfigValues).
struct Expansion {
  std::size_t values = 0;
  std::size_t bytes = 0;
};

Node node_from_yaml(const YAML::Node& yaml, const std::string& source, int fallback_line, int depth,
                    Expansion& expansion, std::vector<std::string>& warnings) {
  const int line = yaml.Mark().is_null() ? fallback_line : yaml.Mark().line + 1;
  if (++expansion.values > kMaxConfigValues) {
    ST_THROW(ConfigError, source, ":", line, ": the document expands to more than ", kMaxConfigValues,
             " values; a config holds tens. YAML aliases (*name) repeat everything their anchor (&name) holds, "
             "so nested aliases multiply; refused before it takes this rank's memory");
  }
  if (depth > kMaxConfigDepth) {
    ST_THROW(ConfigError, source, ":", line, ": mappings and lists nest deeper than ", kMaxConfigDepth,
             " levels; a config needs a few, so the document is refused as malformed");
  }
  if (yaml.Type() == YAML::NodeType::Scalar) {
    expansion.bytes += yaml.Scalar().size();
    if (expansion.bytes > kMaxConfigExpandedBytes) {
      ST_THROW(ConfigError, source, ":", line, ": the document's values expand to more than ",
               kMaxConfigExpandedBytes >> 20, " MiB of text (YAML aliases repeat their anchor's values); a config "
               "holds kilobytes, so it is refused before it takes this rank's memory");
    }
  }
  switch (yaml.Type()) {
    case YAML::NodeType::Undefined:
    case YAML::NodeType::Null: {
      Node node = Node::null();
      node.line = fallback_line;  // yaml-cpp's marks for empty values point past them
      return node;
    }
    case YAML::NodeType::Scalar: {
      Node node = scalar_from_yaml(yaml);
      node.line = line;
      return node;
    }
    case YAML::NodeType::Sequence: {
      Node node = Node::list();
      node.line = line;
      for (const auto& item : yaml) node.push(node_from_yaml(item, source, line, depth + 1, expansion, warnings));
      return node;
    }
    case YAML::NodeType::Map: {
      Node node = Node::map();
      node.line = line;
      std::map<std::string, int> key_lines;
      for (const auto& member : yaml) {
        const int key_line = member.first.Mark().line + 1;
        if (!member.first.IsScalar()) {
          ST_THROW(ConfigError, source, ":", key_line, ": a mapping key must be a plain name");
        }
        const std::string key = member.first.Scalar();
        Node value = node_from_yaml(member.second, source, key_line, depth + 1, expansion, warnings);
        if (!key_lines.emplace(key, key_line).second) {
          // PyYAML, and so Accelerate, keeps the last value in the first
          // one's place; so does this reader, saying which lines collided.
          auto first = std::find_if(node.members.begin(), node.members.end(),
                                    [&](const auto& entry) { return entry.first == key; });
          warnings.push_back(source + ":" + std::to_string(key_line) + ": duplicate key '" + key +
                             "' (first given at line " + std::to_string(key_lines[key]) + "): the value at line " +
                             std::to_string(key_line) + " is used, as PyYAML and Accelerate read it; delete the other");
          first->second = std::move(value);
          continue;
        }
        node.add(key, std::move(value));
      }
      return node;
    }
  }
  return Node::null();
}

}  // namespace

Node parse_yaml_document(const std::string& text, const std::string& source, std::vector<std::string>& warnings) {
  check_document_size(text.size(), source);
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::DeepRecursion& e) {
    // yaml-cpp's own guard (2000 levels) says only "bad file".
    ST_THROW(ConfigError, source, ":", e.mark.line + 1, ": mappings and lists nest deeper than yaml-cpp reads (",
             e.depth(), " levels at line ", e.mark.line + 1, "); a config needs a few, so the document is refused "
             "as malformed");
  } catch (const YAML::ParserException& e) {
    ST_THROW(ConfigError, source, ":", e.mark.line + 1, ":", e.mark.column + 1,
             ": malformed YAML at line ", e.mark.line + 1, ", column ", e.mark.column + 1, ": ", e.msg);
  } catch (const YAML::Exception& e) {
    ST_THROW(ConfigError, source, ": malformed YAML: ", e.what());
  }
  Expansion expansion;
  return node_from_yaml(root, source, 1, 0, expansion, warnings);
}

// ---------------------------------------------------------------- JSON in

namespace {

using OrderedJson = nlohmann::ordered_json;

Node node_from_json(const OrderedJson& json) {
  switch (json.type()) {
    case OrderedJson::value_t::null: return Node::null();
    case OrderedJson::value_t::boolean: return Node::of(json.get<bool>());
    case OrderedJson::value_t::number_integer: return Node::of(json.get<int64_t>());
    case OrderedJson::value_t::number_unsigned: {
      const auto value = json.get<uint64_t>();
      if (value <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Node::of(static_cast<int64_t>(value));
      }
      return Node::of(static_cast<double>(value));
    }
    case OrderedJson::value_t::number_float: {
      Node node = Node::of(json.get<double>());
      node.text = json.dump();
      return node;
    }
    case OrderedJson::value_t::string: return Node::of(json.get<std::string>());
    case OrderedJson::value_t::object: {
      Node node = Node::map();
      for (const auto& [key, value] : json.items()) node.add(key, node_from_json(value));
      return node;
    }
    case OrderedJson::value_t::array: {
      Node node = Node::list();
      for (const auto& item : json) node.push(node_from_json(item));
      return node;
    }
    default: return Node::null();
  }
}

}  // namespace

Node parse_json_document(const std::string& text, const std::string& source) {
  check_document_size(text.size(), source);
  // One set of keys per open object: nlohmann keeps the last of two equal
  // keys silently, and a silently dropped setting is the worst outcome.
  std::vector<std::set<std::string>> open_objects;
  std::optional<std::string> duplicate;
  const OrderedJson::parser_callback_t watch_keys =
      [&](int /*depth*/, OrderedJson::parse_event_t event, OrderedJson& parsed) {
        switch (event) {
          case OrderedJson::parse_event_t::object_start: open_objects.emplace_back(); break;
          case OrderedJson::parse_event_t::object_end:
            if (!open_objects.empty()) open_objects.pop_back();
            break;
          case OrderedJson::parse_event_t::key:
            if (!open_objects.empty() && !open_objects.back().insert(parsed.get<std::string>()).second &&
                !duplicate) {
              duplicate = parsed.get<std::string>();
            }
            break;
          default: break;
        }
        return true;
      };
  OrderedJson json;
  try {
    json = parse_json_within_depth<ConfigError, OrderedJson>(text, source, watch_keys, /*ignore_comments=*/true);
  } catch (const OrderedJson::parse_error& e) {
    // e.byte is the 1-based offset of the character the parser stopped at.
    std::size_t line = 1;
    std::size_t column = 1;
    const std::size_t stop = std::min<std::size_t>(e.byte > 0 ? e.byte - 1 : 0, text.size());
    for (std::size_t i = 0; i < stop; ++i) {
      if (text[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    std::string detail = e.what();
    // "[json.exception.parse_error.101] parse error at line 3, column 5: syntax error ..."
    const auto colon = detail.find(": ", detail.find("parse error"));
    if (colon != std::string::npos) detail = detail.substr(colon + 2);
    ST_THROW(ConfigError, source, ":", line, ":", column, ": malformed JSON at line ", line, ", column ", column,
             ": ", detail);
  } catch (const OrderedJson::exception& e) {
    // Not a syntax error but a value the parser cannot hold, e.g. a number
    // beyond double's range (out_of_range.406; found by tests/fuzz).
    ST_THROW(ConfigError, source, ": a value in this JSON cannot be represented (", e.what(),
             "); numbers must fit in a double");
  }
  if (duplicate) {
    ST_THROW(ConfigError, source, ": duplicate key '", *duplicate,
             "' in one JSON object (DeepSpeed rejects these too); keep one of them");
  }
  return node_from_json(json);
}

// ---------------------------------------------------------------- limits

void check_document_size(std::size_t bytes, const std::string& source) {
  if (bytes <= kMaxConfigTextBytes) return;
  ST_THROW(ConfigError, source, ": ", bytes, " bytes is over the ", kMaxConfigTextBytes >> 20,
           " MiB a config file may be; a config is a few kilobytes (is this the right file?)");
}

namespace {

/// A warning's kind: its text without digits (line numbers, counts), and
/// with `names` also without what it quotes.
std::string warning_kind(const std::string& warning, bool without_names) {
  std::string kind;
  bool quoted = false;
  for (char c : warning) {
    if (without_names && c == '\'') {
      quoted = !quoted;
      kind += c;
      continue;
    }
    if (quoted || (c >= '0' && c <= '9')) continue;
    kind += c;
  }
  return kind;
}

}  // namespace

void summarise_repeated_warnings(std::vector<std::string>& warnings) {
  // Two passes: the same message about the same name (a key given again and
  // again), then the same message about any names (thousands of unknown keys).
  for (bool without_names : {false, true}) {
    std::map<std::string, std::size_t> seen;
    std::map<std::string, std::size_t> summary_at;  // kind -> index of its summary line in `kept`
    std::map<std::string, std::size_t> left_out;
    std::vector<std::string> kept;
    for (std::string& warning : warnings) {
      const std::string kind = warning_kind(warning, without_names);
      if (++seen[kind] <= kWarningsShownPerKind) {
        kept.push_back(std::move(warning));
        continue;
      }
      if (left_out[kind]++ == 0) {
        summary_at[kind] = kept.size();
        kept.emplace_back();
      }
    }
    for (const auto& [kind, index] : summary_at) {
      kept[index] = std::to_string(left_out[kind]) + " more warning(s) like the " +
                    std::to_string(kWarningsShownPerKind) + " above were not shown (" + kind.substr(0, 80) +
                    (kind.size() > 80 ? "..." : "") + ")";
    }
    warnings = std::move(kept);
  }
}

// ---------------------------------------------------------------- YAML out

namespace {

bool needs_quotes(const std::string& text) {
  if (text.empty()) return true;
  if (is_yaml_null_word(text) || number_from_text(text)) return true;
  // YAML 1.1 readers (PyYAML, hence Accelerate) read these as booleans.
  static const std::set<std::string> kBooleanWords = {"y", "n", "yes", "no", "on", "off", "true", "false"};
  if (kBooleanWords.count(lowercase(text)) != 0) return true;
  if (std::string("-?:,[]{}#&*!|>'\"%@`").find(text.front()) != std::string::npos) return true;
  if (text.front() == ' ' || text.back() == ' ') return true;
  if (text.find(": ") != std::string::npos || text.find(" #") != std::string::npos) return true;
  return text.find_first_of("\n\r\t") != std::string::npos;
}

std::string yaml_scalar(const Node& node) {
  switch (node.kind) {
    case Node::Kind::kNull: return "null";
    case Node::Kind::kBool: return node.boolean ? "true" : "false";
    case Node::Kind::kInteger: return std::to_string(node.integer);
    case Node::Kind::kFloat: {
      std::string text = format_double(node.number);
      // PyYAML (YAML 1.1) reads 1e-08 as a string; 1.0e-08 is a float everywhere.
      if (text.find_first_of(".n") == std::string::npos) {
        const auto exponent = text.find('e');
        if (exponent == std::string::npos) {
          text += ".0";
        } else {
          text.insert(exponent, ".0");
        }
      }
      return text;
    }
    case Node::Kind::kString: {
      if (!needs_quotes(node.text)) return node.text;
      if (node.text.find_first_of("\n\r\t\\") != std::string::npos) return nlohmann::json(node.text).dump();
      std::string quoted = "'";
      for (char c : node.text) quoted += c == '\'' ? std::string("''") : std::string(1, c);
      return quoted + "'";
    }
    default: return "";
  }
}

void emit_yaml_members(const Node& map, int indent, std::string& out) {
  const std::string pad(static_cast<std::size_t>(indent), ' ');
  for (const auto& [key, value] : map.members) {
    out += pad + key + ":";
    if (value.kind == Node::Kind::kMap) {
      if (value.members.empty()) {
        out += " {}\n";
      } else {
        out += "\n";
        emit_yaml_members(value, indent + 2, out);
      }
    } else if (value.kind == Node::Kind::kList) {
      std::vector<std::string> items;
      for (const auto& item : value.items) items.push_back(yaml_scalar(item));
      out += " [" + join(items, ", ") + "]\n";
    } else {
      out += " " + yaml_scalar(value) + "\n";
    }
  }
}

OrderedJson json_from_node(const Node& node) {
  switch (node.kind) {
    case Node::Kind::kNull: return nullptr;
    case Node::Kind::kBool: return node.boolean;
    case Node::Kind::kInteger: return node.integer;
    case Node::Kind::kFloat: return node.number;
    case Node::Kind::kString: return node.text;
    case Node::Kind::kMap: {
      OrderedJson object = OrderedJson::object();
      for (const auto& [key, value] : node.members) object[key] = json_from_node(value);
      return object;
    }
    case Node::Kind::kList: {
      OrderedJson array = OrderedJson::array();
      for (const auto& item : node.items) array.push_back(json_from_node(item));
      return array;
    }
  }
  return nullptr;
}

}  // namespace

std::string emit_yaml(const Node& root) {
  std::string out;
  emit_yaml_members(root, 0, out);
  return out;
}

std::string emit_json(const Node& root) { return json_from_node(root).dump(2) + "\n"; }

}  // namespace shardtrain::config_detail
