// Checked, fsynced file writes (durable_file.h). Plain POSIX calls rather
// than std::ofstream: a stream reports a failure as one bit, without errno,
// and cannot fsync.
#include "checkpoint/durable_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "shardtrain/error.h"

namespace shardtrain::checkpoint {

DurableFile::DurableFile(std::filesystem::path path, std::string what)
    : path_(std::move(path)), what_(std::move(what)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ST_CHECK(fd_ >= 0, what_, ": cannot create ", path_.string(), ": ", std::strerror(errno));
}

DurableFile::~DurableFile() {
  if (fd_ >= 0) ::close(fd_);
}

void DurableFile::write(const void* data, uint64_t count) {
  const char* p = static_cast<const char*>(data);
  while (count > 0) {
    const ssize_t n = ::write(fd_, p, static_cast<size_t>(std::min<uint64_t>(count, uint64_t{1} << 30)));
    if (n < 0 && errno == EINTR) continue;
    ST_CHECK(n > 0, what_, ": writing ", path_.string(), " failed: ",
             n < 0 ? std::strerror(errno) : "no progress (disk full?)");
    p += n;
    count -= static_cast<uint64_t>(n);
    written_ += static_cast<uint64_t>(n);
  }
}

void DurableFile::finish(bool sync) {
  if (sync) ST_CHECK(::fsync(fd_) == 0, what_, ": fsync of ", path_.string(), " failed: ", std::strerror(errno));
  const int fd = std::exchange(fd_, -1);
  ST_CHECK(::close(fd) == 0, what_, ": closing ", path_.string(), " failed: ", std::strerror(errno));
}

void write_durable_text(const std::filesystem::path& path, const std::string& text, const std::string& what) {
  DurableFile file(path, what);
  file.write(text.data(), text.size());
  file.finish();
}

void sync_directory(const std::filesystem::path& path, const std::string& what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  ST_CHECK(fd >= 0, what, ": cannot open ", path.string(), " to fsync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  ST_CHECK(rc == 0, what, ": fsync of ", path.string(), " failed: ", std::strerror(err));
}

}  // namespace shardtrain::checkpoint
