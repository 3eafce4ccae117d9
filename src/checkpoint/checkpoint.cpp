// Saving and loading checkpoints collectively: the staged write, fsync and
// rename, `latest`, the kept history, and reading back under any engine and
// world size (checkpoint.h).
#include "checkpoint/checkpoint.h"
#include "json_depth.h"
#include "shardtrain/checkpoint_location.h"

#include <functional>
#include <optional>
#include <cerrno>
#include <cstring>
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "checkpoint/durable_file.h"
#include "comm/failure_agreement.h"
#include "shardtrain/error.h"
#include "shardtrain/lora.h"
#include "shardtrain/logging.h"
#include "shardtrain/safetensors.h"

namespace shardtrain::checkpoint {
namespace fs = std::filesystem;

namespace {

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  ST_CHECK(in.good(), "checkpoint: ", path.string(), " is missing");
  try {
    return parse_json_within_depth<Error, nlohmann::json>(in, "checkpoint: " + path.string());
  } catch (const nlohmann::json::exception& e) {
    ST_THROW(Error, "checkpoint: ", path.string(), " is not valid JSON (", e.what(),
             "); the checkpoint is damaged — load another tag");
  }
}

/// Fault-injection for the crash-safety tests: SHARDTRAIN_CHECKPOINT_KILL_AT=<point>
/// makes rank 0 die by SIGKILL at that point of a save, as a crash would.
void crash_point(int rank, const char* point) {
  const char* wanted = std::getenv("SHARDTRAIN_CHECKPOINT_KILL_AT");
  if (rank == 0 && wanted != nullptr && std::string(wanted) == point) ::raise(SIGKILL);
}

/// Published checkpoints in save order (the history file lists them).
std::vector<std::string> read_history(const fs::path& root) {
  std::vector<std::string> tags;
  std::ifstream in(root / "history");
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) tags.push_back(line);
  }
  return tags;
}

/// Fault injection for the failed-save tests (see checkpoint.h):
/// SHARDTRAIN_CHECKPOINT_FAIL_AT=<phase>[:<rank>[:<errno>]].
void injected_failure(int rank, const char* phase, const std::string& path) {
  const char* spec = std::getenv("SHARDTRAIN_CHECKPOINT_FAIL_AT");
  if (spec == nullptr) return;
  std::string text(spec), wanted_phase = text, rank_text = "0", errno_text;
  if (auto colon = text.find(':'); colon != std::string::npos) {
    wanted_phase = text.substr(0, colon);
    rank_text = text.substr(colon + 1);
    if (auto second = rank_text.find(':'); second != std::string::npos) {
      errno_text = rank_text.substr(second + 1);
      rank_text = rank_text.substr(0, second);
    }
  }
  if (wanted_phase != phase || std::atoi(rank_text.c_str()) != rank) return;
  const int code = errno_text.empty() ? EIO : std::atoi(errno_text.c_str());
  ST_THROW(Error, "writing '", path, "' failed: ", std::strerror(code), " (injected by SHARDTRAIN_CHECKPOINT_FAIL_AT)");
}

/// What `latest` names now, for the error message.
std::string latest_or_none(const fs::path& root) {
  std::ifstream in(root / kLatestFile);
  std::string tag;
  if (!in.good() || !std::getline(in, tag) || tag.empty()) return "none yet";
  return tag;
}

/// How far rank 0's publishing got, so a failed save can be undone exactly.
struct PublishProgress {
  bool moved_aside = false;  ///< an older checkpoint of the same tag went to .old-TAG
  bool renamed = false;      ///< .tmp-TAG became TAG
};

/// Rank 0, after a failed save: removes everything the save wrote (nothing
/// it did not write: an older checkpoint of the same tag is put back) while
/// `latest` still names the previous checkpoint. Best effort: a cleanup that
/// fails itself is logged, and the original error is what the caller reports.
void discard_unpublished(const fs::path& root, const std::string& tag, const PublishProgress& progress) {
  std::error_code ec;
  fs::remove_all(root / (".tmp-" + tag), ec);
  fs::remove(root / "latest.tmp", ec);
  fs::remove(root / "history.tmp", ec);
  const fs::path final_dir = root / tag;
  if (progress.renamed) fs::remove_all(final_dir, ec);
  if (progress.moved_aside) fs::rename(root / (".old-" + tag), final_dir, ec);
  if (ec) ST_LOG_WARN("checkpoint: cleaning up the failed save of {} in {}: {}", tag, root.string(), ec.message());
}

