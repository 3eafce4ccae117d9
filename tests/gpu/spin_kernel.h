#pragma once
// launch_spin: one GPU thread that spins on `stream` for about `seconds`,
// counted in cycles of the SM's reported clock (a boosted clock ends it
// sooner). See spin_kernel.cu.

#include <cuda_runtime_api.h>

namespace shardtrain::testing {

cudaError_t launch_spin(cudaStream_t stream, double seconds);

}  // namespace shardtrain::testing
