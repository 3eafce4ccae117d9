#pragma once
// Reads what a test's training runs leave on disk, read the same way by every
// test that compares runs: the tag a checkpoint directory's `latest` file
// names, and a file of losses written one per line.

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace shardtrain::testing {

/// The first line of DIR/latest ("" when the file is missing): the tag of the
/// checkpoint a resume would load, read from the file itself rather than
/// through the library's own reader.
inline std::string read_latest_tag(const std::filesystem::path& checkpoint_dir) {
  std::ifstream in(checkpoint_dir / "latest");
  std::string tag;
  std::getline(in, tag);
  return tag;
}

/// The numbers of a file of one loss per line, in order.
inline std::vector<double> read_loss_lines(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::vector<double> losses;
  for (double loss; in >> loss;) losses.push_back(loss);
  return losses;
}

}  // namespace shardtrain::testing
