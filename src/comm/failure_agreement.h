#pragma once
// Agreeing on a failure before acting on it: a phase that can throw on some
// ranks and not others (a file one rank reads, a slice one rank owns) must
// not let those ranks leave while the others wait in the next collective.
// Every rank runs the phase, then all learn whether it failed anywhere, and
// why, and act alike.

#include <functional>
#include <optional>
#include <string>

#include "shardtrain/comm/communicator.h"

namespace shardtrain::comm {

/// Collective. Runs `phase` where `participate`, then agrees with every rank
/// whether it failed anywhere: nullopt when it succeeded everywhere, else
/// "rank R: why" for the lowest failing rank, the same text on every rank.
std::optional<std::string> agree_on_failure(Communicator& comm, bool participate,
                                            const std::function<void()>& phase);

/// Collective: whether `holds` is true on every rank.
bool all_ranks(Communicator& comm, bool holds);

}  // namespace shardtrain::comm
