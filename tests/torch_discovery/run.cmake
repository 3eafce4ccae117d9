# The configure step refuses each LibTorch shardtrain cannot build on, with a
# message that names the fix, and takes a good one (the project's .venv torch)
# with the NCCL of its wheel. Stand-in pythons answer
# torch.utils.cmake_prefix_path with stand-in torch trees that carry only the
# files the checks read (the version header, torch/version.py); the real
# python's torch tree is used for the accepted case and the cache check.
#
# -D SOURCE_DIR=... -D WORK_DIR=... -D GENERATOR=... -D REAL_PYTHON=... (the .venv python3)
file(REMOVE_RECURSE ${WORK_DIR})
find_program(system_python NAMES python3 REQUIRED)

# A python whose `torch` reports a torch tree at `root` (or fails to import when root is "").
function(make_python name root out_var)
  set(site ${WORK_DIR}/${name}/site-packages)
  file(MAKE_DIRECTORY ${site}/torch)
  if(root)
    file(WRITE ${site}/torch/__init__.py "class utils:\n    cmake_prefix_path = '${root}/share/cmake'\n")
  else()
    file(WRITE ${site}/torch/__init__.py "raise ImportError('No module named torch (stand-in)')\n")
  endif()
  set(python ${WORK_DIR}/${name}/python)
  file(WRITE ${python} "#!/bin/sh\nPYTHONPATH='${site}' exec '${system_python}' \"$@\"\n")
  file(CHMOD ${python} PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE)
  set(${out_var} ${python} PARENT_SCOPE)
endfunction()

# A torch tree with version `version` built for CUDA `cuda` ("None": CPU-only).
function(make_torch_tree name version cuda out_var)
  set(root ${WORK_DIR}/${name}/torch)
  string(REPLACE "." ";" parts ${version})
  list(GET parts 0 major)
  list(GET parts 1 minor)
  file(WRITE ${root}/include/torch/headeronly/version.h
    "#define TORCH_VERSION_MAJOR ${major}\n#define TORCH_VERSION_MINOR ${minor}\n#define TORCH_VERSION_PATCH 0\n")
  file(WRITE ${root}/version.py "__version__ = '${version}'\ncuda: Optional[str] = ${cuda}\n")
  file(WRITE ${root}/share/cmake/Torch/TorchConfig.cmake "message(FATAL_ERROR \"stand-in torch: never loaded\")\n")
  set(${out_var} ${root} PARENT_SCOPE)
endfunction()

# Configures with `python` in a build directory of its own; returns the exit code and the output.
function(configure name python rc_var out_var)
  execute_process(
    COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/${name}/build -G ${GENERATOR}
      -DPython3_EXECUTABLE=${python} -DSHARDTRAIN_BUILD_TESTS=OFF -DSHARDTRAIN_BUILD_EXAMPLES=OFF
      -DSHARDTRAIN_BUILD_BENCH=OFF
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(REGEX REPLACE "[ \n]+" " " flat "${out}${err}")
  set(${rc_var} ${rc} PARENT_SCOPE)
  set(${out_var} "${flat}" PARENT_SCOPE)
endfunction()

function(expect_refusal name python)
  configure(${name} ${python} rc out)
  if(rc EQUAL 0)
    message(FATAL_ERROR "${name}: the configure step accepted it:\n${out}")
  endif()
  foreach(needle IN LISTS ARGN)
    string(FIND "${out}" "${needle}" at)
    if(at EQUAL -1)
      message(FATAL_ERROR "${name}: the refusal does not say '${needle}':\n${out}")
    endif()
  endforeach()
  message("ok: ${name} refused, naming the fix")
endfunction()

make_python(no_torch "" python)
expect_refusal(no_torch ${python} "has no usable torch" "run scripts/setup")

make_torch_tree(old 1.13.1 "None" root)
make_python(old ${root} python)
expect_refusal(old ${python} "is version '1.13.0'" "needs 2.11 or newer" "run scripts/setup")

make_torch_tree(cpu_only 2.11.0 "None" root)
make_python(cpu_only ${root} python)
expect_refusal(cpu_only ${python} "CPU-only build" "pip install torch==2.11.0")

make_torch_tree(other_cuda 2.11.0 "'12.8'" root)
make_python(other_cuda ${root} python)
expect_refusal(other_cuda ${python} "built with CUDA 12.8" "Point CUDA_HOME")

# The real torch is taken, with its wheel's NCCL.
configure(good ${REAL_PYTHON} rc out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "good: configuring against ${REAL_PYTHON}'s torch failed:\n${out}")
endif()
foreach(needle "LibTorch 2.11" "from python: ${REAL_PYTHON}" "/nvidia/nccl/lib/libnccl.so.2")
  string(FIND "${out}" "${needle}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "good: the configure output does not say '${needle}':\n${out}")
  endif()
endforeach()
message("ok: LibTorch and NCCL from the .venv torch wheel")

# The same build directory, now pointed at another LibTorch (an upgrade in place).
make_torch_tree(upgraded 2.12.0 "'13.0'" root)
make_python(upgraded ${root} python)
execute_process(
  COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/good/build -UTorch_DIR -DPython3_EXECUTABLE=${python}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
string(REGEX REPLACE "[ \n]+" " " out "${out}${err}")
if(rc EQUAL 0)
  message(FATAL_ERROR "upgraded: a build directory configured against another LibTorch was reused:\n${out}")
endif()
foreach(needle "was configured against LibTorch 2.11" "delete ${WORK_DIR}/good/build")
  string(FIND "${out}" "${needle}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "upgraded: the refusal does not say '${needle}':\n${out}")
  endif()
endforeach()
message("ok: a build directory keeps the LibTorch it was configured with")
