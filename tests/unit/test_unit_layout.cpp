// The engine's layout and gradient plumbing, without ranks: UnitLayout's
// pieces place every rank's shard where the parameters view it, and the
// post-accumulate hook hands the engine autograd's own gradient tensor.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "engine/grad_ready_hook.h"
#include "engine/unit_layout.h"

namespace {

using shardtrain::engine::UnitLayout;

/// Every rank's shard of `values` laid into a full buffer through the
/// pieces, as an all-gather of each piece would: rank r's
/// shard[shard_offset, +chunk) at full_offset + r * chunk.
at::Tensor gather_through_pieces(const UnitLayout& layout, const std::vector<at::Tensor>& values) {
  const int W = layout.world_size();
  at::Tensor full = at::full({layout.full_numel()}, -1.0);
  for (int r = 0; r < W; ++r) {
    at::Tensor shard = at::empty({layout.shard_numel()});
    layout.pack_shard(values, r, shard);
    for (const auto& piece : layout.pieces()) {
      full.narrow(0, piece.full_offset + r * piece.chunk, piece.chunk)
          .copy_(shard.narrow(0, piece.shard_offset, piece.chunk));
    }
  }
  return full;
}

std::vector<at::Tensor> distinct_values(const std::vector<int64_t>& numels) {
  std::vector<at::Tensor> values;
  double start = 1.0;
  for (int64_t n : numels) {
    values.push_back(at::arange(start, start + static_cast<double>(n), at::kFloat));
    start += 1000.0;
  }
  return values;
}

// Sizes that divide by the world, that do not, one smaller than the world
// (whole ranks of padding) and an empty one, at worlds 1 to 4.
TEST(UnitUnitLayout, PiecesPutEveryShardWhereTheParametersViewIt) {
  const std::vector<int64_t> numels = {12, 7, 1, 0, 30};
  for (const auto kind : {UnitLayout::Kind::kPerParam, UnitLayout::Kind::kFlat}) {
    for (int W = 1; W <= 4; ++W) {
      const UnitLayout layout(kind, numels, W);
      ASSERT_EQ(layout.full_numel(), W * layout.shard_numel());
      const auto values = distinct_values(numels);
      const at::Tensor full = gather_through_pieces(layout, values);
      // The pieces tile the full buffer exactly: nothing is left unwritten.
      EXPECT_FALSE(full.eq(-1.0).any().item<bool>()) << "world " << W;
      int64_t covered = 0;
      for (const auto& piece : layout.pieces()) covered += W * piece.chunk;
      EXPECT_EQ(covered, layout.full_numel()) << "world " << W;
      for (int i = 0; i < layout.num_params(); ++i) {
        EXPECT_TRUE(at::equal(full.narrow(0, layout.param_offset_in_full(i), numels[i]), values[i]))
            << "parameter " << i << " world " << W;
      }
      // param_splits / param_shard_offset (how the engine cuts a gradient)
      // agree with the segments each rank owns.
      for (int i = 0; i < layout.num_params(); ++i) {
        const auto splits = layout.param_splits(i);
        int64_t sum = 0;
        for (int r = 0; r < W; ++r) {
          int64_t owned = 0, offset = -1;
          for (const auto& segment : layout.segments_of_rank(r)) {
            if (segment.param_index == i) {
              owned = segment.length;
              offset = segment.shard_offset;
            }
          }
          EXPECT_EQ(splits[r], owned) << "parameter " << i << " rank " << r << " world " << W;
          if (owned > 0) EXPECT_EQ(layout.param_shard_offset(i, r), offset) << "parameter " << i << " rank " << r;
          sum += splits[r];
        }
        EXPECT_EQ(sum, numels[i]);
      }
    }
  }
}

TEST(UnitUnitLayout, PerParamPiecesAreOnePerParameterAndFlatIsOne) {
  const UnitLayout per_param(UnitLayout::Kind::kPerParam, {12, 7, 0}, 3);
  ASSERT_EQ(per_param.pieces().size(), 2u) << "the empty parameter has no piece";
  EXPECT_EQ(per_param.pieces()[0].param_index, 0);
  EXPECT_EQ(per_param.pieces()[0].chunk, 4);
  EXPECT_EQ(per_param.pieces()[1].chunk, 3);  // ceil(7 / 3)
  EXPECT_EQ(per_param.pieces()[1].full_offset, 12);
  EXPECT_EQ(per_param.pieces()[1].shard_offset, 4);
  const UnitLayout flat(UnitLayout::Kind::kFlat, {12, 7, 0}, 3);
  ASSERT_EQ(flat.pieces().size(), 1u);
  EXPECT_EQ(flat.pieces()[0].chunk, 7);  // ceil(19 / 3)
}

TEST(UnitUnitLayout, OptimizerStepSlicesTileThePartitionPerParameterOrBySize) {
  using Slices = std::vector<std::pair<int64_t, int64_t>>;
  using shardtrain::engine::optimizer_step_slices;
  // sub_group_size 0 (DeepSpeed: one sub-group per parameter): a slice from
  // each parameter run's start, in any order, duplicates once, to the end.
  EXPECT_EQ(optimizer_step_slices({12, 0, 5, 12}, 0, 20), (Slices{{0, 5}, {5, 12}, {12, 20}}));
  // A rank's runs from a real layout: rank 1 of 3 owns [4, 8) of parameter 0
  // at shard offset 0 and [3, 6) of parameter 1 at shard offset 4.
  const UnitLayout layout(UnitLayout::Kind::kPerParam, {12, 7}, 3);
  std::vector<int64_t> starts;
  for (const auto& segment : layout.segments_of_rank(1)) starts.push_back(segment.shard_offset);
  EXPECT_EQ(optimizer_step_slices(starts, 0, layout.shard_numel()), (Slices{{0, 4}, {4, 7}}));
  // A size: fixed slices, the last one short.
  EXPECT_EQ(optimizer_step_slices({}, 8, 20), (Slices{{0, 8}, {8, 16}, {16, 20}}));
  EXPECT_EQ(optimizer_step_slices({}, 1000, 20), (Slices{{0, 20}}));
  EXPECT_TRUE(optimizer_step_slices({3}, 0, 0).empty());
  // Aligned to an audit's sampling pattern of 16 elements: starts round down
  // (parameters) or sizes round up, so each slice samples as the whole does.
  EXPECT_EQ(optimizer_step_slices({5, 20, 40}, 0, 50, 16), (Slices{{0, 16}, {16, 32}, {32, 50}}));
  EXPECT_EQ(optimizer_step_slices({}, 7, 40, 16), (Slices{{0, 16}, {16, 32}, {32, 40}}));
}

// The engine reduces the tensor autograd produced. A tensor hook that keeps
// the gradient forces AccumulateGrad to clone it; the post-accumulate hook
// sees .grad() as autograd's own output, the storage the pre-hook saw.
TEST(UnitGradHooks, PostAccumulateHookSeesAutogradsOwnGradientAndGoesWithItsHandle) {
  for (const bool hold_in_pre_hook : {false, true}) {
    at::Tensor w = torch::randn({64, 32}, torch::requires_grad());
    const void* produced = nullptr;
    at::Tensor held;
    w.register_hook([&](const at::Tensor& grad) {
      produced = grad.data_ptr();  // the address only, no reference
      if (hold_in_pre_hook) held = grad;
    });
    int calls = 0;
    const void* accumulated = nullptr;
    auto hook = std::make_unique<shardtrain::engine::GradReadyHook>(w, [&] {
      ++calls;
      ASSERT_TRUE(w.grad().defined());
      accumulated = w.grad().data_ptr();
    });
    at::Tensor x = torch::randn({8, 64});
    at::matmul(x, w).sum().backward();
    EXPECT_EQ(calls, 1);
    // The same product autograd computes for it (mm backward: mat1^T @ grad).
    EXPECT_TRUE(at::equal(w.grad(), at::mm(x.t(), at::ones({8, 32}))));
    if (hold_in_pre_hook) {
      EXPECT_NE(accumulated, produced) << "a held gradient is cloned into .grad()";
    } else {
      EXPECT_EQ(accumulated, produced) << ".grad() is the tensor autograd produced";
    }
    // Gone with its handle: a later backward does not call it.
    hook.reset();
    w.mutable_grad() = at::Tensor();
    at::matmul(x, w).sum().backward();
    EXPECT_EQ(calls, 1);
  }
}

}  // namespace