/// The random streams a rank's file keeps, by key: the CPU's, and on a GPU the
/// GPU's too (LoRA dropout on CUDA tensors draws from it). A resume on another
/// kind of device restores those it shares with the saving run.
std::vector<std::pair<std::string, at::Generator>> random_streams(const comm::Communicator& comm) {
  std::vector<std::pair<std::string, at::Generator>> streams = {{"rng/cpu", at::detail::getDefaultCPUGenerator()}};
  if (comm.device().is_cuda()) streams.emplace_back("rng/cuda", at::globalContext().defaultGenerator(comm.device()));
  return streams;
}

/// `text` (any bytes) as a uint8 tensor, and back: how a rank file holds a string.
at::Tensor text_bytes(const std::string& text) {
  at::Tensor bytes = at::empty({static_cast<int64_t>(text.size())}, at::TensorOptions().dtype(at::kByte));
  if (!text.empty()) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  return bytes;
}

std::string bytes_text(const at::Tensor& bytes) {
  const at::Tensor flat = bytes.to(at::kCPU).contiguous();
  return std::string(static_cast<const char*>(flat.data_ptr()), static_cast<std::size_t>(flat.numel()));
}

/// A custom optimizer's state loads, before the model, where every rank
/// holds the same elements in the same places as the rank that saved its file
/// (the same layout: Engine::custom_optimizer_layout), and then on every
/// rank. It cannot be resharded, so where any rank's layout differs or its
/// file is missing (more ranks than saved it: replicas included, which must
/// step alike) it loads nowhere, and the custom optimizer starts fresh with
/// a warning while the model and the rest load. A state that does not load
/// (another optimizer type) stops every rank.
template <typename Reader>
void load_custom_optimizer(engine::Engine& engine, comm::Communicator& comm, const Index& index,
                           const fs::path& ckpt, Reader& reader) {
  const std::string own = rank_file(comm.rank(), ".safetensors");
  auto saved_on = [&](const std::string& file) {
    return index.file_position.count(file) > 0 && reader(file).contains(kCustomOptimizerKey);
  };
  // Every rank has a custom optimizer or none (one config): no collective without one.
  const std::string layout = engine.custom_optimizer_layout();
  if (layout.empty()) {
    try {
      if (comm.rank() == 0 && saved_on(own)) {
        ST_LOG_WARN("checkpoint {} holds a custom optimizer's state; this run has no custom optimizer, so it is "
                    "not loaded", ckpt.string());
      }
    } catch (const std::exception&) {
      // Only a warning: the slices' load reports a file it cannot read.
    }
    return;
  }
  std::string why_not;
  if (auto failed = agree_on_failure(comm, true, [&] {
        if (!saved_on(own)) {
          why_not = "it holds no custom optimizer state for rank " + std::to_string(comm.rank());
        } else if (!reader(own).contains(kCustomOptimizerLayoutKey) ||
                   bytes_text(reader(own).read(kCustomOptimizerLayoutKey)) != layout) {
          why_not = "rank " + std::to_string(comm.rank()) + "'s custom optimizer state was saved over another layout";
        }
      })) {
    ST_THROW(Error, "checkpoint ", ckpt.string(), ": reading the custom optimizer's state failed (", *failed,
             "); nothing was loaded");
  }
  if (!comm::all_ranks(comm, why_not.empty())) {
    if (comm.rank() == 0 || !why_not.empty()) {
      ST_LOG_WARN("checkpoint {}: {}; the custom optimizer starts with a fresh state on every rank (momentum and "
                  "moments restart) while the model and the training state load. Its state is per rank and cannot "
                  "be resharded: resume at world size {} with the wrapping it was saved with to continue it",
                  ckpt.string(), why_not.empty() ? "another rank cannot load its part" : why_not, index.world_size);
    }
    return;
  }
  if (auto failed = agree_on_failure(comm, true, [&] {
        engine.load_custom_optimizer_state(bytes_text(reader(own).read(kCustomOptimizerKey)));
      })) {
    ST_THROW(Error, "checkpoint ", ckpt.string(), ": the custom optimizer's state does not load into this run's "
             "custom optimizer (", *failed, "); the model was not loaded. Resume with the custom optimizer it was "
             "saved with");
  }
}

}  // namespace

