// The authenticated rendezvous store in one process: c10d's store semantics
// (Gloo and the NCCL backend rely on them), token refusal with the fix in the
// message, mutual authentication (a server without the token is not
// trusted), binding only the address it is given, resilience to silent
// or garbage connections, and the store host's wait for every rank to be done
// with the store after a connect.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <chrono>
#include <deque>
#include <string>
#include <thread>
#include <utility>

#include <gtest/gtest.h>

#include "comm/rendezvous/protocol.h"
#include "comm/rendezvous/server.h"
#include "comm/rendezvous/store.h"
#include "comm/store_check_in.h"
#include "shardtrain/error.h"
#include "support/multirank.h"

namespace {

namespace rdzv = shardtrain::comm::rendezvous;
using Clock = std::chrono::steady_clock;
using Bytes = std::vector<uint8_t>;

constexpr auto kTimeout = std::chrono::milliseconds(5000);

Bytes bytes_of(const std::string& text) { return Bytes(text.begin(), text.end()); }
std::string text_of(const Bytes& bytes) { return std::string(bytes.begin(), bytes.end()); }

c10::intrusive_ptr<rdzv::RendezvousStore> connect(int port, const std::string& token,
                                                  std::chrono::milliseconds timeout = kTimeout,
                                                  const std::string& job_id = "") {
  return c10::make_intrusive<rdzv::RendezvousStore>(rdzv::Endpoint{"127.0.0.1", port, token, job_id}, timeout);
}

/// The refusal a server sends after the client's first bytes: its status
/// byte and its reason.
std::pair<int, std::string> refusal_after(int fd) {
  const auto deadline = Clock::now() + kTimeout;
  Bytes hello(rdzv::kHelloBytes);
  rdzv::recv_all(fd, hello.data(), hello.size(), deadline, "the server");
  uint8_t status = 0;
  rdzv::recv_all(fd, &status, 1, deadline, "the server");
  Bytes frame = rdzv::recv_frame(fd, deadline, "the server");
  rdzv::FrameReader reader(frame);
  reader.head();
  return {status, reader.text()};
}

using shardtrain::testing::try_loopback_connection;

/// A socket listening on 127.0.0.1 on a free port with this accept backlog,
/// that nobody serves: the test plays the server. {descriptor, port}.
std::pair<int, int> loopback_listener(int backlog) {
  const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ST_CHECK(listener >= 0, "socket() failed: ", std::strerror(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ST_CHECK(::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
               ::listen(listener, backlog) == 0,
           "listening on 127.0.0.1 failed: ", std::strerror(errno));
  socklen_t length = sizeof(address);
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length);
  return {listener, ntohs(address.sin_port)};
}

int raw_connection(int port) {
  const int fd = try_loopback_connection(port);
  EXPECT_GE(fd, 0) << "connect to 127.0.0.1:" << port << " failed";
  return fd;
}

TEST(UnitRendezvousStore, KeepsC10dStoreSemantics) {
  rdzv::RendezvousServer server("127.0.0.1", 0, "job-token");
  auto store = connect(server.port(), "job-token");
  auto other = connect(server.port(), "job-token");
  store->set("a", bytes_of("one"));
  EXPECT_EQ(text_of(other->get("a")), "one");
  EXPECT_EQ(store->add("counter", 1), 1);
  EXPECT_EQ(other->add("counter", 2), 3);
  EXPECT_EQ(text_of(store->get("counter")), "3");  // counters read back as decimal text, as in c10d
  EXPECT_TRUE(store->check({"a", "counter"}));
  EXPECT_FALSE(store->check({"a", "absent"}));
  EXPECT_EQ(store->getNumKeys(), 2);
  // compareSet: created only from an empty expectation; replaced only on a match.
  EXPECT_EQ(text_of(store->compareSet("cas", bytes_of("x"), bytes_of("y"))), "x");
  EXPECT_FALSE(store->check({"cas"}));
  EXPECT_EQ(text_of(store->compareSet("cas", {}, bytes_of("y"))), "y");
  EXPECT_EQ(text_of(store->compareSet("cas", bytes_of("wrong"), bytes_of("z"))), "y");
  EXPECT_EQ(text_of(store->compareSet("cas", bytes_of("y"), bytes_of("z"))), "z");
  EXPECT_TRUE(store->deleteKey("cas"));
  EXPECT_FALSE(store->deleteKey("cas"));
  // get and wait park until another client sets the key.
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    other->set("late", bytes_of("arrived"));
    other->set("later", bytes_of("too"));
  });
  EXPECT_EQ(text_of(store->get("late")), "arrived");
  store->wait({"late", "later"});
  writer.join();
  auto copy = store->clone();
  EXPECT_EQ(text_of(copy->get("later")), "too");
}

