// What `shardtrain env` reports: versions, backends, CPU features and GEMM speeds,
// for bug reports (env_report.h).
#include "shardtrain/env_report.h"

#include <chrono>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
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

/// The BLAS LibTorch was built with, from its build settings ("BLAS_INFO=mkl,
/// ..."); empty when they do not say. The PyPI wheel links MKL into
/// libtorch_cpu.so, so no BLAS library appears in /proc/self/maps however
/// fast its GEMMs are: the loaded libraries cannot tell.
std::string libtorch_blas() {
  // The key at the start of an entry ("Build settings: BLAS_INFO=mkl, ...").
  static const std::regex key(R"((^|[ ,])BLAS_INFO=([^, \n]+))");
  const std::string settings = at::show_config();
  std::smatch match;
  return std::regex_search(settings, match, key) ? match[2].str() : std::string();
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
  }
  const std::string blas = libtorch_blas();
  add("CPU BLAS (LibTorch's build)", blas.empty() ? "not stated by LibTorch" : blas);
  // "generic" is the reference BLAS, whose fp32 GEMM is many times slower
  // than MKL's or OpenBLAS's; the PyPI wheel says "mkl".
  if (blas.empty() || blas == "generic") {
    report.warnings.push_back("LibTorch was built without an optimised BLAS (BLAS_INFO=" +
                              (blas.empty() ? std::string("unstated") : blas) +
                              "): fp32 GEMMs run on reference code; build against the PyPI torch wheel that "
                              "scripts/setup installs (BLAS_INFO=mkl)");
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
