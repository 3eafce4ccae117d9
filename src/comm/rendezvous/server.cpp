// The rendezvous store's server (see server.h).

#include "comm/rendezvous/server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <unordered_map>
#include <vector>

#include "comm/rendezvous/protocol.h"
#include "shardtrain/error.h"
#include "shardtrain/logging.h"

namespace shardtrain::comm::rendezvous {
namespace {

// Admission of connections that have not proved the token yet. A stranger
// who can reach the port could hold every pending slot with silent
// connections; the table used to close every later connection on accept,
// real ranks included, until the job timed out. Now a new connection always
// gets in, and the oldest pending one makes room. A rank's handshake needs
// two rounds of the serving loop (its hello goes out, its proof comes in),
// and each round accepts at most kAcceptsPerRound connections, so a flood
// needs kMaxPendingPerSource / kAcceptsPerRound = 4 rounds to push it out
// however fast it connects; a rank pushed out all the same retries. A source
// address may hold at most half the table, so a flood from one host cannot
// crowd out the ranks of another.
/// Unauthenticated connections held at once (bounds the descriptors a flood takes).
constexpr std::size_t kMaxPendingHandshakes = 256;
/// Of those, from one source address.
constexpr std::size_t kMaxPendingPerSource = kMaxPendingHandshakes / 2;
/// New connections taken per round; the rest wait in the kernel's backlog.
constexpr int kAcceptsPerRound = 32;
/// Evictions and handshake timeouts are logged as one summary per source per
/// this interval, not one line per connection.
constexpr auto kRefusalLogInterval = std::chrono::seconds(10);

std::string describe_address(const sockaddr* address) {
  char host[NI_MAXHOST] = "?";
  char service[NI_MAXSERV] = "?";
  const socklen_t length =
      address->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : static_cast<socklen_t>(sizeof(sockaddr_in));
  ::getnameinfo(address, length, host, sizeof(host), service, sizeof(service), NI_NUMERICHOST | NI_NUMERICSERV);
  return address->sa_family == AF_INET6 ? "[" + std::string(host) + "]:" + service
                                        : std::string(host) + ":" + service;
}

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

/// "127.0.0.1" of "127.0.0.1:5000", "[::1]" of "[::1]:5000".
std::string host_of(const std::string& peer) { return peer.substr(0, peer.rfind(':')); }

struct Connection {
  std::string peer;
  std::string source;  ///< the peer's address without its port
  Clock::time_point accepted;
  bool authenticated = false;
  Bytes server_nonce;
  Bytes in;
  Bytes out;
  std::size_t out_pos = 0;
  bool close_after_flush = false;
  Clock::time_point handshake_deadline;
};

struct ParkedRequest {
  int fd;
  Op op;
  std::vector<std::string> keys;
};

Bytes ok_reply() { return FrameWriter(0).finish(); }

}  // namespace

struct RendezvousServer::State {
  std::unordered_map<int, Connection> connections;
  /// Per source: connections closed silently (evicted, timed out) since the last summary.
  std::map<std::string, int64_t> closed_quietly;
  Clock::time_point last_summary{};
  std::map<std::string, Bytes> keys;
  std::vector<ParkedRequest> parked;
};

RendezvousServer::RendezvousServer(const std::string& bind_host, int port, std::string token, std::string job_id)
    : token_(std::move(token)), job_id_(std::move(job_id)), state_(std::make_unique<State>()) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const int resolved = ::getaddrinfo(bind_host.c_str(), service.c_str(), &hints, &found);
  ST_CHECK(resolved == 0, "the rendezvous cannot listen on '", bind_host, "': the name does not resolve (",
           ::gai_strerror(resolved), "); set --main_process_ip / MASTER_ADDR to this machine's address");
  std::string last_error;
  for (addrinfo* a = found; a != nullptr && listen_fd_ < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    // A restarted job may reuse the port while the last one's sockets linger in TIME_WAIT.
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 512) == 0) {
      listen_fd_ = fd;
    } else {
      last_error = std::string(std::strerror(errno)) + " (" + describe_address(a->ai_addr) + ")";
      ::close(fd);
    }
  }
  ::freeaddrinfo(found);
  ST_CHECK(listen_fd_ >= 0, "the rendezvous cannot listen on ", bind_host, ":", port, ": ", last_error);
  sockaddr_storage bound{};
  socklen_t length = sizeof(bound);
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &length);
  bound_address_ = describe_address(reinterpret_cast<sockaddr*>(&bound));
  port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  set_nonblocking(listen_fd_);
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  ST_CHECK(wake_fd_ >= 0, "the rendezvous server could not create its wake-up descriptor: ", std::strerror(errno));
  thread_ = std::thread([this] { serve(); });
}

