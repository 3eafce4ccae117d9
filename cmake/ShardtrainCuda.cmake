# SHARDTRAIN_CUDA = AUTO | ON | OFF
#
# Wherever nvcc exists the CUDA kernel library is compiled (so CUDA code cannot
# rot on machines without a GPU). The NCCL communicator is compiled wherever the
# CUDA toolkit and NCCL are found; it can only be *used* when LibTorch itself has
# CUDA (CUDA tensors exist), which the runtime factory checks.

set(SHARDTRAIN_WITH_CUDA_KERNELS OFF)
set(SHARDTRAIN_WITH_NCCL OFF)

string(TOUPPER "${SHARDTRAIN_CUDA}" _st_cuda_mode)
if(NOT _st_cuda_mode MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "SHARDTRAIN_CUDA must be AUTO, ON or OFF (got '${SHARDTRAIN_CUDA}')")
endif()

if(NOT _st_cuda_mode STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER)
    find_program(_st_nvcc nvcc HINTS $ENV{CUDA_HOME}/bin /usr/local/cuda/bin)
    if(_st_nvcc)
      set(CMAKE_CUDA_COMPILER ${_st_nvcc})
    endif()
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # The architectures come from TORCH_CUDA_ARCH_LIST (cmake/ShardtrainFindTorch.cmake):
    # torch's CMake config turns CMAKE_CUDA_ARCHITECTURES off and adds its own
    # -gencode flags to every CUDA compile.
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(SHARDTRAIN_WITH_CUDA_KERNELS ON)
    # The NCCL LibTorch loads comes first: a pip wheel's (nvidia/nccl, which
    # ships libnccl.so.2 without the unversioned link), else the one next to
    # LibTorch's own CUDA libraries. Two NCCL copies in one process share
    # symbols but not ncclGroupStart's thread-local state. NCCL_HOME overrides.
    find_path(SHARDTRAIN_NCCL_INCLUDE_DIR nccl.h
      HINTS $ENV{NCCL_HOME}/include ${SHARDTRAIN_WHEEL_NCCL_DIR}/include ${CUDAToolkit_INCLUDE_DIRS})
    find_library(SHARDTRAIN_NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR
      HINTS $ENV{NCCL_HOME}/lib ${SHARDTRAIN_WHEEL_NCCL_DIR}/lib ${TORCH_INSTALL_PREFIX}/lib ${CUDAToolkit_LIBRARY_DIR})
    if(SHARDTRAIN_WHEEL_NCCL_DIR AND SHARDTRAIN_NCCL_INCLUDE_DIR
       AND NOT SHARDTRAIN_NCCL_INCLUDE_DIR STREQUAL "${SHARDTRAIN_WHEEL_NCCL_DIR}/include")
      message(WARNING "NCCL headers from ${SHARDTRAIN_NCCL_INCLUDE_DIR}, but LibTorch loads the NCCL of its wheel "
        "(${SHARDTRAIN_WHEEL_NCCL_DIR}); the NCCL backend checks the versions when it starts")
    endif()
    # The backend needs non-blocking communicators (a rank that never joins must
    # end in a timeout, not a hang inside ncclCommInitRank) and ncclCommFinalize:
    # NCCL 2.14; ncclAvg and ncclBfloat16 came in 2.10.
    set(_st_nccl_version "")
    if(SHARDTRAIN_NCCL_INCLUDE_DIR)
      file(STRINGS ${SHARDTRAIN_NCCL_INCLUDE_DIR}/nccl.h _st_nccl_defines
        REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
      foreach(_st_part MAJOR MINOR PATCH)
        set(_st_nccl_${_st_part} 0)
        foreach(_st_line IN LISTS _st_nccl_defines)
          if(_st_line MATCHES "^#define NCCL_${_st_part} +([0-9]+)")
            set(_st_nccl_${_st_part} ${CMAKE_MATCH_1})
          endif()
        endforeach()
      endforeach()
      set(_st_nccl_version "${_st_nccl_MAJOR}.${_st_nccl_MINOR}.${_st_nccl_PATCH}")
      if(_st_nccl_version VERSION_LESS 2.14)
        message(WARNING "NCCL ${_st_nccl_version} at ${SHARDTRAIN_NCCL_INCLUDE_DIR} is older than 2.14 "
          "(non-blocking communicators); the NCCL backend is not built. Set NCCL_HOME to a newer NCCL.")
        set(SHARDTRAIN_NCCL_INCLUDE_DIR SHARDTRAIN_NCCL_INCLUDE_DIR-NOTFOUND)
      endif()
    endif()
    if(SHARDTRAIN_NCCL_INCLUDE_DIR AND SHARDTRAIN_NCCL_LIBRARY)
      set(SHARDTRAIN_WITH_NCCL ON)
      message(STATUS "shardtrain: NCCL ${_st_nccl_version}: ${SHARDTRAIN_NCCL_INCLUDE_DIR}, ${SHARDTRAIN_NCCL_LIBRARY}")
      add_library(shardtrain_nccl_deps INTERFACE)
      target_include_directories(shardtrain_nccl_deps INTERFACE ${SHARDTRAIN_NCCL_INCLUDE_DIR})
      target_link_libraries(shardtrain_nccl_deps INTERFACE ${SHARDTRAIN_NCCL_LIBRARY} CUDA::cudart)
    endif()
  elseif(_st_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "SHARDTRAIN_CUDA=ON but no CUDA compiler (nvcc) was found. "
      "Install the CUDA toolkit, set CUDACXX or CMAKE_CUDA_COMPILER, or use -DSHARDTRAIN_CUDA=AUTO.")
  endif()
endif()

if(_st_cuda_mode STREQUAL "ON" AND NOT SHARDTRAIN_WITH_NCCL)
  message(FATAL_ERROR "SHARDTRAIN_CUDA=ON but NCCL (nccl.h, libnccl) was not found. Set NCCL_HOME.")
endif()

message(STATUS "shardtrain: CUDA kernels ${SHARDTRAIN_WITH_CUDA_KERNELS}, NCCL backend ${SHARDTRAIN_WITH_NCCL}")
