#pragma once
// Stops a job at prepare() whose ranks would train different things: a
// different resolved config (zero stage, dtypes, batch sizes, world size,
// seed) or a different model (parameter names, shapes, dtypes). Without the
// check such a job hangs in a collective or, worse, trains garbage.

#include <cstdint>
#include <optional>
#include <string>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/config.h"

namespace torch::nn {
class Module;
}

namespace shardtrain {

/// The facts every rank must share about the run: the resolved config as
/// YAML (less machine_rank, which differs by design), the world size, the
/// load dtype and the seed when the program gave one.
std::string describe_run(const TrainingConfig& resolved, int world_size, const std::string& load_dtype,
                         std::optional<uint64_t> seed);

/// One line per parameter ("param NAME [shape] dtype trainable|frozen") and
/// per buffer, in the module's order.
std::string describe_model(const torch::nn::Module& module);

/// Collective. `description` is this rank's view as text, one fact per line;
/// `what` names it in the error ("resolved config", "model"). Every rank
/// compares a 64-bit hash of its text; when they differ, the first rank
/// whose text differs from rank 0's and the first differing line are found,
/// and every rank throws ConfigError naming both ranks' versions of that line.
void check_ranks_agree(comm::Communicator& comm, const std::string& what, const std::string& description);

}  // namespace shardtrain
