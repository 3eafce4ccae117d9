#pragma once
// Saving and loading a checkpoint, collectively, under either engine and at
// any world size (the format itself: format.h).
//
// Writes go to DIR/.tmp-TAG, are fsynced, renamed into place, then `latest`
// is replaced: a process killed at any moment leaves the previous checkpoint
// complete and `latest` naming a complete one.

#include <functional>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "checkpoint/format.h"
#include "checkpoint/hf_writer.h"
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

/// Collective. Writes the model's parameters as a Hugging Face weights
/// directory (hf_writer.h) straight from the live shards: the engine gathers
/// one unit at a time and rank 0 writes each parameter as it arrives. Nothing
/// else is written (no optimizer state, no staging checkpoint), so the export
/// needs only its own size on disk. A failure on rank 0 (a full disk) fails
/// every rank together with CheckpointSaveError naming it, after every rank
/// has finished the gathers; the partial export is removed.
///
/// `selection` picks and renames what is written, and folds LoRA adapters:
/// a PEFT adapter is the trainable parameters under PEFT's keys, a merged
/// export every base weight with its adapter folded in and no adapter tensors.
struct ExportSelection {
  /// Parameters written; unset: all.
  std::function<bool(const std::string&)> include;
  /// The name a parameter gets in the file; unset: its own.
  std::function<std::string(const std::string&)> rename;
  /// LoRA layers to merge, path -> scaling: PATH.weight is written as
  /// PATH.weight + scaling * PATH.lora_B.weight @ PATH.lora_A.weight, and
  /// PATH.lora_A/B.weight are left out.
  std::map<std::string, double> merge_lora;
};
void save_model(engine::Engine& engine, comm::Communicator& comm, const std::string& out_dir,
                const ExportOptions& options, const ExportSelection& selection = {});

/// Collective. Verifies every file (size, CRC-32) and that the checkpoint
/// holds exactly the model's parameters with their shapes, loads every slice
/// this rank owns, and returns the training state. `tag` empty: DIR/latest.
nlohmann::json load(engine::Engine& engine, comm::Communicator& comm, const std::string& dir,
                    const std::string& tag);

}  // namespace shardtrain::checkpoint
