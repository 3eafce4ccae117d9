#pragma once
// Which bf16 GEMM a CPU process uses, decided once: LibTorch's native kernel
// only where the CPU has native bf16 instructions and a short measurement
// confirms that kernel beats widening to fp32 (it is ~20x slower where
// LibTorch 1.13 falls back to scalar code, and oneDNN can be capped below
// the hardware with DNNL_MAX_CPU_ISA). SHARDTRAIN_CPU_GEMM overrides it.

#include "shardtrain/nn/linear.h"

namespace shardtrain::kernels::cpu {

/// The process-wide choice (thread-safe; measured on first call).
const nn::CpuLowPrecisionGemm& low_precision_gemm_choice();

/// Whether /proc/cpuinfo's flags list `flag` (e.g. "avx512_bf16").
bool cpu_has_flag(const char* flag);

}  // namespace shardtrain::kernels::cpu
