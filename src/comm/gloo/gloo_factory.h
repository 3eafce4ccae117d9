#pragma once
// Entry points to the Gloo (CPU) backend that exist in every build, so callers
// need no #if: the backend itself lives in one file (gloo_communicator.cpp) so
// that gloo's headers, which the PyTorch wheel does not ship, reach no other
// translation unit; a build without them compiles gloo_unavailable.cpp, which
// keeps CPU training to one process and says why.

#include <string>
#include <vector>

#include "comm/c10d.h"
#include "shardtrain/comm/communicator.h"

namespace shardtrain::comm {

/// Whether this build has the Gloo backend (gloo's headers at configure time).
bool gloo_available();
/// Why gloo_available() is false, in words ("" when it is true).
std::string gloo_unavailable_reason();

/// A Gloo communicator of `world_size` ranks over `store` (shared by the whole
/// job; `store_prefix` keeps this group's keys apart). `hostname` selects the
/// interface Gloo binds ("" = the default one). Connecting is a rendezvous of
/// all ranks, bounded by `options.timeout`. Without Gloo in the build a world
/// of one gets a single-process communicator, and a larger one a ConfigError.
CommunicatorPtr make_gloo_communicator(StorePtr store, int rank, int world_size, std::vector<int> global_ranks,
                                       CommOptions options, std::string hostname, std::string store_prefix);

}  // namespace shardtrain::comm
