#include "checkpoint/export.h"

#include <fcntl.h>
#include <unistd.h>

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

#include "checkpoint/checkpoint.h"
#include "checkpoint/format.h"
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
  if (index.format_version != kFormatVersion) {
    problems.push_back("index.json has format version " + std::to_string(index.format_version) +
                       "; this shardtrain reads version " + std::to_string(kFormatVersion));
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

at::ScalarType export_dtype(const std::string& name) {
  if (name == "fp32" || name == "float32" || name == "f32") return at::kFloat;
  if (name == "bf16" || name == "bfloat16") return at::kBFloat16;
  ST_THROW(Error, "export: dtype '", name, "' is not supported; use fp32 or bf16");
}

/// One output file: which parameters it holds, in order.
struct Shard {
  std::string file;
  std::vector<const ParamEntry*> params;
  uint64_t bytes = 0;
};

/// Writes to a file descriptor, turning short writes and errno into Errors
/// that name the file.
class OutFile {
 public:
  explicit OutFile(const fs::path& path) : path_(path.string()) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    ST_CHECK(fd_ >= 0, "export: cannot create ", path_, ": ", std::strerror(errno));
  }
  ~OutFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  OutFile(const OutFile&) = delete;
  OutFile& operator=(const OutFile&) = delete;

  void write(const void* data, uint64_t count) {
    const char* p = static_cast<const char*>(data);
    while (count > 0) {
      const ssize_t n = ::write(fd_, p, std::min<uint64_t>(count, 1ULL << 30));
      if (n < 0 && errno == EINTR) continue;
      ST_CHECK(n > 0, "export: writing ", path_, " failed: ", n < 0 ? std::strerror(errno) : "no progress",
               " (disk full?)");
      p += n;
      count -= static_cast<uint64_t>(n);
      written_ += static_cast<uint64_t>(n);
    }
  }

  /// fsync + close: the rename that publishes the export must not reach the
  /// disk before the data does, and close() can report deferred write errors.
  void finish() {
    ST_CHECK(::fsync(fd_) == 0, "export: fsync of ", path_, " failed: ", std::strerror(errno));
    const int fd = fd_;
    fd_ = -1;
    ST_CHECK(::close(fd) == 0, "export: closing ", path_, " failed: ", std::strerror(errno));
  }

  uint64_t written() const { return written_; }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t written_ = 0;
};

