#pragma once
// The wire protocol of shardtrain's rendezvous store (private header): the
// handshake by which a process proves it holds the job's token, the request
// framing, and the socket helpers the server and the client share.
//
// Why our own store rather than c10d's TCPStore: TCPStore has no
// authentication; it serves any process that can reach its port, so every
// key the ranks exchange (Gloo addresses, the NCCL unique id) would be open
// to anyone on the network.
//
// Handshake (a challenge-response, so the token never crosses the wire):
//   server -> client  kMagic, server nonce Ns (32 random bytes)
//   client -> server  kMagic, client nonce Nc, HMAC-SHA256(token, "client" Ns Nc J),
//                     u8 length, job id J
//   server -> client  0, HMAC-SHA256(token, "server" Ns Nc J)   (accepted)
//                  or R, u32 length, reason                      (refused, then closed;
//                                                                  R is a Refusal)
// The client checks the server's MAC too: an impostor listening on the port
// cannot harvest what the ranks would write. Traffic after the handshake is
// not encrypted (see README, "Reliability and security").
//
// The job id J binds a store to one job. Two jobs that share a token (one
// exported in the shell) and a port would otherwise mix: a rank of the second
// joined the first one's store and failed later with a misleading timeout.
// J travels in the clear (it is a name, not a secret) so the server can refuse
// a rank of another job by name; the MACs cover it, so it cannot be swapped.
//
// Requests and replies: u32 little-endian payload length, then the payload:
// a one-byte opcode (request) or status (reply), then fields, each a u32
// length and its bytes. Integers travel as 8-byte little-endian fields.

#include <sys/socket.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain::comm::rendezvous {

/// "STRDZV" and a two-digit protocol version; a peer with the same prefix and
/// another version is a different shardtrain, and is told so.
inline constexpr std::array<uint8_t, 8> kMagic{'S', 'T', 'R', 'D', 'Z', 'V', '0', '2'};
inline constexpr std::size_t kMagicPrefixBytes = 6;
inline constexpr std::size_t kNonceBytes = 32;
inline constexpr std::size_t kMacBytes = 32;
inline constexpr std::size_t kHelloBytes = kMagic.size() + kNonceBytes;
/// The fixed part of a client's proof; the job id's length byte and the id follow.
inline constexpr std::size_t kProofBytes = kMagic.size() + kNonceBytes + kMacBytes;
/// A job id is a name (a torchrun rdzv id, a Slurm job id, a few words).
inline constexpr std::size_t kMaxJobIdBytes = 128;
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

/// The status byte of a refused handshake: what the client should advise.
enum class Refusal : uint8_t {
  kNotThisJobsToken = 1,  ///< bad protocol or token: check the token
  kAnotherJob = 2,        ///< the token fits, the job id does not: the reason names both jobs
};

using Bytes = std::vector<uint8_t>;
using Clock = std::chrono::steady_clock;

/// True when this build can authenticate (it links OpenSSL's libcrypto).
bool authentication_available();
/// `n` bytes from the system's cryptographic random source.
Bytes random_bytes(std::size_t n);
/// HMAC-SHA256(token, label || server_nonce || client_nonce || job_id).
Bytes handshake_mac(const std::string& token, const char* label, const Bytes& server_nonce,
                    const Bytes& client_nonce, const std::string& job_id);
/// Constant-time comparison, so a refused peer learns nothing from timing.
bool same_mac(const Bytes& a, const Bytes& b);
/// A fresh per-job token: 32 random bytes in hex.
std::string generate_token();

/// Throws ConfigError unless `job_id` is at most kMaxJobIdBytes of printable ASCII.
void check_job_id(const std::string& job_id);
/// The client's answer to the server's hello (the handshake's second message).
Bytes client_proof(const std::string& token, const std::string& job_id, const Bytes& server_nonce,
                   const Bytes& client_nonce);

/// A client's proof as the server reads it off the wire.
struct ClientProof {
  enum class Status {
    kIncomplete,      ///< more bytes are needed
    kNotOurProtocol,  ///< the magic is not shardtrain's rendezvous
    kOtherVersion,    ///< shardtrain's rendezvous, another protocol version
    kBadJobId,        ///< a job id longer than kMaxJobIdBytes, or not printable ASCII
    kComplete,
  };
  Status status = Status::kIncomplete;
  Bytes client_nonce;
  Bytes mac;
  std::string job_id;
  /// Bytes of `in` the proof took (kComplete only).
  std::size_t size = 0;
};
/// Parses the start of `in`; never reads past its end.
ClientProof parse_client_proof(const Bytes& in);
/// The two version digits of a magic that carries shardtrain's prefix.
std::string protocol_version_of(const uint8_t* magic);

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

/// A TCP connection to `address` made by `deadline`: the descriptor
/// (blocking, close-on-exec, TCP_NODELAY), or -1 with `error` set to the
/// errno value (ETIMEDOUT when the deadline passed). Not one blocking
/// connect(): that ignores the deadline (an unanswered SYN is retried for
/// about two minutes) and fails with EINTR when a signal arrives, although
/// the connection goes on.
int connect_by(const sockaddr* address, socklen_t length, Clock::time_point deadline, int& error);

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
