# Finds LibTorch. First what CMAKE_PREFIX_PATH / Torch_DIR point at, or
# Debian's libtorch-dev; where none is found (SHARDTRAIN_TORCH_FROM_PYTHON
# AUTO) or when asked (ON), the torch package of a python3 interpreter:
# torch.utils.cmake_prefix_path, as a pip-installed CUDA PyTorch on a GPU node
# provides it. A wheel's NCCL (site-packages/nvidia/nccl) is then the one to
# build against: it is the library LibTorch loads.
#
# Sets SHARDTRAIN_TORCH_SOURCE ("prefix path" or "python: <prefix>") and, for
# a wheel, SHARDTRAIN_WHEEL_NCCL_DIR.

set(SHARDTRAIN_TORCH_FROM_PYTHON "AUTO" CACHE STRING
  "Take LibTorch from python3's torch package: AUTO (when no other LibTorch is found), ON, OFF")
set_property(CACHE SHARDTRAIN_TORCH_FROM_PYTHON PROPERTY STRINGS AUTO ON OFF)
string(TOUPPER "${SHARDTRAIN_TORCH_FROM_PYTHON}" _st_from_python)
if(NOT _st_from_python MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "SHARDTRAIN_TORCH_FROM_PYTHON must be AUTO, ON or OFF (got '${SHARDTRAIN_TORCH_FROM_PYTHON}')")
endif()

set(SHARDTRAIN_TORCH_SOURCE "prefix path")
set(SHARDTRAIN_WHEEL_NCCL_DIR "")
if(_st_from_python STREQUAL "AUTO")
  find_package(Torch QUIET)
endif()
if(_st_from_python STREQUAL "ON" OR (_st_from_python STREQUAL "AUTO" AND NOT Torch_FOUND))
  find_package(Python3 COMPONENTS Interpreter)
  if(Python3_Interpreter_FOUND)
    execute_process(COMMAND ${Python3_EXECUTABLE} -c "import torch; print(torch.utils.cmake_prefix_path)"
      OUTPUT_VARIABLE _st_torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
      ERROR_VARIABLE _st_torch_error RESULT_VARIABLE _st_torch_failed)
    if(NOT _st_torch_failed AND EXISTS "${_st_torch_prefix}/Torch/TorchConfig.cmake")
      list(PREPEND CMAKE_PREFIX_PATH "${_st_torch_prefix}")
      set(SHARDTRAIN_TORCH_SOURCE "python: ${_st_torch_prefix}")
      # nvidia-nccl-cuXX is a namespace package: its directory is __path__[0].
      execute_process(COMMAND ${Python3_EXECUTABLE} -c "import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])"
        OUTPUT_VARIABLE _st_nccl_dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _st_nccl_failed)
      if(NOT _st_nccl_failed AND EXISTS "${_st_nccl_dir}/include/nccl.h")
        set(SHARDTRAIN_WHEEL_NCCL_DIR "${_st_nccl_dir}")
      endif()
    elseif(_st_from_python STREQUAL "ON")
      message(FATAL_ERROR "SHARDTRAIN_TORCH_FROM_PYTHON=ON, but ${Python3_EXECUTABLE}'s torch gives no LibTorch "
        "CMake package (torch.utils.cmake_prefix_path = '${_st_torch_prefix}' holds no Torch/TorchConfig.cmake; "
        "${_st_torch_error}). A pip wheel of PyTorch has one (Debian's python3-torch does not: use libtorch-dev); "
        "or pass -DPython3_EXECUTABLE=/path/to/python")
    endif()
  elseif(_st_from_python STREQUAL "ON")
    message(FATAL_ERROR "SHARDTRAIN_TORCH_FROM_PYTHON=ON, but no python3 interpreter was found")
  endif()
endif()
find_package(Torch REQUIRED)
message(STATUS "shardtrain: LibTorch from ${SHARDTRAIN_TORCH_SOURCE}")
