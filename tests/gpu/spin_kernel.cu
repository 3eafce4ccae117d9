// A kernel that keeps a stream busy for a given time: the GPU tests use it to
// hold a collective back on its stream until the watchdog's deadline has
// passed (a hang that needs no second GPU).

#include "spin_kernel.h"

namespace shardtrain::testing {
namespace {

__global__ void spin_for(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

}  // namespace

cudaError_t launch_spin(cudaStream_t stream, double seconds) {
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  int khz = 0;  // the SM clock; clock64() counts its cycles
  status = cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device);
  if (status != cudaSuccess) return status;
  spin_for<<<1, 1, 0, stream>>>(static_cast<long long>(seconds * khz * 1000.0));
  return cudaGetLastError();
}

}  // namespace shardtrain::testing
