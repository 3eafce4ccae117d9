// Loss-curve pictures through gnuplot (see metrics_plot.h). gnuplot rather
// than a python3-matplotlib script: the CLI stays one C++ program with no
// Python at run time, and Debian's gnuplot-nox is a small package that draws
// PNG (cairo) and SVG; the data goes to it as plain two-column files.

#include "shardtrain/metrics_plot.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "json_depth.h"
#include "shardtrain/error.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;

/// The panels, in order: the metrics-file keys read for each (the first
/// present wins, so train_tiny's and the fine-tune's names both work).
struct Panel {
  const char* title;
  std::vector<const char*> keys;
  bool log_scale;
  bool smoothable = true;
};
const std::vector<Panel>& panels() {
  static const std::vector<Panel> all = {
      {"loss", {"loss"}, false},
      {"gradient norm", {"grad_norm"}, true},
      {"learning rate", {"lr"}, false, false},
      {"tokens/s", {"tokens_per_s", "tokens_per_s_rank0"}, false},
      {"lost-update fraction", {"lost_update_frac"}, false},
      {"lost-update fraction a bf16 master would have", {"lost_update_frac_if_bf16"}, false},
  };
  return all;
}

using Series = std::vector<std::pair<double, double>>;

/// One run's series per panel title.
std::map<std::string, Series> read_run(const std::string& path) {
  std::ifstream in(path);
  ST_CHECK(in.good(), "plot: cannot read the metrics file '", path, "'");
  std::map<std::string, Series> series;
  std::string line;
  int64_t number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = parse_json_within_depth<Error, nlohmann::json>(line, "plot: " + path + " line " + std::to_string(number));
    } catch (const nlohmann::json::exception& e) {
      ST_THROW(Error, "plot: ", path, " line ", number, " is not JSON (", e.what(),
               "); pass a metrics file written by --metrics-out");
    }
    ST_CHECK(j.is_object() && j.contains("step") && j["step"].is_number(), "plot: ", path, " line ", number,
             " has no numeric \"step\"; pass a metrics file written by --metrics-out");
    const double step = j["step"].get<double>();
    for (const Panel& panel : panels()) {
      for (const char* key : panel.keys) {
        if (!j.contains(key) || !j[key].is_number()) continue;
        const double value = j[key].get<double>();
        // -1 is the metrics files' "not computed" (grad_norm without clipping).
        if (!(panel.log_scale && value <= 0)) series[panel.title].emplace_back(step, value);
        break;
      }
    }
  }
  return series;
}

std::string gnuplot_string(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

Series smoothed(const Series& series, int64_t window) {
  std::vector<double> values;
  for (const auto& point : series) values.push_back(point.second);
  const std::vector<double> means = trailing_mean(values, window);
  Series out;
  for (std::size_t i = 0; i < series.size(); ++i) out.emplace_back(series[i].first, means[i]);
  return out;
}

bool panel_wanted(const Panel& panel, const std::vector<std::string>& metrics) {
  if (metrics.empty()) return true;
  for (const auto& metric : metrics) {
    for (const char* key : panel.keys) {
      if (metric == key) return true;
    }
  }
  return false;
}

}  // namespace

