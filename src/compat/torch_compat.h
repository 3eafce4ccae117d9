#pragma once
// The one place that knows which LibTorch shardtrain is built against.
//
// LibTorch changed c10d between 1.13 (Debian, CI) and 2.x (GPU users):
// ProcessGroup became a dispatcher over Backend objects, c10d option structs grew
// fields (so it must be filled by name, never positionally), c10::optional
// became std::optional, and Gloo gained _allgather_base / reduce_scatter
// fallbacks. Every version-dependent c10d call goes through this header; the
// calls that need a CUDA LibTorch are in torch_cuda.h.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include <torch/version.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "compat/torch_cuda.h"

#define SHARDTRAIN_TORCH_VERSION_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace shardtrain::compat {

using StorePtr = c10::intrusive_ptr<c10d::Store>;
using WorkHandle = c10::intrusive_ptr<c10d::Work>;

inline StorePtr make_prefix_store(const std::string& prefix, StorePtr store) {
  return c10::make_intrusive<c10d::PrefixStore>(prefix, std::move(store));
}

inline std::string torch_version_string() { return TORCH_VERSION; }

}  // namespace shardtrain::compat
