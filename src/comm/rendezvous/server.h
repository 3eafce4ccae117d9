#pragma once
// The rendezvous store's server (private header): rank 0 hosts it for the
// job's lifetime. One thread serves every connection through poll(), so a
// process that connects and says nothing holds no thread and no more than one
// handshake's worth of memory. A connection must prove it holds the job's
// token (protocol.h) before it may read or write a key; one that
// fails is refused, logged and closed, and the job goes on.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

namespace shardtrain::comm::rendezvous {

/// A connection that has not proved itself this long after it was accepted is
/// closed: a handshake is one round trip, so seconds are generous even
/// between continents.
inline constexpr std::chrono::seconds kHandshakeTimeout{3};

class RendezvousServer {
 public:
  /// Binds `bind_host`:`port` (a name or numeric address; "0.0.0.0" for
  /// every interface; port 0 for any free one) and starts serving. Throws
  /// Error naming the address and the system's reason when it cannot listen.
  /// Only processes that carry `token` and the same `job_id` may join.
  RendezvousServer(const std::string& bind_host, int port, std::string token, std::string job_id = "");
  ~RendezvousServer();
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;

  /// The port it listens on (the chosen one when constructed with 0).
  int port() const { return port_; }
  /// "127.0.0.1:29500": the address it is bound to, as the kernel reports it.
  const std::string& bound_address() const { return bound_address_; }
  /// Connections refused so far (wrong or missing token, bad handshake, timeouts).
  int64_t refused_connections() const { return refused_.load(); }

 private:
  struct State;
  void serve();

  int listen_fd_ = -1;
  int wake_fd_ = -1;
  int port_ = 0;
  std::string bound_address_;
  std::string token_;
  std::string job_id_;
  std::atomic<int64_t> refused_{0};
  std::unique_ptr<State> state_;
  std::thread thread_;
};

}  // namespace shardtrain::comm::rendezvous
