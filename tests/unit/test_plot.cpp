// `shardtrain plot` / plot_metrics: pictures of metrics files, and clear
// errors for what cannot be drawn.

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "shardtrain/error.h"
#include "shardtrain/metrics_plot.h"
#include "support/contains.h"
#include "support/scratch_dir.h"

namespace {

namespace fs = std::filesystem;

void write(const fs::path& path, const std::string& text) { std::ofstream(path) << text; }

std::string read(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

TEST(UnitPlot, DrawsEveryRunIntoPngAndSvg) {
  const shardtrain::testing::ScratchDir scratch;
  // The fine-tune's key names in one file, train_tiny's in the other.
  const fs::path a = scratch.file("zero3.jsonl"), b = scratch.file("fsdp_pure.jsonl");
  write(a, R"({"step":1,"loss":6.1,"lr":0.001,"grad_norm":2.5,"tokens_per_s_rank0":4000}
{"step":2,"loss":5.2,"lr":0.001,"grad_norm":2.1,"tokens_per_s_rank0":4100}
{"step":3,"loss":4.0,"lr":0.0009,"grad_norm":1.7,"tokens_per_s_rank0":4050}
)");
  write(b, R"({"step":1,"loss":6.1,"lr":0.001,"grad_norm":-1,"tokens_per_s":3900,"lost_update_frac":0.91}

{"step":2,"loss":6.1,"lr":0.001,"grad_norm":-1,"tokens_per_s":3950,"lost_update_frac":0.93}
)");
  const fs::path svg = scratch.file("curves.svg");
  shardtrain::plot_metrics({{a.string(), ""}, {b.string(), "pure 1e-5"}}, svg.string());
  const std::string text = read(svg);
  EXPECT_NE(text.find("<svg"), std::string::npos);
  // Labels: the file name when none is given, else the label; every panel that some run has.
  EXPECT_NE(text.find("zero3"), std::string::npos);
  EXPECT_NE(text.find("pure 1e-5"), std::string::npos);
  for (const char* title : {"loss", "gradient norm", "learning rate", "tokens/s", "lost-update fraction"}) {
    EXPECT_NE(text.find(title), std::string::npos) << title;
  }
  const fs::path png = scratch.file("curves.png");
  shardtrain::plot_metrics({{a.string(), ""}}, png.string());
  EXPECT_EQ(read(png).substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
}

TEST(UnitPlot, SmoothsWithATrailingMeanAndDrawsOnlyTheChosenMetrics) {
  const shardtrain::testing::ScratchDir scratch;
  // Exact in binary: every sum and quotient below is a small dyadic rational.
  const std::vector<double> means = shardtrain::trailing_mean({1, 3, 5, 7, 9}, 2);
  EXPECT_EQ(means, (std::vector<double>{1, 2, 4, 6, 8}));
  EXPECT_EQ(shardtrain::trailing_mean({2, 4}, 1), (std::vector<double>{2, 4}));
  EXPECT_EQ(shardtrain::trailing_mean({2, 4, 6}, 10), (std::vector<double>{2, 3, 4}));
  EXPECT_THROW(shardtrain::trailing_mean({1}, 0), shardtrain::Error);

  const fs::path a = scratch.file("audit.jsonl");
  write(a, R"({"step":1,"loss":6.1,"lr":0.001,"lost_update_frac":0.9,"lost_update_frac_if_bf16":0.9}
{"step":2,"loss":5.9,"lr":0.001,"lost_update_frac":0.8,"lost_update_frac_if_bf16":0.95}
)");
  const fs::path svg = scratch.file("chosen.svg");
  shardtrain::PlotOptions options;
  options.smooth = 2;
  options.metrics = {"loss", "lost_update_frac_if_bf16"};
  shardtrain::plot_metrics({{a.string(), ""}}, svg.string(), options);
  const std::string text = read(svg);
  EXPECT_NE(text.find("loss (mean of the last 2 steps)"), std::string::npos);
  EXPECT_NE(text.find("lost-update fraction a bf16 master would have"), std::string::npos);
  EXPECT_EQ(text.find("learning rate"), std::string::npos) << "lr was not chosen";
  options.metrics = {"los"};
  try {
    shardtrain::plot_metrics({{a.string(), ""}}, svg.string(), options);
    FAIL() << "an unknown metric was accepted";
  } catch (const shardtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown metric 'los'"), std::string::npos) << e.what();
  }
}

TEST(UnitPlot, WhatCannotBeDrawnIsAClearError) {
  const shardtrain::testing::ScratchDir scratch;
  const fs::path bad = scratch.file("bad.jsonl"), empty = scratch.file("nothing.jsonl"), ok = scratch.file("ok.jsonl");
  write(bad, "{\"step\":1,\"loss\":2}\nnot json\n");
  write(empty, "{\"step\":1,\"skipped\":false}\n");
  write(ok, "{\"step\":1,\"loss\":2}\n");
  using shardtrain::testing::error_message_of;
  EXPECT_NE(error_message_of([&] { shardtrain::plot_metrics({{bad.string(), ""}}, scratch.file("x.png")); })
                .find("line 2 is not JSON"),
            std::string::npos);
  EXPECT_NE(error_message_of([&] { shardtrain::plot_metrics({{empty.string(), ""}}, scratch.file("x.png")); })
                .find("none of the files has"),
            std::string::npos);
  EXPECT_NE(error_message_of([&] { shardtrain::plot_metrics({{ok.string(), ""}}, scratch.file("x.pdf")); })
                .find("must end in .png or .svg"),
            std::string::npos);
  EXPECT_NE(error_message_of([&] { shardtrain::plot_metrics({{"/nonexistent.jsonl", ""}}, scratch.file("x.png")); })
                .find("cannot read the metrics file '/nonexistent.jsonl'"),
            std::string::npos);
}

}  // namespace
