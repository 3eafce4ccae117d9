// Reading the rendezvous token from a file (see token_file.h).

#include "comm/rendezvous/token_file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

#include "shardtrain/error.h"

namespace shardtrain::comm::rendezvous {

std::string read_token_file(const std::string& path) {
  struct stat info {};
  ST_CHECK_T(ConfigError, ::stat(path.c_str(), &info) == 0, "the rendezvous token file ", path,
             " cannot be read (", std::strerror(errno), ")");
  ST_CHECK_T(ConfigError, S_ISREG(info.st_mode), "the rendezvous token file ", path, " is not a regular file");
  ST_CHECK_T(ConfigError, info.st_uid == ::geteuid(), "the rendezvous token file ", path,
             " belongs to another user (uid ", info.st_uid, "); use a file of your own with mode 0600");
  // Any group or other permission bit: someone else could read (or replace) the secret.
  char mode[8];
  std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(info.st_mode & 07777));
  ST_CHECK_T(ConfigError, (info.st_mode & 077) == 0, "the rendezvous token file ", path, " has mode ", mode,
             ", so other users may read or replace it; run chmod 600 ", path);
  constexpr std::size_t kMaxTokenFileBytes = 4096;  // a secret is tens of bytes; anything bigger is the wrong file
  ST_CHECK_T(ConfigError, static_cast<std::size_t>(info.st_size) <= kMaxTokenFileBytes, "the rendezvous token file ",
             path, " holds ", info.st_size, " bytes; a token is one line (e.g. openssl rand -hex 32 > FILE)");
  std::ifstream in(path, std::ios::binary);
  std::string token((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ST_CHECK_T(ConfigError, !in.bad(), "reading the rendezvous token file ", path, " failed");
  while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) token.pop_back();
  ST_CHECK_T(ConfigError, !token.empty(), "the rendezvous token file ", path,
             " is empty; write the job's secret into it, e.g. openssl rand -hex 32 > ", path);
  return token;
}

std::optional<std::string> token_from_environment(const std::function<const char*(const char*)>& lookup) {
  if (const char* token = lookup("SHARDTRAIN_RDZV_TOKEN"); token != nullptr && *token != '\0') return token;
  if (const char* file = lookup("SHARDTRAIN_RDZV_TOKEN_FILE"); file != nullptr && *file != '\0') {
    return read_token_file(file);
  }
  return std::nullopt;
}

}  // namespace shardtrain::comm::rendezvous
