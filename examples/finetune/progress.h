#pragma once
// Console progress bar and summary table for the fine-tune examples (rank 0).
//
// Written by hand: Debian packages no C++ progress-bar or table library
// (indicators, tabulate and the like are not in Debian 12), and what the
// examples need is one redrawn line plus an aligned two-column table.

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace finetune {

inline std::string format_duration(double seconds) {
  if (!(seconds >= 0) || seconds > 1e7) return "--:--";
  const long total = static_cast<long>(seconds + 0.5);
  char text[32];
  if (total >= 3600) {
    std::snprintf(text, sizeof text, "%ld:%02ld:%02ld", total / 3600, (total / 60) % 60, total % 60);
  } else {
    std::snprintf(text, sizeof text, "%02ld:%02ld", total / 60, total % 60);
  }
  return text;
}

inline std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024 && unit < 4) {
    bytes /= 1024;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof text, unit == 0 ? "%.0f %s" : "%.1f %s", bytes, units[unit]);
  return text;
}

/// One line: `step 40/300 [#####.....] loss 1.234 lr 1.0e-03 2500 tok/s ETA 01:23`.
/// On a terminal the line is redrawn in place; otherwise (a log file, the
/// launcher's pipe) a full line is printed every `every` steps and at the end,
/// so logs stay readable. The loss shown is the mean over the steps since the
/// line before, as the Trainer logs the mean over its logging_steps (a single
/// step's loss says little about a noisy run); the metrics file has each step's.
class ProgressBar {
 public:
  /// `interactive` unset: whether stdout is a terminal. `out`: where it prints (tests pass a stream).
  ProgressBar(int64_t total, int64_t first, bool enabled, int64_t every, std::optional<bool> interactive = {},
              std::ostream& out = std::cout)
      : total_(total), first_(first), enabled_(enabled), every_(std::max<int64_t>(1, every)),
        interactive_(interactive.value_or(isatty(STDOUT_FILENO) == 1)), out_(out),
        start_(std::chrono::steady_clock::now()) {}

  void update(int64_t step, double loss, double lr, double tokens_per_s) {
    if (!enabled_) return;
    loss_sum_ += loss;
    ++losses_;
    const bool last = step == total_;
    if (!interactive_ && !last && step != first_ + 1 && step % every_ != 0) return;
    loss = loss_sum_ / static_cast<double>(losses_);
    loss_sum_ = 0;
    losses_ = 0;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    const int64_t done = step - first_;
    const double eta = done > 0 ? elapsed / done * static_cast<double>(total_ - step) : -1;
    const int width = 24;
    const int filled = total_ > 0 ? static_cast<int>(width * step / total_) : width;
    std::ostringstream line;
    line << "step " << step << "/" << total_ << " [" << std::string(filled, '#') << std::string(width - filled, '.')
         << "] loss ";
    char numbers[160];
    std::snprintf(numbers, sizeof numbers, "%.4f  lr %.2e  %.0f tok/s  elapsed %s  ETA %s", loss, lr, tokens_per_s,
                  format_duration(elapsed).c_str(), format_duration(eta).c_str());
    line << numbers;
    if (interactive_) {
      out_ << "\r" << line.str() << "\x1b[K" << (last ? "\n" : "") << std::flush;
    } else {
      out_ << line.str() << std::endl;
    }
  }

  /// Ends the redrawn line before other output.
  void interrupt() {
    if (enabled_ && interactive_) out_ << std::endl;
  }

 private:
  int64_t total_, first_;
  bool enabled_;
  int64_t every_;
  bool interactive_;
  std::ostream& out_;
  std::chrono::steady_clock::time_point start_;
  double loss_sum_ = 0;  // over the steps since the last line printed
  int64_t losses_ = 0;
};

/// Two aligned columns with a title rule.
class SummaryTable {
 public:
  void add(std::string key, std::string value) { rows_.emplace_back(std::move(key), std::move(value)); }

  std::string render(const std::string& title) const {
    size_t key_width = 0, value_width = title.size();
    for (const auto& [key, value] : rows_) {
      key_width = std::max(key_width, key.size());
      value_width = std::max(value_width, key_width + 3 + value.size());
    }
    std::ostringstream out;
    const std::string rule(std::max(value_width, key_width + 3), '-');
    out << rule << "\n" << title << "\n" << rule << "\n";
    for (const auto& [key, value] : rows_) {
      out << key << std::string(key_width - key.size(), ' ') << " | " << value << "\n";
    }
    out << rule << "\n";
    return out.str();
  }

 private:
  std::vector<std::pair<std::string, std::string>> rows_;
};

}  // namespace finetune
