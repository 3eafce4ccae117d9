#pragma once
// Entry point to the Gloo (CPU) backend. The backend itself lives in one file
// (backends/comm/gloo/gloo_communicator.cpp) so that gloo's headers, which the
// PyTorch wheel does not ship, reach no other translation unit.

#include <string>
#include <vector>

#include "comm/c10d.h"
#include "shardtrain/comm/communicator.h"

namespace shardtrain::comm {

/// A Gloo communicator of `world_size` ranks over `store` (shared by the whole
/// job; `store_prefix` keeps this group's keys apart). `hostname` selects the
/// interface Gloo binds ("" = the default one). Connecting is a rendezvous of
/// all ranks, bounded by `options.timeout`.
CommunicatorPtr make_gloo_communicator(StorePtr store, int rank, int world_size, std::vector<int> global_ranks,
                                       CommOptions options, std::string hostname, std::string store_prefix);

}  // namespace shardtrain::comm
