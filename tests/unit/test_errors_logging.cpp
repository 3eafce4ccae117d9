// Errors (ST_CHECK's message, condition and location; typed throws), the
// logger's levels, and the communicator's chunk sizes.
#include <gtest/gtest.h>

#include "shardtrain/error.h"
#include "shardtrain/logging.h"
#include "shardtrain/comm/communicator.h"

namespace {

TEST(UnitErrors, CheckThrowsWithMessageConditionAndLocation) {
  try {
    int world = 3;
    ST_CHECK(world % 2 == 0, "world size ", world, " is odd");
    FAIL() << "ST_CHECK did not throw";
  } catch (const shardtrain::Error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("world size 3 is odd"), std::string::npos) << what;
    EXPECT_NE(what.find("world % 2 == 0"), std::string::npos) << what;
    EXPECT_NE(what.find("test_errors_logging.cpp"), std::string::npos) << what;
  }
}

TEST(UnitErrors, TypedThrowKeepsType) {
  EXPECT_THROW(ST_THROW(shardtrain::TimeoutError, "late"), shardtrain::TimeoutError);
  EXPECT_THROW(ST_CHECK_T(shardtrain::ConfigError, false, "bad"), shardtrain::ConfigError);
  EXPECT_NO_THROW(ST_CHECK(true, "never"));
}

TEST(UnitLogging, ParsesLevelsAndRejectsUnknownNames) {
  EXPECT_EQ(shardtrain::parse_log_level("debug"), spdlog::level::debug);
  EXPECT_EQ(shardtrain::parse_log_level("WARNING"), spdlog::level::warn);
  EXPECT_EQ(shardtrain::parse_log_level("off"), spdlog::level::off);
  try {
    shardtrain::parse_log_level("verbose");
    FAIL();
  } catch (const shardtrain::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("trace, debug, info"), std::string::npos) << e.what();
  }
}

TEST(UnitLogging, RankZeroInfoOthersWarnByDefault) {
  unsetenv("SHARDTRAIN_LOG_LEVEL");
  shardtrain::set_log_rank(0);
  EXPECT_EQ(shardtrain::logger().level(), spdlog::level::info);
  shardtrain::set_log_rank(3);
  EXPECT_EQ(shardtrain::logger().level(), spdlog::level::warn);
  setenv("SHARDTRAIN_LOG_LEVEL", "debug", 1);
  shardtrain::set_log_rank(0);  // same rank: re-applies only on change
  shardtrain::set_log_rank(2);
  EXPECT_EQ(shardtrain::logger().level(), spdlog::level::debug);
  unsetenv("SHARDTRAIN_LOG_LEVEL");
  shardtrain::set_log_rank(0);
}

TEST(UnitComm, ChunkSizeRoundsUp) {
  EXPECT_EQ(shardtrain::comm::chunk_size(10, 4), 3);
  EXPECT_EQ(shardtrain::comm::chunk_size(8, 4), 2);
  EXPECT_EQ(shardtrain::comm::chunk_size(0, 4), 0);
  EXPECT_EQ(shardtrain::comm::chunk_size(1, 1), 1);
  EXPECT_THROW(shardtrain::comm::chunk_size(4, 0), shardtrain::Error);
}

}  // namespace
