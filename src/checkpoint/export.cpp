// The offline checkpoint tools (see export.h): verify, inspect, and the export of
// a checkpoint's fp32 masters as a Hugging Face directory through HfWeightsWriter.

#include "checkpoint/export.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <memory>
#include <sstream>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "json_depth.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/format.h"
#include "checkpoint/hf_writer.h"
#include "shardtrain/error.h"
#include "shardtrain/safetensors.h"

namespace shardtrain::checkpoint {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string crc_hex(uint32_t crc) {
  std::ostringstream out;
  out << "0x" << std::hex << std::setw(8) << std::setfill('0') << crc;
  return out.str();
}

// ---- verification ------------------------------------------------------------

/// Index-only checks of one parameter's slices: every slice names a listed
/// file and has master; master slices tile [0, numel) with no gap or overlap.
void check_coverage(const Index& index, const ParamEntry& param, std::vector<std::string>& problems) {
  const std::string who = "parameter '" + param.name + "'";
  std::vector<std::pair<int64_t, int64_t>> ranges;  // [begin, end) of master slices
  for (const auto& slice : param.slices) {
    const std::string range = "[" + std::to_string(slice.begin) + ", " +
                              std::to_string(slice.begin + slice.length) + ")";
    if (!plain_file_name(slice.file)) {
      problems.push_back(who + ": slice " + range + " names file '" + slice.file +
                         "', which is not a plain file name inside the checkpoint");
      continue;
    }
    if (index.file_position.count(slice.file) == 0) {
      problems.push_back(who + ": slice " + range + " is in file " + slice.file +
                         ", which the index's file list does not have");
    }
    if (slice.begin < 0 || slice.length < 0 || slice.begin + slice.length > param.numel) {
      problems.push_back(who + ": slice " + range + " in " + slice.file + " lies outside its " +
                         std::to_string(param.numel) + " elements");
      continue;
    }
    if (!slice.has("master")) {
      problems.push_back(who + ": slice " + range + " in " + slice.file + " holds no 'master' values");
      continue;
    }
    if (slice.length > 0) ranges.emplace_back(slice.begin, slice.begin + slice.length);
  }
  std::sort(ranges.begin(), ranges.end());
  int64_t covered_to = 0;  // [0, covered_to) is covered by the ranges seen so far
  for (const auto& [begin, end] : ranges) {
    if (begin > covered_to) {
      problems.push_back(who + ": elements [" + std::to_string(covered_to) + ", " + std::to_string(begin) +
                         ") are in no slice (gap in its master slices)");
    } else if (begin < covered_to) {
      problems.push_back(who + ": elements [" + std::to_string(begin) + ", " +
                         std::to_string(std::min(end, covered_to)) +
                         ") are in more than one slice (overlapping master slices)");
    }
    covered_to = std::max(covered_to, end);
  }
  if (covered_to < param.numel) {
    problems.push_back(who + ": elements [" + std::to_string(covered_to) + ", " + std::to_string(param.numel) +
                       ") are in no slice (gap in its master slices)");
  }
}

/// Checks that the (size- and CRC-intact) file `file` holds every tensor the
/// index places in it, with the recorded length and dtype: a file that passes
/// its CRC can still disagree with an index edited or assembled by hand.
void check_file_contents(const Index& index, const FileEntry& file, std::vector<std::string>& problems) {
  std::unique_ptr<safetensors::Reader> reader;
  try {
    reader = std::make_unique<safetensors::Reader>((index.dir / file.name).string());
  } catch (const Error& e) {
    problems.push_back("file " + file.name + " is not a readable safetensors file: " + e.what());
    return;
  }
  for (const auto& param : index.params) {
    for (const auto& slice : param.slices) {
      if (slice.file != file.name) continue;
      for (const auto& kind : slice.kinds) {
        const std::string key = slice_key(param.name, slice.begin, kind);
        if (!reader->contains(key)) {
          problems.push_back("file " + file.name + " has no tensor '" + key + "' that the index lists for parameter '" +
                             param.name + "'");
          continue;
        }
        const auto& info = reader->info(key);
        if (info.numel() != slice.length) {
          problems.push_back("file " + file.name + ": tensor '" + key + "' of parameter '" + param.name + "' has " +
                             std::to_string(info.numel()) + " elements but the index says " +
                             std::to_string(slice.length));
        }
        if (kind == "master" && !param.dtype.empty() && param.dtype != c10::toString(info.dtype)) {
          problems.push_back("file " + file.name + ": tensor '" + key + "' of parameter '" + param.name + "' is " +
                             c10::toString(info.dtype) + " but the index says " + param.dtype);
        }
      }
    }
  }
}

VerifyReport verify_index(const Index& index) {
  VerifyReport report;
  report.checkpoint_dir = index.dir.string();
  report.files = index.files.size();
  report.params = index.params.size();
  auto& problems = report.problems;
  if (!readable_version(index.format_version)) {
    problems.push_back("index.json has format version " + std::to_string(index.format_version) +
                       "; this shardtrain reads " + readable_versions());
  }
  for (const auto& file : index.files) {
    if (!plain_file_name(file.name)) {
      problems.push_back("file '" + file.name + "' in the index is not a plain file name inside the checkpoint");
      continue;
    }
    const fs::path path = index.dir / file.name;
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) {
      problems.push_back("file " + file.name + " (rank " + std::to_string(file.rank) + ") is missing");
      continue;
    }
    const uint64_t size = fs::file_size(path, ec);
    if (ec) {
      problems.push_back("file " + file.name + " cannot be read: " + ec.message());
      continue;
    }
    // A truncated file also fails its CRC; reporting the size says why.
    if (size != file.size) {
      problems.push_back("file " + file.name + " (rank " + std::to_string(file.rank) + ") has " +
                         std::to_string(size) + " bytes but the index says " + std::to_string(file.size) +
                         " (truncated or replaced)");
      continue;
    }
    uint32_t crc = 0;
    try {
      crc = safetensors::crc32_of_file(path.string());
    } catch (const Error& e) {
      problems.push_back("file " + file.name + " cannot be read: " + e.what());
      continue;
    }
    if (crc != file.crc32) {
      problems.push_back("file " + file.name + " (rank " + std::to_string(file.rank) +
                         ") fails its CRC-32 check: the index says " + crc_hex(file.crc32) + ", the file has " +
                         crc_hex(crc) + " (its bytes were altered)");
      continue;
    }
    check_file_contents(index, file, problems);
  }
  for (const auto& param : index.params) check_coverage(index, param, problems);
  return report;
}