TEST(UnitRendezvousStore, WaitForAMissingKeyTimesOutAndTheStoreStaysUsable) {
  rdzv::RendezvousServer server("127.0.0.1", 0, "t");
  auto store = connect(server.port(), "t");
  const auto start = Clock::now();
  EXPECT_THROW(store->wait({"never"}, std::chrono::milliseconds(300)), shardtrain::TimeoutError);
  const double waited = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_GE(waited, 0.3);
  EXPECT_LT(waited, 0.3 + 2.0);  // the deadline, plus a scheduling margin on a loaded 2-core machine
  store->set("k", bytes_of("v"));  // reconnects after the abandoned request
  EXPECT_EQ(text_of(store->get("k")), "v");
}

TEST(UnitRendezvousStore, WrongOrMissingTokenIsRefusedWithTheFix) {
  rdzv::RendezvousServer server("127.0.0.1", 0, "the-job-token");
  auto member = connect(server.port(), "the-job-token");
  member->set("nccl/unique_id", bytes_of("secret"));
  for (const std::string& token : {std::string("a-wrong-token"), std::string()}) {
    try {
      connect(server.port(), token);
      ADD_FAILURE() << "a client with token '" << token << "' was let in";
    } catch (const shardtrain::ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("refused this process"), std::string::npos) << what;
      EXPECT_NE(what.find("wrong or missing rendezvous token"), std::string::npos) << what;
      EXPECT_NE(what.find("--rdzv_token"), std::string::npos) << what;
    }
  }
  EXPECT_EQ(server.refused_connections(), 2);
  // The members are unaffected.
  EXPECT_EQ(text_of(member->get("nccl/unique_id")), "secret");
}

TEST(UnitRendezvousStore, SilentAndGarbageConnectionsDoNotStopTheStore) {
  rdzv::RendezvousServer server("127.0.0.1", 0, "t");
  const int silent = raw_connection(server.port());
  const int garbage = raw_connection(server.port());
  std::string request = "GET / HTTP/1.1\r\nHost: example\r\n\r\n";
  request.resize(rdzv::kProofBytes, ' ');
  ASSERT_EQ(::send(garbage, request.data(), request.size(), 0), static_cast<ssize_t>(request.size()));
  // The server's hello, then the refusal status, then the close.
  Bytes reply(rdzv::kHelloBytes + 1);
  rdzv::recv_all(garbage, reply.data(), reply.size(), Clock::now() + kTimeout, "the server");
  EXPECT_EQ(reply.back(), 1);
  auto store = connect(server.port(), "t");  // served while `silent` still holds its handshake slot
  store->set("k", bytes_of("v"));
  EXPECT_EQ(text_of(store->get("k")), "v");
  ::close(silent);
  ::close(garbage);
}

