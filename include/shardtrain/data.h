#pragma once
/// @file data.h
/// Splitting a dataset's indices between data-parallel ranks, resumably.
///
/// DistributedSampler follows torch.utils.data.DistributedSampler:
///  * each epoch draws a permutation of 0..n-1 seeded by (seed + epoch), or
///    uses 0..n-1 in order when shuffle is off;
///  * without drop_last the list is padded by wrapping around to a multiple of
///    the world size W (so a few samples are seen twice per epoch); with
///    drop_last the tail beyond the last multiple of W is dropped;
///  * rank r takes list positions r, r+W, r+2W, ...
/// so every rank gets the same number of indices, the ranks are disjoint
/// apart from the padding, and together they cover the dataset.
///
/// The permutation comes from a self-contained generator (splitmix64 and a
/// Fisher-Yates shuffle), not from torch's RNG, so it is identical on every
/// platform, LibTorch version and process. It is therefore not the same
/// permutation torch.utils.data.DistributedSampler draws for the same seed.
///
/// Resuming mid-epoch: position() counts the indices of this rank's list that
/// the training loop has consumed. Save state() in a checkpoint; after
/// load_state() at the same world size over the same data,
/// remaining_indices() continues with exactly the indices an uninterrupted
/// run would have used next. At another world size (or over other data) it
/// continues after the same number of samples of the epoch, as Accelerate's
/// skip of the batches already seen.

#include <cstdint>
#include <vector>

namespace shardtrain {

/// What a checkpoint stores to resume a DistributedSampler mid-epoch.
struct SamplerState {
  uint64_t seed = 0;
  int64_t epoch = 0;
  int64_t position = 0;      ///< indices of this rank's list already consumed this epoch
  int world_size = 0;        ///< the world the position counts in (0: the loading sampler's)
  int64_t dataset_size = -1;  ///< the rows the state was over (-1: unknown, as in older checkpoints)
};

class DistributedSampler {
 public:
  /// Throws shardtrain::Error for a negative dataset size, a world size < 1, a
  /// rank outside [0, world_size), or drop_last over fewer rows than ranks
  /// (every rank's share would be empty).
  DistributedSampler(int64_t dataset_size, int world_size, int rank, uint64_t seed,
                     bool shuffle = true, bool drop_last = false);

  /// Selects the epoch whose permutation indices() returns and rewinds
  /// position() to 0. Call it at the start of every epoch, as with torch's sampler.
  void set_epoch(int64_t epoch);
  int64_t epoch() const { return epoch_; }

  /// This rank's indices for the current epoch (num_samples() of them).
  std::vector<int64_t> indices() const;
  /// indices() from position() on: what is left of this epoch.
  std::vector<int64_t> remaining_indices() const;

  /// Indices of this rank's list consumed so far this epoch.
  int64_t position() const { return position_; }
  /// Throws shardtrain::Error unless 0 <= position <= num_samples().
  void set_position(int64_t position);
  /// Moves position() forward by `count` consumed indices (clamped at the end of the epoch).
  void advance(int64_t count);

  SamplerState state() const { return SamplerState{seed_, epoch_, position_, world_size_, dataset_size_}; }
  /// Adopts the saved seed and epoch, and continues after the samples the
  /// saved position stands for (position x its world size), rounded down to
  /// this world's ranks: at the same world size, the saved position itself.
  /// A state at its epoch's end, or past this world's epoch length (a larger
  /// padded epoch at another world size), starts the next epoch, where the
  /// training loop would have gone next.
  void load_state(const SamplerState& state);

  /// Indices per rank per epoch.
  int64_t num_samples() const { return num_samples_; }
  /// num_samples() * world_size: the padded (or truncated) epoch length.
  int64_t total_size() const { return num_samples_ * world_size_; }
  int64_t dataset_size() const { return dataset_size_; }
  int world_size() const { return world_size_; }
  int rank() const { return rank_; }
  uint64_t seed() const { return seed_; }
  bool shuffle() const { return shuffle_; }
  bool drop_last() const { return drop_last_; }

 private:
  int64_t dataset_size_;
  int world_size_;
  int rank_;
  uint64_t seed_;
  bool shuffle_;
  bool drop_last_;
  int64_t num_samples_ = 0;
  int64_t epoch_ = 0;
  int64_t position_ = 0;
};

}  // namespace shardtrain
