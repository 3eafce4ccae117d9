// Decides once per process how bf16 GEMMs run on the CPU (cpu_gemm_choice.h).
#include "kernels/cpu/cpu_gemm_choice.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <string>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>

#include "shardtrain/error.h"

namespace shardtrain::kernels::cpu {
namespace {

std::string cpuinfo_flags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) == 0) {
      auto colon = line.find(':');
      if (colon != std::string::npos) return " " + line.substr(colon + 1) + " ";
    }
  }
  return " ";
}

bool env_flag(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && std::string(value) != "0" && std::string(value) != "";
}

nn::CpuLowPrecisionGemm decide() {
  nn::CpuLowPrecisionGemm choice;
  choice.native_bf16_cpu = cpu_has_flag("avx512_bf16") || cpu_has_flag("amx_bf16");
  const bool onednn_off = env_flag("SHARDTRAIN_CPU_DISABLE_ONEDNN");
  if (onednn_off) {
    // Developer switch: LibTorch then routes bf16 GEMMs exactly as on a CPU
    // without AVX-512 (its scalar fallback), so an AVX-512 machine reproduces
    // an AVX2-only one. DNNL_MAX_CPU_ISA=AVX2 does not: oneDNN 2.6 then has
    // no bf16 matmul at all and LibTorch throws.
    at::globalContext().setUserEnabledMkldnn(false);
    choice.native_bf16_cpu = false;
  }
  const char* forced = std::getenv("SHARDTRAIN_CPU_GEMM");
  const std::string mode = forced == nullptr ? "auto" : forced;
  ST_CHECK_T(ConfigError, mode == "auto" || mode == "native" || mode == "widened",
             "SHARDTRAIN_CPU_GEMM='", mode, "' is not one of auto, native, widened");
  if (mode != "auto") {
    choice.widened = mode == "widened";
    choice.reason = "SHARDTRAIN_CPU_GEMM=" + mode;
    return choice;
  }
  if (onednn_off) {
    choice.widened = true;
    choice.reason = "SHARDTRAIN_CPU_DISABLE_ONEDNN=1: oneDNN is off, LibTorch's bf16 GEMM runs as on a CPU without AVX-512";
    return choice;
  }
  if (!choice.native_bf16_cpu) {
    // No bf16 instructions: any native kernel emulates them, and LibTorch
    // 2.11's falls back to its generic scalar GEMM (cpublas_gemm_impl; 63x
    // slower than fp32 at 512^3, docs/precision.md). Deciding without a
    // measurement keeps every run on such a CPU on the same (deterministic)
    // path.
    choice.widened = true;
    choice.reason = "the CPU has no native bf16 (no avx512_bf16 or amx_bf16)";
    return choice;
  }
  // Native bf16 hardware: LibTorch's own kernel (oneDNN), unless it fails
  // here (oneDNN capped by DNNL_MAX_CPU_ISA, or a build that does not route
  // bf16 to it). Never by a timing: every rank of a job, and every run, must
  // take the same path, because the two round differently. (A 512^3 race
  // between the two used to decide; on the PyTorch 2.11 wheel, whose fp32
  // GEMM is MKL's, they ran close enough that load flipped it, and ranks of
  // one job computed different bits.)
  at::NoGradGuard no_grad;
  try {
    const at::Tensor a = at::ones({8, 8}, at::kBFloat16);
    (void)at::mm(a, a);
  } catch (const std::exception& failure) {
    choice.widened = true;
    choice.reason = std::string("LibTorch's native bf16 GEMM failed here (") + failure.what() + ")";
    choice.reason = choice.reason.substr(0, choice.reason.find('\n'));
    return choice;
  }
  choice.widened = false;
  choice.reason = "the CPU has native bf16 (avx512_bf16 or amx_bf16)";
  return choice;
}

}  // namespace

bool cpu_has_flag(const char* flag) {
  static const std::string flags = cpuinfo_flags();
  return flags.find(std::string(" ") + flag + " ") != std::string::npos;
}

const nn::CpuLowPrecisionGemm& low_precision_gemm_choice() {
  static std::once_flag once;
  static nn::CpuLowPrecisionGemm choice;
  std::call_once(once, [] { choice = decide(); });
  return choice;
}

}  // namespace shardtrain::kernels::cpu