TEST(UnitRendezvousStore, AFloodOfSilentConnectionsCannotStarveTheRanks) {
  rdzv::RendezvousServer server("127.0.0.1", 0, "t");
  const int port = server.port();
  // More silent connections than the store keeps pending: it used to close
  // every later connection on accept, real ranks included, until they timed out.
  std::vector<int> idle;
  for (int i = 0; i < 300; ++i) idle.push_back(raw_connection(port));
  auto first = connect(port, "t");  // the oldest silent one makes room
  first->set("first", bytes_of("in"));
  // Then a flood that never stops while two ranks meet through the store,
  // from the same address as they come from (the hardest case: 127.0.0.1).
  std::atomic<bool> stop{false};
  std::atomic<int64_t> opened{0};
  std::thread flooder([&] {
    std::deque<int> held;
    while (!stop) {
      const int fd = try_loopback_connection(port);
      if (fd < 0) continue;
      ++opened;
      held.push_back(fd);
      if (held.size() > 300) {
        ::close(held.front());
        held.pop_front();
      }
    }
    for (int fd : held) ::close(fd);
  });
  while (opened.load() < 500) std::this_thread::sleep_for(std::chrono::milliseconds(1));  // the flood is on
  std::thread other_rank([&] {
    auto store = connect(port, "t", std::chrono::milliseconds(20000));
    store->set("rank1", bytes_of("here"));
    store->wait({"rank0"});
  });
  auto store = connect(port, "t", std::chrono::milliseconds(20000));
  store->set("rank0", bytes_of("here"));
  store->wait({"rank1"});
  other_rank.join();
  const int64_t flood = opened.load();
  stop = true;
  flooder.join();
  for (int fd : idle) ::close(fd);
  EXPECT_EQ(text_of(store->get("first")), "in");
  EXPECT_GE(flood, 500) << "the flood did not run while the ranks met";
  // 300 idle connections from one address, at most 128 of them kept.
  EXPECT_GE(server.refused_connections(), 300 - 128) << "the store did not push out silent connections";
}

TEST(UnitRendezvousStore, ARankOfAnotherJobIsRefusedByName) {
  // Two jobs that share an exported token and a port: job 2's rank used to
  // join job 1's store and fail much later with a misleading timeout.
  rdzv::RendezvousServer server("127.0.0.1", 0, "shared-token", "job-one");
  auto member = connect(server.port(), "shared-token", kTimeout, "job-one");
  member->set("k", bytes_of("job one's"));
  const auto start = Clock::now();
  try {
    connect(server.port(), "shared-token", kTimeout, "job-two");
    ADD_FAILURE() << "a rank of job-two joined job-one's store";
  } catch (const shardtrain::ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("belongs to job 'job-two' and this store to job 'job-one'"), std::string::npos) << what;
    EXPECT_NE(what.find("--main_process_port"), std::string::npos) << what;
    EXPECT_EQ(what.find("wrong or missing rendezvous token"), std::string::npos) << what;
  }
  // Refused at once, not after the connect timeout.
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 0.5 * kTimeout.count() / 1000.0);
  EXPECT_EQ(server.refused_connections(), 1);
  EXPECT_EQ(text_of(member->get("k")), "job one's");
}

TEST(UnitRendezvousStore, APeerOfAnotherProtocolVersionIsToldSo) {
  rdzv::RendezvousServer server("127.0.0.1", 0, "t");
  const int fd = raw_connection(server.port());
  const std::string old_magic = "STRDZV01";
  ASSERT_EQ(::send(fd, old_magic.data(), old_magic.size(), 0), static_cast<ssize_t>(old_magic.size()));
  const auto [status, reason] = refusal_after(fd);
  EXPECT_EQ(status, 1);
  EXPECT_NE(reason.find("version 01"), std::string::npos) << reason;
  EXPECT_NE(reason.find("the same shardtrain"), std::string::npos) << reason;
  ::close(fd);
}

