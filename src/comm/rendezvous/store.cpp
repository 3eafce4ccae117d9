// The rendezvous store's client (see store.h).

#include "comm/rendezvous/store.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "comm/rendezvous/protocol.h"
#include "comm/rendezvous/server.h"
#include "shardtrain/error.h"

namespace shardtrain::comm::rendezvous {
namespace {

/// How long one connect attempt may take: an unanswered SYN is sent again
/// after 1 s and 3 s, so this covers two retransmissions. The caller retries
/// until its own deadline, so one host address that drops every SYN cannot
/// use up the whole rendezvous timeout before the next address is tried.
constexpr auto kConnectAttempt = std::chrono::seconds(5);

/// One TCP connect to any of `host`'s addresses by `deadline`; -1 (and
/// `error`) when none answers.
int try_connect(const Endpoint& endpoint, Clock::time_point deadline, std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(endpoint.port);
  const int resolved = ::getaddrinfo(endpoint.host.c_str(), service.c_str(), &hints, &found);
  if (resolved != 0) {
    error = std::string("the name does not resolve: ") + ::gai_strerror(resolved);
    return -1;
  }
  int connected = -1;
  for (addrinfo* a = found; a != nullptr && connected < 0; a = a->ai_next) {
    int failure = 0;
    connected = connect_by(a->ai_addr, a->ai_addrlen, std::min(deadline, Clock::now() + kConnectAttempt), failure);
    if (connected < 0) error = std::strerror(failure);
  }
  ::freeaddrinfo(found);
  return connected;
}

}  // namespace

RendezvousStore::RendezvousStore(Endpoint endpoint, std::chrono::milliseconds timeout,
                                 std::shared_ptr<RendezvousServer> server)
    : c10d::Store(timeout), endpoint_(std::move(endpoint)), server_(std::move(server)) {
  std::lock_guard<std::mutex> lock(mutex_);
  connect_locked(Clock::now() + timeout);
}

RendezvousStore::~RendezvousStore() {
  if (fd_ >= 0) ::close(fd_);
}

std::string RendezvousStore::describe() const {
  return "the rendezvous at " + endpoint_.host + ":" + std::to_string(endpoint_.port);
}

void RendezvousStore::connect_locked(Clock::time_point deadline) {
  std::string last_error = "no attempt";
  int closed_mid_handshake = 0;  // connections the server accepted, then closed or stalled
  auto pause = std::chrono::milliseconds(20);
  while (true) {
    const int fd = try_connect(endpoint_, deadline, last_error);
    if (fd >= 0) {
      try {
        const std::string peer = describe();
        Bytes hello(kHelloBytes);
        recv_all(fd, hello.data(), hello.size(), deadline, peer);
        ST_CHECK_T(ConfigError, std::equal(kMagic.begin(), kMagic.begin() + kMagicPrefixBytes, hello.begin()),
                   "the process at ", endpoint_.host, ":", endpoint_.port,
                   " is not a shardtrain rendezvous (another service holds the port?); choose another "
                   "MASTER_PORT / --main_process_port");
        ST_CHECK_T(ConfigError, std::equal(kMagic.begin(), kMagic.end(), hello.begin()), describe(),
                   " speaks version ", protocol_version_of(hello.data()), " of shardtrain's rendezvous protocol and "
                   "this process version ", protocol_version_of(kMagic.data()),
                   ": every machine of a job must run the same shardtrain");
        Bytes server_nonce(hello.begin() + kMagic.size(), hello.end());
        Bytes client_nonce = random_bytes(kNonceBytes);
        const Bytes proof = client_proof(endpoint_.token, endpoint_.job_id, server_nonce, client_nonce);
        send_all(fd, proof.data(), proof.size(), deadline, peer);
        uint8_t status = 0;
        recv_all(fd, &status, 1, deadline, peer);
        if (status != 0) {
          Bytes refusal = recv_frame(fd, deadline, peer);
          FrameReader reader(refusal);
          reader.head();
          // A refusal that names the two jobs says the fix itself; a token refusal gets the hint.
          ST_THROW(ConfigError, describe(), " refused this process: ", reader.text(),
                   status == static_cast<uint8_t>(Refusal::kAnotherJob)
                       ? ""
                       : ". Start it with the token of the job it belongs to (--rdzv_token / SHARDTRAIN_RDZV_TOKEN)");
        }
        Bytes server_mac(kMacBytes);
        recv_all(fd, server_mac.data(), server_mac.size(), deadline, peer);
        ST_CHECK_T(ConfigError,
                   same_mac(server_mac,
                            handshake_mac(endpoint_.token, "server", server_nonce, client_nonce, endpoint_.job_id)),
                   describe(), " does not hold this job's rendezvous token: another job (or an impostor) listens "
                   "on that port. Check MASTER_ADDR/MASTER_PORT and --rdzv_token");
        fd_ = fd;
        return;
      } catch (const ConfigError&) {
        ::close(fd);
        throw;
      } catch (const Error& failure) {
        // The server closed or stalled mid-handshake (it is shutting down, or
        // this was a stale job's port): retry until the deadline like a refused connect.
        last_error = failure.what();
        ++closed_mid_handshake;
        ::close(fd);
      }
    }
    if (Clock::now() + pause >= deadline) {
      if (closed_mid_handshake > 0) {
        ST_THROW(TimeoutError, describe(), " accepted this process's connection ", closed_mid_handshake,
                 " time(s) but closed it before the handshake finished (last: ", last_error,
                 "): the store is up, and is shutting down or was pushing out connections that never "
                 "authenticate (a flood on its port; rank 0's log counts them)");
      }
      ST_THROW(TimeoutError, "could not reach ", describe(), " (", last_error,
               "): nothing accepted the connection");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(500));
  }
}

std::vector<uint8_t> RendezvousStore::exchange(const std::vector<uint8_t>& request, std::chrono::milliseconds timeout,
                                               const char* what) {
  std::lock_guard<std::mutex> lock(mutex_);
  // kNoTimeout (0) means "wait as long as it takes", as for c10d's stores.
  const auto deadline = timeout.count() > 0 ? Clock::now() + timeout : Clock::time_point::max();
  if (fd_ < 0) connect_locked(timeout.count() > 0 ? deadline : Clock::now() + timeout_);
  try {
    send_all(fd_, request.data(), request.size(), deadline, describe());
    Bytes reply = recv_frame(fd_, deadline, describe());
    FrameReader reader(reply);
    ST_CHECK(reader.head() == 0, describe(), " answered ", what, " with an error");
    return reply;
  } catch (const TimeoutError& failure) {
    ::close(fd_);
    fd_ = -1;
    ST_THROW(TimeoutError, what, " on ", describe(), " timed out after ", timeout.count(), " ms (", failure.what(), ")");
  } catch (const Error& failure) {
    ::close(fd_);
    fd_ = -1;
    ST_THROW(Error, what, " on ", describe(), " failed: ", failure.what(),
             ". Rank 0 hosts the store: it has probably exited");
  }
}

namespace {

/// The first field of a reply, after its status byte.
Bytes first_field(const Bytes& reply) {
  FrameReader reader(reply);
  reader.head();
  return reader.bytes();
}

int64_t first_integer(const Bytes& reply) {
  FrameReader reader(reply);
  reader.head();
  return reader.integer();
}

Bytes keys_request(Op op, const std::vector<std::string>& keys) {
  FrameWriter writer(static_cast<uint8_t>(op));
  writer.field(static_cast<int64_t>(keys.size()));
  for (const auto& key : keys) writer.field(key);
  return writer.finish();
}

}  // namespace

c10::intrusive_ptr<c10d::Store> RendezvousStore::clone() {
  return c10::make_intrusive<RendezvousStore>(endpoint_, timeout_, server_);
}

void RendezvousStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  exchange(FrameWriter(static_cast<uint8_t>(Op::kSet)).field(key).field(value).finish(), timeout_, "set");
}

