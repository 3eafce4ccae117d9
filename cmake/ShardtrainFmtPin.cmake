# Makes the fmt that spdlog was built with win over the fmt that a PyTorch
# wheel ships under torch/include/fmt.
#
# Why: shardtrain logs through spdlog, and Debian's spdlog 1.10 is written
# against (and linked to) fmt 9. The torch wheel's include directory carries
# fmt 12 headers and comes before /usr/include, so `#include <fmt/...>` would
# otherwise pick torch's copy and spdlog would not compile (fmt::basic_runtime
# is gone in fmt 10+). A directory holding only a `fmt` link to spdlog's own
# fmt headers, put first on the include path of every target that includes
# spdlog, settles it once. fmt's versioned inline namespace (fmt::v9 against
# torch's fmt::v12) keeps the two copies apart at link time. Torch's public
# headers that use fmt (c10d logging) compile against fmt 9 as well.
#
# Used by the build (CMakeLists.txt) and by the installed package
# (shardtrainConfig.cmake), so an outside project gets the same order.

# shardtrain_fmt_pin_dir(<out-var> <pin-parent-dir>): creates <pin-parent-dir>/fmt
# pointing at spdlog's fmt headers and returns <pin-parent-dir>.
function(shardtrain_fmt_pin_dir out_var pin_parent)
  if(NOT TARGET fmt::fmt)
    find_package(fmt CONFIG QUIET)
  endif()
  set(_st_fmt_include "")
  if(TARGET fmt::fmt)
    get_target_property(_st_fmt_include fmt::fmt INTERFACE_INCLUDE_DIRECTORIES)
  endif()
  if(NOT _st_fmt_include)
    message(FATAL_ERROR "shardtrain: the fmt library spdlog uses was not found (Debian: apt-get install libfmt-dev, "
      "which libspdlog-dev depends on). Without it the fmt headers of the torch wheel would be used with spdlog, "
      "which does not compile.")
  endif()
  list(GET _st_fmt_include 0 _st_fmt_include)
  if(NOT EXISTS "${_st_fmt_include}/fmt/core.h")
    message(FATAL_ERROR "shardtrain: fmt::fmt names ${_st_fmt_include}, which holds no fmt/core.h")
  endif()
  file(MAKE_DIRECTORY "${pin_parent}")
  file(CREATE_LINK "${_st_fmt_include}/fmt" "${pin_parent}/fmt" SYMBOLIC)
  set(${out_var} "${pin_parent}" PARENT_SCOPE)
endfunction()