TEST(UnitRendezvousStore, AHandshakeThatArrivesByteByByteIsAccepted) {
  // TCP may split the proof anywhere; the server must wait for the rest
  // (the job id's length, then the id) rather than judge a part of it.
  rdzv::RendezvousServer server("127.0.0.1", 0, "t", "a-job");
  const int fd = raw_connection(server.port());
  const auto deadline = Clock::now() + kTimeout;
  Bytes hello(rdzv::kHelloBytes);
  rdzv::recv_all(fd, hello.data(), hello.size(), deadline, "the server");
  const Bytes server_nonce(hello.begin() + rdzv::kMagic.size(), hello.end());
  const Bytes client_nonce = rdzv::random_bytes(rdzv::kNonceBytes);
  const Bytes proof = rdzv::client_proof("t", "a-job", server_nonce, client_nonce);
  for (uint8_t byte : proof) {
    rdzv::send_all(fd, &byte, 1, deadline, "the server");
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  uint8_t status = 1;
  rdzv::recv_all(fd, &status, 1, deadline, "the server");
  EXPECT_EQ(status, 0);
  Bytes server_mac(rdzv::kMacBytes);
  rdzv::recv_all(fd, server_mac.data(), server_mac.size(), deadline, "the server");
  EXPECT_TRUE(rdzv::same_mac(server_mac, rdzv::handshake_mac("t", "server", server_nonce, client_nonce, "a-job")));
  ::close(fd);
  EXPECT_EQ(server.refused_connections(), 0);
}

TEST(UnitRendezvousStore, AJobIdThatIsNotPrintableIsRefused) {
  rdzv::RendezvousServer server("127.0.0.1", 0, "t");
  EXPECT_THROW(connect(server.port(), "t", kTimeout, std::string("job\nforged log line")), shardtrain::ConfigError);
  EXPECT_THROW(connect(server.port(), "t", kTimeout, std::string(rdzv::kMaxJobIdBytes + 1, 'j')),
               shardtrain::ConfigError);
  // Sent by hand, past the client's own check: the server refuses it too.
  const int fd = raw_connection(server.port());
  Bytes proof(rdzv::kMagic.begin(), rdzv::kMagic.end());
  proof.resize(rdzv::kProofBytes, 0);
  proof.push_back(3);
  for (uint8_t c : {'a', '\x1b', 'b'}) proof.push_back(c);
  ASSERT_EQ(::send(fd, proof.data(), proof.size(), 0), static_cast<ssize_t>(proof.size()));
  const auto [status, reason] = refusal_after(fd);
  EXPECT_EQ(status, 1);
  EXPECT_NE(reason.find("not printable ASCII"), std::string::npos) << reason;
  ::close(fd);
}

TEST(UnitRendezvousStore, ServerThatCannotProveTheTokenIsNotTrusted) {
  // An impostor on the port: it says hello, accepts any proof and answers with a made-up MAC.
  // (Not a structured binding: C++17 lambdas cannot capture one.)
  const std::pair<int, int> listening = loopback_listener(1);
  const int listener = listening.first, port = listening.second;
  std::thread impostor([&] {
    const int fd = ::accept(listener, nullptr, nullptr);
    Bytes hello(rdzv::kMagic.begin(), rdzv::kMagic.end());
    hello.resize(rdzv::kHelloBytes, 7);
    const auto deadline = Clock::now() + kTimeout;
    rdzv::send_all(fd, hello.data(), hello.size(), deadline, "client");
    Bytes proof(rdzv::kProofBytes);
    rdzv::recv_all(fd, proof.data(), proof.size(), deadline, "client");
    Bytes accepted(1 + rdzv::kMacBytes, 0);
    rdzv::send_all(fd, accepted.data(), accepted.size(), deadline, "client");
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    ::close(fd);
  });
  try {
    connect(port, "the-job-token");
    ADD_FAILURE() << "the client trusted a server that does not hold the token";
  } catch (const shardtrain::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("does not hold this job's rendezvous token"), std::string::npos) << e.what();
  }
  impostor.join();
  ::close(listener);
}