std::vector<uint8_t> RendezvousStore::compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                                 const std::vector<uint8_t>& desired) {
  return first_field(exchange(
      FrameWriter(static_cast<uint8_t>(Op::kCompareSet)).field(key).field(expected).field(desired).finish(), timeout_,
      "compareSet"));
}

std::vector<uint8_t> RendezvousStore::get(const std::string& key) {
  return first_field(exchange(FrameWriter(static_cast<uint8_t>(Op::kGet)).field(key).finish(), timeout_,
                              ("get('" + key + "')").c_str()));
}

int64_t RendezvousStore::add(const std::string& key, int64_t value) {
  return first_integer(exchange(FrameWriter(static_cast<uint8_t>(Op::kAdd)).field(key).field(value).finish(), timeout_, "add"));
}

bool RendezvousStore::deleteKey(const std::string& key) {
  return first_integer(exchange(FrameWriter(static_cast<uint8_t>(Op::kDelete)).field(key).finish(), timeout_,
                                "deleteKey")) != 0;
}

bool RendezvousStore::check(const std::vector<std::string>& keys) {
  return first_integer(exchange(keys_request(Op::kCheck, keys), timeout_, "check")) != 0;
}

int64_t RendezvousStore::getNumKeys() {
  return first_integer(exchange(FrameWriter(static_cast<uint8_t>(Op::kNumKeys)).finish(), timeout_, "getNumKeys"));
}

void RendezvousStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void RendezvousStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  std::string what = "wait(";
  for (std::size_t i = 0; i < keys.size() && i < 3; ++i) what += (i ? ", '" : "'") + keys[i] + "'";
  what += keys.size() > 3 ? ", ...)" : ")";
  exchange(keys_request(Op::kWait, keys), timeout, what.c_str());
}

}  // namespace shardtrain::comm::rendezvous
