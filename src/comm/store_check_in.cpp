// check_in_after_connect: the store's host waits until the group's other
// members have said they are done with the store (store_check_in.h says why).

#include "comm/store_check_in.h"

#include <algorithm>
#include <thread>

#include "shardtrain/error.h"

namespace shardtrain::comm {

void check_in_after_connect(c10d::Store& store, const std::string& key_prefix, const std::vector<int>& members,
                            int my_global_rank, std::chrono::milliseconds timeout) {
  const std::string key = key_prefix + "connected";
  if (my_global_rank != kStoreHostRank) {
    store.add(key, 1);
    return;
  }
  const bool host_is_member = std::find(members.begin(), members.end(), kStoreHostRank) != members.end();
  const int64_t expected = static_cast<int64_t>(members.size()) - (host_is_member ? 1 : 0);
  const auto start = std::chrono::steady_clock::now();
  // Polled, because a wait on a key that the last rank sets would need that
  // rank to read a reply after rank 0 may already be gone. The others finish
  // connecting within milliseconds of rank 0, so the first polls are short.
  auto pause = std::chrono::milliseconds(1);
  for (int64_t arrived = store.add(key, 0); arrived < expected; arrived = store.add(key, 0)) {
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
    if (waited >= timeout) {
      ST_THROW(TimeoutError, "rank 0 hosts the job's rendezvous store and waited ", waited.count(), " ms (limit ",
               timeout.count(), " ms) for the other ", expected, " rank(s) of the group (store prefix '", key_prefix,
               "') to finish connecting; only ", arrived,
               " did. A rank has probably died while connecting: its own output says why");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(20));
  }
}

}  // namespace shardtrain::comm