// ---- export ------------------------------------------------------------------

/// Assembles `param` from its master slices, cast to `dtype`: the only
/// tensor-sized allocation export makes, one parameter at a time.
at::Tensor assemble(const Index& index, const ParamEntry& param, at::ScalarType dtype,
                    std::map<std::string, std::unique_ptr<safetensors::Reader>>& readers) {
  at::Tensor full = at::empty({param.numel}, at::TensorOptions().dtype(dtype).device(at::kCPU));
  int64_t covered = 0;
  for (const auto& slice : param.slices) {
    if (!slice.has("master") || slice.length == 0) continue;
    auto& reader = readers[slice.file];
    if (!reader) reader = std::make_unique<safetensors::Reader>((index.dir / slice.file).string());
    const at::Tensor part = reader->read_slice(slice_key(param.name, slice.begin, "master"), 0, slice.length);
    full.narrow(0, slice.begin, slice.length).copy_(part);  // copy_ casts to the export dtype
    covered += slice.length;
  }
  // verify() established exact coverage; this guards against the files
  // changing between that check and now.
  ST_CHECK(covered == param.numel, "export: checkpoint ", index.dir.string(), ": parameter '", param.name,
           "' has ", covered, " of its ", param.numel, " elements in master slices");
  return full;
}

}  // namespace

namespace {

/// Where a checkpoint's index should be but is not: `path` itself when it
/// holds rank files (a DIR/TAG that lost its index), or the tag DIR/latest
/// names. Empty when `path` does not look like a checkpoint at all.
fs::path checkpoint_without_index(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return {};
  if (has_latest(path)) {
    const fs::path tagged = path / latest_tag(path.string());
    return is_checkpoint(tagged) ? fs::path() : tagged;
  }
  for (const auto& entry : fs::directory_iterator(path, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("rank", 0) == 0 && entry.path().extension() == ".safetensors") return path;
  }
  return {};
}

}  // namespace

