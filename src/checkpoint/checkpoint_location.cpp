// Resolving --resume arguments to a checkpoint (see checkpoint_location.h).

#include "shardtrain/checkpoint_location.h"

#include <algorithm>
#include <filesystem>
#include <system_error>
#include <vector>

#include "checkpoint/format.h"
#include "shardtrain/error.h"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;

using checkpoint::has_latest;
using checkpoint::is_checkpoint;

/// "step_9" before "step_10": by the number after the last underscore where both have one.
bool tag_order(const fs::path& a, const fs::path& b) {
  auto number = [](const std::string& name) -> long long {
    const std::size_t underscore = name.rfind('_');
    if (underscore == std::string::npos) return -1;
    try {
      return std::stoll(name.substr(underscore + 1));
    } catch (const std::exception&) {
      return -1;
    }
  };
  const long long x = number(a.filename().string()), y = number(b.filename().string());
  if (x >= 0 && y >= 0 && x != y) return x < y;
  return a < b;
}

}  // namespace

std::string describe_checkpoints_under(const std::string& dir) {
  std::vector<fs::path> found;
  for (const fs::path& root : {fs::path(dir), fs::path(dir) / "checkpoints"}) {
    std::error_code ec;
    if (!fs::is_directory(root, ec)) continue;
    for (const auto& entry : fs::directory_iterator(root, ec)) {
      if (entry.is_directory(ec) && is_checkpoint(entry.path())) found.push_back(entry.path());
    }
  }
  if (found.empty()) return "no checkpoint under " + dir;
  std::sort(found.begin(), found.end(), tag_order);
  std::string text = "found: ";
  for (std::size_t i = 0; i < found.size(); ++i) text += (i ? ", " : "") + found[i].string();
  return text;
}

CheckpointLocation find_checkpoint(const std::string& resume, const std::string& output_dir) {
  ST_CHECK_T(ConfigError, !resume.empty(), "--resume is empty; give a checkpoint, a checkpoint directory, a run's "
             "output directory, or `latest` (this run's output directory)");
  const fs::path where = resume == "latest" ? fs::path(output_dir) : fs::path(resume);
  if (is_checkpoint(where)) return {where.parent_path().string(), where.filename().string()};
  if (has_latest(where)) return {where.string(), ""};
  if (has_latest(where / "checkpoints")) return {(where / "checkpoints").string(), ""};
  ST_THROW(ConfigError, "--resume ", resume, resume == "latest" ? " (this run's output directory " + output_dir + ")" : "",
           ": no checkpoint there. Looked for ", (where / checkpoint::kIndexFile).string(), ", ",
           (where / checkpoint::kLatestFile).string(), " and ",
           (where / "checkpoints" / checkpoint::kLatestFile).string(), "; ", describe_checkpoints_under(where.string()));
}

}  // namespace shardtrain