RendezvousServer::~RendezvousServer() {
  const uint64_t one = 1;
  if (::write(wake_fd_, &one, sizeof(one)) < 0) {
    // Nothing to do: the poll timeout below ends the loop at the latest.
  }
  if (thread_.joinable()) thread_.join();
  for (auto& [fd, connection] : state_->connections) ::close(fd);
  ::close(listen_fd_);
  ::close(wake_fd_);
}

namespace {

/// Handles one authenticated request; returns false when the connection must close.
bool handle_request(int fd, Connection& c, const Bytes& payload, std::map<std::string, Bytes>& keys,
                    std::vector<ParkedRequest>& parked, bool& keys_changed) {
  FrameReader in(payload);
  const auto op = static_cast<Op>(in.head());
  auto reply = [&](Bytes frame) { c.out.insert(c.out.end(), frame.begin(), frame.end()); };
  switch (op) {
    case Op::kSet: {
      std::string key = in.text();
      keys[key] = in.bytes();
      keys_changed = true;
      reply(ok_reply());
      return true;
    }
    case Op::kGet: {
      std::string key = in.text();
      auto found = keys.find(key);
      if (found != keys.end()) {
        reply(FrameWriter(0).field(found->second).finish());
      } else {
        parked.push_back({fd, op, {std::move(key)}});
      }
      return true;
    }
    case Op::kAdd: {
      std::string key = in.text();
      const int64_t delta = in.integer();
      int64_t value = 0;
      auto found = keys.find(key);
      // Counters are stored as decimal text, as c10d's stores keep them: a
      // get() of a counter key reads the same bytes everywhere.
      if (found != keys.end()) value = std::strtoll(std::string(found->second.begin(), found->second.end()).c_str(), nullptr, 10);
      // A sum past int64 is refused like any malformed request (signed
      // overflow is undefined behaviour; a fuzzed Add of INT64_MAX twice found it).
      if (__builtin_add_overflow(value, delta, &value)) return false;
      const std::string text = std::to_string(value);
      keys[key] = Bytes(text.begin(), text.end());
      keys_changed = true;
      reply(FrameWriter(0).field(value).finish());
      return true;
    }
    case Op::kCheck:
    case Op::kWait: {
      const int64_t count = in.integer();
      if (count < 0 || count > 1 << 20) return false;
      std::vector<std::string> wanted;
      bool all = true;
      for (int64_t i = 0; i < count; ++i) {
        wanted.push_back(in.text());
        all = all && keys.count(wanted.back()) != 0;
      }
      if (op == Op::kCheck) {
        reply(FrameWriter(0).field(static_cast<int64_t>(all)).finish());
      } else if (all) {
        reply(ok_reply());
      } else {
        parked.push_back({fd, op, std::move(wanted)});
      }
      return true;
    }
    case Op::kDelete: {
      const bool erased = keys.erase(in.text()) != 0;
      reply(FrameWriter(0).field(static_cast<int64_t>(erased)).finish());
      return true;
    }
    case Op::kNumKeys:
      reply(FrameWriter(0).field(static_cast<int64_t>(keys.size())).finish());
      return true;
    case Op::kCompareSet: {
      // c10d's semantics: a missing key is created only when `expected` is empty.
      std::string key = in.text();
      Bytes expected = in.bytes();
      Bytes desired = in.bytes();
      auto found = keys.find(key);
      if (found == keys.end()) {
        if (expected.empty()) {
          keys[key] = desired;
          keys_changed = true;
          reply(FrameWriter(0).field(desired).finish());
        } else {
          reply(FrameWriter(0).field(expected).finish());
        }
      } else if (found->second == expected) {
        found->second = desired;
        keys_changed = true;
        reply(FrameWriter(0).field(desired).finish());
      } else {
        reply(FrameWriter(0).field(found->second).finish());
      }
      return true;
    }
  }
  return false;  // an unknown opcode: not one of ours
}

/// Sends what `c` has queued, as far as the socket takes it now (it is
/// non-blocking; the rest goes when poll() reports room). Returns false when
/// the connection must close. Replies go out in the round that made them, not
/// the next one: a client that has its reply is then sure the bytes of every
/// reply made before it are on their way too, which is what lets rank 0 leave
/// once the others have checked in (comm/store_check_in.h).
bool send_queued(int fd, Connection& c) {
  if (c.out_pos == c.out.size()) return true;
  const ssize_t n = ::send(fd, c.out.data() + c.out_pos, c.out.size() - c.out_pos, MSG_NOSIGNAL);
  if (n > 0) c.out_pos += static_cast<std::size_t>(n);
  if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return false;
  if (c.out_pos == c.out.size()) {
    c.out.clear();
    c.out_pos = 0;
    if (c.close_after_flush) return false;
  }
  return true;
}

/// Answers every parked request the current keys satisfy.
void release_parked(std::vector<ParkedRequest>& parked, const std::map<std::string, Bytes>& keys,
                    std::unordered_map<int, Connection>& connections) {
  for (auto it = parked.begin(); it != parked.end();) {
    bool all = true;
    for (const auto& key : it->keys) all = all && keys.count(key) != 0;
    auto connection = connections.find(it->fd);
    if (connection == connections.end()) {
      it = parked.erase(it);
      continue;
    }
    if (!all) {
      ++it;
      continue;
    }
    Bytes frame = it->op == Op::kGet ? FrameWriter(0).field(keys.at(it->keys[0])).finish() : ok_reply();
    connection->second.out.insert(connection->second.out.end(), frame.begin(), frame.end());
    it = parked.erase(it);
  }
}

}  // namespace

