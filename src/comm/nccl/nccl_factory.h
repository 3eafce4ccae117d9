#pragma once
// Entry points to the NCCL backend that exist in every build, so callers need
// no #if: without NCCL (or without a CUDA LibTorch) they report why.

#include <string>
#include <vector>

#include "comm/c10d.h"
#include "shardtrain/comm/communicator.h"

namespace shardtrain::comm {

/// NCCL compiled in, LibTorch built with CUDA, and a GPU visible.
bool nccl_usable();
/// Why nccl_usable() is false, in words.
std::string nccl_unavailable_reason();
/// NCCL version compiled against, e.g. "2.28.3"; empty without NCCL.
std::string nccl_version_string();
/// Version of the libnccl this process loaded (ncclGetVersion; needs no GPU),
/// e.g. "2.28.9"; empty without NCCL.
std::string nccl_loaded_version_string();

CommunicatorPtr make_nccl_communicator(comm::StorePtr store, int rank, int world_size,
                                       std::vector<int> global_ranks, CommOptions options,
                                       int device_index);

}  // namespace shardtrain::comm
