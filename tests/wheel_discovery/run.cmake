# Configures shardtrain the way a GPU node with a pip-installed PyTorch does
# (SHARDTRAIN_TORCH_FROM_PYTHON=ON): a stand-in python whose `torch` package
# answers torch.utils.cmake_prefix_path with this build's LibTorch CMake
# directory, and whose `nvidia.nccl` package holds include/nccl.h and
# lib/libnccl.so.2 (only the versioned name, as the wheels ship it). Checks
# that LibTorch and NCCL come from there.
#
# -D SOURCE_DIR=... -D WORK_DIR=... -D GENERATOR=... -D TORCH_CMAKE_DIR=...
# [-D NCCL_HEADER=.../nccl.h -D NCCL_LIBRARY=.../libnccl.so.2]
file(REMOVE_RECURSE ${WORK_DIR})
set(site ${WORK_DIR}/site-packages)
file(MAKE_DIRECTORY ${site}/torch)
file(WRITE ${site}/torch/__init__.py
  "class utils:\n    cmake_prefix_path = '${TORCH_CMAKE_DIR}'\n")
if(NCCL_HEADER AND NCCL_LIBRARY)
  file(MAKE_DIRECTORY ${site}/nvidia/nccl/include ${site}/nvidia/nccl/lib)
  file(CREATE_LINK ${NCCL_HEADER} ${site}/nvidia/nccl/include/nccl.h SYMBOLIC)
  file(REAL_PATH ${NCCL_LIBRARY} nccl_real)
  file(CREATE_LINK ${nccl_real} ${site}/nvidia/nccl/lib/libnccl.so.2 SYMBOLIC)
endif()
find_program(python3 NAMES python3 REQUIRED)
file(WRITE ${WORK_DIR}/python "#!/bin/sh\nPYTHONPATH='${site}' exec '${python3}' \"$@\"\n")
file(CHMOD ${WORK_DIR}/python PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE)

execute_process(
  COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
    -DSHARDTRAIN_TORCH_FROM_PYTHON=ON -DPython3_EXECUTABLE=${WORK_DIR}/python
    -DSHARDTRAIN_BUILD_TESTS=OFF -DSHARDTRAIN_BUILD_EXAMPLES=OFF -DSHARDTRAIN_BUILD_BENCH=OFF
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(rc)
  message(FATAL_ERROR "configuring from the python torch failed")
endif()
string(FIND "${out}" "LibTorch from python: ${TORCH_CMAKE_DIR}" torch_found)
if(torch_found EQUAL -1)
  message(FATAL_ERROR "LibTorch was not taken from the python torch package")
endif()
if(NCCL_HEADER AND NCCL_LIBRARY)
  string(FIND "${out}" "${site}/nvidia/nccl/include, ${site}/nvidia/nccl/lib/libnccl.so.2" nccl_found)
  if(nccl_found EQUAL -1)
    message(FATAL_ERROR "NCCL was not taken from the wheel's nvidia/nccl (headers and libnccl.so.2)")
  endif()
endif()
message("ok: LibTorch and NCCL from the python packages")
