#pragma once
/// @file metrics_plot.h
/// Pictures of training runs from their metrics files (one JSON object per
/// step, as `--metrics-out` writes them): loss, gradient norm, learning rate,
/// tokens/s and the lost-update fraction against the step, one line per run.
/// Drawn by gnuplot (Debian's gnuplot-nox; scripts/setup installs it).

#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain {

struct PlotRun {
  std::string metrics_path;  ///< JSON lines with at least "step"
  std::string label;         ///< empty: the file name without its extension
};

struct PlotOptions {
  /// Plot each point as the mean of the last `smooth` points of its series
  /// (1: the raw values). Per-step losses of different batches are noisy;
  /// a window shows the trend. The learning rate is never smoothed.
  int64_t smooth = 1;
  /// Which metrics, by metrics-file key: loss, grad_norm, lr, tokens_per_s,
  /// lost_update_frac, lost_update_frac_if_bf16. Empty: every one some run has.
  std::vector<std::string> metrics;
};

/// Draws every metric that some run has (or options.metrics), one panel
/// each, into `output` (.png or .svg, chosen by the extension). Throws
/// shardtrain::Error naming the file for an unreadable or malformed metrics
/// file, for runs without any known metric, for an unknown metric name, and
/// when gnuplot is missing or fails.
void plot_metrics(const std::vector<PlotRun>& runs, const std::string& output, const PlotOptions& options = {});

/// What --smooth plots: out[i] = mean of values[max(0, i - window + 1) .. i].
std::vector<double> trailing_mean(const std::vector<double>& values, int64_t window);

}  // namespace shardtrain
