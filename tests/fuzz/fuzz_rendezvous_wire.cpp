// libFuzzer target for the rendezvous store's wire protocol (protocol.h): a
// live RendezvousServer in this process receives each input over TCP, as a
// stranger's handshake or, after a real handshake, as a member's requests.
//
// Input: byte 0 picks the role (even: a stranger, whose bytes arrive before
// any handshake; odd: a member, whose bytes follow a completed handshake),
// the rest is what that peer sends. The peer then half-closes and the target
// waits for the server to close the connection. A finding is a crash or
// sanitizer report in the server thread or the parsers, a server that never
// closes a finished connection, or a server that no longer serves a member
// (checked after every input with a set and a get).
//
// This process's main thread, which runs the harness's socket calls and the
// member's RendezvousStore, is interrupted by a signal every 200 us. libFuzzer
// does this too, rarely (its timeout alarm, without SA_RESTART): a blocking
// connect() it interrupted once failed a CI run. Constantly, every call that
// can return EINTR does, so the harness and the store's client must both
// handle it; a missed case fails here at once instead of one run in many.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/rendezvous/protocol.h"
#include "comm/rendezvous/server.h"
#include "comm/rendezvous/store.h"
#include "fuzz_support.h"

namespace {

namespace rdzv = shardtrain::comm::rendezvous;
using Clock = std::chrono::steady_clock;

constexpr const char* kToken = "fuzz-token";
constexpr const char* kJobId = "fuzz-job";
/// The server is replaced after this many inputs, so the keys members set do
/// not accumulate over millions of runs.
constexpr int kInputsPerServer = 2000;
/// Generous for one loopback connection on a loaded machine; a server that
/// needs longer has stopped serving.
constexpr auto kDeadline = std::chrono::seconds(10);

struct Live {
  std::unique_ptr<rdzv::RendezvousServer> server;
  c10::intrusive_ptr<rdzv::RendezvousStore> member;
  int inputs = 0;
};

/// The signal storm (see the top of this file): a thread that interrupts the
/// main thread every kInterruptEvery, started once, running until exit.
constexpr auto kInterruptEvery = std::chrono::microseconds(200);

void start_interrupting_this_thread() {
  struct sigaction action{};
  action.sa_handler = [](int) {};  // no SA_RESTART: interrupted calls return EINTR
  ::sigaction(SIGUSR2, &action, nullptr);
  const pid_t process = ::getpid();
  const auto thread = static_cast<pid_t>(::syscall(SYS_gettid));
  std::thread([process, thread] {
    while (true) {
      ::syscall(SYS_tgkill, process, thread, SIGUSR2);
      std::this_thread::sleep_for(kInterruptEvery);
    }
  }).detach();
}

Live& live() {
  static Live state;
  if (!state.server || state.inputs >= kInputsPerServer) {
    state.member.reset();
    state.server = std::make_unique<rdzv::RendezvousServer>("127.0.0.1", 0, kToken, kJobId);
    state.member = c10::make_intrusive<rdzv::RendezvousStore>(
        rdzv::Endpoint{"127.0.0.1", state.server->port(), kToken, kJobId},
        std::chrono::duration_cast<std::chrono::milliseconds>(kDeadline));
    state.inputs = 0;
  }
  ++state.inputs;
  return state;
}

/// A harness failure (not a finding about the server, or one the server's
/// side cannot show otherwise) traps, after saying which step failed: a
/// trap alone in a CI log names nothing.
[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_rendezvous_wire: %s\n", what.c_str());
  std::fflush(stderr);
  __builtin_trap();
}

std::string system_error(const char* call) { return std::string(call) + " failed: " + std::strerror(errno); }

/// A raw TCP connection to the server. A busy machine may briefly have no
/// ephemeral port to spare, which says nothing about the server: retried.
int connect_to(int port, Clock::time_point deadline) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  while (true) {
    int error = 0;
    const int fd = rdzv::connect_by(reinterpret_cast<sockaddr*>(&address), sizeof(address), deadline, error);
    if (fd >= 0) return fd;
    if (error != EADDRNOTAVAIL && error != EAGAIN) {
      fail(std::string("connect() to the server failed: ") + std::strerror(error));
    }
    if (Clock::now() >= deadline) fail("no ephemeral port became free to connect to the server");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

/// Reads whatever arrives until the server closes the connection; false when
/// the deadline passes first. Reads in blocks, not a byte per call: a member
/// may ask for megabytes of replies.
bool drained_until_closed(int fd, Clock::time_point deadline) {
  uint8_t sink[65536];
  while (Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, 100);
    if (ready < 0 && errno != EINTR) fail(system_error("poll() on the server's connection"));
    if (ready <= 0) continue;
    const ssize_t n = ::recv(fd, sink, sizeof(sink), MSG_DONTWAIT);
    if (n == 0) return true;                   // closed
    if (n < 0 && errno == ECONNRESET) return true;  // closed with unread bytes in its buffer
    if (n < 0 && errno != EAGAIN && errno != EINTR) fail(system_error("recv() from the server"));
  }
  return false;
}

/// Closes with a reset: thousands of inputs a second each leave a socket in
/// TIME_WAIT otherwise (where the server closed first, the state is the
/// server's and this cannot help, but it does no harm).
void close_with_reset(int fd) {
  const linger reset{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
  ::close(fd);
}

/// Connects and completes a member's handshake; -1 when the server closed it
/// for taking longer than kHandshakeTimeout, which it does by design (a
/// stall of this process on a loaded machine, not a finding).
int connect_as_member(int port, Clock::time_point deadline) {
  const auto started = Clock::now();
  const int fd = connect_to(port, deadline);
  try {
    rdzv::Bytes hello(rdzv::kHelloBytes);
    rdzv::recv_all(fd, hello.data(), hello.size(), deadline, "the server");
    const rdzv::Bytes server_nonce(hello.begin() + rdzv::kMagic.size(), hello.end());
    const rdzv::Bytes proof =
        rdzv::client_proof(kToken, kJobId, server_nonce, rdzv::random_bytes(rdzv::kNonceBytes));
    rdzv::send_all(fd, proof.data(), proof.size(), deadline, "the server");
    uint8_t status = 1;
    rdzv::recv_all(fd, &status, 1, deadline, "the server");
    if (status != 0) fail("the server refused a member's handshake with status " + std::to_string(status));
    rdzv::Bytes server_mac(rdzv::kMacBytes);
    rdzv::recv_all(fd, server_mac.data(), server_mac.size(), deadline, "the server");
  } catch (const shardtrain::Error& e) {
    close_with_reset(fd);
    if (Clock::now() - started >= rdzv::kHandshakeTimeout) return -1;
    fail(std::string("a member's handshake failed within the server's handshake timeout: ") + e.what());
  }
  return fd;
}

void exchange(int port, bool member, const uint8_t* data, size_t size) {
  const auto deadline = Clock::now() + kDeadline;
  int fd = -1;
  if (member) {
    while (fd < 0) fd = connect_as_member(port, deadline);
  } else {
    fd = connect_to(port, deadline);
    // A stranger is greeted before it says anything.
    rdzv::Bytes hello(rdzv::kHelloBytes);
    try {
      rdzv::recv_all(fd, hello.data(), hello.size(), deadline, "the server");
    } catch (const shardtrain::Error& e) {
      fail(std::string("no greeting for a new connection: ") + e.what());
    }
  }
  // The server may refuse and close before it has read everything: a failed
  // send is then expected, not a finding.
  try {
    if (size > 0) rdzv::send_all(fd, data, size, deadline, "the server");
  } catch (const shardtrain::TimeoutError&) {
    fail("the server stopped reading without closing the connection");
  } catch (const shardtrain::Error&) {
  }
  ::shutdown(fd, SHUT_WR);
  // Every connection ends, whatever it sent.
  if (!drained_until_closed(fd, deadline)) fail("the server never closed a finished connection");
  close_with_reset(fd);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool interrupted = (start_interrupting_this_thread(), true);
  (void)interrupted;
  if (size == 0) return 0;
  const rdzv::Bytes rest(data + 1, data + size);
  // The parsers on their own first: they must bound every read.
  fuzz::parses_or_rejects([&] {
    (void)rdzv::parse_client_proof(rest);
    rdzv::FrameReader reader(rest);
    reader.head();
    while (!reader.at_end()) (void)reader.bytes();
  });
  Live& state = live();
  exchange(state.server->port(), (data[0] & 1) != 0, rest.data(), rest.size());
  // The store still serves its members.
  const std::string value = std::to_string(state.inputs);
  state.member->set("fuzz/alive", std::vector<uint8_t>(value.begin(), value.end()));
  const std::vector<uint8_t> read = state.member->get("fuzz/alive");
  if (std::string(read.begin(), read.end()) != value) fail("the store no longer serves its member");
  return 0;
}