// A host whose packets are dropped (a firewall, a wrong MASTER_ADDR) answers
// no SYN: a blocking connect() waits out the kernel's SYN retries, about two
// minutes, whatever the rendezvous timeout says. A listener whose accept
// queue is full drops SYNs the same way, on loopback.
TEST(UnitRendezvousStore, AnUnansweredConnectGivesUpAtTheRendezvousTimeout) {
  const auto [listener, port] = loopback_listener(0);  // room for one connection that is never accepted
  const int queued = raw_connection(port);  // fills the queue: later SYNs are dropped
  constexpr auto timeout = std::chrono::milliseconds(1500);
  const auto started = Clock::now();
  EXPECT_THROW(connect(port, "t", timeout), shardtrain::TimeoutError);
  // The bound is the timeout plus slack for a loaded machine; a connect that
  // ignored the deadline takes the kernel's SYN retry time (127 s by default).
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - started);
  EXPECT_LT(waited.count(), (timeout + std::chrono::seconds(10)).count()) << "milliseconds until it gave up";
  ::close(queued);
  ::close(listener);
}

TEST(UnitRendezvousStore, ListensOnlyOnTheAddressItIsGiven) {
  rdzv::RendezvousServer server("127.0.0.1", 0, "t");
  EXPECT_EQ(shardtrain::testing::listening_ipv4_address(server.port()), "0100007F");
  EXPECT_EQ(server.bound_address(), "127.0.0.1:" + std::to_string(server.port()));
  rdzv::RendezvousServer everywhere("0.0.0.0", 0, "t");  // what SHARDTRAIN_RDZV_BIND=0.0.0.0 asks for
  EXPECT_EQ(shardtrain::testing::listening_ipv4_address(everywhere.port()), "00000000");
}

TEST(UnitRendezvousStore, TakenPortIsAnErrorNamingTheAddress) {
  rdzv::RendezvousServer first("127.0.0.1", 0, "t");
  try {
    rdzv::RendezvousServer second("127.0.0.1", first.port(), "t");
    ADD_FAILURE() << "two servers listen on one port";
  } catch (const shardtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Address already in use"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(first.port())), std::string::npos) << e.what();
  }
}

TEST(UnitRendezvousStore, GeneratedTokensAreFreshHex) {
  const std::string a = rdzv::generate_token();
  const std::string b = rdzv::generate_token();
  EXPECT_EQ(a.size(), 64u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos) << a;
  EXPECT_NE(a, b);
}

}  // namespace

// The host (global rank 0) returns only once every other member has checked
// in, and a member that never does is named by count within the limit.
TEST(UnitStoreCheckIn, TheHostWaitsForEveryOtherMemberAndTimesOutNamingTheCount) {
  rdzv::RendezvousServer server("127.0.0.1", 0, "t");
  auto host = connect(server.port(), "t");
  auto member = connect(server.port(), "t");
  const std::vector<int> members{0, 1, 2};
  std::atomic<bool> host_returned{false};
  std::thread host_thread([&] {
    shardtrain::comm::check_in_after_connect(*host, "world/", members, 0, kTimeout);
    host_returned = true;
  });
  shardtrain::comm::check_in_after_connect(*member, "world/", members, 1, kTimeout);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_FALSE(host_returned) << "rank 2 has not checked in yet";
  shardtrain::comm::check_in_after_connect(*member, "world/", members, 2, kTimeout);
  host_thread.join();
  EXPECT_TRUE(host_returned);

  // A sub-group without the host: rank 0 waits for all of its members; one never comes.
  shardtrain::comm::check_in_after_connect(*member, "g0/", {1, 2}, 1, kTimeout);
  try {
    shardtrain::comm::check_in_after_connect(*host, "g0/", {1, 2}, 0, std::chrono::milliseconds(300));
    ADD_FAILURE() << "the host returned with one member missing";
  } catch (const shardtrain::TimeoutError& failure) {
    const std::string what = failure.what();
    EXPECT_NE(what.find("for the other 2 rank(s)"), std::string::npos) << what;
    EXPECT_NE(what.find("only 1 did"), std::string::npos) << what;
    EXPECT_NE(what.find("store prefix 'g0/'"), std::string::npos) << what;
  }
}
