# Compiles, syntax only, the code that only a CUDA build of LibTorch builds
# (src/compat/torch_cuda.cpp's CUDA half, the NCCL backend's CUDA-LibTorch
# branches, tests/gpu), against the CUDA headers Debian's CPU LibTorch ships
# (c10/cuda, ATen/cuda) and the CUDA toolkit: CI has no CUDA LibTorch, and this
# code must not rot there. It catches what the compiler front end sees
# (names, types, signatures); linking and running need a GPU node
# (scripts/gpu-check).
#
# -D CXX=compiler -D INCLUDES="dir;dir" -D SOURCES="file;file"
list(REMOVE_DUPLICATES INCLUDES)
foreach(dir IN LISTS INCLUDES)
  # The compiler's own directories stay where it puts them: -I/usr/include
  # would put C headers before libstdc++'s wrappers of them.
  if(NOT dir STREQUAL "/usr/include" AND NOT dir STREQUAL "/usr/local/include")
    list(APPEND flags "-I${dir}")
  endif()
endforeach()
set(failed "")
foreach(source IN LISTS SOURCES)
  execute_process(
    COMMAND ${CXX} -std=c++17 -fsyntax-only -DSHARDTRAIN_TORCH_CUDA=1 ${flags} ${source}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc)
    message("== ${source}\n${out}${err}")
    list(APPEND failed ${source})
  else()
    message("ok ${source}")
  endif()
endforeach()
if(failed)
  message(FATAL_ERROR "CUDA-LibTorch code that does not compile: ${failed}")
endif()
