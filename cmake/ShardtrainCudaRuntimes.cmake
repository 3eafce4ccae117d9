# The CUDA libraries a shardtrain program links are the files LibTorch loads,
# never a second copy from the CUDA toolkit. Used by shardtrain's own build
# (ShardtrainFindTorch.cmake) and, installed, by shardtrainConfig.cmake, so an
# outside program gets the same.
#
# Why: a process maps one file per soname, the first found, and every library
# in it calls that one. The torch wheel's libtorch_cuda finds libcudart.so.13
# in site-packages/nvidia/cu13/lib through its own RPATH; LibTorch's CMake
# config links CUDA::cudart and CUDA::nvrtc, which FindCUDAToolkit points at
# the toolkit's copies. A program that calls the CUDA runtime itself then
# NEEDs libcudart.so.13 and finds the toolkit's first (its RUNPATH lists the
# toolkit's directory), and LibTorch runs on a runtime it was not built and
# tested with; one older than the wheel's fails at load.
#
# Which file LibTorch resolves is asked of the loader (ldd on the LibTorch
# library that needs it), not guessed from the wheel's layout.

# shardtrain_use_torch_cuda_runtimes(<torch prefix> <out var>)
# Call right after find_package(Torch). Repoints CUDA::cudart and CUDA::nvrtc,
# and the toolkit's libnvrtc that TorchConfig.cmake lists by path in
# TORCH_LIBRARIES (CUDA_NVRTC_LIB), at the files LibTorch's own libraries
# resolve. The NVRTC entry matters although nothing calls NVRTC: its
# directory enters every program's RUNPATH, and CMake cannot order it after
# the wheel's, which holds a libnvrtc.so.13 too, so the toolkit's libcudart
# was found first. Sets <out var> to the libcudart file chosen, or to ""
# when ldd names none (a LibTorch that bundles its runtime under another
# name, a cross build): the toolkit's copies stay then.
function(shardtrain_use_torch_cuda_runtimes torch_prefix out_cudart)
  set(${out_cudart} "" PARENT_SCOPE)
  set(torch_libraries ${TORCH_LIBRARIES})
  # CUDA target, and the LibTorch library that loads it.
  foreach(runtime_and_user IN ITEMS "cudart:libtorch_cuda.so" "nvrtc:libcaffe2_nvrtc.so")
    string(REPLACE ":" ";" runtime_and_user "${runtime_and_user}")
    list(GET runtime_and_user 0 runtime)
    list(GET runtime_and_user 1 user)
    if(NOT EXISTS "${torch_prefix}/lib/${user}")
      continue()
    endif()
    execute_process(COMMAND ldd "${torch_prefix}/lib/${user}" OUTPUT_VARIABLE needs ERROR_QUIET)
    if(NOT needs MATCHES "lib${runtime}\\.so\\.[0-9]+ => (/[^\n]*) \\(0x")
      continue()
    endif()
    set(torch_copy "${CMAKE_MATCH_1}")
    if(TARGET CUDA::${runtime})
      set_property(TARGET CUDA::${runtime} PROPERTY IMPORTED_LOCATION "${torch_copy}")
    endif()
    list(TRANSFORM torch_libraries REPLACE "^.*/lib${runtime}\\.so(\\.[0-9.]+)?$" "${torch_copy}")
    if(runtime STREQUAL "cudart")
      set(${out_cudart} "${torch_copy}" PARENT_SCOPE)
    endif()
  endforeach()
  set(TORCH_LIBRARIES ${torch_libraries} PARENT_SCOPE)
endfunction()