VerifyReport verify(const std::string& path) {
  // A checkpoint that lost its index is damaged (verify's exit 1), not "no
  // checkpoint here" (an error, exit 2).
  const fs::path lost = checkpoint_without_index(path);
  if (!lost.empty() && !is_checkpoint(path)) {
    VerifyReport report;
    report.checkpoint_dir = lost.string();
    report.problems.push_back((lost / kIndexFile).string() + " is missing" +
                              (fs::exists(lost) ? "" : " (the directory " + lost.string() + " does not exist)") +
                              "; without its index the checkpoint cannot be read");
    return report;
  }
  const std::string dir = resolve_checkpoint_dir(path);
  try {
    return verify_index(read_index(dir));
  } catch (const Error& e) {
    // An unreadable index is damage to report, like a bad file.
    VerifyReport report;
    report.checkpoint_dir = dir;
    report.problems.push_back(e.what());
    return report;
  }
}

std::string inspect(const std::string& path) {
  const Index index = read_index(resolve_checkpoint_dir(path));
  std::ostringstream out;
  out << "checkpoint " << index.dir.string() << "\n";
  out << "engine " << index.engine << ", world size " << index.world_size << ", format version "
      << index.format_version << "\n\n";

  // Parameters: columns sized to their widest cell.
  std::vector<std::vector<std::string>> rows = {{"parameter", "shape", "dtype", "numel", "trainable", "files"}};
  int64_t total = 0;
  for (const auto& param : index.params) {
    std::vector<std::string> files;
    for (const auto& slice : param.slices) {
      if (std::find(files.begin(), files.end(), slice.file) == files.end()) files.push_back(slice.file);
    }
    std::string file_list;
    for (const auto& f : files) file_list += (file_list.empty() ? "" : ", ") + f;
    rows.push_back({param.name, shape_text(param.shape), param.dtype, std::to_string(param.numel),
                    param.trainable ? "yes" : "no", file_list});
    total += param.numel;
  }
  auto print_table = [&out](const std::vector<std::vector<std::string>>& table) {
    std::vector<std::size_t> width(table.front().size(), 0);
    for (const auto& row : table)
      for (std::size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
    for (const auto& row : table) {
      out << " ";
      for (std::size_t c = 0; c < row.size(); ++c) {
        out << " " << row[c];
        if (c + 1 < row.size()) out << std::string(width[c] - row[c].size() + 1, ' ');
      }
      out << "\n";
    }
  };
  out << "parameters: " << index.params.size() << " (" << total << " elements)\n";
  print_table(rows);

  std::vector<std::vector<std::string>> file_rows = {{"file", "rank", "size", "crc32"}};
  uint64_t bytes = 0;
  for (const auto& file : index.files) {
    file_rows.push_back({file.name, std::to_string(file.rank), std::to_string(file.size), crc_hex(file.crc32)});
    bytes += file.size;
  }
  out << "\nfiles: " << index.files.size() << " (" << bytes << " bytes)\n";
  print_table(file_rows);

  out << "\ntraining state:\n" << index.training_state.dump(2) << "\n";
  return out.str();
}

void export_hf(const std::string& path, const std::string& out_dir, const ExportOptions& options) {
  const VerifyReport report = verify(path);
  if (!report.ok()) {
    std::ostringstream message;
    message << "export: checkpoint " << report.checkpoint_dir << " is damaged; refusing to export it ("
            << report.problems.size() << " problem" << (report.problems.size() == 1 ? "" : "s") << "):";
    for (const auto& problem : report.problems) message << "\n  - " << problem;
    ST_THROW(Error, message.str());
  }
  const Index index = read_index(report.checkpoint_dir);
  ST_CHECK(!index.params.empty(), "export: checkpoint ", index.dir.string(), " holds no parameters");
  std::vector<ExportTensor> tensors;  // name order, as the index (and save_pretrained) has them
  for (const auto& param : index.params) tensors.push_back({param.name, param.shape});
  HfWeightsWriter writer(std::move(tensors), out_dir, options);
  std::map<std::string, std::unique_ptr<safetensors::Reader>> readers;
  for (const auto& param : index.params) writer.write(param.name, assemble(index, param, writer.dtype(), readers));
  writer.finish();
}

}  // namespace shardtrain::checkpoint
