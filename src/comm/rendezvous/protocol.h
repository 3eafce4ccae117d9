#pragma once
// The wire protocol of shardtrain's rendezvous store (private header): the
// handshake by which a process proves it holds the job's token, the request
// framing, and the socket helpers the server and the client share.
//
// Why our own store rather than c10d's TCPStore: TCPStore (1.13 and 2.x)
// accepts any process that can reach its port, and 1.13's cannot be told
// which address to listen on. Every key the ranks exchange (Gloo addresses,
// the NCCL unique id) would be open to anyone on the network.
//
// Handshake (a challenge-response, so the token never crosses the wire):
//   server -> client  kMagic, server nonce Ns (32 random bytes)
//   client -> server  kMagic, client nonce Nc, HMAC-SHA256(token, "client" Ns Nc)
//   server -> client  0, HMAC-SHA256(token, "server" Ns Nc)     (accepted)
//                  or 1, u32 length, reason                      (refused, then closed)
// The client checks the server's MAC too: an impostor listening on the port
// cannot harvest what the ranks would write. Traffic after the handshake is
// not encrypted (see README, "Reliability and security").
//
// Requests and replies: u32 little-endian payload length, then the payload:
// a one-byte opcode (request) or status (reply), then fields, each a u32
// length and its bytes. Integers travel as 8-byte little-endian fields.

#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain::comm::rendezvous {

inline constexpr std::array<uint8_t, 8> kMagic{'S', 'T', 'R', 'D', 'Z', 'V', '0', '1'};
inline constexpr std::size_t kNonceBytes = 32;
inline constexpr std::size_t kMacBytes = 32;
inline constexpr std::size_t kHelloBytes = kMagic.size() + kNonceBytes;
inline constexpr std::size_t kProofBytes = kMagic.size() + kNonceBytes + kMacBytes;
/// A frame larger than this is refused: values are addresses, ids and logs,
/// and an unbounded length would let any peer make the other allocate at will.
inline constexpr uint32_t kMaxFrameBytes = 64u << 20;

enum class Op : uint8_t {
  kSet = 1,
  kGet = 2,          ///< parks until the key exists
  kAdd = 3,
  kCheck = 4,
  kDelete = 5,
  kNumKeys = 6,
  kWait = 7,         ///< parks until every key exists
  kCompareSet = 8,
};

using Bytes = std::vector<uint8_t>;
using Clock = std::chrono::steady_clock;

/// True when this build can authenticate (it links OpenSSL's libcrypto).
bool authentication_available();
/// `n` bytes from the system's cryptographic random source.
Bytes random_bytes(std::size_t n);
/// HMAC-SHA256(token, label || server_nonce || client_nonce).
Bytes handshake_mac(const std::string& token, const char* label, const Bytes& server_nonce,
                    const Bytes& client_nonce);
/// Constant-time comparison, so a refused peer learns nothing from timing.
bool same_mac(const Bytes& a, const Bytes& b);
/// A fresh per-job token: 32 random bytes in hex.
std::string generate_token();

/// Builds a payload: opcode/status byte, then fields.
class FrameWriter {
 public:
  explicit FrameWriter(uint8_t head) { bytes_.assign(4, 0); bytes_.push_back(head); }
  FrameWriter& field(const std::string& text) { return field(text.data(), text.size()); }
  FrameWriter& field(const Bytes& data) { return field(data.data(), data.size()); }
  FrameWriter& field(int64_t value);
  FrameWriter& field(const void* data, std::size_t size);
  /// The length prefix filled in: ready to send.
  Bytes finish();

 private:
  Bytes bytes_;
};

/// Reads a payload's fields; every read is bounds-checked (throws Error).
class FrameReader {
 public:
  explicit FrameReader(const Bytes& payload) : payload_(payload) {}
  uint8_t head();
  Bytes bytes();
  std::string text();
  int64_t integer();
  bool at_end() const { return pos_ == payload_.size(); }

 private:
  const Bytes& payload_;
  std::size_t pos_ = 0;
};

/// Sends all of `data` or throws; `what` names the peer in the error.
void send_all(int fd, const uint8_t* data, std::size_t size, Clock::time_point deadline, const std::string& what);
/// Receives exactly `size` bytes by `deadline`. Throws TimeoutError when the
/// deadline passes, Error when the peer closes or the socket fails.
void recv_all(int fd, uint8_t* data, std::size_t size, Clock::time_point deadline, const std::string& what);
/// One length-prefixed payload.
Bytes recv_frame(int fd, Clock::time_point deadline, const std::string& what);

/// Little-endian u32 at `p`.
uint32_t read_u32(const uint8_t* p);

}  // namespace shardtrain::comm::rendezvous
