// DistributedSampler: each rank's share of a dataset's indices per epoch,
// shuffled with a seeded SplitMix64 so every rank computes the same order,
// and resumable at a position (data.h).
#include "shardtrain/data.h"

#include <algorithm>
#include <numeric>

#include "shardtrain/error.h"

namespace shardtrain {
namespace {

/// splitmix64 (Steele, Lea, Flood 2014): tiny, full-period over 2^64 and
/// well mixed even for consecutive seeds, which (seed + epoch) produces.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, bound) without modulo bias: draws below 2^64 mod bound are
  /// rejected so every residue has the same number of preimages.
  uint64_t below(uint64_t bound) {
    const uint64_t threshold = (0 - bound) % bound;
    for (;;) {
      const uint64_t x = next();
      if (x >= threshold) return x % bound;
    }
  }

 private:
  uint64_t state_;
};

/// Indices per rank per epoch, as torch counts them: drop_last -> ceil((n - W)
/// / W) when n % W != 0, i.e. floor(n / W); otherwise ceil(n / W).
int64_t samples_per_rank(int64_t rows, int64_t world, bool drop_last) {
  return drop_last ? rows / world : (rows + world - 1) / world;
}

}  // namespace

DistributedSampler::DistributedSampler(int64_t dataset_size, int world_size, int rank, uint64_t seed,
                                       bool shuffle, bool drop_last)
    : dataset_size_(dataset_size),
      world_size_(world_size),
      rank_(rank),
      seed_(seed),
      shuffle_(shuffle),
      drop_last_(drop_last) {
  ST_CHECK(dataset_size >= 0, "DistributedSampler: dataset size must be >= 0, got ", dataset_size);
  ST_CHECK(world_size >= 1, "DistributedSampler: world size must be >= 1, got ", world_size);
  ST_CHECK(rank >= 0 && rank < world_size, "DistributedSampler: rank ", rank, " is outside [0, ",
           world_size, ")");
  ST_CHECK(!drop_last || dataset_size == 0 || dataset_size >= world_size, "DistributedSampler: drop_last over ",
           dataset_size, " rows and ", world_size, " ranks leaves every rank none; use drop_last=false (the rows "
           "are then repeated to one per rank) or at least ", world_size, " rows");
  num_samples_ = samples_per_rank(dataset_size, world_size, drop_last);
}

void DistributedSampler::set_epoch(int64_t epoch) {
  epoch_ = epoch;
  position_ = 0;
}

std::vector<int64_t> DistributedSampler::indices() const {
  std::vector<int64_t> order(static_cast<size_t>(dataset_size_));
  std::iota(order.begin(), order.end(), int64_t{0});
  if (shuffle_ && dataset_size_ > 1) {
    // Unsigned addition wraps, so every (seed, epoch) pair, negative epochs
    // included, names a well-defined stream.
    SplitMix64 rng(seed_ + static_cast<uint64_t>(epoch_));
    for (int64_t i = dataset_size_ - 1; i > 0; --i) {
      const auto j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(i) + 1));
      std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
    }
  }
  const int64_t total = total_size();
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(num_samples_));
  // Position p of the padded list is order[p % n]: padding wraps to the
  // start as many times as needed, as torch does when padding exceeds n.
  for (int64_t p = rank_; p < total; p += world_size_) {
    mine.push_back(order[static_cast<size_t>(p % dataset_size_)]);
  }
  return mine;
}

std::vector<int64_t> DistributedSampler::remaining_indices() const {
  std::vector<int64_t> all = indices();
  all.erase(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(position_));
  return all;
}

void DistributedSampler::set_position(int64_t position) {
  ST_CHECK(position >= 0 && position <= num_samples_, "DistributedSampler: position ", position,
           " is outside [0, ", num_samples_, "] (indices per rank per epoch)");
  position_ = position;
}

void DistributedSampler::advance(int64_t count) {
  ST_CHECK(count >= 0, "DistributedSampler: cannot advance by a negative count ", count);
  position_ = std::min(num_samples_, position_ + count);
}

void DistributedSampler::load_state(const SamplerState& state) {
  ST_CHECK(state.position >= 0 && state.world_size >= 0, "DistributedSampler: a saved position ", state.position,
           " over ", state.world_size, " ranks is not a state");
  seed_ = state.seed;
  set_epoch(state.epoch);
  if (total_size() == 0) return;  // nothing to draw: every epoch is empty
  // Positions count one rank's share; the epoch's place is the samples all
  // ranks consumed. An epoch finished where it was saved is finished here,
  // even where this world pads it longer.
  const int64_t saved_world = state.world_size > 0 ? state.world_size : world_size_;
  const int64_t saved_rows = state.dataset_size >= 0 ? state.dataset_size : dataset_size_;
  const int64_t saved_samples = samples_per_rank(saved_rows, saved_world, drop_last_);
  const int64_t consumed = state.position * saved_world;
  if (state.position >= saved_samples || consumed >= total_size()) {
    set_epoch(state.epoch + 1);
    return;
  }
  set_position(consumed / world_size_);
}

}  // namespace shardtrain
