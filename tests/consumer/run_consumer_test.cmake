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
# wheel's nvidia/cu13/lib), which the installed libshardtrain's RPATH names,
# not a toolkit's copy found first (CMakeLists.txt, CMAKE_INSTALL_RPATH).
run(ldd ${WORK_DIR}/build/consumer)
if(NOT LAST_OUTPUT MATCHES "libcudart\\.so\\.[0-9]+ => [^\n]*/nvidia/")
  string(REGEX MATCH "libcudart[^\n]*" cudart_line "${LAST_OUTPUT}")
  message(FATAL_ERROR "the installed package resolves another CUDA runtime than LibTorch's: ${cudart_line}")
endif()
