#pragma once
// Text between ranks over the Communicator: the collectives carry tensors of
// numbers only, so a string travels as one int64 per byte. For the rare,
// small messages of error handling (why a save failed, where two ranks'
// configs differ), never for data.

#include <string>

#include "shardtrain/comm/communicator.h"

namespace shardtrain::comm {

/// Collective: every rank returns `root`'s `text` (other ranks' `text` is
/// ignored). Lengths may differ; at most `max_bytes` bytes arrive.
std::string broadcast_text(Communicator& comm, const std::string& text, int root, size_t max_bytes = 1 << 20);

}  // namespace shardtrain::comm
