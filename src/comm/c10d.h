#pragma once
// The c10d types every backend shares: the job's key-value store and a
// backend's pending collective, and where a sub-group keeps its keys. One
// header so that callers name them once.

#include <cstdint>
#include <string>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace shardtrain::comm {

using StorePtr = c10::intrusive_ptr<c10d::Store>;
using WorkHandle = c10::intrusive_ptr<c10d::Work>;

inline StorePtr make_prefix_store(const std::string& prefix, StorePtr store) {
  return c10::make_intrusive<c10d::PrefixStore>(prefix, std::move(store));
}

/// Where sub-group `group_index` of the group keyed by `parent_prefix` keeps
/// its keys in the job's store.
inline std::string sub_group_store_prefix(const std::string& parent_prefix, int64_t group_index) {
  return parent_prefix + "g" + std::to_string(group_index) + "/";
}

}  // namespace shardtrain::comm