void plot_metrics(const std::vector<PlotRun>& runs, const std::string& output, const PlotOptions& options) {
  ST_CHECK(!runs.empty(), "plot: no metrics files given");
  ST_CHECK(options.smooth >= 1, "plot: the smoothing window must be at least 1 step, got ", options.smooth);
  for (const auto& metric : options.metrics) {
    bool known = false;
    std::string names;
    for (const Panel& panel : panels()) {
      names += std::string(names.empty() ? "" : ", ") + panel.keys.front();
      for (const char* key : panel.keys) known = known || metric == key;
    }
    ST_CHECK(known, "plot: unknown metric '", metric, "'; choose from ", names);
  }
  const std::string extension = fs::path(output).extension().string();
  ST_CHECK(extension == ".png" || extension == ".svg", "plot: the output '", output,
           "' must end in .png or .svg (the picture's format)");
  std::vector<std::string> labels;
  std::vector<std::map<std::string, Series>> data;
  for (const auto& run : runs) {
    labels.push_back(run.label.empty() ? fs::path(run.metrics_path).stem().string() : run.label);
    data.push_back(read_run(run.metrics_path));
  }
  std::vector<const Panel*> shown;
  for (const Panel& panel : panels()) {
    if (!panel_wanted(panel, options.metrics)) continue;
    for (const auto& run : data) {
      if (run.count(panel.title) && !run.at(panel.title).empty()) {
        shown.push_back(&panel);
        break;
      }
    }
  }
  ST_CHECK(!shown.empty(), "plot: none of the files has loss, grad_norm, lr, tokens/s or lost_update_frac");

  const fs::path work = fs::temp_directory_path() / ("shardtrain-plot-" + std::to_string(::getpid()));
  fs::create_directories(work);
  std::ostringstream script;
  const int height = 300 * static_cast<int>(shown.size());
  if (extension == ".png") {
    script << "set terminal pngcairo size 1000," << height << " font 'sans,10'\n";
  } else {
    script << "set terminal svg size 1000," << height << " font 'sans,10'\n";
  }
  script << "set output " << gnuplot_string(output) << "\n";
  script << "set multiplot layout " << shown.size() << ",1\n";
  // Labels are file names and run names: "_" must not turn into a subscript.
  script << "set termoption noenhanced\n";
  script << "set grid\nset key outside right top\nset xlabel 'step'\n";
  for (std::size_t p = 0; p < shown.size(); ++p) {
    const Panel& panel = *shown[p];
    const bool smooth = panel.smoothable && options.smooth > 1;
    const std::string title =
        smooth ? std::string(panel.title) + " (mean of the last " + std::to_string(options.smooth) + " steps)"
               : std::string(panel.title);
    script << "set title " << gnuplot_string(title) << "\n";
    script << (panel.log_scale ? "set logscale y\n" : "unset logscale y\n");
    std::vector<std::string> plots;
    for (std::size_t r = 0; r < data.size(); ++r) {
      if (!data[r].count(panel.title)) continue;
      const fs::path file = work / ("p" + std::to_string(p) + "_r" + std::to_string(r) + ".dat");
      std::ofstream out(file);
      out.precision(10);
      const Series& raw = data[r].at(panel.title);
      for (const auto& [step, value] : smooth ? smoothed(raw, options.smooth) : raw) out << step << " " << value << "\n";
      plots.push_back(gnuplot_string(file.string()) + " using 1:2 with lines linewidth 2 title " + gnuplot_string(labels[r]));
    }
    script << "plot ";
    for (std::size_t k = 0; k < plots.size(); ++k) script << (k ? ", " : "") << plots[k];
    script << "\n";
  }
  script << "unset multiplot\n";
  const fs::path script_path = work / "plot.gp";
  std::ofstream(script_path) << script.str();

  const std::string command = "gnuplot " + gnuplot_string(script_path.string()) + " 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  ST_CHECK(pipe != nullptr, "plot: cannot start gnuplot");
  std::string said;
  char chunk[4096];
  while (std::size_t got = std::fread(chunk, 1, sizeof chunk, pipe)) said.append(chunk, got);
  const int status = ::pclose(pipe);
  fs::remove_all(work);
  ST_CHECK(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) != 127,
           "plot: gnuplot is not installed; install it (Debian: apt-get install gnuplot-nox, which scripts/setup does)");
  ST_CHECK(status == 0, "plot: gnuplot failed drawing ", output, ": ", said);
  ST_CHECK(fs::exists(output) && fs::file_size(output) > 0, "plot: gnuplot wrote no picture to ", output, ": ", said);
}

std::vector<double> trailing_mean(const std::vector<double>& values, int64_t window) {
  ST_CHECK(window >= 1, "plot: the smoothing window must be at least 1 step, got ", window);
  std::vector<double> out;
  out.reserve(values.size());
  // Summed afresh per point (not a running sum): no drift from adding and
  // subtracting, and windows are short.
  for (std::size_t i = 0; i < values.size(); ++i) {
    const std::size_t first = i + 1 >= static_cast<std::size_t>(window) ? i + 1 - static_cast<std::size_t>(window) : 0;
    double sum = 0;
    for (std::size_t k = first; k <= i; ++k) sum += values[k];
    out.push_back(sum / static_cast<double>(i - first + 1));
  }
  return out;
}

}  // namespace shardtrain
