#pragma once
// Which bf16 GEMM a CPU process uses, decided once and the same way on every
// rank: LibTorch's native kernel where the CPU has native bf16 instructions
// (and that kernel runs), else widened to fp32. No timing decides it: the
// two paths round differently. SHARDTRAIN_CPU_GEMM overrides it.

#include "shardtrain/nn/linear.h"

namespace shardtrain::kernels::cpu {

/// The process-wide choice (thread-safe; measured on first call).
const nn::CpuLowPrecisionGemm& low_precision_gemm_choice();

/// Whether /proc/cpuinfo's flags list `flag` (e.g. "avx512_bf16").
bool cpu_has_flag(const char* flag);

}  // namespace shardtrain::kernels::cpu
