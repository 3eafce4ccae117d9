#pragma once
// The version-dependent c10d calls of the Gloo backend, apart from
// torch_compat.h so that a build without Gloo headers (a GPU node whose pip
// LibTorch ships none) compiles everything else.

#include <chrono>
#include <string>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "compat/torch_compat.h"

namespace shardtrain::compat {

using GlooGroupPtr = c10::intrusive_ptr<c10d::ProcessGroupGloo>;

/// A Gloo process group whose sockets bind to `hostname`'s interface (or the
/// default interface when empty). Constructing it is itself a rendezvous
/// (full-mesh connect through the store), bounded by `timeout`.
inline GlooGroupPtr make_gloo_group(const StorePtr& store, int rank, int size,
                                    std::chrono::milliseconds timeout, const std::string& hostname,
                                    int threads) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  if (hostname.empty()) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  } else {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
  }
  options->threads = threads;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

}  // namespace shardtrain::compat
