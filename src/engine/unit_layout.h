#pragma once
// How one unit's parameters map onto equal per-rank shards, and onto the
// full buffer the module's parameters view.
//
// Both engines shard a unit's parameters into W shards of S elements each;
// they differ in which elements a rank owns:
//  * kPerParam (ZeRO, DeepSpeed's partition_parameters): every parameter is
//    flattened, padded to a multiple of W and split evenly, so rank r owns
//    [r*c, (r+1)*c) of every parameter (c = ceil(n/W)); its shard is the
//    concatenation of those chunks.
//  * kFlat (FSDP's FlatParameter): the parameters are concatenated (each
//    aligned), the whole is padded to a multiple of W and split evenly, so a
//    rank owns one contiguous range of the concatenation.
//
// The full buffer (W*S elements in both) is laid out so that every
// collective reads or writes it in place: it is a sequence of "pieces", and
// piece p holds rank r's shard[p.shard_offset, +p.chunk) at
// p.full_offset + r * p.chunk. kFlat has one piece, the concatenation itself;
// kPerParam has one per parameter, the parameter followed by its padding. An
// all-gather per piece therefore writes straight into the storage the
// parameters view. Gradients are reduced where autograd left them: a
// kPerParam gradient is its piece (copied into a padded one only when n is
// not a multiple of W); a kFlat gradient is cut unevenly where the shards cut
// the concatenation (segments_of_rank), a reduce-scatter with uneven counts.

#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace shardtrain::engine {

/// One contiguous run of a parameter that a rank owns.
struct OwnedSegment {
  int param_index = 0;
  int64_t param_offset = 0;  ///< element offset inside the flattened parameter
  int64_t shard_offset = 0;  ///< element offset inside the rank's shard
  int64_t length = 0;
};

/// One all-gather / reduce-scatter over the full buffer (see the file comment).
struct CollectivePiece {
  int64_t full_offset = 0;   ///< start in the full buffer; W * chunk elements from here
  int64_t shard_offset = 0;  ///< start in every rank's shard
  int64_t chunk = 0;         ///< elements each rank contributes
  int param_index = -1;      ///< kPerParam: the parameter it holds; kFlat: -1 (all of them)
};

class UnitLayout {
 public:
  enum class Kind { kPerParam, kFlat };

  /// `numels`: element counts of the unit's parameters, in order.
  /// `align`: kFlat aligns each parameter's start to this many elements.
  UnitLayout(Kind kind, std::vector<int64_t> numels, int world_size, int64_t align = 1);

  Kind kind() const { return kind_; }
  int world_size() const { return world_size_; }
  int num_params() const { return static_cast<int>(numels_.size()); }
  int64_t param_numel(int i) const { return numels_[i]; }
  /// S: elements per rank shard.
  int64_t shard_numel() const { return shard_numel_; }
  /// W * S: the full buffer, padding included.
  int64_t full_numel() const { return shard_numel_ * world_size_; }
  /// Where parameter i starts inside the full buffer.
  int64_t param_offset_in_full(int i) const { return full_offsets_[i]; }
  /// Sum of the parameters' element counts (no padding).
  int64_t total_param_numel() const;

  /// The pieces, in full-buffer order; pieces of no elements are left out.
  const std::vector<CollectivePiece>& pieces() const { return pieces_; }

  /// The parameter runs rank r owns.
  std::vector<OwnedSegment> segments_of_rank(int rank) const;

  /// How parameter i's elements fall on the ranks' shards: element counts per
  /// rank (summing to n_i; a rank may get none), in element order.
  std::vector<int64_t> param_splits(int i) const;
  /// Where rank r's part of parameter i starts in r's shard (0 if it has none).
  int64_t param_shard_offset(int i, int rank) const;

  /// Rank r's shard of `values`, as an all-gather of the pieces would lay it
  /// out in the full buffer (S elements).
  void pack_shard(const std::vector<at::Tensor>& values, int rank, const at::Tensor& shard) const;

 private:
  Kind kind_;
  std::vector<int64_t> numels_;
  int world_size_;
  int64_t shard_numel_ = 0;
  std::vector<int64_t> full_offsets_;
  std::vector<CollectivePiece> pieces_;
  /// kPerParam: offset of parameter i's chunk inside a shard, and the chunk size.
  std::vector<int64_t> chunk_offsets_;
  std::vector<int64_t> chunk_sizes_;
};

/// The [begin, end) slices the optimizer steps a rank's flat partition of
/// `total` elements in (DeepSpeed's sub_group_size). `sub_group_size` > 0:
/// slices of that many elements; 0: DeepSpeed's meaning (stage3.py closes a
/// sub-group after every parameter), a slice from each of
/// `parameter_starts` (the partition offsets where a parameter's run
/// begins). Every slice starts at a multiple of `alignment`, so an audit
/// that samples by element index inside a slice samples the same elements
/// as one slice over the whole partition. The slices tile [0, total).
std::vector<std::pair<int64_t, int64_t>> optimizer_step_slices(std::vector<int64_t> parameter_starts,
                                                               int64_t sub_group_size, int64_t total,
                                                               int64_t alignment = 1);

}  // namespace shardtrain::engine
