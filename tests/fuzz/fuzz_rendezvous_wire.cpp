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
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
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

/// The server's side of the exchange cannot be seen from here except through
/// the socket: a harness failure (not a finding about the server) traps too.
void require(bool condition) {
  if (!condition) __builtin_trap();
}

/// A raw TCP connection to the server. (tests/support has one, but it comes
/// with GoogleTest, which this target does not link.)
int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  require(fd >= 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  require(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
  return fd;
}

void exchange(int port, bool member, const uint8_t* data, size_t size) {
  const int fd = connect_to(port);
  const auto deadline = Clock::now() + kDeadline;
  rdzv::Bytes hello(rdzv::kHelloBytes);
  rdzv::recv_all(fd, hello.data(), hello.size(), deadline, "the server");
  if (member) {
    const rdzv::Bytes server_nonce(hello.begin() + rdzv::kMagic.size(), hello.end());
    const rdzv::Bytes proof = rdzv::client_proof(kToken, kJobId, server_nonce, rdzv::random_bytes(rdzv::kNonceBytes));
    rdzv::send_all(fd, proof.data(), proof.size(), deadline, "the server");
    uint8_t status = 1;
    rdzv::recv_all(fd, &status, 1, deadline, "the server");
    require(status == 0);
    rdzv::Bytes server_mac(rdzv::kMacBytes);
    rdzv::recv_all(fd, server_mac.data(), server_mac.size(), deadline, "the server");
  }
  // The server may refuse and close before it has read everything: a failed
  // send is then expected, not a finding.
  try {
    if (size > 0) rdzv::send_all(fd, data, size, deadline, "the server");
  } catch (const shardtrain::TimeoutError&) {
    __builtin_trap();  // the server stopped reading without closing
  } catch (const shardtrain::Error&) {
  }
  ::shutdown(fd, SHUT_WR);
  // Read until the server closes: every connection ends, whatever it sent.
  uint8_t sink[4096];
  while (true) {
    try {
      rdzv::recv_all(fd, sink, 1, deadline, "the server");
    } catch (const shardtrain::TimeoutError&) {
      __builtin_trap();  // a finished connection the server never closed
    } catch (const shardtrain::Error&) {
      break;  // closed (or reset): done
    }
  }
  // Closed with a reset once the server has closed its side: this end sent
  // the first FIN, so a plain close would keep the port in TIME_WAIT for a
  // minute, and thousands of inputs a second exhaust the ephemeral ports
  // (the harness's connect then fails, which is no finding about the server).
  const linger reset{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
  ::close(fd);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
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
  require(std::string(read.begin(), read.end()) == value);
  return 0;
}
