#pragma once
// How one unit's parameters map onto equal per-rank shards.
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
// Everything the engines move goes through the "rank-major" W*S layout: an
// all-gather of the shards produces it, and a reduce-scatter consumes it. In
// the flat layout it is the gathered buffer itself; in the per-param layout
// it is unpacked into a compact buffer where each parameter is contiguous.

#include <cstdint>
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
  /// W * S.
  int64_t gathered_numel() const { return shard_numel_ * world_size_; }
  /// Elements of the buffer the module's parameters view (compact for
  /// kPerParam, the gathered buffer for kFlat).
  int64_t full_numel() const { return full_numel_; }
  /// Where parameter i starts inside the full buffer.
  int64_t param_offset_in_full(int i) const { return full_offsets_[i]; }
  /// Sum of the parameters' element counts (no padding).
  int64_t total_param_numel() const;

  /// The parameter runs rank r owns.
  std::vector<OwnedSegment> segments_of_rank(int rank) const;

  /// Rank-major W*S tensor -> full buffer (casts if dtypes differ). For kFlat
  /// with the same storage this is a no-op; callers may pass the same tensor.
  void unpack(const at::Tensor& rank_major, const at::Tensor& full) const;

  /// Writes `values[i]` (any shape with numel n_i; undefined = zeros) into the
  /// rank-major layout `out` (W*S, padding zeroed), casting to out's dtype.
  void pack(const std::vector<at::Tensor>& values, const at::Tensor& out) const;

  /// Rank r's shard of `values`, as pack() would lay it out (S elements).
  void pack_shard(const std::vector<at::Tensor>& values, int rank, const at::Tensor& shard) const;

 private:
  Kind kind_;
  std::vector<int64_t> numels_;
  int world_size_;
  int64_t shard_numel_ = 0;
  int64_t full_numel_ = 0;
  std::vector<int64_t> full_offsets_;
  /// kPerParam: offset of parameter i's chunk inside a shard, and the chunk size.
  std::vector<int64_t> chunk_offsets_;
  std::vector<int64_t> chunk_sizes_;
};

}  // namespace shardtrain::engine
