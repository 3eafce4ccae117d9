#pragma once
// The substring check the tests assert error messages and program output with.

#include <string>

namespace shardtrain::testing {

inline bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace shardtrain::testing