void RendezvousServer::serve() {
  State& s = *state_;
  auto refuse = [&](Connection& c, const std::string& reason, Refusal why = Refusal::kNotThisJobsToken) {
    ++refused_;
    ST_LOG_WARN("rendezvous: refused the connection from {}: {}", c.peer, reason);
    Bytes frame = FrameWriter(1).field(reason).finish();
    // The status byte first, then the reason as a frame (the handshake's refusal form).
    c.out.push_back(static_cast<uint8_t>(why));
    c.out.insert(c.out.end(), frame.begin(), frame.end());
    c.close_after_flush = true;
    c.in.clear();
  };
  std::vector<int> to_close;
  while (true) {
    std::vector<pollfd> fds{{wake_fd_, POLLIN, 0}, {listen_fd_, POLLIN, 0}};
    for (auto& [fd, c] : s.connections) {
      short events = c.close_after_flush ? 0 : POLLIN;
      if (c.out_pos < c.out.size()) events |= POLLOUT;
      fds.push_back({fd, events, 0});
    }
    const int ready = ::poll(fds.data(), fds.size(), 1000);
    if (ready < 0 && errno != EINTR) {
      ST_LOG_ERROR("rendezvous server: poll failed: {}; the store stops serving", std::strerror(errno));
      return;
    }
    if (fds[0].revents != 0) return;  // the destructor asked us to stop
    const auto now = Clock::now();
    if (fds[1].revents & POLLIN) {
      for (int accepted = 0; accepted < kAcceptsPerRound; ++accepted) {
        sockaddr_storage peer{};
        socklen_t length = sizeof(peer);
        const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&peer), &length, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) break;
        const std::string peer_text = describe_address(reinterpret_cast<sockaddr*>(&peer));
        const std::string source = host_of(peer_text);
        // Make room: the oldest pending connection of this source when it
        // holds its quota, else the oldest of all when the table is full.
        std::size_t pending = 0, from_source = 0;
        int oldest = -1, oldest_of_source = -1;
        for (const auto& [other_fd, other] : s.connections) {
          if (other.authenticated || other.close_after_flush) continue;
          ++pending;
          if (oldest < 0 || other.accepted < s.connections.at(oldest).accepted) oldest = other_fd;
          if (other.source != source) continue;
          ++from_source;
          if (oldest_of_source < 0 || other.accepted < s.connections.at(oldest_of_source).accepted) {
            oldest_of_source = other_fd;
          }
        }
        const int evict = from_source >= kMaxPendingPerSource ? oldest_of_source
                          : pending >= kMaxPendingHandshakes  ? oldest
                                                              : -1;
        if (evict >= 0) {
          // Closed with the others after this round, so its descriptor number
          // is not reused by a connection accepted now while poll()'s results
          // for it are still read below.
          Connection& pushed_out = s.connections.at(evict);
          ++refused_;
          ++s.closed_quietly[pushed_out.source];
          pushed_out.close_after_flush = true;
          pushed_out.out.clear();
          pushed_out.out_pos = 0;
          to_close.push_back(evict);
        }
        const int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        Connection c;
        c.peer = peer_text;
        c.source = source;
        c.accepted = now;
        c.server_nonce = random_bytes(kNonceBytes);
        c.out.assign(kMagic.begin(), kMagic.end());
        c.out.insert(c.out.end(), c.server_nonce.begin(), c.server_nonce.end());
        c.handshake_deadline = now + kHandshakeTimeout;
        s.connections.emplace(fd, std::move(c));
      }
    }
    bool keys_changed = false;
    for (std::size_t i = 2; i < fds.size(); ++i) {
      const int fd = fds[i].fd;
      auto found = s.connections.find(fd);
      if (found == s.connections.end()) continue;
      Connection& c = found->second;
      bool drop = (fds[i].revents & (POLLERR | POLLNVAL)) != 0;
      if (!drop && !c.close_after_flush && (fds[i].revents & (POLLIN | POLLHUP))) {
        uint8_t buffer[65536];
        const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
          drop = true;
        } else if (n > 0) {
          c.in.insert(c.in.end(), buffer, buffer + n);
        }
      }
      if (!drop && !c.authenticated && !c.close_after_flush && !c.in.empty()) {
        const ClientProof proof = parse_client_proof(c.in);
        using Status = ClientProof::Status;
        if (proof.status == Status::kNotOurProtocol) {
          refuse(c, "it does not speak shardtrain's rendezvous protocol");
        } else if (proof.status == Status::kOtherVersion) {
          refuse(c, "it speaks version " + protocol_version_of(c.in.data()) +
                        " of shardtrain's rendezvous protocol and this store version " +
                        protocol_version_of(kMagic.data()) + ": every machine of a job must run the same shardtrain");
        } else if (proof.status == Status::kBadJobId) {
          refuse(c, "its job id is longer than " + std::to_string(kMaxJobIdBytes) + " bytes or not printable ASCII");
        } else if (proof.status == Status::kComplete && proof.job_id != job_id_) {
          refuse(c, "it belongs to job '" + proof.job_id + "' and this store to job '" + job_id_ +
                        "': two jobs share this port. Give each job its own --main_process_port / MASTER_PORT "
                        "(and its own token)",
                 Refusal::kAnotherJob);
        } else if (proof.status == Status::kComplete &&
                   !same_mac(proof.mac, handshake_mac(token_, "client", c.server_nonce, proof.client_nonce, job_id_))) {
          refuse(c,
                 "wrong or missing rendezvous token: this job's processes must all carry the token its launcher "
                 "made (SHARDTRAIN_RDZV_TOKEN, or --rdzv_token on every machine)");
        } else if (proof.status == Status::kComplete) {
          c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(proof.size));
          c.authenticated = true;
          c.out.push_back(0);
          Bytes server_mac = handshake_mac(token_, "server", c.server_nonce, proof.client_nonce, job_id_);
          c.out.insert(c.out.end(), server_mac.begin(), server_mac.end());
        }
      }
      while (!drop && c.authenticated && c.in.size() >= 4) {
        const uint32_t n = read_u32(c.in.data());
        if (n > kMaxFrameBytes) {
          drop = true;
          break;
        }
        if (c.in.size() < 4 + static_cast<std::size_t>(n)) break;
        Bytes payload(c.in.begin() + 4, c.in.begin() + 4 + n);
        c.in.erase(c.in.begin(), c.in.begin() + 4 + n);
        try {
          if (!handle_request(fd, c, payload, s.keys, s.parked, keys_changed)) drop = true;
        } catch (const Error&) {
          drop = true;  // a malformed request from an authenticated peer: a bug there, not here
        }
      }
      if (!drop) drop = !send_queued(fd, c);
      if (!drop && !c.authenticated && !c.close_after_flush && now > c.handshake_deadline) {
        // A silent connection: counted in the summary, not logged one by one.
        ++refused_;
        ++s.closed_quietly[c.source];
        drop = true;
      }
      if (drop) to_close.push_back(fd);
    }
    if (!s.closed_quietly.empty() && now - s.last_summary >= kRefusalLogInterval) {
      for (const auto& [source, count] : s.closed_quietly) {
        ST_LOG_WARN("rendezvous: closed {} connection(s) from {} that did not complete the handshake within {} s "
                    "or were pushed out by newer ones (at most {} may wait per address); a flood on the port?",
                    count, source, std::chrono::duration_cast<std::chrono::seconds>(kHandshakeTimeout).count(),
                    kMaxPendingPerSource);
      }
      s.closed_quietly.clear();
      s.last_summary = now;
    }
    if (keys_changed) {
      release_parked(s.parked, s.keys, s.connections);
      for (auto& [fd, c] : s.connections) {
        if (!send_queued(fd, c)) to_close.push_back(fd);
      }
    }
    std::sort(to_close.begin(), to_close.end());
    to_close.erase(std::unique(to_close.begin(), to_close.end()), to_close.end());
    for (int fd : to_close) {
      s.connections.erase(fd);
      ::close(fd);
    }
    if (!to_close.empty()) {
      s.parked.erase(std::remove_if(s.parked.begin(), s.parked.end(),
                                    [&](const ParkedRequest& p) { return s.connections.count(p.fd) == 0; }),
                     s.parked.end());
    }
    to_close.clear();
  }
}

}  // namespace shardtrain::comm::rendezvous
