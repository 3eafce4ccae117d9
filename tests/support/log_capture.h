#pragma once
// Captures what the shardtrain logger writes while a LogCapture is alive, for
// tests that check a warning's text.

#include <algorithm>
#include <memory>
#include <sstream>
#include <string>

#include <spdlog/sinks/ostream_sink.h>

#include "shardtrain/logging.h"

namespace shardtrain::testing {

class LogCapture {
 public:
  LogCapture() : sink_(std::make_shared<spdlog::sinks::ostream_sink_mt>(out_)) {
    shardtrain::logger().sinks().push_back(sink_);
  }
  ~LogCapture() {
    auto& sinks = shardtrain::logger().sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
  }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;
  std::string text() const { return out_.str(); }

 private:
  std::ostringstream out_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
};

}  // namespace shardtrain::testing
