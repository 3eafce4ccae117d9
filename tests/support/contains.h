#pragma once
// What the tests assert error messages and program output with: the
// substring check, and the message a call throws.

#include <functional>
#include <string>

#include "shardtrain/error.h"

namespace shardtrain::testing {

inline bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

/// The message of the shardtrain::Error `call` throws, or "no error".
inline std::string error_message_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const shardtrain::Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace shardtrain::testing
