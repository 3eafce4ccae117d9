#pragma once
/// @file checkpoint_location.h
/// What a user means by "resume from here", read the way the Transformers
/// Trainer and Accelerate users write it.

#include <string>

namespace shardtrain {

/// A checkpoint to load: Accelerator::load_state(dir, tag); an empty tag means dir/latest.
struct CheckpointLocation {
  std::string dir;
  std::string tag;
};

/// Resolves `resume` (a --resume argument):
///  * "latest": this run's own `output_dir`, as resume_from_checkpoint=True;
///  * a checkpoint (a directory holding index.json): that one;
///  * a checkpoint directory (holding `latest`): its latest;
///  * a run's output directory (holding checkpoints/latest): its latest.
/// Throws ConfigError naming what it looked for and listing the checkpoints
/// it found there instead.
CheckpointLocation find_checkpoint(const std::string& resume, const std::string& output_dir);

/// The checkpoints (directories holding index.json) in `dir` and in
/// `dir`/checkpoints, for "not found" messages: "found: A/step_5, A/step_10",
/// or "no checkpoint under A".
std::string describe_checkpoints_under(const std::string& dir);

}  // namespace shardtrain
