#pragma once
// The client side of shardtrain's rendezvous store (private header): a
// c10d::Store, so Gloo's and our NCCL backend's set-up use it as they would
// c10d's TCPStore, that authenticates to the server (server.h)
// with the job's token before its first request.

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace shardtrain::comm::rendezvous {

class RendezvousServer;

struct Endpoint {
  std::string host;
  int port = 0;
  /// The job's secret; empty for an unauthenticated job (both ends then agree on the empty key).
  std::string token;
  /// The job this process belongs to; the server refuses a process of another job by name.
  std::string job_id;
};

class RendezvousStore final : public c10d::Store {
 public:
  /// Connects and authenticates, retrying a refused or unreachable connect
  /// until `timeout` (rank 0 may not listen yet). Throws ConfigError when the
  /// server refuses the token or cannot prove it holds the same one, and
  /// TimeoutError when nothing answers in time. `server` (rank 0's) lives as
  /// long as the last store that holds it.
  RendezvousStore(Endpoint endpoint, std::chrono::milliseconds timeout,
                  std::shared_ptr<RendezvousServer> server = nullptr);
  ~RendezvousStore() override;

  /// A second connection to the same server (c10d calls it, e.g. for a
  /// process group's own store).
  c10::intrusive_ptr<c10d::Store> clone() override;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

 private:
  /// Sends `request` and returns the reply's payload (its status byte, then
  /// its fields), within `timeout`. A failure closes the connection (its state is
  /// unknown); the next request reconnects.
  std::vector<uint8_t> exchange(const std::vector<uint8_t>& request, std::chrono::milliseconds timeout,
                                const char* what);
  void connect_locked(std::chrono::steady_clock::time_point deadline);
  std::string describe() const;

  Endpoint endpoint_;
  std::shared_ptr<RendezvousServer> server_;
  std::mutex mutex_;
  int fd_ = -1;
};

}  // namespace shardtrain::comm::rendezvous
