// Strings over the Communicator (see text_exchange.h).

#include "comm/text_exchange.h"

#include <algorithm>

#include <ATen/ATen.h>

namespace shardtrain::comm {

std::string broadcast_text(Communicator& comm, const std::string& text, int root, size_t max_bytes) {
  const auto on_device = at::TensorOptions().dtype(at::kLong).device(comm.device());
  // The length first, so every rank allocates the same buffer.
  at::Tensor length = at::full({1}, static_cast<int64_t>(std::min(text.size(), max_bytes)),
                               at::TensorOptions().dtype(at::kLong));
  at::Tensor length_here = length.to(comm.device());
  comm.broadcast(length_here, root);
  const int64_t n = length_here.cpu().item<int64_t>();
  if (n == 0) return "";
  at::Tensor bytes = at::zeros({n}, at::TensorOptions().dtype(at::kLong));
  if (comm.rank() == root) {
    int64_t* out = bytes.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<unsigned char>(text[static_cast<size_t>(i)]);
  }
  at::Tensor bytes_here = bytes.to(on_device.device());
  comm.broadcast(bytes_here, root);
  const at::Tensor received = bytes_here.cpu();
  std::string result(static_cast<size_t>(n), '\0');
  for (int64_t i = 0; i < n; ++i) result[static_cast<size_t>(i)] = static_cast<char>(received.data_ptr<int64_t>()[i]);
  return result;
}

}  // namespace shardtrain::comm
