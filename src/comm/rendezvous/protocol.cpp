// The rendezvous store's wire protocol (see protocol.h).

#include "comm/rendezvous/protocol.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "build_config.h"  // SHARDTRAIN_WITH_OPENSSL
#if defined(SHARDTRAIN_WITH_OPENSSL)
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#endif

#include "shardtrain/error.h"

namespace shardtrain::comm::rendezvous {

bool authentication_available() {
#if defined(SHARDTRAIN_WITH_OPENSSL)
  return true;
#else
  return false;
#endif
}

Bytes random_bytes(std::size_t n) {
  Bytes out(n);
  std::size_t filled = 0;
  while (filled < n) {
    // getrandom(2): the kernel's CSPRNG, no file descriptor to run out of.
    const ssize_t got = ::getrandom(out.data() + filled, n - filled, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      ST_THROW(Error, "reading random bytes for the rendezvous failed: ", std::strerror(errno));
    }
    filled += static_cast<std::size_t>(got);
  }
  return out;
}

Bytes handshake_mac(const std::string& token, const char* label, const Bytes& server_nonce,
                    const Bytes& client_nonce, const std::string& job_id) {
#if defined(SHARDTRAIN_WITH_OPENSSL)
  Bytes message(label, label + std::strlen(label));
  message.insert(message.end(), server_nonce.begin(), server_nonce.end());
  message.insert(message.end(), client_nonce.begin(), client_nonce.end());
  message.insert(message.end(), job_id.begin(), job_id.end());
  Bytes mac(EVP_MAX_MD_SIZE);
  unsigned int length = 0;
  const uint8_t* result = HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()), message.data(),
                               message.size(), mac.data(), &length);
  ST_CHECK(result != nullptr && length == kMacBytes, "HMAC-SHA256 of the rendezvous handshake failed");
  mac.resize(length);
  return mac;
#else
  (void)token;
  (void)label;
  (void)server_nonce;
  (void)client_nonce;
  (void)job_id;
  // Both ends of an OpenSSL-less build agree on "no proof"; init_distributed
  // refuses a token it cannot check, so this never passes for authentication.
  return Bytes(kMacBytes, 0);
#endif
}

bool same_mac(const Bytes& a, const Bytes& b) {
  if (a.size() != b.size()) return false;
#if defined(SHARDTRAIN_WITH_OPENSSL)
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
#else
  uint8_t diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ b[i];
  return diff == 0;
#endif
}

std::string generate_token() {
  static const char* digits = "0123456789abcdef";
  std::string token;
  for (uint8_t byte : random_bytes(32)) {
    token.push_back(digits[byte >> 4]);
    token.push_back(digits[byte & 15]);
  }
  return token;
}

namespace {

/// A job id is printable ASCII: the server names it in its log and its refusal.
template <typename Iterator>
bool printable_ascii(Iterator begin, Iterator end) {
  return std::all_of(begin, end, [](auto c) {
    const auto byte = static_cast<uint8_t>(c);
    return byte >= 0x20 && byte < 0x7f;
  });
}

}  // namespace

void check_job_id(const std::string& job_id) {
  ST_CHECK_T(ConfigError, job_id.size() <= kMaxJobIdBytes, "the rendezvous job id '", job_id, "' is ",
             job_id.size(), " bytes long; at most ", kMaxJobIdBytes, " are allowed (SHARDTRAIN_RDZV_ID / --rdzv_id)");
  ST_CHECK_T(ConfigError, printable_ascii(job_id.begin(), job_id.end()),
             "the rendezvous job id must be printable ASCII (SHARDTRAIN_RDZV_ID / --rdzv_id)");
}

