#pragma once
// Offline tools for checkpoints written by checkpoint::save (the format: format.h):
// find one, check it, describe it, and turn its fp32 masters into a Hugging
// Face weights directory. None of them needs an engine, a model or a
// communicator: everything comes from DIR/TAG/index.json and the rank files,
// so they run on any machine that can read the checkpoint.

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/hf_writer.h"

namespace shardtrain::checkpoint {

/// What verify() found. `problems` empty means the checkpoint is intact.
struct VerifyReport {
  std::string checkpoint_dir;  ///< the resolved DIR/TAG
  std::size_t files = 0;       ///< files the index lists
  std::size_t params = 0;      ///< parameters the index lists
  std::vector<std::string> problems;

  bool ok() const { return problems.empty(); }
};

/// Checks a checkpoint without loading it: index.json parses and has this
/// build's format version; every file it lists exists with the recorded size
/// and CRC-32; every slice names a listed file that holds its tensors with
/// the recorded length; and every parameter's "master" slices cover
/// [0, numel) exactly once. Damage is reported in the returned problems (each
/// naming the file or parameter); only an unresolvable `path` throws.
VerifyReport verify(const std::string& path);

/// A human-readable description: the parameters (shape, dtype, numel, which
/// files hold them), the files (size, rank, CRC-32), the engine, world size
/// and training state. Throws shardtrain::Error on an unreadable index.
std::string inspect(const std::string& path);


/// Writes the checkpoint's parameters (assembled from their "master" slices,
/// under their own names and shapes) as a Hugging Face weights directory:
/// OUT/model.safetensors, or model-0000i-of-0000N.safetensors shards plus
/// model.safetensors.index.json when the weights exceed max_shard_bytes.
/// Verifies first and refuses a damaged checkpoint, listing its problems.
/// Streams: at most one parameter is in memory at a time. Output is built in
/// a temporary sibling directory and moved into `out_dir` only when complete;
/// earlier weight files in `out_dir` are replaced, other files are kept.
void export_hf(const std::string& path, const std::string& out_dir, const ExportOptions& options = {});

}  // namespace shardtrain::checkpoint
