# LibTorch integration: what we link, and where the gloo headers that c10d's
# ProcessGroupGloo.hpp includes live.
#
# The PyTorch wheel ships c10d's headers but not gloo's. Debian's libgloo-dev
# provides them; they are older than the gloo compiled into libtorch_cpu, so
# only one translation unit sees them, with hidden visibility
# (src/comm/gloo/gloo_communicator.cpp says why that is safe, and the
# collective tests prove it). A GPU node without them builds with
# -DSHARDTRAIN_GLOO=OFF (NCCL carries the job; CPU runs are single-process).

set(SHARDTRAIN_TORCH_TARGET ${TORCH_LIBRARIES})

set(SHARDTRAIN_GLOO "AUTO" CACHE STRING "Build the Gloo (CPU) backend: AUTO (when its headers are found)|ON|OFF")
set_property(CACHE SHARDTRAIN_GLOO PROPERTY STRINGS AUTO ON OFF)
find_path(SHARDTRAIN_GLOO_INCLUDE_DIR gloo/config.h
  HINTS ${TORCH_INCLUDE_DIRS}
  DOC "Directory that contains gloo/config.h")
set(SHARDTRAIN_GLOO_INCLUDE_DIRS "")
if(SHARDTRAIN_GLOO_INCLUDE_DIR)
  set(SHARDTRAIN_GLOO_INCLUDE_DIRS ${SHARDTRAIN_GLOO_INCLUDE_DIR})
endif()
