# Finds LibTorch and checks that it is the platform shardtrain builds on:
# PyTorch 2.11 or newer with CUDA, as PyPI's default Linux wheel ships it
# (scripts/setup installs torch==2.11.0 into the project's .venv).
#
# Where it comes from, in order: CMAKE_PREFIX_PATH / Torch_DIR (a LibTorch
# zip), else the torch package of a python3 (torch.utils.cmake_prefix_path):
# by default the project's own .venv, else -DPython3_EXECUTABLE. The wheel's
# NCCL (site-packages/nvidia/nccl) is then the one to build against: it is the
# library LibTorch loads.
#
# Every refusal names its fix: no torch, a torch older than 2.11, a CPU-only
# wheel, a CUDA toolkit whose major version differs from the wheel's, and a
# build directory configured against another LibTorch.
#
# Sets SHARDTRAIN_TORCH_SOURCE, SHARDTRAIN_WHEEL_NCCL_DIR (a wheel's NCCL, or
# ""), SHARDTRAIN_TORCH_CUDA_VERSION ("13.0").

set(SHARDTRAIN_MIN_TORCH_VERSION 2.11)
set(_st_setup_hint "run scripts/setup (it installs torch==2.11.0, the CUDA 13.0 build, from PyPI into .venv)")

# The GPU architectures every CUDA file is compiled for. Torch's CMake config
# reads TORCH_CUDA_ARCH_LIST (the variable, else the environment variable) and
# adds -gencode flags to CMAKE_CUDA_FLAGS; it sets CMAKE_CUDA_ARCHITECTURES to
# OFF, so that variable has no effect. Ampere (8.0), Hopper (9.0) and Blackwell
# (10.0) are what this project's GPU users run; scripts/gpu-bundle narrows it.
# The last one also carries its PTX (+PTX), which the driver compiles for a
# newer GPU (sm_120, say) instead of failing with "no kernel image".
if(NOT DEFINED TORCH_CUDA_ARCH_LIST)
  if(DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    set(_st_default_archs "$ENV{TORCH_CUDA_ARCH_LIST}")
  else()
    set(_st_default_archs "8.0;9.0;10.0+PTX")
  endif()
  set(TORCH_CUDA_ARCH_LIST "${_st_default_archs}" CACHE STRING
    "GPU architectures of the CUDA kernels, as torch reads them (e.g. 8.0;9.0;10.0+PTX)")
endif()

if(NOT DEFINED Python3_EXECUTABLE AND EXISTS "${PROJECT_SOURCE_DIR}/.venv/bin/python3")
  set(Python3_EXECUTABLE "${PROJECT_SOURCE_DIR}/.venv/bin/python3" CACHE FILEPATH "python3 whose torch to build against")
endif()

set(SHARDTRAIN_TORCH_SOURCE "prefix path")
set(SHARDTRAIN_WHEEL_NCCL_DIR "")
find_package(Torch QUIET)
if(NOT Torch_FOUND)
  find_package(Python3 COMPONENTS Interpreter)
  if(NOT Python3_Interpreter_FOUND)
    message(FATAL_ERROR "shardtrain: no LibTorch found and no python3 to ask for one: ${_st_setup_hint}")
  endif()
  execute_process(COMMAND ${Python3_EXECUTABLE} -c "import torch; print(torch.utils.cmake_prefix_path)"
    OUTPUT_VARIABLE _st_torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
    ERROR_VARIABLE _st_torch_error RESULT_VARIABLE _st_torch_failed)
  if(_st_torch_failed OR NOT EXISTS "${_st_torch_prefix}/Torch/TorchConfig.cmake")
    string(STRIP "${_st_torch_error}" _st_torch_error)
    message(FATAL_ERROR "shardtrain: ${Python3_EXECUTABLE} has no usable torch (${_st_torch_error}): "
      "${_st_setup_hint}, or point -DPython3_EXECUTABLE at a python with torch>=${SHARDTRAIN_MIN_TORCH_VERSION}, "
      "or -DCMAKE_PREFIX_PATH at a LibTorch")
  endif()
  list(PREPEND CMAKE_PREFIX_PATH "${_st_torch_prefix}")
  set(SHARDTRAIN_TORCH_SOURCE "python: ${Python3_EXECUTABLE}")
  # nvidia-nccl-cuXX is a namespace package: its directory is __path__[0].
  execute_process(COMMAND ${Python3_EXECUTABLE} -c "import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])"
    OUTPUT_VARIABLE _st_nccl_dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _st_nccl_failed)
  if(NOT _st_nccl_failed AND EXISTS "${_st_nccl_dir}/include/nccl.h")
    set(SHARDTRAIN_WHEEL_NCCL_DIR "${_st_nccl_dir}")
  endif()
endif()

# The version and the CUDA build are read from the package's own files before
# torch's CMake config runs: that config fails on a toolkit mismatch with a
# message that does not name the fix, and needs nvcc to exist at all.
if(Torch_DIR)
  get_filename_component(_st_torch_root "${Torch_DIR}/../../.." ABSOLUTE)
else()
  get_filename_component(_st_torch_root "${_st_torch_prefix}/../.." ABSOLUTE)
endif()
set(_st_version_file "")
foreach(_st_candidate "${_st_torch_root}/include/torch/headeronly/version.h" "${_st_torch_root}/include/torch/csrc/api/include/torch/version.h")
  if(NOT _st_version_file AND EXISTS "${_st_candidate}")
    set(_st_version_file "${_st_candidate}")
  endif()
endforeach()
set(_st_torch_version "")
if(_st_version_file)
  file(STRINGS "${_st_version_file}" _st_version_lines REGEX "^#define TORCH_VERSION_(MAJOR|MINOR|PATCH) ")
  foreach(_st_part MAJOR MINOR PATCH)
    foreach(_st_line IN LISTS _st_version_lines)
      if(_st_line MATCHES "^#define TORCH_VERSION_${_st_part} ([0-9]+)")
        set(_st_v_${_st_part} ${CMAKE_MATCH_1})
      endif()
    endforeach()
  endforeach()
  set(_st_torch_version "${_st_v_MAJOR}.${_st_v_MINOR}.${_st_v_PATCH}")
endif()
if(NOT _st_torch_version OR _st_torch_version VERSION_LESS SHARDTRAIN_MIN_TORCH_VERSION)
  message(FATAL_ERROR "shardtrain: LibTorch at ${_st_torch_root} is version '${_st_torch_version}'; shardtrain needs "
    "${SHARDTRAIN_MIN_TORCH_VERSION} or newer (Debian's libtorch-dev 1.13 is no longer supported): ${_st_setup_hint}")
endif()
# The wheel records the CUDA it was built with in torch/version.py ("cuda = None" on a CPU-only wheel);
# a LibTorch zip in build-version.txt-less form is judged by its torch_cuda library below.
set(SHARDTRAIN_TORCH_CUDA_VERSION "")
if(EXISTS "${_st_torch_root}/version.py")
  file(STRINGS "${_st_torch_root}/version.py" _st_cuda_line REGEX "^cuda")
  if(_st_cuda_line MATCHES "'([0-9]+\\.[0-9]+)'")
    set(SHARDTRAIN_TORCH_CUDA_VERSION ${CMAKE_MATCH_1})
  elseif(_st_cuda_line MATCHES "None")
    message(FATAL_ERROR "shardtrain: the torch at ${_st_torch_root} is a CPU-only build (torch.version.cuda is None). "
      "shardtrain builds its CUDA kernels and NCCL backend in every build, against the CUDA wheel GPU users have: "
      "pip install torch==2.11.0 from PyPI's default index (not the /whl/cpu one), or ${_st_setup_hint}")
  endif()
endif()
if(SHARDTRAIN_TORCH_CUDA_VERSION)
  find_program(_st_nvcc_for_check nvcc HINTS $ENV{CUDA_HOME}/bin /usr/local/cuda/bin)
  if(NOT _st_nvcc_for_check)
    message(FATAL_ERROR "shardtrain: torch ${_st_torch_version} is built with CUDA ${SHARDTRAIN_TORCH_CUDA_VERSION}, "
      "but no nvcc was found: install the CUDA ${SHARDTRAIN_TORCH_CUDA_VERSION} toolkit (/usr/local/cuda) or set CUDA_HOME")
  endif()
  execute_process(COMMAND ${_st_nvcc_for_check} --version OUTPUT_VARIABLE _st_nvcc_out ERROR_QUIET)
  string(REGEX MATCH "release ([0-9]+)\\.([0-9]+)" _st_nvcc_release "${_st_nvcc_out}")
  set(_st_nvcc_major ${CMAKE_MATCH_1})
  string(REGEX MATCH "^[0-9]+" _st_wheel_cuda_major "${SHARDTRAIN_TORCH_CUDA_VERSION}")
  if(NOT _st_nvcc_major STREQUAL _st_wheel_cuda_major)
    message(FATAL_ERROR "shardtrain: torch ${_st_torch_version} is built with CUDA ${SHARDTRAIN_TORCH_CUDA_VERSION}, "
      "but ${_st_nvcc_for_check} is CUDA ${CMAKE_MATCH_1}.${CMAKE_MATCH_2}: the kernels must be compiled by the "
      "same CUDA major version. Point CUDA_HOME (or -DCMAKE_CUDA_COMPILER) at a CUDA ${_st_wheel_cuda_major} toolkit, "
      "or install the torch wheel built for CUDA ${_st_nvcc_major}")
  endif()
endif()

# A build directory stays with the LibTorch it was configured with: objects
# and the precompiled header compiled against one LibTorch do not link with
# another (say, after an upgrade of the venv's torch).
set(_st_torch_identity "${_st_torch_version} at ${_st_torch_root}")
if(DEFINED CACHE{SHARDTRAIN_CONFIGURED_TORCH} AND NOT SHARDTRAIN_CONFIGURED_TORCH STREQUAL _st_torch_identity)
  message(FATAL_ERROR "shardtrain: this build directory (${CMAKE_BINARY_DIR}) was configured against LibTorch "
    "${SHARDTRAIN_CONFIGURED_TORCH}, and now finds ${_st_torch_identity}. Its objects and precompiled header "
    "belong to the first one: delete ${CMAKE_BINARY_DIR} (or at least ${CMAKE_BINARY_DIR}/CMakeCache.txt and "
    "${CMAKE_BINARY_DIR}/CMakeFiles) and configure again.")
endif()
set(SHARDTRAIN_CONFIGURED_TORCH "${_st_torch_identity}" CACHE INTERNAL "LibTorch this build directory was configured with")

find_package(Torch REQUIRED)
if(NOT TARGET torch_cuda)
  message(FATAL_ERROR "shardtrain: LibTorch ${_st_torch_version} at ${_st_torch_root} has no torch_cuda library (a "
    "CPU-only build): ${_st_setup_hint}")
endif()
# The CUDA runtime and NVRTC LibTorch loads, not the toolkit's copies
# (ShardtrainCudaRuntimes.cmake says why). libshardtrain's search path is an
# RPATH (CMakeLists.txt), so an LD_LIBRARY_PATH naming the toolkit does not
# put its copy back in front.
include(ShardtrainCudaRuntimes)
shardtrain_use_torch_cuda_runtimes("${TORCH_INSTALL_PREFIX}" SHARDTRAIN_CUDART_LIBRARY)
if(SHARDTRAIN_CUDART_LIBRARY)
  message(STATUS "shardtrain: CUDA runtime ${SHARDTRAIN_CUDART_LIBRARY} (the one LibTorch loads)")
else()
  message(STATUS "shardtrain: the CUDA toolkit's runtime: ldd names no libcudart.so for "
    "${TORCH_INSTALL_PREFIX}/lib/libtorch_cuda.so (a LibTorch that bundles its runtime under another name, "
    "or a cross build)")
endif()
# LibTorch 2.12 and later need C++20 in their headers.
if(_st_torch_version VERSION_GREATER_EQUAL 2.12 AND CMAKE_CXX_STANDARD LESS 20)
  set(CMAKE_CXX_STANDARD 20)
endif()
message(STATUS "shardtrain: LibTorch ${_st_torch_version} (CUDA ${SHARDTRAIN_TORCH_CUDA_VERSION}) from ${SHARDTRAIN_TORCH_SOURCE}, C++${CMAKE_CXX_STANDARD}")