Bytes client_proof(const std::string& token, const std::string& job_id, const Bytes& server_nonce,
                   const Bytes& client_nonce) {
  check_job_id(job_id);
  const Bytes mac = handshake_mac(token, "client", server_nonce, client_nonce, job_id);
  ST_CHECK(client_nonce.size() == kNonceBytes && mac.size() == kMacBytes, "rendezvous handshake: a nonce of ",
           client_nonce.size(), " bytes or a MAC of ", mac.size(), " bytes");
  // Copied into a buffer sized once: growing a vector with insert() makes
  // GCC 12 warn (-Wstringop-overread, a false positive in vector.tcc).
  Bytes proof(kProofBytes + 1 + job_id.size());
  auto out = std::copy(kMagic.begin(), kMagic.end(), proof.begin());
  out = std::copy(client_nonce.begin(), client_nonce.end(), out);
  out = std::copy(mac.begin(), mac.end(), out);
  *out++ = static_cast<uint8_t>(job_id.size());
  std::copy(job_id.begin(), job_id.end(), out);
  return proof;
}

ClientProof parse_client_proof(const Bytes& in) {
  ClientProof proof;
  // The magic is judged as soon as it has arrived, so a stranger that sends
  // a few bytes of something else is refused without waiting for more.
  const std::size_t seen = std::min(in.size(), kMagic.size());
  if (!std::equal(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(std::min(seen, kMagicPrefixBytes)),
                  kMagic.begin())) {
    proof.status = ClientProof::Status::kNotOurProtocol;
    return proof;
  }
  if (seen < kMagic.size()) return proof;
  if (!std::equal(kMagic.begin(), kMagic.end(), in.begin())) {
    proof.status = ClientProof::Status::kOtherVersion;
    return proof;
  }
  if (in.size() < kProofBytes + 1) return proof;
  const std::size_t id_bytes = in[kProofBytes];
  if (id_bytes > kMaxJobIdBytes) {
    proof.status = ClientProof::Status::kBadJobId;
    return proof;
  }
  if (in.size() < kProofBytes + 1 + id_bytes) return proof;
  if (!printable_ascii(in.begin() + static_cast<std::ptrdiff_t>(kProofBytes + 1),
                       in.begin() + static_cast<std::ptrdiff_t>(kProofBytes + 1 + id_bytes))) {
    proof.status = ClientProof::Status::kBadJobId;
    return proof;
  }
  const auto at = [&](std::size_t offset) { return in.begin() + static_cast<std::ptrdiff_t>(offset); };
  proof.client_nonce.assign(at(kMagic.size()), at(kMagic.size() + kNonceBytes));
  proof.mac.assign(at(kMagic.size() + kNonceBytes), at(kProofBytes));
  proof.job_id.assign(at(kProofBytes + 1), at(kProofBytes + 1 + id_bytes));
  proof.size = kProofBytes + 1 + id_bytes;
  proof.status = ClientProof::Status::kComplete;
  return proof;
}

std::string protocol_version_of(const uint8_t* magic) {
  std::string digits;
  for (std::size_t i = kMagicPrefixBytes; i < kMagic.size(); ++i) {
    const char c = static_cast<char>(magic[i]);
    digits.push_back(c >= '0' && c <= '9' ? c : '?');
  }
  return digits;
}

FrameWriter& FrameWriter::field(int64_t value) {
  uint8_t bytes[8];
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<uint8_t>(static_cast<uint64_t>(value) >> (8 * i));
  return field(bytes, sizeof(bytes));
}

FrameWriter& FrameWriter::field(const void* data, std::size_t size) {
  ST_CHECK(size <= kMaxFrameBytes, "rendezvous store: a value of ", size, " bytes exceeds the limit of ",
           kMaxFrameBytes);
  const auto n = static_cast<uint32_t>(size);
  for (int i = 0; i < 4; ++i) bytes_.push_back(static_cast<uint8_t>(n >> (8 * i)));
  const auto* p = static_cast<const uint8_t*>(data);
  bytes_.insert(bytes_.end(), p, p + size);
  return *this;
}

Bytes FrameWriter::finish() {
  const std::size_t payload = bytes_.size() - 4;
  ST_CHECK(payload <= kMaxFrameBytes, "rendezvous store: a request of ", payload, " bytes exceeds the limit of ",
           kMaxFrameBytes);
  for (int i = 0; i < 4; ++i) bytes_[i] = static_cast<uint8_t>(payload >> (8 * i));
  return std::move(bytes_);
}

uint32_t read_u32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
         static_cast<uint32_t>(p[3]) << 24;
}

