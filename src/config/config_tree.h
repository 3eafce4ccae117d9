#pragma once
// A format-neutral document tree for configuration files. YAML and JSON are
// both read into it, so one reader serves Accelerate YAML, Accelerate JSON and
// DeepSpeed JSON alike; and both are written from it, so to_yaml and to_json
// print the same fields in the same order. Private to src/config.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace shardtrain::config_detail {

struct Node {
  enum class Kind { kNull, kBool, kInteger, kFloat, kString, kMap, kList };

  Kind kind = Kind::kNull;
  bool boolean = false;
  int64_t integer = 0;
  double number = 0.0;  ///< also set for kInteger
  /// A scalar as the file wrote it; for kString the string itself.
  std::string text;
  /// Map members in file order, each key once (see the parsers for duplicates).
  std::vector<std::pair<std::string, Node>> members;
  std::vector<Node> items;
  /// 1-based line in the source file; 0 where the parser does not report
  /// positions (nlohmann::json reports them only for syntax errors).
  int line = 0;

  // Declared here, defaulted after the class where Node is complete: clang in
  // C++20 otherwise instantiates the members' vector of the still incomplete
  // Node while it checks std::pair's constructors.
  Node();
  Node(const Node&);
  Node(Node&&) noexcept;
  Node& operator=(const Node&);
  Node& operator=(Node&&) noexcept;
  ~Node();

  static Node null();
  static Node of(bool value);
  static Node of(int value) { return of(static_cast<int64_t>(value)); }
  static Node of(int64_t value);
  static Node of(double value);
  static Node of(std::string value);
  static Node of(const char* value) { return of(std::string(value)); }
  static Node map();
  static Node list();

  /// Appends a member (maps) and returns *this so trees read like the file they print.
  Node& add(std::string key, Node value);
  Node& push(Node value);
  const Node* find(std::string_view key) const;
  bool is_scalar() const { return kind != Kind::kMap && kind != Kind::kList; }
};

inline Node::Node() = default;
inline Node::Node(const Node&) = default;
inline Node::Node(Node&&) noexcept = default;
inline Node& Node::operator=(const Node&) = default;
inline Node& Node::operator=(Node&&) noexcept = default;
inline Node::~Node() = default;

/// What one config document may hold. Real configs are a few kilobytes:
/// tens of keys, at most four levels deep. The limits sit orders of magnitude
/// above that and stop a document that nests, or expands through YAML aliases
/// (`*name` repeats everything `&name` holds), without bound before it takes a
/// rank's memory or stack: a 288-byte alias bomb grew to 1.36 GB, a JSON file
/// nested 15,000 deep crashed the reader. Every rank reads the config.
inline constexpr std::size_t kMaxConfigTextBytes = std::size_t{4} << 20;  ///< the document's text
inline constexpr int kMaxConfigDepth = 64;  ///< nested mappings and lists (kMaxJsonDepth for JSON)
/// Values (scalars, mappings, lists) after YAML aliases are expanded: each
/// expansion counts every value it repeats.
inline constexpr std::size_t kMaxConfigValues = 100000;
inline constexpr std::size_t kMaxConfigExpandedBytes = std::size_t{16} << 20;  ///< scalar text after expansion
/// Warnings of one kind shown before the rest are counted in one line.
inline constexpr std::size_t kWarningsShownPerKind = 5;

/// Throws ConfigError when `text` is over kMaxConfigTextBytes.
void check_document_size(std::size_t bytes, const std::string& source);

/// Keeps the first kWarningsShownPerKind warnings of each kind (the same
/// message but for its line numbers and quoted names: "unknown key '…' in f")
/// and replaces the rest by one line that counts them, in place of the first
/// one left out.
void summarise_repeated_warnings(std::vector<std::string>& warnings);

/// Throws ConfigError "<source>: malformed YAML at line L, column C: ..." on
/// syntax errors. A duplicate key keeps its last value, as PyYAML does, and
/// adds a warning naming both lines to `warnings`.
Node parse_yaml_document(const std::string& text, const std::string& source, std::vector<std::string>& warnings);
/// Throws ConfigError "<source>: malformed JSON at line L, column C: ..." on
/// syntax errors and on duplicate keys (DeepSpeed rejects those too).
/// Comments are allowed: DeepSpeed reads its config with hjson.
Node parse_json_document(const std::string& text, const std::string& source);

std::string emit_yaml(const Node& root);
std::string emit_json(const Node& root);

// ---- small text helpers shared by the config sources
std::string lowercase(std::string text);
std::string uppercase(std::string text);
std::string join(const std::vector<std::string>& parts, const std::string& separator);
std::size_t edit_distance(std::string_view a, std::string_view b);
/// The candidate a misspelt `word` most likely meant: the nearest by edit
/// distance (case-insensitive) when close enough for its length, else one that
/// `word` is a prefix of or that is a prefix of `word`; nullopt when none fits.
std::optional<std::string> nearest(const std::string& word, const std::vector<std::string>& candidates);
/// Shortest text that reads back as the same double ("0.001", "5e-05").
std::string format_double(double value);
/// A value as an error message quotes it: strings in double quotes, others as written.
std::string describe(const Node& node);

}  // namespace shardtrain::config_detail
