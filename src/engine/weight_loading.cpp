// Freeing and measuring parameter storage, for the ranks that do not load
// the weights themselves, and reading from a weight source (weight_loading.h).
#include "shardtrain/weight_loading.h"

#include <limits>
#include <unordered_set>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "engine/storage_resize.h"
#include "shardtrain/error.h"

namespace shardtrain {

int64_t release_storage(const at::Tensor& tensor) {
  ST_CHECK(tensor.defined(), "release_storage: the tensor is undefined");
  if (!tensor.has_storage()) return 0;
  const int64_t held = static_cast<int64_t>(tensor.storage().nbytes());
  if (held == 0) return 0;  // released already (tied parameters come here twice)
  const int64_t own = tensor.numel() * static_cast<int64_t>(tensor.element_size());
  ST_CHECK(held == own && tensor.storage_offset() == 0, "release_storage: the tensor (", tensor.sizes(), ", ",
           own, " bytes) views a storage of ", held,
           " bytes shared with other tensors; freeing it would destroy their values. Release parameters right "
           "after constructing their module, before prepare() or any view is taken");
  engine::resize_storage_bytes(tensor, 0);
  return held;
}

int64_t release_parameter_storage(torch::nn::Module& module) {
  int64_t released = 0;
  for (const auto& p : module.parameters(/*recurse=*/true)) released += release_storage(p);
#if defined(__GLIBC__)
  // glibc keeps freed heap memory resident, and the modules built next leave
  // small live allocations between the freed blocks, so without this the
  // resident set grows by several modules' worth while a model is built
  // module by module (measured: ~3 decoder layers of a 4-layer model).
  if (released >= (int64_t{1} << 20)) malloc_trim(0);
#endif
  return released;
}

bool is_storage_released(const at::Tensor& tensor) {
  return tensor.defined() && tensor.numel() > 0 && (!tensor.has_storage() || tensor.storage().nbytes() == 0);
}

void read_weights(const WeightSource& source, const std::string& name, int64_t begin, int64_t length,
                  const at::Tensor& out) {
  out.fill_(std::numeric_limits<double>::quiet_NaN());
  source(name, begin, length, out);
  ST_CHECK(!out.isnan().any().item<bool>(), "the weight source left elements of '", name, "' [", begin, ", +",
           length, ") unwritten (or wrote NaN); it must copy into `out`");
}

int64_t parameter_storage_bytes(torch::nn::Module& module) {
  std::unordered_set<const void*> seen;
  int64_t total = 0;
  for (const auto& p : module.parameters(/*recurse=*/true)) {
    if (!p.has_storage()) continue;
    if (seen.insert(p.storage().unsafeGetStorageImpl()).second) total += static_cast<int64_t>(p.storage().nbytes());
  }
  return total;
}

}  // namespace shardtrain
