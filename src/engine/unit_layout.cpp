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
    int64_t full = 0;
    for (int i = 0; i < n; ++i) {
      chunk_sizes_[i] = (numels_[i] + world_size_ - 1) / world_size_;
      chunk_offsets_[i] = shard;
      shard += chunk_sizes_[i];
      full_offsets_[i] = full;
      full += numels_[i];
    }
    shard_numel_ = shard;
    full_numel_ = full;
  } else {
    int64_t offset = 0;
    for (int i = 0; i < n; ++i) {
      offset = (offset + align - 1) / align * align;
      full_offsets_[i] = offset;
      offset += numels_[i];
    }
    shard_numel_ = (offset + world_size_ - 1) / world_size_;
    full_numel_ = shard_numel_ * world_size_;
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

void UnitLayout::unpack(const at::Tensor& rank_major, const at::Tensor& full) const {
  ST_CHECK(rank_major.numel() == gathered_numel(), "unpack: expected ", gathered_numel(), " elements, got ",
           rank_major.numel());
  ST_CHECK(full.numel() == full_numel_, "unpack: full buffer has ", full.numel(), " elements, layout needs ",
           full_numel_);
  if (kind_ == Kind::kFlat) {
    if (!rank_major.is_same(full)) full.copy_(rank_major);
    return;
  }
  at::Tensor grid = rank_major.view({world_size_, shard_numel_});
  for (int i = 0; i < num_params(); ++i) {
    const int64_t c = chunk_sizes_[i];
    if (c == 0) continue;
    at::Tensor padded = grid.narrow(1, chunk_offsets_[i], c).reshape({-1});
    full.narrow(0, full_offsets_[i], numels_[i]).copy_(padded.narrow(0, 0, numels_[i]));
  }
}

void UnitLayout::pack(const std::vector<at::Tensor>& values, const at::Tensor& out) const {
  ST_CHECK(static_cast<int>(values.size()) == num_params(), "pack: ", values.size(), " tensors for ",
           num_params(), " parameters");
  ST_CHECK(out.numel() == gathered_numel() && out.is_contiguous(), "pack: output must be a contiguous ",
           gathered_numel(), "-element tensor");
  if (kind_ == Kind::kFlat) {
    out.zero_();
    for (int i = 0; i < num_params(); ++i) {
      if (values[i].defined()) out.narrow(0, full_offsets_[i], numels_[i]).copy_(values[i].reshape({-1}));
    }
    return;
  }
  at::Tensor grid = out.view({world_size_, shard_numel_});
  for (int i = 0; i < num_params(); ++i) {
    const int64_t c = chunk_sizes_[i];
    if (c == 0) continue;
    at::Tensor block = grid.narrow(1, chunk_offsets_[i], c);  // W x c, strided
    if (!values[i].defined()) {
      block.zero_();
      continue;
    }
    const int64_t n = numels_[i];
    at::Tensor flat = values[i].reshape({-1});
    if (n == world_size_ * c) {
      block.copy_(flat.view({world_size_, c}));
    } else {
      at::Tensor padded = at::zeros({world_size_ * c}, out.options());
      padded.narrow(0, 0, n).copy_(flat);
      block.copy_(padded.view({world_size_, c}));
    }
  }
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

}  // namespace shardtrain::engine
