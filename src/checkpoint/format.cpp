// The checkpoint format's names, its typed index and the resolution of
// `latest` (see format.h).

#include "checkpoint/format.h"

#include <algorithm>
#include <fstream>
#include <iomanip>
#include <limits>
#include <sstream>
#include <system_error>

#include <zlib.h>

#include "json_depth.h"
#include "checkpoint/index_fields.h"
#include "shardtrain/checkpoint_location.h"
#include "shardtrain/error.h"

namespace shardtrain::checkpoint {
namespace fs = std::filesystem;
using nlohmann::json;

std::string rank_file(int rank, const char* extension) {
  std::ostringstream name;
  name << "rank" << std::setw(5) << std::setfill('0') << rank << extension;
  return name.str();
}

std::string slice_key(const std::string& name, int64_t begin, const std::string& kind) {
  return name + "@" + std::to_string(begin) + "/" + kind;
}

std::string readable_versions() {
  std::string text = kOldestReadableVersion == kFormatVersion ? "version " : "versions ";
  for (int v = kOldestReadableVersion; v <= kFormatVersion; ++v) {
    text += std::to_string(v) + (v + 1 < kFormatVersion ? ", " : v + 1 == kFormatVersion ? " and " : "");
  }
  return text;
}

namespace {

/// Field path -> CRC-32 of its canonical text (nlohmann's dump: keys sorted,
/// no spaces), for every field of `index` but the checksums themselves.
std::map<std::string, uint32_t> field_checksums(const json& index) {
  std::map<std::string, uint32_t> sums;
  auto add = [&](const std::string& path, const json& value) {
    const std::string text = value.dump();
    sums[path] = static_cast<uint32_t>(
        ::crc32(0L, reinterpret_cast<const Bytef*>(text.data()), static_cast<uInt>(text.size())));
  };
  for (const auto& [key, value] : index.items()) {
    if (key == "checksums") continue;
    // One checksum per entry of the containers, so a mismatch names the entry.
    if ((key == "training_state" || key == "params" || key == "files") && value.is_object()) {
      add(key, json(value.size()));  // an entry added or removed shows in the count as well as by name
      for (const auto& [name, entry] : value.items()) add(key + "." + name, entry);
    } else {
      add(key, value);
    }
  }
  return sums;
}

/// The fields of a format-2 index that differ from what its checksums say.
std::vector<std::string> edited_fields(const json& raw) {
  std::vector<std::string> edited;
  const auto found = raw.find("checksums");
  if (found == raw.end() || !found->is_object()) return {"checksums (missing)"};
  std::map<std::string, uint32_t> recorded;
  for (const auto& [path, value] : found->items()) {
    if (!value.is_number_unsigned()) return {"checksums." + path + " (not a checksum)"};
    recorded[path] = value.get<uint32_t>();
  }
  const std::map<std::string, uint32_t> computed = field_checksums(raw);
  for (const auto& [path, sum] : computed) {
    const auto it = recorded.find(path);
    if (it == recorded.end()) {
      edited.push_back(path + " (added)");
    } else if (it->second != sum) {
      edited.push_back(path);
    }
  }
  for (const auto& [path, sum] : recorded) {
    if (computed.count(path) == 0) edited.push_back(path + " (removed)");
  }
  return edited;
}

}  // namespace

void seal_index(json& index) {
  json sums = json::object();
  for (const auto& [path, sum] : field_checksums(index)) sums[path] = sum;
  index["checksums"] = std::move(sums);
}

bool SliceEntry::has(const std::string& kind) const {
  return std::find(kinds.begin(), kinds.end(), kind) != kinds.end();
}

const ParamEntry* Index::param(const std::string& name) const {
  const auto it = param_position.find(name);
  return it == param_position.end() ? nullptr : &params[it->second];
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

bool plain_file_name(const std::string& name) {
  return !name.empty() && name.find('/') == std::string::npos && name != "." && name != "..";
}

Index read_index(const fs::path& dir) {
  const fs::path index_path = dir / kIndexFile;
  std::ifstream in(index_path);
  ST_CHECK(in.good(), "checkpoint ", dir.string(), ": ", index_path.string(), " is missing");
  json raw;
  try {
    raw = parse_json_within_depth<Error, json>(in, "checkpoint " + dir.string() + ": " + index_path.string());
  } catch (const json::exception& e) {
    ST_THROW(Error, "checkpoint ", dir.string(), ": ", index_path.string(), " is not valid JSON (", e.what(),
             "); the checkpoint is damaged — load another tag");
  }
  Index index;
  index.dir = dir;
  std::string where = "the header";
  try {
    ST_CHECK(raw.is_object(), "checkpoint ", index_path.string(), " is not a JSON object");
    index.format_version = index_integer_or<int>(raw, "format_version", 0, "the header's");
    index.engine = raw.value("engine", std::string("?"));
    index.world_size = index_integer_or<int>(raw, "world_size", 0, "the header's");
    index.training_state = raw.value("training_state", json::object());
    // Another version's layout is not this one's: its header is all that can
    // be read, and the reader reports the version (load refuses it, verify
    // lists it) instead of a field that "is malformed".
    if (!readable_version(index.format_version)) return index;
    if (index.format_version >= kFirstChecksummedVersion) {
      const std::vector<std::string> edited = edited_fields(raw);
      std::string list;
      for (const auto& field : edited) list += (list.empty() ? "" : ", ") + field;
      ST_CHECK(edited.empty(), "checkpoint ", dir.string(), ": ", kIndexFile,
               " was edited after the save; these fields no longer match their checksums: ", list,
               ". A resume would continue the saved weights with the edited state, so the index is refused: "
               "restore the original ", kIndexFile, " or load another tag");
      index.checksummed = true;
    }
    where = "\"files\"";
    for (const auto& [name, meta] : raw.at("files").items()) {
      where = "file " + name;
      FileEntry file;
      file.name = name;
      file.size = index_integer<uint64_t>(meta.at("size"), where + " size");
      file.crc32 = index_integer<uint32_t>(meta.at("crc32"), where + " crc32");
      file.rank = index_integer_or<int>(meta, "rank", -1, where);
      index.file_position[name] = index.files.size();
      index.files.push_back(std::move(file));
    }
    where = "\"params\"";
    for (const auto& [name, meta] : raw.at("params").items()) {
      where = "parameter '" + name + "'";
      ParamEntry param;
      param.name = name;
      param.shape = index_shape(meta.at("shape"), where + " shape");
      param.dtype = meta.value("dtype", std::string());
      param.trainable = meta.value("trainable", true);
      for (int64_t extent : param.shape) {
        ST_CHECK(extent >= 0, "checkpoint ", index_path.string(), ": parameter '", name, "' has shape ",
                 shape_text(param.shape), " with a negative extent");
        ST_CHECK(extent == 0 || param.numel <= std::numeric_limits<int64_t>::max() / extent, "checkpoint ",
                 index_path.string(), ": parameter '", name, "' has shape ", shape_text(param.shape),
                 ", more elements than an int64 counts; the index is damaged");
        param.numel *= extent;
      }
      for (const auto& s : meta.at("slices")) {
        SliceEntry slice;
        slice.file = s.at("file").get<std::string>();
        slice.begin = index_integer<int64_t>(s.at("begin"), where + " slice begin");
        slice.length = index_integer<int64_t>(s.at("length"), where + " slice length");
        slice.kinds = s.at("kinds").get<std::vector<std::string>>();
        param.slices.push_back(std::move(slice));
      }
      index.param_position[name] = index.params.size();
      index.params.push_back(std::move(param));
    }
  } catch (const json::exception& e) {
    ST_THROW(Error, "checkpoint ", index_path.string(), ": ", where, " is malformed (", e.what(),
             "); the index is damaged");
  }
  return index;
}

bool is_checkpoint(const fs::path& dir) {
  std::error_code ec;
  return fs::is_regular_file(dir / kIndexFile, ec);
}

bool has_latest(const fs::path& dir) {
  std::error_code ec;
  return fs::is_regular_file(dir / kLatestFile, ec);
}

std::string latest_tag(const std::string& dir) {
  const fs::path latest = fs::path(dir) / kLatestFile;
  std::ifstream in(latest);
  ST_CHECK(in.good(), "no checkpoint in ", dir, ": ", latest.string(),
           " does not exist (save_state writes it); pass the tag to load explicitly (",
           describe_checkpoints_under(dir), ")");
  std::string tag;
  std::getline(in, tag);
  ST_CHECK(!tag.empty(), "checkpoint: ", latest.string(), " is empty");
  return tag;
}

std::string resolve_checkpoint_dir(const std::string& path) {
  const fs::path p(path);
  ST_CHECK(fs::exists(p), "checkpoint path ", path, " does not exist");
  if (fs::is_regular_file(p / kIndexFile)) return p.string();
  if (fs::exists(p / kLatestFile)) {
    const std::string tag = latest_tag(path);
    const fs::path dir = p / tag;
    ST_CHECK(fs::is_regular_file(dir / kIndexFile), "checkpoint ", path, ": latest names tag '", tag, "' but ",
             (dir / kIndexFile).string(), " does not exist");
    return dir.string();
  }
  ST_THROW(Error, "checkpoint path ", path,
           " is not a checkpoint: it has neither index.json (a DIR/TAG) nor latest (a checkpoint DIR)");
}

}  // namespace shardtrain::checkpoint
