#pragma once
// The checkpoint format shared by both engines and every world size.
//
//   DIR/latest                  the tag of the newest complete checkpoint (written last)
//   DIR/TAG/index.json          format version; per parameter its shape, dtype and which
//                               file holds which element range with which state kinds;
//                               per file its size and CRC-32; the training state; the
//                               resolved config and its precision plan
//   DIR/TAG/rankNNNNN.safetensors  one per writing rank: "<name>@<begin>/<kind>" tensors
//                               (kind: master, exp_avg, exp_avg_sq, momentum) and the rank's RNG
//   DIR/TAG/rankNNNNN.json      the rank's manifest (what the index is built from)
//
// Slices are keyed by parameter name and element range of the flattened
// parameter, so a load maps them onto whatever layout the loading run has:
// zero (per-parameter chunks) or fsdp (flat chunks), any world size.
// Writes go to DIR/.tmp-TAG, are fsynced, renamed into place, then `latest`
// is replaced: a process killed at any moment leaves the previous checkpoint
// complete and `latest` naming a complete one.

#include <string>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "shardtrain/comm/communicator.h"

namespace shardtrain::checkpoint {

constexpr int kFormatVersion = 1;

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

/// The tag DIR/latest names (throws naming the path when there is none).
std::string latest_tag(const std::string& dir);

}  // namespace shardtrain::checkpoint
