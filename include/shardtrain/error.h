#pragma once
/// @file error.h
/// Exceptions thrown by shardtrain and the checking macros that build them.
///
/// Library code never calls exit(): every failure is an exception whose
/// message names the problem and, where there is one, the fix. The source
/// location is appended so bug reports point at the check that fired.

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace shardtrain {

/// Base class of every exception shardtrain throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A collective, rendezvous or store operation did not complete within its timeout.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

/// A checkpoint save failed on some rank (disk full, permissions, a write
/// error). Every rank throws it together, after the save cleaned up: the
/// temporary directory is gone, `latest` still names the previous checkpoint,
/// and the training state in memory is as it was.
class CheckpointSaveError : public Error {
 public:
  using Error::Error;
};

/// A configuration value (file, flag or environment variable) is invalid.
class ConfigError : public Error {
 public:
  using Error::Error;
};

namespace detail {

template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

inline std::string concat() { return {}; }

/// Appends " (check `cond` at file:line)" to the message and throws E.
template <typename E>
[[noreturn]] void throw_with_location(const char* file, int line, const char* condition,
                                      const std::string& message) {
  std::ostringstream out;
  out << message;
  if (condition != nullptr && *condition != '\0') {
    out << " [check `" << condition << "` failed";
  } else {
    out << " [raised";
  }
  out << " at " << file << ":" << line << "]";
  throw E(out.str());
}

}  // namespace detail
}  // namespace shardtrain

/// Throws shardtrain::Error with the concatenated arguments unless `cond` holds.
#define ST_CHECK(cond, ...)                                                              \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      ::shardtrain::detail::throw_with_location<::shardtrain::Error>(                    \
          __FILE__, __LINE__, #cond, ::shardtrain::detail::concat(__VA_ARGS__));         \
    }                                                                                    \
  } while (false)

/// Like ST_CHECK but throws the given exception type (a shardtrain::Error subclass).
#define ST_CHECK_T(ErrorType, cond, ...)                                                 \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      ::shardtrain::detail::throw_with_location<ErrorType>(                              \
          __FILE__, __LINE__, #cond, ::shardtrain::detail::concat(__VA_ARGS__));         \
    }                                                                                    \
  } while (false)

/// Unconditionally throws the given exception type.
#define ST_THROW(ErrorType, ...)                                                         \
  ::shardtrain::detail::throw_with_location<ErrorType>(__FILE__, __LINE__, "",           \
                                                       ::shardtrain::detail::concat(__VA_ARGS__))
