# LibTorch integration: what we link, whether LibTorch itself has CUDA, and
# where the gloo headers that c10d's ProcessGroupGloo.hpp includes live.
#
# Debian's libtorch-dev (1.13.1, CPU) is the default; any other LibTorch is
# picked up through CMAKE_PREFIX_PATH (e.g. -DCMAKE_PREFIX_PATH=/opt/libtorch).

set(SHARDTRAIN_TORCH_TARGET ${TORCH_LIBRARIES})

if(TARGET torch_cuda)
  set(SHARDTRAIN_TORCH_HAS_CUDA ON)
else()
  set(SHARDTRAIN_TORCH_HAS_CUDA OFF)
endif()

# c10d's Gloo headers include <gloo/...>. Debian installs them from libgloo-dev
# under /usr/include; LibTorch zips ship their own copy under include/. They
# must be the Gloo LibTorch was built with; a pip wheel may ship none, and
# then (SHARDTRAIN_GLOO AUTO, with NCCL found) the Gloo backend is left out
# and CPU runs are single-process. The decision is taken in CMakeLists.txt,
# once NCCL is known.
set(SHARDTRAIN_GLOO "AUTO" CACHE STRING "Build the Gloo (CPU) backend: AUTO (when its headers are found)|ON|OFF")
set_property(CACHE SHARDTRAIN_GLOO PROPERTY STRINGS AUTO ON OFF)
find_path(SHARDTRAIN_GLOO_INCLUDE_DIR gloo/config.h
  HINTS ${TORCH_INCLUDE_DIRS}
  DOC "Directory that contains gloo/config.h")
set(SHARDTRAIN_GLOO_INCLUDE_DIRS "")
if(SHARDTRAIN_GLOO_INCLUDE_DIR)
  set(SHARDTRAIN_GLOO_INCLUDE_DIRS ${SHARDTRAIN_GLOO_INCLUDE_DIR})
endif()

message(STATUS "shardtrain: LibTorch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX}, CUDA in LibTorch: ${SHARDTRAIN_TORCH_HAS_CUDA}")
