#pragma once
// Which GPU a process of a job uses: the one decision that resolve_device
// ("cuda", "auto") and the NCCL backend share, so the model and the
// communicator never disagree about it.

#include <optional>

namespace shardtrain {

/// The CUDA device index for the process of local rank `local_rank` when it
/// sees `visible_gpus` devices: its local rank, one GPU per process. A
/// process that sees exactly one GPU uses it whatever its local rank:
/// launchers that bind one GPU per task (Slurm's --gpus-per-task=1, a
/// CUDA_VISIBLE_DEVICES set per rank) leave each process its own device 0.
/// nullopt where there is no such device (more processes than GPUs).
inline std::optional<int> gpu_for_local_rank(int local_rank, int visible_gpus) {
  if (visible_gpus == 1 && local_rank >= 0) return 0;
  if (local_rank < 0 || local_rank >= visible_gpus) return std::nullopt;
  return local_rank;
}

}  // namespace shardtrain
