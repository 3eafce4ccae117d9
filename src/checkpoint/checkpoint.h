#pragma once
// Saving and loading a checkpoint, collectively, under either engine and at
// any world size (the format itself: format.h).
//
// Writes go to DIR/.tmp-TAG, are fsynced, renamed into place, then `latest`
// is replaced: a process killed at any moment leaves the previous checkpoint
// complete and `latest` naming a complete one.

#include <string>

#include <nlohmann/json.hpp>

#include "checkpoint/format.h"
#include "engine/engine.h"
#include "shardtrain/comm/communicator.h"

namespace shardtrain::checkpoint {

/// Collective. Returns the checkpoint directory DIR/TAG. `keep_last` > 0
/// removes the oldest published checkpoints beyond that many (never the new one).
///
/// A save that fails on any rank fails on every rank together: the ranks
/// agree after each phase (directories, every rank's files, publishing), so
/// no rank waits for one that gave up. Then the temporary directory is
/// removed, `latest` keeps naming the previous checkpoint, and every rank
/// throws CheckpointSaveError naming the rank and the reason. Nothing in the
/// engine is modified by a save. Fault injection for the tests:
/// SHARDTRAIN_CHECKPOINT_FAIL_AT=<phase>[:<rank>[:<errno>]] fails that phase
/// (rank_file, rank_manifest, index, latest) on that rank (default 0) as a
/// write error with that errno (default EIO) would.
std::string save(engine::Engine& engine, comm::Communicator& comm, const std::string& dir,
                 const std::string& tag, const nlohmann::json& training_state, const std::string& config_yaml,
                 const std::string& precision_plan, int keep_last = 0);

/// Collective. Verifies every file (size, CRC-32) and that the checkpoint
/// holds exactly the model's parameters with their shapes, loads every slice
/// this rank owns, and returns the training state. `tag` empty: DIR/latest.
nlohmann::json load(engine::Engine& engine, comm::Communicator& comm, const std::string& dir,
                    const std::string& tag);

}  // namespace shardtrain::checkpoint
