#pragma once
// How the CUDA elementwise kernels split n elements over their threads, as
// plain C++ that the kernels and a CPU test share: the test runs the same
// loops for every simulated thread and checks that each element is visited
// exactly once, on the vector path and off it, at any offset and length.
//
// An elementwise launch covers [0, n) in three parts:
//   head   [0, head)                 one element per thread, until every
//                                    stream's pointer is aligned for packs;
//   packs  [head, head + packs*kVec)  kVec elements per 16-byte (fp32) or
//                                    8-byte (16-bit) access;
//   tail   [tail_begin, n)           one element per thread.
// Each part is a grid-stride loop, so any grid size covers everything; the
// grid is capped at what the device keeps resident.

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "kernels/element_math.h"

namespace shardtrain::kernels::cuda {

/// Elements per pack: 16-byte loads of fp32, 8-byte loads of 16-bit types.
constexpr int kVec = 4;
constexpr int kThreads = 256;
/// 8 blocks of 256 threads = 2048 resident threads per SM (Volta..Blackwell).
constexpr int kBlocksPerSm = 8;

struct ElementwisePlan {
  int64_t n = 0;
  int64_t head = 0;
  int64_t packs = 0;
  int64_t tail_begin = 0;
  unsigned blocks = 1;
  int threads = kThreads;
};

/// Elements from `address` (of elements of `element_size` bytes) to the next
/// address aligned for a pack, or -1 when no number of whole elements gets
/// there (the address is not even element-aligned).
inline int64_t elements_to_pack_alignment(const void* address, std::size_t element_size) {
  const std::size_t pack_bytes = element_size * kVec;
  const auto a = reinterpret_cast<std::uintptr_t>(address);
  if (a % element_size != 0) return -1;
  return static_cast<int64_t>(((pack_bytes - a % pack_bytes) % pack_bytes) / element_size);
}

/// Stands for a stream a launch does not use, in common_head's list.
constexpr int64_t kNoStream = INT64_MAX;

/// The head shared by all streams (kNoStream entries ignored), or -1 when
/// they disagree (then no packs).
inline int64_t common_head(std::initializer_list<int64_t> heads) {
  int64_t common = -2;
  for (const int64_t h : heads) {
    if (h == kNoStream) continue;
    if (h < 0) return -1;
    if (common == -2) {
      common = h;
    } else if (h != common) {
      return -1;
    }
  }
  return common < 0 ? 0 : common;
}

/// The plan for n elements whose streams reach pack alignment after `head`
/// elements (-1: never, so everything runs one element per thread), on a
/// device with `sm_count` multiprocessors.
inline ElementwisePlan make_elementwise_plan(int64_t n, int64_t head, int sm_count) {
  ElementwisePlan plan;
  plan.n = n < 0 ? 0 : n;
  if (head < 0 || head >= plan.n) {
    plan.head = 0;
    plan.packs = 0;
  } else {
    plan.head = head;
    plan.packs = (plan.n - head) / kVec;
  }
  plan.tail_begin = plan.head + plan.packs * kVec;
  int64_t items = plan.packs;
  if (plan.n - plan.tail_begin > items) items = plan.n - plan.tail_begin;
  if (plan.head > items) items = plan.head;
  const int64_t wanted = (items + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sm_count < 1 ? 1 : sm_count) * kBlocksPerSm;
  plan.blocks = static_cast<unsigned>(wanted < 1 ? 1 : (wanted < cap ? wanted : cap));
  return plan;
}

/// Runs one thread's share of a plan: on_element(i) for single elements,
/// on_pack(first) for the pack [first, first + kVec). `thread` is the global
/// thread index, `stride` the number of threads in the grid.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class OnElement, class OnPack>
ST_HOST_DEVICE void for_each_plan_item(const ElementwisePlan& plan, int64_t thread, int64_t stride,
                                       OnElement&& on_element, OnPack&& on_pack) {
  for (int64_t i = thread; i < plan.head; i += stride) on_element(i);
  for (int64_t k = thread; k < plan.packs; k += stride) on_pack(plan.head + k * kVec);
  for (int64_t i = plan.tail_begin + thread; i < plan.n; i += stride) on_element(i);
}

/// The gradient-norm launch: one block of math::kSumLanes threads per
/// math::kSumBlock elements; lane `lane` of block `block` adds the elements
/// this calls on_element for, in order (element_math.h's partition).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class OnElement>
ST_HOST_DEVICE void for_each_lane_element(int64_t n, int64_t block, int lane, OnElement&& on_element) {
  const int64_t first = block * math::kSumBlock;
  const int64_t end = first + math::kSumBlock < n ? first + math::kSumBlock : n;
  for (int64_t i = first + lane; i < end; i += math::kSumLanes) on_element(i);
}

}  // namespace shardtrain::kernels::cuda
