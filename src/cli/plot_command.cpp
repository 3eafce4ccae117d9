// `shardtrain plot RUN.jsonl... -o curves.png|svg [--label L ...]`: pictures
// of training runs from their metrics files (see metrics_plot.h).

#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "shardtrain/error.h"
#include "shardtrain/metrics_plot.h"

namespace shardtrain::cli {

void register_plot_command(CLI::App& app, int& exit_code) {
  auto* plot = app.add_subcommand(
      "plot", "Draw loss, grad norm, lr, tokens/s and lost_update_frac against step from metrics files (--metrics-out)");
  auto files = std::make_shared<std::vector<std::string>>();
  auto labels = std::make_shared<std::vector<std::string>>();
  auto output = std::make_shared<std::string>();
  plot->add_option("files", *files, "Metrics files (JSON lines), one line per run in the picture")
      ->required()
      ->check(CLI::ExistingFile);
  plot->add_option("-o,--output", *output, "The picture: .png or .svg")->required();
  plot->add_option("--label", *labels, "Labels of the runs, in file order (default: the file names)");
  auto options = std::make_shared<PlotOptions>();
  plot->add_option("--smooth", options->smooth, "Plot the mean of the last N steps (1: raw values; lr is never smoothed)")
      ->capture_default_str();
  plot->add_option("--metrics", options->metrics,
                   "Only these metrics: loss grad_norm lr tokens_per_s lost_update_frac lost_update_frac_if_bf16")
      ->delimiter(',');
  plot->callback([&exit_code, files, labels, output, options]() {
    ST_CHECK_T(ConfigError, labels->empty() || labels->size() == files->size(), "plot: ", labels->size(),
               " --label values for ", files->size(), " files; give one per file or none");
    std::vector<PlotRun> runs;
    for (std::size_t i = 0; i < files->size(); ++i) {
      runs.push_back({(*files)[i], labels->empty() ? std::string() : (*labels)[i]});
    }
    plot_metrics(runs, *output, *options);
    std::cout << "plot: " << files->size() << " run(s) -> " << *output << "\n";
    exit_code = 0;
  });
}

}  // namespace shardtrain::cli
