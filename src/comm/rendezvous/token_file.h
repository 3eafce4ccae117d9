#pragma once
// Reading the rendezvous token from a file (private header). A token on the
// command line is visible to every local user in ps; a file that only its
// owner can read is not. Both `shardtrain launch --rdzv_token_file` and a
// worker started by torchrun/srun (SHARDTRAIN_RDZV_TOKEN_FILE) read it here.

#include <functional>
#include <optional>
#include <string>

namespace shardtrain::comm::rendezvous {

/// The token in `path`: a regular file of this user's that no one else may
/// read or write (mode 0600 or stricter), trailing whitespace dropped. Throws
/// ConfigError naming the file and the fix (e.g. `chmod 600 PATH`).
std::string read_token_file(const std::string& path);

/// The token the environment gives: SHARDTRAIN_RDZV_TOKEN, else the file
/// SHARDTRAIN_RDZV_TOKEN_FILE names; nullopt when neither is set (non-empty).
/// `lookup` returns a variable's value or nullptr (std::getenv, or a test's map).
std::optional<std::string> token_from_environment(const std::function<const char*(const char*)>& lookup);

}  // namespace shardtrain::comm::rendezvous
