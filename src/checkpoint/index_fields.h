#pragma once
// The integer fields of a checkpoint index (index.json), read safely. An
// index edited by hand or damaged on disk is user input, and nlohmann turns a
// float or an out-of-range number into an integer with a plain cast, which is
// undefined behaviour; these checks turn such values into an Error naming
// the field.

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "shardtrain/error.h"

namespace shardtrain::checkpoint {

template <typename T>
T index_integer(const nlohmann::json& value, const std::string& what) {
  static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>);
  using Limits = std::numeric_limits<T>;
  bool fits = false;
  if (value.is_number_unsigned()) {
    fits = value.get<uint64_t>() <= static_cast<uint64_t>(Limits::max());
  } else if (value.is_number_integer()) {
    const int64_t v = value.get<int64_t>();
    fits = v >= 0 ? static_cast<uint64_t>(v) <= static_cast<uint64_t>(Limits::max())
                  : std::is_signed_v<T> && v >= static_cast<int64_t>(Limits::min());
  }
  ST_CHECK(fits, "checkpoint index: ", what, " must be an integer in [", +Limits::min(), ", ", +Limits::max(),
           "], got ", value.dump(), "; the index is damaged");
  return value.is_number_unsigned() ? static_cast<T>(value.get<uint64_t>()) : static_cast<T>(value.get<int64_t>());
}

/// `object[key]` as an integer, or `fallback` when the key is absent.
template <typename T>
T index_integer_or(const nlohmann::json& object, const char* key, T fallback, const std::string& what) {
  if (!object.is_object() || !object.contains(key)) return fallback;
  return index_integer<T>(object.at(key), what + " " + key);
}

inline std::vector<int64_t> index_shape(const nlohmann::json& value, const std::string& what) {
  ST_CHECK(value.is_array(), "checkpoint index: ", what, " must be a list of integers, got ", value.dump());
  std::vector<int64_t> shape;
  for (const auto& extent : value) shape.push_back(index_integer<int64_t>(extent, what));
  return shape;
}

}  // namespace shardtrain::checkpoint
