#pragma once
/// @file env_report.h
/// What `shardtrain env` prints: versions and capabilities for bug reports
/// (the equivalent of `accelerate env` / `ds_report`).

#include <string>
#include <utility>
#include <vector>

namespace shardtrain {

struct EnvReport {
  /// (label, value) rows in display order.
  std::vector<std::pair<std::string, std::string>> rows;
  /// Problems worth fixing (e.g. reference BLAS in use), one sentence each.
  std::vector<std::string> warnings;

  std::string to_text() const;
  std::string to_json() const;
};

/// Collects the report. With `measure_gemm`, times a 1024x1024 fp32 and bf16
/// matmul to show which BLAS speed this process gets (about a second).
EnvReport collect_env_report(bool measure_gemm);

}  // namespace shardtrain