uint8_t FrameReader::head() {
  ST_CHECK(pos_ < payload_.size(), "rendezvous store: an empty message");
  return payload_[pos_++];
}

Bytes FrameReader::bytes() {
  ST_CHECK(payload_.size() - pos_ >= 4, "rendezvous store: a message ends inside a field length");
  const uint32_t n = read_u32(payload_.data() + pos_);
  pos_ += 4;
  ST_CHECK(payload_.size() - pos_ >= n, "rendezvous store: a field of ", n, " bytes overruns its message");
  Bytes out(payload_.begin() + static_cast<std::ptrdiff_t>(pos_),
            payload_.begin() + static_cast<std::ptrdiff_t>(pos_ + n));
  pos_ += n;
  return out;
}

std::string FrameReader::text() {
  Bytes raw = bytes();
  return std::string(raw.begin(), raw.end());
}

int64_t FrameReader::integer() {
  Bytes raw = bytes();
  ST_CHECK(raw.size() == 8, "rendezvous store: an integer field of ", raw.size(), " bytes");
  uint64_t value = 0;
  for (int i = 0; i < 8; ++i) value |= static_cast<uint64_t>(raw[i]) << (8 * i);
  return static_cast<int64_t>(value);
}

namespace {

/// Rounded up: poll() with a truncated timeout would wake just before the deadline.
int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left, 1 << 30));
}

/// Waits for `events` on `fd` until the deadline; false when it passed.
bool wait_ready(int fd, short events, Clock::time_point deadline) {
  while (true) {
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, remaining_ms(deadline));
    if (rc > 0) return true;
    if (rc == 0 && Clock::now() >= deadline) return false;
    if (rc == 0) continue;
    if (errno != EINTR) return true;  // let the read/write report the error
  }
}

/// The outcome of a non-blocking connect once the socket is writable.
int pending_error(int fd) {
  int error = 0;
  socklen_t length = sizeof(error);
  return ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) == 0 ? error : errno;
}

}  // namespace

int connect_by(const sockaddr* address, socklen_t length, Clock::time_point deadline, int& error) {
  const int fd = ::socket(address->sa_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    error = errno;
    return -1;
  }
  error = ::connect(fd, address, length) == 0 ? 0 : errno;
  if (error == EINPROGRESS || error == EINTR) error = wait_ready(fd, POLLOUT, deadline) ? pending_error(fd) : ETIMEDOUT;
  if (error != 0) {
    ::close(fd);
    return -1;
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

void send_all(int fd, const uint8_t* data, std::size_t size, Clock::time_point deadline, const std::string& what) {
  std::size_t sent = 0;
  while (sent < size) {
    if (!wait_ready(fd, POLLOUT, deadline)) ST_THROW(TimeoutError, "sending to ", what, " timed out");
    const ssize_t n = ::send(fd, data + sent, size - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      ST_THROW(Error, "sending to ", what, " failed: ", std::strerror(errno));
    }
    sent += static_cast<std::size_t>(n);
  }
}

void recv_all(int fd, uint8_t* data, std::size_t size, Clock::time_point deadline, const std::string& what) {
  std::size_t got = 0;
  while (got < size) {
    if (!wait_ready(fd, POLLIN, deadline)) ST_THROW(TimeoutError, "waiting for ", what, " timed out");
    const ssize_t n = ::recv(fd, data + got, size - got, MSG_DONTWAIT);
    if (n == 0) ST_THROW(Error, what, " closed the connection");
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      ST_THROW(Error, "receiving from ", what, " failed: ", std::strerror(errno));
    }
    got += static_cast<std::size_t>(n);
  }
}

Bytes recv_frame(int fd, Clock::time_point deadline, const std::string& what) {
  uint8_t header[4];
  recv_all(fd, header, 4, deadline, what);
  const uint32_t n = read_u32(header);
  ST_CHECK(n <= kMaxFrameBytes, what, " sent a message of ", n, " bytes, over the limit of ", kMaxFrameBytes);
  Bytes payload(n);
  if (n > 0) recv_all(fd, payload.data(), n, deadline, what);
  return payload;
}

}  // namespace shardtrain::comm::rendezvous