std::string save(engine::Engine& engine, comm::Communicator& comm, const std::string& dir,
                 const std::string& tag, const nlohmann::json& training_state, const std::string& config_yaml,
                 const std::string& precision_plan, int keep_last) {
  ST_CHECK(!tag.empty() && tag.find('/') == std::string::npos && tag[0] != '.', "checkpoint tag '", tag,
           "' must be a plain directory name");
  const int rank = comm.rank();
  const fs::path root(dir);
  const fs::path final_dir = root / tag;
  const fs::path tmp = root / (".tmp-" + tag);
  const fs::path old = root / (".old-" + tag);

  // Every failure below is agreed on by all ranks before anyone acts on it,
  // then cleaned up by rank 0 and thrown everywhere.
  PublishProgress progress;
  auto fail = [&](const std::string& reason) {
    if (rank == 0) discard_unpublished(root, tag, progress);
    comm.barrier();
    ST_THROW(CheckpointSaveError, "checkpoint save of '", tag, "' in ", dir, " failed: ", reason,
             ". The partial save was removed; the previous checkpoint (latest: ", latest_or_none(root),
             ") is intact and training state is unchanged");
  };

  if (auto failed = agree_on_failure(comm, rank == 0, [&] {
        fs::create_directories(root);
        fs::remove_all(tmp);  // a save killed earlier
        fs::create_directories(tmp);
      })) {
    fail(*failed);
  }

  nlohmann::json slices = nlohmann::json::array();
  if (auto failed = agree_on_failure(comm, true, [&] {
        std::vector<std::pair<std::string, at::Tensor>> tensors;
        for (const auto& slice : engine.checkpoint_slices()) {
          nlohmann::json kinds = nlohmann::json::array();
          std::string dtype;
          for (const auto& [kind, value] : slice.state) {
            // The views themselves: write_file brings each down to the host as it
            // writes it, so a GPU rank never holds its whole shard in host memory.
            tensors.emplace_back(slice_key(slice.name, slice.begin, kind), value);
            kinds.push_back(kind);
            if (kind == "master") dtype = c10::toString(value.scalar_type());
          }
          slices.push_back({{"name", slice.name}, {"shape", slice.shape}, {"trainable", slice.trainable},
                            {"begin", slice.begin}, {"length", slice.length}, {"kinds", kinds}, {"dtype", dtype}});
        }
        // Per-rank RNG, so a resume at the same world size continues the same random streams.
        for (auto& [key, generator] : random_streams(comm)) {
          std::lock_guard<std::mutex> lock(generator.mutex());
          tensors.emplace_back(key, generator.get_state());
        }
        if (auto custom = engine.custom_optimizer_state()) {
          tensors.emplace_back(kCustomOptimizerKey, text_bytes(custom->archive));
          tensors.emplace_back(kCustomOptimizerLayoutKey, text_bytes(custom->layout));
        }
        const std::string file = rank_file(rank, ".safetensors");
        injected_failure(rank, "rank_file", (tmp / file).string());
        safetensors::write_file((tmp / file).string(), tensors,
                                {{"format", "shardtrain-checkpoint"}, {"rank", std::to_string(rank)}});
        nlohmann::json manifest = {{"file", file},
                                   {"rank", rank},
                                   {"size", fs::file_size(tmp / file)},
                                   {"crc32", safetensors::crc32_of_file((tmp / file).string())},
                                   {"slices", slices}};
        injected_failure(rank, "rank_manifest", (tmp / rank_file(rank, ".json")).string());
        write_durable_text(tmp / rank_file(rank, ".json"), manifest.dump(), "checkpoint");
        crash_point(rank, "after_rank_files");
      })) {
    fail(*failed);
  }

  if (auto failed = agree_on_failure(comm, rank == 0, [&] {
        nlohmann::json index = {{"format_version", kFormatVersion},
                                {"engine", engine.name()},
                                {"world_size", comm.world_size()},
                                {"training_state", training_state},
                                {"config", config_yaml},
                                {"precision_plan", precision_plan}};
        nlohmann::json params = nlohmann::json::object();
        nlohmann::json files = nlohmann::json::object();
        for (int r = 0; r < comm.world_size(); ++r) {
          const nlohmann::json m = read_json(tmp / rank_file(r, ".json"));
          files[m["file"].get<std::string>()] = {{"size", m["size"]}, {"crc32", m["crc32"]}, {"rank", r}};
          for (const auto& slice : m["slices"]) {
            auto& p = params[slice["name"].get<std::string>()];
            p["shape"] = slice["shape"];
            p["dtype"] = slice["dtype"];
            p["trainable"] = slice["trainable"];
            p["slices"].push_back(
                {{"file", m["file"]}, {"begin", slice["begin"]}, {"length", slice["length"]}, {"kinds", slice["kinds"]}});
          }
        }
        index["params"] = params;
        index["files"] = files;
        seal_index(index);
        injected_failure(rank, "index", (tmp / kIndexFile).string());
        write_durable_text(tmp / kIndexFile, index.dump(1), "checkpoint");
        sync_directory(tmp, "checkpoint");
        crash_point(rank, "after_index");
        // Publish: the new directory first, `latest` last. A checkpoint of the
        // same tag waits in .old-TAG until `latest` is written, so a failure
        // in between can put it back.
        fs::remove_all(old);
        if (fs::exists(final_dir)) {
          fs::rename(final_dir, old);
          progress.moved_aside = true;
        }
        fs::rename(tmp, final_dir);
        progress.renamed = true;
        sync_directory(root, "checkpoint");
        crash_point(rank, "after_rename");
        injected_failure(rank, "latest", (root / "latest.tmp").string());
        write_durable_text(root / "latest.tmp", tag + "\n", "checkpoint");
        crash_point(rank, "before_latest_rename");
        fs::rename(root / "latest.tmp", root / kLatestFile);
        sync_directory(root, "checkpoint");
      })) {
    fail(*failed);
  }

  // Housekeeping after publishing: a failure here leaves a complete, published
  // checkpoint, so it warns instead of failing the save.
  if (rank == 0) {
    try {
      fs::remove_all(old);
      // Keep-last-N (Accelerate's total_limit): oldest first, never the one just written.
      std::vector<std::string> history = read_history(root);
      history.erase(std::remove(history.begin(), history.end(), tag), history.end());
      history.push_back(tag);
      while (keep_last > 0 && static_cast<int>(history.size()) > keep_last) {
        fs::remove_all(root / history.front());
        history.erase(history.begin());
      }
      std::string lines;
      for (const auto& t : history) lines += t + "\n";
      write_durable_text(root / "history.tmp", lines, "checkpoint");
      fs::rename(root / "history.tmp", root / "history");
    } catch (const std::exception& e) {
      ST_LOG_WARN("checkpoint {} was saved, but updating {}/history (keep_last) failed: {}", tag, dir, e.what());
    }
  }
  comm.barrier();
  return final_dir.string();
}

