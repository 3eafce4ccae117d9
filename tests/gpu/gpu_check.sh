#!/usr/bin/env bash
# Builds shardtrain against a CUDA LibTorch and runs the GPU-labelled tests
# (tests/gpu: the CUDA kernels against ATen CPU references, the NCCL backend).
# For a machine with a GPU; CI machines without one build the kernels only.
#
# Usage: tests/gpu/gpu_check.sh [LIBTORCH_DIR]
#   LIBTORCH_DIR, else $LIBTORCH: a CUDA build of LibTorch (the cxx11-ABI zip
#   from pytorch.org, or the directory printed by
#   python -c 'import torch; print(torch.utils.cmake_prefix_path)').
#
# Environment:
#   CUDACXX     nvcc to compile with (default: $CUDA_HOME/bin/nvcc, then
#               /usr/local/cuda/bin/nvcc). Use the toolkit whose major version
#               matches LibTorch's CUDA: a different one puts two CUDA runtimes
#               into the test process.
#   NCCL_HOME   NCCL to link (include/nccl.h, lib/libnccl.so); should be the one
#               LibTorch uses. Default: next to LibTorch, then the CUDA toolkit.
#   CUDA_ARCHS  CMAKE_CUDA_ARCHITECTURES (default 90: H100/H200).
#   BUILD_DIR   build directory (default: <repo>/build-gpu).
#   JOBS        parallel build jobs (default: number of CPUs).
#   STRICT=1    fail instead of warning when the CUDA versions differ.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
libtorch=${1:-${LIBTORCH:-}}
build_dir=${BUILD_DIR:-$repo/build-gpu}
archs=${CUDA_ARCHS:-90}
jobs=${JOBS:-$(nproc)}

die() { echo "gpu_check: $*" >&2; exit 1; }
warn() { echo "gpu_check: warning: $*" >&2; }

[[ -n "$libtorch" ]] || die "pass the CUDA LibTorch directory as the first argument (or set LIBTORCH)"
[[ -f "$libtorch/share/cmake/Torch/TorchConfig.cmake" ]] ||
  die "$libtorch does not look like LibTorch (no share/cmake/Torch/TorchConfig.cmake)"
[[ -e "$libtorch/lib/libtorch_cuda.so" ]] ||
  die "$libtorch is a CPU-only LibTorch (no lib/libtorch_cuda.so); the GPU tests need a CUDA build"

# Without a visible GPU every test would skip and this check would prove nothing.
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: is this a GPU machine with the NVIDIA driver?"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader ||
  die "nvidia-smi sees no GPU"

nvcc=${CUDACXX:-}
if [[ -z "$nvcc" ]]; then
  for candidate in "${CUDA_HOME:-}/bin/nvcc" /usr/local/cuda/bin/nvcc; do
    if [[ -x "$candidate" ]]; then nvcc=$candidate; break; fi
  done
fi
[[ -n "$nvcc" && -x "$nvcc" ]] || die "nvcc not found; set CUDACXX or CUDA_HOME"

# LibTorch's CUDA version: "2.5.1+cu124" in a zip's build-version, or
# torch/version.py's cuda = '12.4' for a pip install.
torch_cuda=""
if [[ -f "$libtorch/build-version" ]]; then
  torch_cuda=$(sed -n 's/.*+cu\([0-9]\{2,3\}\).*/\1/p' "$libtorch/build-version")
  [[ -n "$torch_cuda" ]] && torch_cuda="${torch_cuda%?}.${torch_cuda: -1}"
elif [[ -f "$libtorch/../../version.py" ]]; then
  torch_cuda=$(sed -n "s/^cuda *= *'\([0-9.]*\)'.*/\1/p" "$libtorch/../../version.py")
fi
nvcc_cuda=$("$nvcc" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
echo "gpu_check: LibTorch $libtorch (CUDA ${torch_cuda:-unknown}), nvcc $nvcc (CUDA $nvcc_cuda)"
if [[ -n "$torch_cuda" && "${torch_cuda%%.*}" != "${nvcc_cuda%%.*}" ]]; then
  message="LibTorch was built with CUDA $torch_cuda but nvcc is CUDA $nvcc_cuda: the kernels and the NCCL backend would load a second CUDA runtime next to LibTorch's. Point CUDACXX at a CUDA ${torch_cuda%%.*}.x toolkit."
  if [[ "${STRICT:-0}" == 1 ]]; then die "$message"; else warn "$message"; fi
fi

generator=()
mkdir -p "$build_dir"
log="$build_dir/gpu_check.configure.log"
command -v ninja >/dev/null && generator=(-G Ninja)

cmake -S "$repo" -B "$build_dir" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$libtorch" \
  -DCMAKE_CUDA_COMPILER="$nvcc" \
  -DCMAKE_CUDA_ARCHITECTURES="$archs" \
  -DSHARDTRAIN_CUDA=ON \
  -DSHARDTRAIN_BUILD_TESTS=ON \
  -DSHARDTRAIN_BUILD_BENCH=OFF | tee "$log"
grep -q "CUDA in LibTorch: ON" "$log" ||
  die "CMake did not pick up LibTorch's CUDA (see $log); is another LibTorch found first?"
grep -q "NCCL backend ON" "$log" || warn "the NCCL backend is not built; its tests will skip"

cmake --build "$build_dir" --target shardtrain_gpu_tests --parallel "$jobs"

# The gpu label is set by tests/gpu/CMakeLists.txt; a skipped test (no GPU,
# one GPU for a two-GPU test) shows as "Not Run" with its reason in the log.
ctest --test-dir "$build_dir" -L gpu --output-on-failure --timeout 600
