#pragma once
// The checkpoint format, in one place: its layout on disk, the names in it
// (index.json, latest, the rank files, the slice keys), the index read into
// checked, typed values, and how `latest` and a checkpoint path resolve.
// Saving, loading and the offline tools (checkpoint.h, export.h) all name a
// checkpoint's parts through this module, so the format is decided here once.
//
//   DIR/latest                  the tag of the newest complete checkpoint (written last)
//   DIR/TAG/index.json          format version; per parameter its shape, dtype and which
//                               file holds which element range with which state kinds;
//                               per file its size and CRC-32; the training state; the
//                               resolved config and its precision plan; and a CRC-32 of
//                               each of those fields ("checksums"), so an index edited
//                               after the save is refused by the name of what changed
//   DIR/TAG/rankNNNNN.safetensors  one per writing rank: "<name>@<begin>/<kind>" tensors
//                               (kind: master, exp_avg, exp_avg_sq, momentum) and the rank's RNG
//   DIR/TAG/rankNNNNN.json      the rank's manifest (what the index is built from)
//
// Slices are keyed by parameter name and element range of the flattened
// parameter, so a load maps them onto whatever layout the loading run has:
// zero (per-parameter chunks) or fsdp (flat chunks), any world size.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace shardtrain::checkpoint {

/// The version save() writes: 2 adds the index's checksums ("checksums").
constexpr int kFormatVersion = 2;
/// The oldest version load() and the tools still read (1: no checksums, so
/// an edited index cannot be told from the original).
constexpr int kOldestReadableVersion = 1;
/// The first version whose index carries checksums.
constexpr int kFirstChecksummedVersion = 2;
/// load() and the tools read this version (kOldestReadableVersion..kFormatVersion).
constexpr bool readable_version(int version) {
  return version >= kOldestReadableVersion && version <= kFormatVersion;
}
/// "versions 1 and 2", for messages about a version this build cannot read.
std::string readable_versions();
/// DIR/TAG/<this>: the index of one checkpoint.
inline constexpr const char* kIndexFile = "index.json";
/// DIR/<this>: the tag of the newest complete checkpoint.
inline constexpr const char* kLatestFile = "latest";

/// "rank00003.safetensors" for rank_file(3, ".safetensors").
std::string rank_file(int rank, const char* extension);
/// The tensor name of one state kind of one slice: "<name>@<begin>/<kind>".
std::string slice_key(const std::string& name, int64_t begin, const std::string& kind);
/// A rank file's tensors of a custom optimizer's state
/// (engine::CustomOptimizerState): its archive, and the layout it was laid
/// over as UTF-8 bytes. Per rank, like the random streams.
inline constexpr const char* kCustomOptimizerKey = "optimizer/custom";
inline constexpr const char* kCustomOptimizerLayoutKey = "optimizer/custom_layout";

// ---- the index, as typed data ------------------------------------------------
// index.json is parsed once into these structs so every reader works on
// checked values instead of catching nlohmann type errors at each use.

struct SliceEntry {
  std::string file;
  int64_t begin = 0;
  int64_t length = 0;
  std::vector<std::string> kinds;

  bool has(const std::string& kind) const;
};

struct ParamEntry {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;  ///< c10 name of the master's dtype ("Float", "BFloat16")
  bool trainable = true;
  int64_t numel = 1;
  std::vector<SliceEntry> slices;
};

struct FileEntry {
  std::string name;
  uint64_t size = 0;
  uint32_t crc32 = 0;
  int rank = -1;
};

struct Index {
  std::filesystem::path dir;
  int format_version = 0;
  /// Its checksums were checked (format 2); false for a format-1 index.
  bool checksummed = false;
  std::string engine;
  int world_size = 0;
  nlohmann::json training_state;
  std::vector<ParamEntry> params;  ///< sorted by name (json objects are)
  std::vector<FileEntry> files;    ///< sorted by name
  std::map<std::string, std::size_t> file_position;
  std::map<std::string, std::size_t> param_position;

  /// The parameter `name`, or null when the index has none.
  const ParamEntry* param(const std::string& name) const;
};

/// Adds "checksums" to an index about to be written: a CRC-32 of the
/// canonical JSON of every field a resume or an export reads, one per
/// training-state key, parameter and file, so a mismatch names the field.
void seal_index(nlohmann::json& index);

/// Reads and checks DIR/TAG/index.json; throws shardtrain::Error naming the
/// file and the field when it is missing, not JSON, malformed, or (format 2)
/// edited after the save: a field whose checksum no longer matches, or one
/// added or removed.
Index read_index(const std::filesystem::path& dir);

/// "[2, 3]".
std::string shape_text(const std::vector<int64_t>& shape);
/// A file name from the index with no directory part: one with a directory
/// part could make the tools read (and report on) files outside the checkpoint.
bool plain_file_name(const std::string& name);

// ---- finding a checkpoint ------------------------------------------------------

/// `dir` holds an index.json: it is one checkpoint, DIR/TAG.
bool is_checkpoint(const std::filesystem::path& dir);
/// `dir` holds a `latest` file: it is a checkpoint root DIR.
bool has_latest(const std::filesystem::path& dir);
/// The tag DIR/latest names (throws naming the path when there is none).
std::string latest_tag(const std::string& dir);
/// `path` is either a checkpoint root DIR (then DIR/latest names the tag) or a
/// checkpoint directory DIR/TAG holding index.json. Returns DIR/TAG; throws
/// shardtrain::Error naming the path when it is neither.
std::string resolve_checkpoint_dir(const std::string& path);

}  // namespace shardtrain::checkpoint