/// The safetensors header of a shard, from the index alone (offsets follow
/// from shapes and the export dtype), so the data can then be streamed.
std::string shard_header(const Shard& shard, at::ScalarType dtype) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  header["__metadata__"] = {{"format", "pt"}};  // what transformers expects
  const uint64_t element_size = at::elementSize(dtype);
  uint64_t offset = 0;
  for (const ParamEntry* param : shard.params) {
    const uint64_t nbytes = static_cast<uint64_t>(param->numel) * element_size;
    header[param->name] = {{"dtype", safetensors::dtype_name(dtype)},
                           {"shape", param->shape},
                           {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text = header.dump();
  // The data buffer starts 8-byte aligned, as the reference writer pads it.
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

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

void write_shard(const Index& index, const Shard& shard, const fs::path& path, at::ScalarType dtype,
                 std::map<std::string, std::unique_ptr<safetensors::Reader>>& readers) {
  const std::string header = shard_header(shard, dtype);
  OutFile out(path);
  const uint64_t header_len = header.size();
  out.write(&header_len, 8);  // little-endian host, as safetensors.cpp asserts
  out.write(header.data(), header.size());
  for (const ParamEntry* param : shard.params) {
    const at::Tensor full = assemble(index, *param, dtype, readers);
    out.write(full.data_ptr(), static_cast<uint64_t>(full.numel()) * full.element_size());
  }
  ST_CHECK(out.written() == 8 + header_len + shard.bytes, "export: ", path.string(), " has ", out.written(),
           " bytes, expected ", 8 + header_len + shard.bytes);
  out.finish();
}

void write_text_file(const fs::path& path, const std::string& text) {
  OutFile out(path);
  out.write(text.data(), text.size());
  out.finish();
}

/// Hugging Face weight files: what a fresh export replaces in `out_dir`.
bool is_weight_file(const std::string& name) {
  const std::string suffix = ".safetensors";
  if (name == "model.safetensors" || name == "model.safetensors.index.json") return true;
  return name.rfind("model-", 0) == 0 && name.size() > suffix.size() &&
         name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
         name.find("-of-") != std::string::npos;
}

/// Publishes the finished `tmp` as `out`. A new `out` is a single rename; into
/// an existing one (a model directory with tokenizer files, say) each file is
/// renamed in, and weight files of an earlier export that this one did not
/// write are removed, since a stale model.safetensors next to a new shard
/// index would be loaded instead of it.
void publish(const fs::path& tmp, const fs::path& out) {
  if (!fs::exists(out)) {
    fs::rename(tmp, out);
    return;
  }
  ST_CHECK(fs::is_directory(out), "export: ", out.string(), " exists and is not a directory");
  std::vector<std::string> produced;
  for (const auto& entry : fs::directory_iterator(tmp)) produced.push_back(entry.path().filename().string());
  for (const auto& entry : fs::directory_iterator(out)) {
    const std::string name = entry.path().filename().string();
    if (is_weight_file(name) && std::find(produced.begin(), produced.end(), name) == produced.end()) {
      fs::remove(entry.path());
    }
  }
  for (const auto& name : produced) fs::rename(tmp / name, out / name);
  fs::remove(tmp);
}

}  // namespace

VerifyReport verify(const std::string& path) {
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
  const at::ScalarType dtype = export_dtype(options.dtype);
  ST_CHECK(options.max_shard_bytes > 0, "export: max shard size must be positive");
  ST_CHECK(!out_dir.empty(), "export: no output directory given");

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
  if (!options.config_json_path.empty()) {
    // Parsed only to catch a wrong file early; it is copied byte for byte.
    std::ifstream in(options.config_json_path);
    ST_CHECK(in.good(), "export: config file ", options.config_json_path, " cannot be read");
    try {
      const json parsed = json::parse(in);
      ST_CHECK(parsed.is_object(), "export: config file ", options.config_json_path, " is not a JSON object");
    } catch (const json::exception& e) {
      ST_THROW(Error, "export: config file ", options.config_json_path, " is not valid JSON (", e.what(), ")");
    }
  }

  // Greedy packing in name order, as save_pretrained does: start a new shard
  // when the next tensor would push the current one past the limit.
  const uint64_t element_size = at::elementSize(dtype);
  std::vector<Shard> shards(1);
  uint64_t total_bytes = 0;
  for (const auto& param : index.params) {
    ST_CHECK(param.name != "__metadata__", "export: checkpoint ", index.dir.string(),
             ": a parameter named '__metadata__' cannot be stored in a safetensors file");
    const uint64_t nbytes = static_cast<uint64_t>(param.numel) * element_size;
    if (!shards.back().params.empty() && shards.back().bytes + nbytes > options.max_shard_bytes) {
      shards.emplace_back();
    }
    shards.back().params.push_back(&param);
    shards.back().bytes += nbytes;
    total_bytes += nbytes;
  }
  const std::size_t count = shards.size();
  for (std::size_t i = 0; i < count; ++i) {
    if (count == 1) {
      shards[i].file = "model.safetensors";
    } else {
      std::ostringstream name;
      name << "model-" << std::setw(5) << std::setfill('0') << (i + 1) << "-of-" << std::setw(5) << std::setfill('0')
           << count << ".safetensors";
      shards[i].file = name.str();
    }
  }

  fs::path out = fs::absolute(fs::path(out_dir)).lexically_normal();
  if (out.filename().empty()) out = out.parent_path();  // "dir/" names dir
  fs::create_directories(out.parent_path());
  const fs::path tmp = out.parent_path() / ("." + out.filename().string() + ".tmp-export-" + std::to_string(::getpid()));
  fs::remove_all(tmp);  // an export of this process killed earlier
  fs::create_directories(tmp);
  try {
    std::map<std::string, std::unique_ptr<safetensors::Reader>> readers;
    for (const auto& shard : shards) write_shard(index, shard, tmp / shard.file, dtype, readers);
    if (count > 1) {
      json weight_map = json::object();
      for (const auto& shard : shards)
        for (const ParamEntry* param : shard.params) weight_map[param->name] = shard.file;
      const json shard_index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
      write_text_file(tmp / "model.safetensors.index.json", shard_index.dump(2) + "\n");
    }
    if (!options.config_json_path.empty()) {
      fs::copy_file(options.config_json_path, tmp / "config.json", fs::copy_options::overwrite_existing);
    }
    publish(tmp, out);
  } catch (const fs::filesystem_error& e) {
    std::error_code ignored;
    fs::remove_all(tmp, ignored);  // leave no half-written export behind
    ST_THROW(Error, "export to ", out.string(), " failed: ", e.what());
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(tmp, ignored);
    throw;
  }
}

}  // namespace shardtrain::checkpoint
