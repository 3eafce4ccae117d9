#pragma once
/// @file safetensors.h
/// Reader and writer for the safetensors checkpoint format
/// (https://huggingface.co/docs/safetensors).
///
/// Debian 12 packages no safetensors library for C++, so shardtrain carries
/// its own. Layout of a file:
///
///   [8 bytes]  N, little-endian uint64
///   [N bytes]  UTF-8 JSON object: optional "__metadata__" {str: str} and, per
///              tensor, {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}
///              (may be padded with trailing spaces; the writer pads so the
///              data buffer starts 8-byte aligned)
///   [rest]     data buffer; offsets are relative to its start; tensors are
///              row-major, little-endian
///
/// Supported dtypes: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL.
/// Every failure throws shardtrain::Error naming the file (and the tensor,
/// where there is one) and what is wrong.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace shardtrain::safetensors {

/// Where one tensor lives in a file and how to interpret its bytes.
struct TensorInfo {
  at::ScalarType dtype = at::ScalarType::Float;
  std::vector<int64_t> shape;
  /// Byte range [data_begin, data_end) relative to the start of the data buffer
  /// (as written in the header's "data_offsets").
  uint64_t data_begin = 0;
  uint64_t data_end = 0;

  int64_t numel() const;
  uint64_t nbytes() const { return data_end - data_begin; }
};

/// The safetensors name of a dtype ("F32", "BF16", ...); throws for dtypes the
/// format (or this implementation) does not support.
const char* dtype_name(at::ScalarType dtype);

/// Writes `tensors` (in the given order) and `metadata` to `path`, replacing
/// any existing file. Tensors may live on any device and need not be
/// contiguous: contiguous CPU copies are written. Writes to `path` directly;
/// callers wanting atomic replacement write to a temporary name and rename.
/// With `fsync`, the file's data is flushed to stable storage before returning
/// (the directory entry is the caller's business, as is the rename).
/// Throws shardtrain::Error on duplicate or empty names, the reserved name
/// "__metadata__", unsupported dtypes, undefined tensors, or I/O failures
/// (message names the path and the errno text).
void write_file(const std::string& path,
                const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                const std::map<std::string, std::string>& metadata = {},
                bool fsync = true);

/// Random access to the tensors of one safetensors file.
///
/// The constructor reads and validates the whole header, so a Reader that
/// exists describes a structurally valid file; tensor data is read on demand
/// with pread (only the requested bytes), which makes concurrent read() calls
/// from several threads safe. Holds the file open until destroyed.
class Reader {
 public:
  /// Opens `path` and validates its header; throws shardtrain::Error naming the
  /// file (and tensor) on any structural problem: short file, header length
  /// past the end, invalid JSON, missing/ill-typed fields, unknown dtype, byte
  /// ranges outside the data buffer, of the wrong size, or overlapping.
  explicit Reader(const std::string& path);
  ~Reader();
  Reader(Reader&& other) noexcept;
  Reader& operator=(Reader&& other) noexcept;
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  /// Tensor names in the order the header lists them.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  /// Throws shardtrain::Error if the file has no tensor `name`.
  const TensorInfo& info(const std::string& name) const;

  /// Reads tensor `name` into a new CPU tensor of its dtype and shape.
  at::Tensor read(const std::string& name) const;
  /// Reads elements [begin, begin + length) of the flattened tensor `name`
  /// into a new 1-D CPU tensor; only those bytes are read from disk.
  at::Tensor read_slice(const std::string& name, int64_t begin, int64_t length) const;

  /// The header's "__metadata__" (empty if absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  uint64_t file_size() const { return file_size_; }
  /// Absolute file offset of the data buffer (8 + header length).
  uint64_t data_offset() const { return data_offset_; }
  const std::string& path() const { return path_; }

 private:
  const TensorInfo& lookup(const std::string& name) const;
  void read_bytes(const std::string& name, uint64_t offset, void* dst, uint64_t count) const;

  std::string path_;
  int fd_ = -1;
  uint64_t file_size_ = 0;
  uint64_t data_offset_ = 0;
  std::vector<std::string> order_;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

/// CRC-32 (zlib's polynomial, as `crc32` tools and zip use) of a whole file;
/// for checkpoint manifests that verify shards after copying.
uint32_t crc32_of_file(const std::string& path);

}  // namespace shardtrain::safetensors
