// safetensors reader/writer. Debian 12 has no safetensors package for C++
// (only the Rust crate and the Python wheel upstream), so this is our own
// implementation of https://huggingface.co/docs/safetensors.
#include "shardtrain/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <tuple>

#include "checkpoint/durable_file.h"
#include "json_depth.h"
#include "shardtrain/error.h"

// The format is little-endian and we copy bytes straight into tensor storage.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "shardtrain's safetensors I/O assumes a little-endian host");

namespace shardtrain::safetensors {
namespace {

using ordered_json = nlohmann::ordered_json;

// Same cap as the reference implementation: a header this large is either
// corruption or an attempt to make us allocate unbounded memory.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kMetadataKey = "__metadata__";

struct DtypeName {
  const char* name;
  at::ScalarType dtype;
};
constexpr DtypeName kDtypes[] = {
    {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
    {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
    {"U8", at::kByte},    {"BOOL", at::kBool},
};

std::string supported_dtypes() {
  std::string out;
  for (const auto& d : kDtypes) {
    if (!out.empty()) out += ", ";
    out += d.name;
  }
  return out;
}

std::string errno_text(int err) { return std::strerror(err); }

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

// Returns false on overflow; shapes come from untrusted headers. Zero dims are
// skipped in the product because LibTorch still computes strides from the
// other dims of an empty tensor, and those must not overflow int64 either.
bool checked_numel(const std::vector<int64_t>& shape, uint64_t* out) {
  uint64_t n = 1;
  bool empty = false;
  for (int64_t d : shape) {
    if (d == 0) {
      empty = true;
    } else if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) {
      return false;
    }
  }
  if (n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
  *out = empty ? 0 : n;
  return true;
}

// Closes on scope exit so every throw path releases the descriptor.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

std::string describe_json(const ordered_json& value) {
  std::string text = value.dump();
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return text;
}

}  // namespace

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const char* dtype_name(at::ScalarType dtype) {
  for (const auto& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  ST_THROW(Error, "safetensors: dtype ", c10::toString(dtype),
           " is not supported (supported: ", supported_dtypes(), ")");
}

// ---- writer ------------------------------------------------------------------

void write_file(const std::string& path,
                const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                const std::map<std::string, std::string>& metadata, bool fsync) {
  // Header first: offsets depend only on numel and dtype, so no tensor needs to
  // be copied before we know the layout (keeps peak memory at one tensor).
  ordered_json header = ordered_json::object();
  if (!metadata.empty()) {
    ordered_json meta = ordered_json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header[kMetadataKey] = std::move(meta);
  }
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    ST_CHECK(!name.empty(), "safetensors: '", path, "': tensor names must not be empty");
    ST_CHECK(name != kMetadataKey, "safetensors: '", path, "': '", kMetadataKey,
             "' is reserved for metadata and cannot name a tensor");
    ST_CHECK(seen.insert(name).second, "safetensors: '", path, "': tensor '", name,
             "' appears twice");
    ST_CHECK(tensor.defined(), "safetensors: '", path, "': tensor '", name, "' is undefined");
    ST_CHECK(tensor.layout() == at::kStrided, "safetensors: '", path, "': tensor '", name,
             "' is not dense (layout ", tensor.layout(), "); convert it with to_dense()");
    const char* dtype = nullptr;
    try {
      dtype = dtype_name(tensor.scalar_type());
    } catch (const Error&) {
      ST_THROW(Error, "safetensors: '", path, "': tensor '", name, "' has dtype ",
               c10::toString(tensor.scalar_type()), ", which safetensors files here cannot hold (supported: ",
               supported_dtypes(), ")");
    }
    uint64_t nbytes = static_cast<uint64_t>(tensor.numel()) * tensor.element_size();
    ordered_json entry;
    entry["dtype"] = dtype;
    entry["shape"] = tensor.sizes().vec();
    entry["data_offsets"] = {offset, offset + nbytes};
    header[name] = std::move(entry);
    offset += nbytes;
  }

  std::string header_text;
  try {
    header_text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    // dump() rejects invalid UTF-8 in names or metadata.
    ST_THROW(Error, "safetensors: '", path, "': tensor name or metadata is not valid UTF-8: ",
             e.what());
  }
  // Pad so the data buffer starts 8-byte aligned, as the reference writer does:
  // readers that mmap the file can then view tensors in place.
  header_text.append((8 - header_text.size() % 8) % 8, ' ');

  std::string prefix(8, '\0');
  uint64_t header_len = header_text.size();
  std::memcpy(prefix.data(), &header_len, 8);  // little-endian host (static_assert above)
  prefix += header_text;

  checkpoint::DurableFile file(path, "safetensors");
  file.write(prefix.data(), prefix.size());
  for (const auto& [name, tensor] : tensors) {
    if (tensor.numel() == 0) continue;
    at::Tensor cpu = tensor.detach().to(at::kCPU).contiguous();
    file.write(cpu.data_ptr(), static_cast<uint64_t>(cpu.numel()) * cpu.element_size());
  }
  file.finish(fsync);
}

// ---- reader ------------------------------------------------------------------

Reader::Reader(const std::string& path) : path_(path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  ST_CHECK(fd.get() >= 0, path, ": cannot open safetensors file: ", errno_text(errno));
  struct stat st {};
  ST_CHECK(::fstat(fd.get(), &st) == 0, path, ": cannot stat: ", errno_text(errno));
  ST_CHECK(S_ISREG(st.st_mode), path, ": not a regular file");
  file_size_ = static_cast<uint64_t>(st.st_size);
  fd_ = fd.get();  // read_bytes needs it; ownership stays with `fd` until validated

  ST_CHECK(file_size_ >= 8, path, ": file is ", file_size_,
           " bytes, shorter than the 8-byte header length; not a safetensors file");
  uint64_t header_len = 0;
  read_bytes("", 0, &header_len, 8);
  ST_CHECK(header_len <= kMaxHeaderBytes, path, ": header length ", header_len,
           " bytes is absurdly large (limit ", kMaxHeaderBytes,
           "); not a safetensors file or corrupted");
  ST_CHECK(header_len <= file_size_ - 8, path, ": header length ", header_len,
           " runs past the end of the file (", file_size_, " bytes, so at most ",
           file_size_ - 8, " bytes of header); file truncated?");
  data_offset_ = 8 + header_len;
  const uint64_t data_size = file_size_ - data_offset_;

  std::string text(header_len, '\0');
  read_bytes("", 8, text.data(), header_len);

  // Duplicate top-level keys would silently shadow each other in the parsed
  // object; spot them while parsing.
  std::string duplicate;
  std::set<std::string> keys;
  ordered_json::parser_callback_t on_event = [&](int depth, nlohmann::json::parse_event_t event,
                                                 ordered_json& parsed) {
    if (event == nlohmann::json::parse_event_t::key && depth == 1 && parsed.is_string()) {
      if (!keys.insert(parsed.get<std::string>()).second && duplicate.empty()) {
        duplicate = parsed.get<std::string>();
      }
    }
    return true;
  };
  ordered_json header;
  try {
    header = parse_json_within_depth<Error, ordered_json>(text, path + ": the header", on_event);
  } catch (const nlohmann::json::exception& e) {
    ST_THROW(Error, path, ": header is not valid JSON: ", e.what());
  }
  ST_CHECK(header.is_object(), path, ": header is not a JSON object but ", header.type_name(),
           " (", describe_json(header), ")");
  ST_CHECK(duplicate.empty(), path, ": header lists '", duplicate, "' twice");

  struct Range {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Range> ranges;
  for (const auto& [name, entry] : header.items()) {
    if (name == kMetadataKey) {
      ST_CHECK(entry.is_object(), path, ": ", kMetadataKey, " is ", entry.type_name(),
               ", expected an object of strings");
      for (const auto& [key, value] : entry.items()) {
        ST_CHECK(value.is_string(), path, ": ", kMetadataKey, " value for '", key, "' is ",
                 value.type_name(), " (", describe_json(value), "), expected a string");
        metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string where = path + ": tensor '" + name + "': ";
    ST_CHECK(entry.is_object(), where, "entry is ", entry.type_name(), ", expected an object");
    for (const char* field : {"dtype", "shape", "data_offsets"}) {
      ST_CHECK(entry.contains(field), where, "missing '", field, "'");
    }

    TensorInfo info;
    const auto& dtype = entry["dtype"];
    ST_CHECK(dtype.is_string(), where, "dtype is ", dtype.type_name(), ", expected a string");
    const std::string dtype_text = dtype.get<std::string>();
    const auto* found = std::find_if(std::begin(kDtypes), std::end(kDtypes),
                                     [&](const DtypeName& d) { return dtype_text == d.name; });
    ST_CHECK(found != std::end(kDtypes), where, "unknown dtype '", dtype_text, "' (supported: ",
             supported_dtypes(), ")");
    info.dtype = found->dtype;

    const auto& shape = entry["shape"];
    ST_CHECK(shape.is_array(), where, "shape is ", shape.type_name(), ", expected an array");
    for (const auto& dim : shape) {
      ST_CHECK(dim.is_number_integer(), where, "shape ", describe_json(shape),
               " has a non-integer dimension ", describe_json(dim));
      ST_CHECK(dim.is_number_unsigned(), where, "shape ", describe_json(shape),
               " has a negative dimension ", describe_json(dim));
      uint64_t d = dim.get<uint64_t>();
      ST_CHECK(d <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), where, "shape ",
               describe_json(shape), " has dimension ", d, ", too large");
      info.shape.push_back(static_cast<int64_t>(d));
    }

    const auto& offsets = entry["data_offsets"];
    ST_CHECK(offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() &&
                 offsets[1].is_number_unsigned(),
             where, "data_offsets ", describe_json(offsets),
             " is not [begin, end] with non-negative integers");
    info.data_begin = offsets[0].get<uint64_t>();
    info.data_end = offsets[1].get<uint64_t>();
    ST_CHECK(info.data_begin <= info.data_end, where, "data_offsets [", info.data_begin, ", ",
             info.data_end, "] has begin after end");
    ST_CHECK(info.data_end <= data_size, where, "data_offsets [", info.data_begin, ", ",
             info.data_end, "] run past the end of the data buffer, which holds ", data_size,
             " bytes; file truncated?");

    uint64_t numel = 0;
    uint64_t needed = 0;
    const uint64_t element_size = at::elementSize(info.dtype);
    ST_CHECK(checked_numel(info.shape, &numel) &&
                 !__builtin_mul_overflow(numel, element_size, &needed),
             where, "shape ", shape_str(info.shape), " of ", dtype_text,
             " is too large (element count or byte size overflows 64 bits)");
    ST_CHECK(info.nbytes() == needed, where, "data_offsets [", info.data_begin, ", ",
             info.data_end, "] hold ", info.nbytes(), " bytes but shape ", shape_str(info.shape),
             " of ", dtype_text, " needs ", needed);

    auto [it, inserted] = tensors_.emplace(name, std::move(info));
    (void)inserted;  // duplicates were rejected above
    order_.push_back(name);
    if (it->second.nbytes() > 0) ranges.push_back({it->second.data_begin, it->second.data_end, &it->first});
  }

  // Empty tensors occupy no bytes and so cannot overlap anything.
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  for (size_t i = 1; i < ranges.size(); ++i) {
    const Range& prev = ranges[i - 1];
    const Range& cur = ranges[i];
    ST_CHECK(cur.begin >= prev.end, path, ": tensor '", *cur.name, "': data_offsets [",
             cur.begin, ", ", cur.end, "] overlap tensor '", *prev.name, "' at [", prev.begin,
             ", ", prev.end, "]");
  }
  fd_ = fd.release();
}

Reader::~Reader() {
  if (fd_ >= 0) ::close(fd_);
}

Reader::Reader(Reader&& other) noexcept
    : path_(std::move(other.path_)),
      fd_(std::exchange(other.fd_, -1)),
      file_size_(other.file_size_),
      data_offset_(other.data_offset_),
      order_(std::move(other.order_)),
      tensors_(std::move(other.tensors_)),
      metadata_(std::move(other.metadata_)) {}

Reader& Reader::operator=(Reader&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    file_size_ = other.file_size_;
    data_offset_ = other.data_offset_;
    order_ = std::move(other.order_);
    tensors_ = std::move(other.tensors_);
    metadata_ = std::move(other.metadata_);
  }
  return *this;
}

std::vector<std::string> Reader::names() const { return order_; }

bool Reader::contains(const std::string& name) const { return tensors_.count(name) > 0; }

const TensorInfo& Reader::info(const std::string& name) const { return lookup(name); }

const TensorInfo& Reader::lookup(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it != tensors_.end()) return it->second;
  std::string listed;
  for (size_t i = 0; i < order_.size() && i < 5; ++i) listed += (i ? ", " : "") + order_[i];
  if (order_.size() > 5) listed += ", ...";
  ST_THROW(Error, path_, ": no tensor '", name, "' (the file has ", order_.size(),
           " tensors: ", listed, ")");
}

void Reader::read_bytes(const std::string& name, uint64_t offset, void* dst, uint64_t count) const {
  char* p = static_cast<char*>(dst);
  while (count > 0) {
    size_t chunk = static_cast<size_t>(std::min<uint64_t>(count, 1ull << 30));
    ssize_t n = ::pread(fd_, p, chunk, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      ST_THROW(Error, path_, ": reading ", name.empty() ? "header" : "tensor '" + name + "'",
               " at byte ", offset, " failed: ", errno_text(errno));
    }
    // The header said these bytes exist; the file must have shrunk since.
    ST_CHECK(n > 0, path_, ": file ended at byte ", offset, " while reading ",
             name.empty() ? "header" : "tensor '" + name + "'", "; truncated while open?");
    p += n;
    offset += static_cast<uint64_t>(n);
    count -= static_cast<uint64_t>(n);
  }
}

namespace {
// A bool byte other than 0/1 is undefined behaviour once viewed as C++ bool.
void check_bools(const at::Tensor& t, const std::string& path, const std::string& name) {
  const auto* bytes = static_cast<const uint8_t*>(t.data_ptr());
  for (int64_t i = 0; i < t.numel(); ++i) {
    ST_CHECK(bytes[i] <= 1, path, ": tensor '", name, "': BOOL element ", i, " has byte value ",
             static_cast<int>(bytes[i]), ", expected 0 or 1");
  }
}
}  // namespace

at::Tensor Reader::read(const std::string& name) const {
  const TensorInfo& info = lookup(name);
  at::Tensor out = at::empty(info.shape, at::TensorOptions().dtype(info.dtype).device(at::kCPU));
  if (info.nbytes() > 0) {
    read_bytes(name, data_offset_ + info.data_begin, out.data_ptr(), info.nbytes());
  }
  if (info.dtype == at::kBool) check_bools(out, path_, name);
  return out;
}

at::Tensor Reader::read_slice(const std::string& name, int64_t begin, int64_t length) const {
  const TensorInfo& info = lookup(name);
  const int64_t numel = info.numel();
  ST_CHECK(begin >= 0 && length >= 0 && begin <= numel && length <= numel - begin, path_,
           ": tensor '", name, "': slice [", begin, ", ", begin, " + ", length,
           ") is outside its ", numel, " elements");
  at::Tensor out = at::empty({length}, at::TensorOptions().dtype(info.dtype).device(at::kCPU));
  const uint64_t element_size = at::elementSize(info.dtype);
  if (length > 0) {
    read_bytes(name, data_offset_ + info.data_begin + static_cast<uint64_t>(begin) * element_size,
               out.data_ptr(), static_cast<uint64_t>(length) * element_size);
  }
  if (info.dtype == at::kBool) check_bools(out, path_, name);
  return out;
}

// ---- checksum ----------------------------------------------------------------

uint32_t crc32_of_file(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  ST_CHECK(fd.get() >= 0, "crc32: cannot open '", path, "': ", errno_text(errno));
  std::vector<unsigned char> buffer(1 << 20);
  uLong crc = ::crc32(0L, Z_NULL, 0);
  for (;;) {
    ssize_t n = ::read(fd.get(), buffer.data(), buffer.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      ST_THROW(Error, "crc32: reading '", path, "' failed: ", errno_text(errno));
    }
    if (n == 0) break;
    crc = ::crc32(crc, buffer.data(), static_cast<uInt>(n));
  }
  return static_cast<uint32_t>(crc);
}

}  // namespace shardtrain::safetensors
