// The hang report's parts that need no second process: the ring of recent
// collectives with its scope chains, the exchange format, and the wording of
// the diagnosis for divergence, a rank behind, and a missing rank.

#include <string>

#include <gtest/gtest.h>

#include "comm/collective_log.h"
#include "support/contains.h"

namespace {

using shardtrain::comm::CollectiveEvent;
using shardtrain::comm::CollectiveLog;
using shardtrain::comm::CollectiveScope;
using shardtrain::comm::LoggedCollective;
using shardtrain::comm::RankLogs;

using shardtrain::testing::contains;

LoggedCollective entry(int64_t seq, const std::string& op, const std::string& context, int64_t numel = 64) {
  return {seq, op, "Float", numel, 2 * numel, context};
}

TEST(UnitHangReport, RingKeepsTheLastEntriesWithTheirScopeChains) {
  CollectiveLog log(0, {0, 1});
  CollectiveEvent event{"all_gather", at::kFloat, 10, 20};
  for (int i = 0; i < 70; ++i) {
    CollectiveScope outer("save_state()");
    CollectiveScope inner("gather layers." + std::to_string(i));
    EXPECT_EQ(log.record(event), i);
  }
  { EXPECT_EQ(log.record({"barrier", at::kFloat, 0, 0}), 70); }
  const auto entries = log.snapshot();
  ASSERT_EQ(entries.size(), static_cast<std::size_t>(CollectiveLog::kCapacity));
  EXPECT_EQ(entries.front().seq, 71 - CollectiveLog::kCapacity);
  EXPECT_EQ(entries[entries.size() - 2].context, "save_state() > gather layers.69");
  EXPECT_EQ(entries[entries.size() - 2].describe(), "save_state() > gather layers.69 > all_gather(Float, 10 -> 20)");
  EXPECT_EQ(entries.back().context, "");  // the scopes closed
  EXPECT_EQ(entries.back().describe(), "barrier");
  EXPECT_EQ(CollectiveScope::current(), "");
}

TEST(UnitHangReport, LogSurvivesTheExchangeFormat) {
  std::vector<LoggedCollective> entries{entry(3, "all_reduce(sum)", "step() > a\tb"), entry(4, "barrier", "")};
  const auto parsed = shardtrain::comm::parse_log(shardtrain::comm::serialize_log(entries));
  ASSERT_EQ(parsed.size(), 2u);
  EXPECT_EQ(parsed[0].seq, 3);
  EXPECT_EQ(parsed[0].op, "all_reduce(sum)");
  EXPECT_EQ(parsed[0].context, "step() > a b");  // a tab would split the line; it becomes a space
  EXPECT_EQ(parsed[1].output_numel, 128);
  EXPECT_TRUE(shardtrain::comm::parse_log("not\ta log line\n").empty());
}

TEST(UnitHangReport, NamesTheFirstDivergenceAndTheRankBehind) {
  RankLogs logs;
  logs[0] = {entry(10, "all_gather", "gather layers.0"), entry(11, "all_gather", "gather layers.1"),
             entry(12, "all_gather", "gather layers.2")};
  logs[1] = {entry(10, "all_gather", "gather layers.0"), entry(11, "all_gather", "gather layers.2")};
  const std::string report = shardtrain::comm::diagnose_hang(logs, {0, 1}, std::chrono::milliseconds(3000));
  EXPECT_TRUE(contains(report, "the ranks diverge at seq 11: rank 0 is in gather layers.1 > all_gather(Float, 64 -> "
                               "128), rank 1 in gather layers.2 > all_gather(Float, 64 -> 128)"))
      << report;
  EXPECT_TRUE(contains(report, "rank 0 at seq 12, gather layers.2 > all_gather")) << report;
  EXPECT_TRUE(contains(report, "rank 1 is behind: 1 collective(s) fewer")) << report;
  EXPECT_FALSE(contains(report, "missing")) << report;
}

TEST(UnitHangReport, UnevenOutputsAreNotADivergence) {
  // An uneven reduce-scatter gives each rank its own split: same call, different output sizes.
  RankLogs logs;
  logs[0] = {{5, "reduce_scatter(sum)", "Float", 10, 6, "reduce gradients of x"}};
  logs[1] = {{5, "reduce_scatter(sum)", "Float", 10, 4, "reduce gradients of x"}};
  const std::string report = shardtrain::comm::diagnose_hang(logs, {0, 1}, std::chrono::milliseconds(3000));
  EXPECT_FALSE(contains(report, "the ranks diverge")) << report;
  EXPECT_TRUE(contains(report, "no divergence in the logged window")) << report;
}

TEST(UnitHangReport, MissingRanksAndGlobalRanksAreNamed) {
  RankLogs logs;
  logs[1] = {entry(0, "barrier", "wait_for_everyone()")};
  const std::string report = shardtrain::comm::diagnose_hang(logs, {4, 5, 6}, std::chrono::milliseconds(2500));
  EXPECT_TRUE(contains(report, "rank 0 (global 4) is missing: it sent no log within 2500 ms")) << report;
  EXPECT_TRUE(contains(report, "rank 2 (global 6) is missing")) << report;
  EXPECT_TRUE(contains(report, "rank 1 (global 5) at seq 0, wait_for_everyone() > barrier")) << report;
}

TEST(UnitHangReport, LogsThatDoNotOverlapSaySo) {
  RankLogs logs;
  logs[0] = {entry(200, "all_gather", "a")};
  logs[1] = {entry(5, "all_gather", "a")};
  const std::string report = shardtrain::comm::diagnose_hang(logs, {0, 1}, std::chrono::milliseconds(1000));
  EXPECT_TRUE(contains(report, "the logs do not overlap")) << report;
  EXPECT_TRUE(contains(report, "rank 1 is behind: 195 collective(s) fewer")) << report;
}

}  // namespace
