#pragma once
// The checkpoint view: what a checkpoint reads and writes of this rank's
// shards, named by parameter and element range so that it is the same for
// every engine and every world size (a checkpoint of one resumes under the
// other). It owns nothing; it reads the unit table and the shard storage.

#include <cstdint>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/shard_groups.h"
#include "engine/shard_storage.h"
#include "engine/unit_table.h"

namespace shardtrain::engine {

/// A trainable parameter range this rank owns, and where it sits in the stepped partition.
struct OwnedRange {
  std::string name;
  int64_t begin;          ///< element offset in the flattened parameter
  int64_t length;
  int64_t master_offset;  ///< offset in the partition the optimizer steps
};

class CheckpointView {
 public:
  CheckpointView(const ShardGroups& groups, const UnitTable& units, ShardStorage& storage)
      : groups_(groups), units_(units), storage_(storage) {}

  /// This rank's slices to save; none on a rank that holds a copy of another's.
  std::vector<CheckpointSlice> slices() const;
  /// Overwrites every owned slice with the source's values and refreshes the
  /// low-precision shards from the masters. The gathered parameters still
  /// hold the old values: the caller regathers.
  /// Returns the dtype values were rounded to (Engine::load_slices).
  std::optional<at::ScalarType> load(const SliceSource& source);
  /// Trainable parameter ranges this rank owns.
  std::vector<OwnedRange> owned_ranges() const;

 private:
  const ShardGroups& groups_;
  const UnitTable& units_;
  ShardStorage& storage_;
};

}  // namespace shardtrain::engine
