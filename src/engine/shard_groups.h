#pragma once
// The communicators the sharded engine's parts share, and where this rank
// sits in the unit layouts. Every part reads them from here, so "which group
// does this collective run over" is answered in one place.

#include <utility>

#include "engine/engine_plan.h"
#include "shardtrain/comm/communicator.h"

namespace shardtrain::engine {

class ShardGroups {
 public:
  ShardGroups(EngineGroups groups, bool shard_params)
      : shard_(std::move(groups.shard)),
        replicate_(std::move(groups.replicate)),
        sync_(std::move(groups.sync)),
        shard_params_(shard_params) {}

  /// The ranks one copy of the model states is sharded over.
  comm::Communicator& shard() const { return *shard_; }
  /// HYBRID_SHARD's replica group (the same shard on every machine), else null.
  comm::Communicator* replicate() const { return replicate_.get(); }
  /// The group the set-up collectives run over (the whole job under HYBRID_SHARD).
  comm::Communicator& sync() const { return sync_ ? *sync_ : *shard_; }
  /// The sync group when it is not the shard group, else null.
  comm::Communicator* separate_sync() const { return sync_.get(); }

  /// Throws when a collective of any group failed after its wait() returned
  /// (NCCL's watchdog): the results it left behind are garbage.
  void check_health() const {
    shard_->check_health();
    if (replicate_) replicate_->check_health();
    if (sync_) sync_->check_health();
  }

  /// Ranks the unit layouts split over: the shard group, or 1 when nothing is sharded.
  int layout_world() const { return shard_params_ ? shard_->world_size() : 1; }
  /// This rank's shard in the layouts (0 when nothing is sharded).
  int layout_rank() const { return shard_params_ ? shard_->rank() : 0; }
  /// One rank with no replicas: an all-gather or reduce-scatter would be a
  /// copy of the shard onto itself, so the engine skips them (no copy).
  bool single_rank() const { return shard_->world_size() == 1 && !replicate_; }
  /// This rank's slices duplicate another rank's (NO_SHARD / zero 0 ranks
  /// other than 0, HYBRID_SHARD machines other than the first).
  bool holds_a_copy() const { return replicate_ ? replicate_->rank() != 0 : (!shard_params_ && shard_->rank() != 0); }

 private:
  comm::CommunicatorPtr shard_;
  comm::CommunicatorPtr replicate_;
  comm::CommunicatorPtr sync_;
  bool shard_params_;
};

}  // namespace shardtrain::engine
