#pragma once
/// @file metrics_plot.h
/// Pictures of training runs from their metrics files (one JSON object per
/// step, as `--metrics-out` writes them): loss, gradient norm, learning rate,
/// tokens/s and the lost-update fraction against the step, one line per run.
/// Drawn by gnuplot (Debian's gnuplot-nox; scripts/setup installs it).

#include <string>
#include <vector>

namespace shardtrain {

struct PlotRun {
  std::string metrics_path;  ///< JSON lines with at least "step"
  std::string label;         ///< empty: the file name without its extension
};

/// Draws every metric that some run has, one panel each, into `output`
/// (.png or .svg, chosen by the extension). Throws shardtrain::Error naming
/// the file for an unreadable or malformed metrics file, for runs without any
/// known metric, and when gnuplot is missing or fails.
void plot_metrics(const std::vector<PlotRun>& runs, const std::string& output);

}  // namespace shardtrain
