// Built when the NCCL backend is not compiled in (no CUDA toolkit / NCCL at
// configure time): the factory reports that instead of failing to link.
#include "comm/nccl/nccl_factory.h"

#include "shardtrain/error.h"

namespace shardtrain::comm {

bool nccl_usable() { return false; }

std::string nccl_unavailable_reason() {
  return "this shardtrain was built without the NCCL backend (configure with the CUDA toolkit and "
         "NCCL present, -DSHARDTRAIN_CUDA=ON)";
}

std::string nccl_version_string() { return {}; }
std::string nccl_loaded_version_string() { return {}; }

CommunicatorPtr make_nccl_communicator(comm::StorePtr, int, int, std::vector<int>, CommOptions, int) {
  ST_THROW(ConfigError, "cannot create an NCCL communicator: ", nccl_unavailable_reason());
}

}  // namespace shardtrain::comm
