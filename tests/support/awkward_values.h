#pragma once
// Bitwise comparisons for the kernel and collective tests: inputs that
// exercise every branch of an elementwise update, and tensor bit equality.

#include <cstdint>
#include <limits>

#include <ATen/ATen.h>

namespace shardtrain::testing {

/// n fp32 values: normal numbers over ten decades, and every 97th element one
/// of zeros of both signs, subnormals, the extremes and (with_non_finite)
/// +-inf and NaN.
inline at::Tensor awkward_values(int64_t n, uint64_t seed, bool with_non_finite) {
  at::manual_seed(seed);
  at::Tensor t = at::randn({n}) * at::pow(10.0, at::randint(-6, 4, {n}).to(at::kFloat));
  float* data = t.data_ptr<float>();
  const float specials[] = {0.0f, -0.0f, std::numeric_limits<float>::denorm_min(), -1e-40f,
                            std::numeric_limits<float>::max(), std::numeric_limits<float>::min(),
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN()};
  const int count = with_non_finite ? 9 : 6;
  for (int64_t i = 0; i < n; i += 97) data[i] = specials[(i / 97) % count];
  return t;
}

/// Bitwise equality of two tensors of one dtype and shape (at::equal would
/// call -0 == +0 equal and NaN unequal). Element sizes 2, 4 and 8.
inline bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::ScalarType bits = a.element_size() == 8 ? at::kLong : a.element_size() == 4 ? at::kInt : at::kShort;
  return at::equal(a.contiguous().view(bits), b.contiguous().view(bits));
}

}  // namespace shardtrain::testing
