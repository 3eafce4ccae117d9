// Built when the Gloo backend is not compiled in (no gloo headers at configure
// time): CPU training still runs in one process, and a larger CPU job is
// refused with the reason instead of failing to link.
#include "comm/gloo/gloo_factory.h"

#include "comm/single_process_communicator.h"
#include "shardtrain/error.h"

namespace shardtrain::comm {

bool gloo_available() { return false; }

std::string gloo_unavailable_reason() {
  return "this shardtrain was built without the Gloo backend (no gloo headers at configure time), so CPU "
         "training runs in one process only";
}

CommunicatorPtr make_gloo_communicator(StorePtr, int, int world_size, std::vector<int>, CommOptions options,
                                       std::string, std::string) {
  ST_CHECK_T(ConfigError, world_size == 1, "cannot create a Gloo communicator of ", world_size,
             " ranks: ", gloo_unavailable_reason());
  return std::make_shared<SingleProcessCommunicator>(at::Device(at::kCPU), std::move(options));
}

}  // namespace shardtrain::comm