namespace {

/// "PATH" of "PATH.lora_A.weight" / "PATH.lora_B.weight" / "PATH.weight" when
/// PATH is a layer being merged; which of the three it is in `part`.
std::optional<std::string> merged_layer_of(const ExportSelection& selection, const std::string& name, int& part) {
  static const std::string kSuffixes[3] = {".weight", ".lora_A.weight", ".lora_B.weight"};
  for (int i = 2; i >= 0; --i) {  // the longer suffixes first: "x.lora_A.weight" also ends in ".weight"
    const std::string& suffix = kSuffixes[i];
    if (name.size() <= suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    const std::string path = name.substr(0, name.size() - suffix.size());
    if (selection.merge_lora.count(path)) {
      part = i;
      return path;
    }
  }
  return std::nullopt;
}

/// A LoRA layer's three tensors until the last of them arrives.
struct PendingMerge {
  at::Tensor parts[3];
  int seen = 0;
};

}  // namespace

void save_model(engine::Engine& engine, comm::Communicator& comm, const std::string& out_dir,
                const ExportOptions& options, const ExportSelection& selection) {
  // The file's tensors in the order they are completed while visiting: a
  // merged weight when the last of its three parts (weight, lora_A, lora_B)
  // has been visited, which every rank computes alike from parameter_shapes.
  std::vector<ExportTensor> planned;
  {
    std::map<std::string, int> parts_seen;
    std::map<std::string, std::vector<int64_t>> base_shape;
    for (auto& [name, shape] : engine.parameter_shapes()) {
      int part = 0;
      if (auto layer = merged_layer_of(selection, name, part)) {
        if (part == 0) base_shape[*layer] = shape;
        if (++parts_seen[*layer] == 3) planned.push_back({*layer + ".weight", base_shape.at(*layer)});
        continue;
      }
      if (selection.include && !selection.include(name)) continue;
      planned.push_back({selection.rename ? selection.rename(name) : name, shape});
    }
    for (const auto& [layer, scaling] : selection.merge_lora) {
      ST_CHECK(parts_seen[layer] == 3, "save_model: the LoRA layer ", layer,
               " to merge does not have its weight, lora_A and lora_B among the model's parameters");
    }
  }
  std::unique_ptr<HfWeightsWriter> writer;
  std::string failure;  // rank 0's first error; it keeps gathering so no rank waits for it
  auto attempt = [&](const std::function<void()>& body) {
    if (!failure.empty()) return;
    try {
      body();
    } catch (const std::exception& e) {
      failure = e.what();
      writer.reset();  // removes the partial export
    }
  };
  const bool writes = comm.rank() == 0;
  if (writes) attempt([&] { writer = std::make_unique<HfWeightsWriter>(planned, out_dir, options); });
  std::map<std::string, PendingMerge> pending;
  engine.visit_full_parameters([&](const std::string& name, const at::Tensor& value) {
    if (!writer) return;
    int part = 0;
    if (auto layer = merged_layer_of(selection, name, part)) {
      // Inside attempt: a failure here (memory, a shape) must not leave the
      // other ranks gathering alone.
      attempt([&] {
        PendingMerge& merge = pending[*layer];
        merge.parts[part] = value.clone();  // the visitor's tensor is reused for the next parameter
        if (++merge.seen < 3) return;
        const at::Tensor merged =
            merged_lora_weight(merge.parts[0], merge.parts[1], merge.parts[2], selection.merge_lora.at(*layer));
        pending.erase(*layer);
        writer->write(*layer + ".weight", merged);
      });
      return;
    }
    if (selection.include && !selection.include(name)) return;
    attempt([&] { writer->write(selection.rename ? selection.rename(name) : name, value); });
  });
  if (auto failed = agree_on_failure(comm, writes, [&] {
        if (!failure.empty()) throw Error(failure);
        writer->finish();
      })) {
    writer.reset();
    ST_THROW(CheckpointSaveError, "save_model to ", out_dir, " failed on ", *failed,
             ". The partial export was removed; the model and its training state are unchanged");
  }
}

nlohmann::json load(engine::Engine& engine, comm::Communicator& comm, const std::string& dir,
                    const std::string& tag_or_empty) {
  // Damage is found before anything is loaded: no partial load. Every rank
  // runs the checks and all agree on the outcome: on file systems that differ
  // between machines, or with a mismatch in one rank's part, a rank that
  // stopped alone would leave the others waiting in the next collective.
  fs::path ckpt;
  Index index;
  if (auto failed = agree_on_failure(comm, true, [&] {
        ckpt = fs::path(dir) / (tag_or_empty.empty() ? latest_tag(dir) : tag_or_empty);
        ST_CHECK(fs::is_directory(ckpt), "checkpoint ", ckpt.string(), " does not exist (",
                 describe_checkpoints_under(dir), ")");
        index = read_index(ckpt);
        ST_CHECK(readable_version(index.format_version), "checkpoint ", ckpt.string(), " has format version ",
                 index.format_version, "; this shardtrain reads ", readable_versions());
        // Every file's name and size on every rank (cheap)...
        for (const FileEntry& file : index.files) {
          const fs::path path = ckpt / file.name;
          ST_CHECK(plain_file_name(file.name), "checkpoint ", ckpt.string(), ": the index lists file '", file.name,
                   "', which is not a plain file name inside the checkpoint; the index is damaged");
          ST_CHECK(fs::exists(path), "checkpoint ", ckpt.string(), ": file ", file.name, " (rank ", file.rank,
                   ") is missing");
          const auto size = fs::file_size(path);
          ST_CHECK(size == file.size, "checkpoint ", ckpt.string(), ": file ", file.name, " has ", size,
                   " bytes but the index says ", file.size, " (truncated or replaced)");
        }
        // ...the CRC-32, which reads the whole file, each file's once across
        // the job, the ranks in turn: W ranks reading every file would read
        // the checkpoint W times from a shared file system...
        for (std::size_t k = static_cast<std::size_t>(comm.rank()); k < index.files.size();
             k += static_cast<std::size_t>(comm.world_size())) {
          const FileEntry& file = index.files[k];
          ST_CHECK(safetensors::crc32_of_file((ckpt / file.name).string()) == file.crc32, "checkpoint ",
                   ckpt.string(), ": file ", file.name, " fails its CRC-32 check (its bytes were altered)");
        }
        // ...and the shapes of the parameters this rank holds slices of (a
        // replica none, a ZeRO-3 rank its own).
        std::map<std::string, std::vector<int64_t>> model_shapes;
        for (const auto& slice : engine.checkpoint_slices()) model_shapes[slice.name] = slice.shape;
        for (const auto& [name, shape] : model_shapes) {
          const ParamEntry* param = index.param(name);
          ST_CHECK(param != nullptr, "checkpoint ", ckpt.string(), " has no parameter '", name,
                   "' that the model has: it was saved from a different model");
          ST_CHECK(param->shape == shape, "checkpoint ", ckpt.string(), ": parameter '", name, "' has shape ",
                   nlohmann::json(param->shape).dump(), " but the model's is ", nlohmann::json(shape).dump());
        }
      })) {
    ST_THROW(Error, *failed, "; nothing was loaded");
  }
  if (!index.checksummed && comm.rank() == 0) {
    ST_LOG_WARN("checkpoint {} has format version {}, written before the index had checksums: an edit to its "
                "training state cannot be detected. Save it again to get a checked index", ckpt.string(),
                index.format_version);
  }

  std::map<std::string, std::unique_ptr<safetensors::Reader>> readers;
  auto reader = [&](const std::string& file) -> safetensors::Reader& {
    auto& slot = readers[file];
    if (!slot) slot = std::make_unique<safetensors::Reader>((ckpt / file).string());
    return *slot;
  };
  // Same world size: each rank continues its random streams. Read, and tried
  // on a copy of each generator, before anything loads; set after. Agreed on,
  // so a bad one stops every rank before the model changes.
  std::vector<std::pair<at::Generator, at::Tensor>> streams_to_restore;
  if (index.world_size == comm.world_size()) {
    const std::string own = rank_file(comm.rank(), ".safetensors");
    if (auto failed = agree_on_failure(comm, true, [&] {
          for (auto& [key, generator] : random_streams(comm)) {
            if (index.file_position.count(own) == 0 || !reader(own).contains(key)) continue;
            at::Tensor state = reader(own).read(key);
            at::Generator trial = generator.clone();
            trial.set_state(state);  // throws where the state does not fit this generator
            streams_to_restore.emplace_back(generator, std::move(state));
          }
        })) {
      ST_THROW(Error, "checkpoint ", ckpt.string(), ": a random-number state cannot be restored (", *failed,
               "); nothing was loaded");
    }
  } else if (comm.rank() == 0) {
    // Rank r's stream has no counterpart at another world size, so none is
    // restored. (Accelerate's load_state restores rank r's file where one
    // exists and skips the rest.)
    ST_LOG_WARN("checkpoint {}: random-number states are kept per rank and restored only at the world size that "
                "saved them ({}); at world {} each rank goes on with its own stream, so dropout and any other "
                "random draw differ from an uninterrupted run",
                ckpt.string(), index.world_size, comm.world_size());
  }
  load_custom_optimizer(engine, comm, index, ckpt, reader);
  auto slice_source = [&](const std::string& name, const std::string& kind, int64_t begin, int64_t length) {
    const ParamEntry* param = index.param(name);
    ST_CHECK(param != nullptr, "checkpoint ", ckpt.string(), " has no parameter '", name, "'");
    at::Tensor result;
    int64_t covered = 0;
    for (const SliceEntry& s : param->slices) {
      ST_CHECK(s.begin >= 0 && s.length >= 0 && s.begin <= std::numeric_limits<int64_t>::max() - s.length,
               "checkpoint ", ckpt.string(), ": parameter ", name, " has a slice [", s.begin, ", +", s.length,
               ") out of range; the index is damaged");
      const int64_t s_end = s.begin + s.length;
      const int64_t lo = std::max(begin, s.begin);
      const int64_t hi = std::min(begin + length, s_end);
      if (lo >= hi) continue;
      ST_CHECK(s.has(kind), "checkpoint ", ckpt.string(), " holds no '", kind, "' for '", name,
               "': it was saved with a different optimizer");
      ST_CHECK(plain_file_name(s.file), "checkpoint ", ckpt.string(), ": parameter '", name, "' names file '",
               s.file, "', which is not a plain file name inside the checkpoint; the index is damaged");
      at::Tensor part = reader(s.file).read_slice(slice_key(name, s.begin, kind), lo - s.begin, hi - lo);
      if (!result.defined()) result = at::empty({length}, part.options());
      result.narrow(0, lo - begin, hi - lo).copy_(part);
      covered += hi - lo;
    }
    ST_CHECK(covered == length, "checkpoint ", ckpt.string(), ": parameter '", name, "' elements [", begin, ", ",
             begin + length, ") are not all in the checkpoint (", covered, " found): its index is damaged");
    return result;
  };
  // A slice only some ranks read (a damaged range, a kind missing from one
  // file) stops every rank: all agree before any gathers again.
  std::optional<at::ScalarType> rounded_to;
  const std::optional<std::string> slices_failed =
      agree_on_failure(comm, true, [&] { rounded_to = engine.load_slices(slice_source); });
  // Every rank, loaded or not: the parameters view the shards again.
  engine.regather_after_load();
  if (slices_failed) {
    ST_THROW(Error, *slices_failed, "; the model's state is now partly the checkpoint's: load a checkpoint "
             "again before training on");
  }
  // Every rank's slices count, so the ranks agree on the dtype (+1: 0 is "none").
  at::Tensor rounded = at::full({1}, rounded_to ? static_cast<int64_t>(*rounded_to) + 1 : 0,
                                at::TensorOptions().dtype(at::kLong).device(comm.device()));
  comm.all_reduce(rounded, comm::ReduceOp::kMax);
  const int64_t rounded_code = rounded.item<int64_t>();
  if (rounded_code > 0 && comm.rank() == 0) {
    const auto dtype = static_cast<at::ScalarType>(rounded_code - 1);
    ST_LOG_WARN("checkpoint {}: values this run holds in {} alone (pure low precision's parameters and optimizer "
                "state, frozen weights without an fp32 copy) were rounded to {} as they loaded; saving now writes "
                "the rounded values",
                ckpt.string(), c10::toString(dtype), c10::toString(dtype));
  }
  for (auto& [generator, state] : streams_to_restore) {
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(state);
  }
  comm.barrier();
  return index.training_state;
}

}  // namespace shardtrain::checkpoint
