// Shard and full-buffer arithmetic of UnitLayout (see unit_layout.h).
#include "engine/unit_layout.h"

#include <algorithm>

#include <ATen/ATen.h>

#include "shardtrain/error.h"

namespace shardtrain::engine {

UnitLayout::UnitLayout(Kind kind, std::vector<int64_t> numels, int world_size, int64_t align)
    : kind_(kind), numels_(std::move(numels)), world_size_(world_size) {
  ST_CHECK(world_size_ > 0, "world size must be positive");
  ST_CHECK(align > 0, "alignment must be positive");
  const int n = num_params();
  full_offsets_.resize(n);
  if (kind_ == Kind::kPerParam) {
    chunk_offsets_.resize(n);
    chunk_sizes_.resize(n);
    int64_t shard = 0;
    for (int i = 0; i < n; ++i) {
      chunk_sizes_[i] = (numels_[i] + world_size_ - 1) / world_size_;
      chunk_offsets_[i] = shard;
      full_offsets_[i] = shard * world_size_;
      if (chunk_sizes_[i] > 0) pieces_.push_back({full_offsets_[i], shard, chunk_sizes_[i], i});
      shard += chunk_sizes_[i];
    }
    shard_numel_ = shard;
  } else {
    int64_t offset = 0;
    for (int i = 0; i < n; ++i) {
      offset = (offset + align - 1) / align * align;
      full_offsets_[i] = offset;
      offset += numels_[i];
    }
    shard_numel_ = (offset + world_size_ - 1) / world_size_;
    if (shard_numel_ > 0) pieces_.push_back({0, 0, shard_numel_, -1});
  }
}

int64_t UnitLayout::total_param_numel() const {
  int64_t total = 0;
  for (int64_t n : numels_) total += n;
  return total;
}

std::vector<OwnedSegment> UnitLayout::segments_of_rank(int rank) const {
  ST_CHECK(rank >= 0 && rank < world_size_, "rank ", rank, " outside 0..", world_size_ - 1);
  std::vector<OwnedSegment> segments;
  for (int i = 0; i < num_params(); ++i) {
    int64_t begin = 0;
    int64_t end = 0;
    int64_t shard_offset = 0;
    if (kind_ == Kind::kPerParam) {
      begin = std::min(numels_[i], rank * chunk_sizes_[i]);
      end = std::min(numels_[i], (rank + 1) * chunk_sizes_[i]);
      shard_offset = chunk_offsets_[i];
    } else {
      const int64_t lo = rank * shard_numel_;
      const int64_t hi = lo + shard_numel_;
      const int64_t p_lo = full_offsets_[i];
      const int64_t p_hi = p_lo + numels_[i];
      begin = std::max(lo, p_lo) - p_lo;
      end = std::min(hi, p_hi) - p_lo;
      shard_offset = std::max(lo, p_lo) - lo;
    }
    if (end > begin) segments.push_back({i, begin, shard_offset, end - begin});
  }
  return segments;
}

std::vector<int64_t> UnitLayout::param_splits(int i) const {
  std::vector<int64_t> splits(static_cast<std::size_t>(world_size_));
  const int64_t n = numels_[i];
  for (int r = 0; r < world_size_; ++r) {
    if (kind_ == Kind::kPerParam) {
      splits[r] = std::max<int64_t>(0, std::min(n, (r + 1) * chunk_sizes_[i]) - r * chunk_sizes_[i]);
    } else {
      const int64_t lo = full_offsets_[i];
      splits[r] = std::max<int64_t>(0, std::min((r + 1) * shard_numel_, lo + n) - std::max(r * shard_numel_, lo));
    }
  }
  return splits;
}

int64_t UnitLayout::param_shard_offset(int i, int rank) const {
  if (kind_ == Kind::kPerParam) return chunk_offsets_[i];
  const int64_t lo = rank * shard_numel_;
  return std::max<int64_t>(0, std::min(full_offsets_[i] - lo, shard_numel_));
}

void UnitLayout::pack_shard(const std::vector<at::Tensor>& values, int rank, const at::Tensor& shard) const {
  ST_CHECK(shard.numel() == shard_numel_, "pack_shard: shard has ", shard.numel(), " elements, layout needs ",
           shard_numel_);
  shard.zero_();
  for (const auto& segment : segments_of_rank(rank)) {
    const at::Tensor& value = values[segment.param_index];
    if (!value.defined()) continue;
    shard.narrow(0, segment.shard_offset, segment.length)
        .copy_(value.reshape({-1}).narrow(0, segment.param_offset, segment.length));
  }
}

std::vector<std::pair<int64_t, int64_t>> optimizer_step_slices(std::vector<int64_t> parameter_starts,
                                                               int64_t sub_group_size, int64_t total,
                                                               int64_t alignment) {
  ST_CHECK(sub_group_size >= 0 && alignment >= 1 && total >= 0, "optimizer_step_slices: sub_group_size ",
           sub_group_size, ", alignment ", alignment, ", total ", total);
  std::vector<int64_t> starts{0};
  if (sub_group_size > 0) {
    const int64_t size = (sub_group_size + alignment - 1) / alignment * alignment;
    for (int64_t begin = size; begin < total; begin += size) starts.push_back(begin);
  } else {
    for (const int64_t start : parameter_starts) starts.push_back(start / alignment * alignment);
  }
  std::sort(starts.begin(), starts.end());
  starts.erase(std::unique(starts.begin(), starts.end()), starts.end());
  std::vector<std::pair<int64_t, int64_t>> slices;
  for (size_t i = 0; i < starts.size() && starts[i] < total; ++i) {
    const int64_t end = i + 1 < starts.size() ? std::min(total, starts[i + 1]) : total;
    slices.emplace_back(starts[i], end);
  }
  return slices;
}

}  // namespace shardtrain::engine
