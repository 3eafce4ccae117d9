// What the fine-tune prints and writes besides training: the progress line
// (redrawn on a terminal, plain lines in a log) and where --report_to sends
// the per-step metrics.

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "finetune/finetune.h"
#include "finetune/progress.h"
#include "shardtrain/error.h"

namespace {

TEST(UnitFinetuneOutput, ProgressRedrawsOneLineOnATerminalAndPrintsPlainLinesOtherwise) {
  std::ostringstream terminal, log;
  finetune::ProgressBar on_terminal(10, 0, true, 4, /*interactive=*/true, terminal);
  finetune::ProgressBar in_log(10, 0, true, 4, /*interactive=*/false, log);
  for (int64_t step = 1; step <= 10; ++step) {
    on_terminal.update(step, 1.5, 1e-3, 100);
    in_log.update(step, 1.5, 1e-3, 100);
  }
  // Terminal: every step redrawn in place with \r, one newline at the end.
  const std::string drawn = terminal.str();
  EXPECT_EQ(std::count(drawn.begin(), drawn.end(), '\r'), 10);
  EXPECT_EQ(std::count(drawn.begin(), drawn.end(), '\n'), 1);
  EXPECT_EQ(drawn.back(), '\n');
  // Log: no control characters; the first step, every 4th and the last.
  const std::string lines = log.str();
  EXPECT_EQ(lines.find('\r'), std::string::npos);
  EXPECT_EQ(lines.find('\x1b'), std::string::npos);
  std::vector<std::string> printed;
  std::istringstream in(lines);
  for (std::string line; std::getline(in, line);) printed.push_back(line.substr(0, line.find(' ', 5)));
  EXPECT_EQ(printed, (std::vector<std::string>{"step 1/10", "step 4/10", "step 8/10", "step 10/10"}));

  // A logged line shows the mean loss of the steps since the line before (steps 2-4: 2, 3 and 4).
  std::ostringstream averaged;
  finetune::ProgressBar mean_of_steps(10, 0, true, 4, /*interactive=*/false, averaged);
  for (int64_t step = 1; step <= 4; ++step) mean_of_steps.update(step, static_cast<double>(step), 1e-3, 100);
  EXPECT_NE(averaged.str().find("step 4/10 [#########...............] loss 3.0000 "), std::string::npos)
      << averaged.str();
}

TEST(UnitFinetuneOutput, ReportToChoosesTheMetricsFileAndFallsBackToJsonlForTrackersNotBuiltIn) {
  std::vector<std::string> warnings;
  EXPECT_EQ(finetune::resolve_metrics_file("none", "", "out", warnings), "");
  EXPECT_EQ(finetune::resolve_metrics_file("jsonl", "", "out", warnings), "out/metrics.jsonl");
  EXPECT_EQ(finetune::resolve_metrics_file("all", "", "out", warnings), "out/metrics.jsonl");
  EXPECT_EQ(finetune::resolve_metrics_file("none", "m.jsonl", "out", warnings), "m.jsonl");  // --metrics-out wins
  EXPECT_TRUE(warnings.empty());
  EXPECT_EQ(finetune::resolve_metrics_file("jsonl, tensorboard", "", "out", warnings), "out/metrics.jsonl");
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("--report_to tensorboard: not built in (no maintained C++ TensorBoard event writer"),
            std::string::npos)
      << warnings[0];
  warnings.clear();
  EXPECT_EQ(finetune::resolve_metrics_file("wandb", "", "out", warnings), "out/metrics.jsonl");  // no lost metrics
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("--report_to wandb: not built in; the metrics go to the JSONL file"), std::string::npos)
      << warnings[0];
  EXPECT_THROW(
      {
        try {
          finetune::resolve_metrics_file("tensorbord", "", "out", warnings);
        } catch (const shardtrain::ConfigError& e) {
          EXPECT_NE(std::string(e.what()).find("--report_to 'tensorbord' is not one of jsonl, none, all"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      shardtrain::ConfigError);
}

}  // namespace
