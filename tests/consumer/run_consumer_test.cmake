# ctest script: install the build into a scratch prefix, then configure, build
# and run tests/consumer against it with find_package(shardtrain).
foreach(var SOURCE_DIR BUILD_DIR WORK_DIR GENERATOR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_consumer_test.cmake needs -D${var}=...")
  endif()
endforeach()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT code EQUAL 0)
    message(FATAL_ERROR "command failed (${code}): ${ARGN}\n${out}\n${err}")
  endif()
  set(LAST_OUTPUT "${out}" PARENT_SCOPE)
endfunction()

run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
# The LibTorch shardtrain was built against, found as an outside project finds it.
set(ENV{CMAKE_PREFIX_PATH} "${TORCH_PREFIX}")
run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/consumer)
if(NOT LAST_OUTPUT MATCHES "consumer ok: shardtrain [0-9]+\\.[0-9]+\\.[0-9]+, world 1, sum 4")
  message(FATAL_ERROR "consumer printed something unexpected: ${LAST_OUTPUT}")
endif()
message(STATUS "${LAST_OUTPUT}")
# The outside program runs LibTorch on the CUDA runtime LibTorch ships (the
# wheel's nvidia/cu13/lib), not a toolkit's copy found first: through the
# installed libshardtrain's RPATH (CMakeLists.txt, CMAKE_INSTALL_RPATH), and,
# since the program calls the CUDA runtime itself and so NEEDs libcudart
# through its own RUNPATH, through the CUDA::cudart that shardtrainConfig.cmake
# points at LibTorch's copy (cmake/ShardtrainCudaRuntimes.cmake).
if(NOT LAST_OUTPUT MATCHES "consumer calls the CUDA runtime [0-9]+")
  message(FATAL_ERROR "the consumer was built without its CUDA runtime call (no CUDA::cudart after "
    "find_package(shardtrain)): ${LAST_OUTPUT}")
endif()
run(readelf -d ${WORK_DIR}/build/consumer)
if(NOT LAST_OUTPUT MATCHES "NEEDED[^\n]*libcudart\\.so")
  message(FATAL_ERROR "the consumer does not need libcudart itself, so this test would not see which copy "
    "its own search path finds:\n${LAST_OUTPUT}")
endif()
if(NOT LAST_OUTPUT MATCHES "\\((RUN)?PATH\\)[^\n]*\\[([^]\n]*)\\]")
  message(FATAL_ERROR "the consumer has no library search path:\n${LAST_OUTPUT}")
endif()
string(REPLACE ":" ";" search_path "${CMAKE_MATCH_2}")
run(ldd ${WORK_DIR}/build/consumer)
if(NOT LAST_OUTPUT MATCHES "libcudart\\.so\\.[0-9]+ => ([^\n]*/nvidia/[^\n]*) \\(0x")
  string(REGEX MATCH "libcudart[^\n]*" cudart_line "${LAST_OUTPUT}")
  message(FATAL_ERROR "the installed package resolves another CUDA runtime than LibTorch's: ${cudart_line}")
endif()
file(REAL_PATH "${CMAKE_MATCH_1}" torch_cudart)
# Which of two libcudart directories on one search path comes first is left
# to CMake's ordering of link directories, which moves with the link line;
# the program is safe only when no second copy is on its path at all.
foreach(dir IN LISTS search_path)
  file(GLOB copies "${dir}/libcudart.so.[0-9]*")
  foreach(copy IN LISTS copies)
    file(REAL_PATH "${copy}" copy_target)
    if(NOT copy_target STREQUAL torch_cudart)
      message(FATAL_ERROR "the consumer's library search path holds a second CUDA runtime, ${copy}, besides "
        "LibTorch's ${torch_cudart}; a change of link order would load it")
    endif()
  endforeach()
endforeach()
