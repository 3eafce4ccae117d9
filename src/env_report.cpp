#include "shardtrain/env_report.h"

#include <chrono>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <torch/version.h>

#include "comm/gloo/gloo_factory.h"
#include "comm/nccl/nccl_factory.h"
#include "kernels/cpu/cpu_gemm_choice.h"
#include "shardtrain/kernels.h"
#include "shardtrain/nn/linear.h"
#include "shardtrain/version.h"

namespace shardtrain {
namespace {

std::string read_first_match(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) {
      auto colon = line.find(':');
      if (colon != std::string::npos) {
        std::string value = line.substr(colon + 1);
        value.erase(0, value.find_first_not_of(" \t"));
        return value;
      }
    }
  }
  return {};
}

/// The BLAS this process actually loaded, from /proc/self/maps: Debian's
/// libblas.so.3 is an alternatives link, so the build config cannot tell.
std::vector<std::string> loaded_blas_libraries() {
  std::ifstream maps("/proc/self/maps");
  std::set<std::string> found;
  std::string line;
  while (std::getline(maps, line)) {
    auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    std::string path = line.substr(slash);
    if (path.find("blas") != std::string::npos || path.find("mkl") != std::string::npos ||
        path.find("lapack") != std::string::npos) {
      found.insert(path);
    }
  }
  return {found.begin(), found.end()};
}

/// `through_shardtrain`: the path training uses (shardtrain::nn::matmul),
/// else LibTorch's own kernel for the dtype.
double gemm_gflops(at::ScalarType dtype, bool through_shardtrain) {
  const int64_t n = 1024;
  at::NoGradGuard no_grad;
  at::Tensor a = at::randn({n, n}).to(dtype);
  at::Tensor b = at::randn({n, n}).to(dtype);
  auto multiply = [&] { return through_shardtrain ? nn::matmul(a, b) : at::mm(a, b); };
  multiply();  // warm-up: first call loads kernels
  int reps = 0;
  auto start = std::chrono::steady_clock::now();
  double elapsed = 0;
  do {
    multiply();
    ++reps;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  } while (elapsed < 0.4);
  return 2.0 * n * n * n * reps / elapsed / 1e9;
}

}  // namespace

EnvReport collect_env_report(bool measure_gemm) {
  EnvReport report;
  auto add = [&](std::string k, std::string v) { report.rows.emplace_back(std::move(k), std::move(v)); };
  add("shardtrain", SHARDTRAIN_VERSION_STRING);
  add("LibTorch", TORCH_VERSION);
  add("NCCL backend", comm::nccl_version_string().empty() ? "not compiled"
                                                          : "compiled, NCCL " + comm::nccl_version_string());
  add("NCCL usable", comm::nccl_usable() ? "yes" : "no: " + comm::nccl_unavailable_reason());
  add("CUDA kernels", kernels::has_kernels_for(c10::DeviceType::CUDA) ? "compiled"
                                                                      : "not compiled (no nvcc at configure time)");
  add("Gloo backend", comm::gloo_available() ? "yes (c10d::ProcessGroupGloo)"
                                             : "no (built without gloo headers: CPU runs are single-process)");
  add("intra-op threads", std::to_string(at::get_num_threads()));
  add("hardware threads", std::to_string(std::thread::hardware_concurrency()));
  std::string cpu = read_first_match("/proc/cpuinfo", "model name");
  add("CPU", cpu.empty() ? "unknown" : cpu);
  std::string features;
  for (const char* f : {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"}) {
    if (kernels::cpu::cpu_has_flag(f)) features += std::string(features.empty() ? "" : " ") + f;
  }
  add("CPU features", features.empty() ? "none of avx2/avx512/amx" : features);
  add("CPU bf16 GEMM", nn::cpu_low_precision_gemm().describe());

  if (measure_gemm) {
    std::ostringstream fp32;
    fp32.precision(1);
    fp32 << std::fixed << gemm_gflops(at::kFloat, false) << " GFLOP/s";
    add("fp32 GEMM 1024^3", fp32.str());
    std::ostringstream native;
    native.precision(1);
    try {
      native << std::fixed << gemm_gflops(at::kBFloat16, false) << " GFLOP/s";
    } catch (const std::exception& failure) {
      const std::string what = failure.what();
      native << "fails: " << what.substr(0, what.find('\n'));
    }
    add("bf16 GEMM 1024^3, LibTorch", native.str());
    std::ostringstream ours;
    ours.precision(1);
    ours << std::fixed << gemm_gflops(at::kBFloat16, true) << " GFLOP/s";
    add("bf16 GEMM 1024^3, shardtrain::nn", ours.str());
  } else {
    at::mm(at::ones({8, 8}), at::ones({8, 8}));  // make sure the BLAS is loaded before reading maps
  }
  auto blas = loaded_blas_libraries();
  std::string blas_text;
  bool openblas = false;
  for (const auto& path : blas) {
    blas_text += (blas_text.empty() ? "" : ", ") + path;
    if (path.find("openblas") != std::string::npos || path.find("mkl") != std::string::npos) openblas = true;
  }
  add("BLAS loaded", blas_text.empty() ? "none found in /proc/self/maps" : blas_text);
  if (!openblas) {
    report.warnings.push_back(
        "LibTorch is using the reference BLAS: fp32 matmul runs ~30x slower. "
        "Install an optimised one: apt-get install libopenblas0-pthread (scripts/setup does this).");
  }
  return report;
}

std::string EnvReport::to_text() const {
  std::size_t width = 0;
  for (const auto& [k, v] : rows) width = std::max(width, k.size());
  std::ostringstream out;
  for (const auto& [k, v] : rows) out << "- " << k << std::string(width - k.size(), ' ') << " : " << v << "\n";
  for (const auto& w : warnings) out << "WARNING: " << w << "\n";
  return out.str();
}

std::string EnvReport::to_json() const {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [k, v] : rows) j[k] = v;
  j["warnings"] = warnings;
  return j.dump(2);
}

}  // namespace shardtrain
