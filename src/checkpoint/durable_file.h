#pragma once
// Writing files that a crash or a full disk cannot leave half-true without
// an error: every short write, errno, failed fsync and failed close becomes
// a shardtrain::Error naming the file. The one way checkpoints, safetensors
// files and Hugging Face exports put their bytes on disk, and sync the
// directories they rename into.

#include <cstdint>
#include <filesystem>
#include <string>

namespace shardtrain::checkpoint {

class DurableFile {
 public:
  /// Creates or truncates `path`. `what` opens every error ("checkpoint",
  /// "safetensors", "export"), so the user knows which save failed.
  DurableFile(std::filesystem::path path, std::string what);
  /// Closes a file finish() did not, reporting nothing: an error is already
  /// on its way out.
  ~DurableFile();
  DurableFile(const DurableFile&) = delete;
  DurableFile& operator=(const DurableFile&) = delete;

  /// All `count` bytes, in as many write() calls as it takes (one call
  /// writes at most about 2 GiB on Linux; a signal may cut one short).
  void write(const void* data, uint64_t count);
  /// fsync (where `sync`: a rename that publishes the file must not reach
  /// the disk before its data) and close, whose error (deferred write
  /// errors on NFS, a quota) is reported too.
  void finish(bool sync = true);
  uint64_t written() const { return written_; }

 private:
  std::filesystem::path path_;
  std::string what_;
  int fd_ = -1;
  uint64_t written_ = 0;
};

/// `text` into `path`, fsynced.
void write_durable_text(const std::filesystem::path& path, const std::string& text, const std::string& what);

/// fsync of a directory after a rename into it, so the rename itself
/// survives a crash (a file's own data: DurableFile::finish).
void sync_directory(const std::filesystem::path& path, const std::string& what);

}  // namespace shardtrain::checkpoint
