// Writing a Hugging Face weights directory tensor by tensor (see hf_writer.h).

#include "checkpoint/hf_writer.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iomanip>
#include <sstream>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "checkpoint/durable_file.h"
#include "json_depth.h"
#include "shardtrain/error.h"
#include "shardtrain/safetensors.h"

namespace shardtrain::checkpoint {
namespace fs = std::filesystem;
using nlohmann::json;

/// One output file: which tensors it holds (indices into the plan), in order.
struct HfWeightsWriter::Shard {
  std::string file;
  std::vector<std::size_t> tensors;
  uint64_t bytes = 0;        ///< tensor data
  std::string header;        ///< the safetensors header, padded
};

namespace {

at::ScalarType export_dtype(const std::string& name) {
  if (name == "fp32" || name == "float32" || name == "f32") return at::kFloat;
  if (name == "bf16" || name == "bfloat16") return at::kBFloat16;
  if (name == "fp16" || name == "float16") return at::kHalf;
  ST_THROW(Error, "export: dtype '", name, "' is not supported; use fp32, bf16 or fp16");
}

/// The model config as the export writes it: the dtype transformers reads
/// (torch_dtype before 5.0, dtype from 5.0, which wins when both are there)
/// is the weights' dtype, so from_pretrained's default loads them unconverted.
std::string config_with_dtype(const std::string& path, at::ScalarType dtype) {
  std::ifstream in(path);
  ST_CHECK(in.good(), "export: config file ", path, " cannot be read");
  json config;
  try {
    config = parse_json_within_depth<Error, json>(in, "export: config file " + path);
  } catch (const json::exception& e) {
    ST_THROW(Error, "export: config file ", path, " is not valid JSON (", e.what(), ")");
  }
  ST_CHECK(config.is_object(), "export: config file ", path, " is not a JSON object");
  const char* name = dtype == at::kFloat ? "float32" : dtype == at::kBFloat16 ? "bfloat16" : "float16";
  if (config.contains("dtype")) config["dtype"] = name;
  if (config.contains("torch_dtype") || !config.contains("dtype")) config["torch_dtype"] = name;
  return config.dump(2) + "\n";
}


int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t extent : shape) n *= extent;
  return n;
}

/// The safetensors header of a shard, from the shapes alone (offsets follow
/// from them and the export dtype), so the data can then be streamed.
std::string shard_header(const std::vector<ExportTensor>& tensors, const std::vector<std::size_t>& members,
                         at::ScalarType dtype) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  header["__metadata__"] = {{"format", "pt"}};  // what transformers expects
  const uint64_t element_size = at::elementSize(dtype);
  uint64_t offset = 0;
  for (std::size_t i : members) {
    const uint64_t nbytes = static_cast<uint64_t>(numel_of(tensors[i].shape)) * element_size;
    header[tensors[i].name] = {{"dtype", safetensors::dtype_name(dtype)},
                               {"shape", tensors[i].shape},
                               {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text = header.dump();
  // The data buffer starts 8-byte aligned, as the reference writer pads it.
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
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
    sync_directory(out.parent_path().empty() ? fs::path(".") : out.parent_path(), "export");
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
  sync_directory(out, "export");
  fs::remove(tmp);
}


}  // namespace

HfWeightsWriter::HfWeightsWriter(std::vector<ExportTensor> tensors, const std::string& out_dir,
                                 const ExportOptions& options)
    : tensors_(std::move(tensors)), dtype_(export_dtype(options.dtype)), options_(options) {
  ST_CHECK(options.max_shard_bytes > 0, "export: max shard size must be positive");
  ST_CHECK(!out_dir.empty(), "export: no output directory given");
  ST_CHECK(!tensors_.empty(), "export: there are no parameters to export");
  if (!options.config_json_path.empty()) config_text_ = config_with_dtype(options.config_json_path, dtype_);
  // Greedy packing in the given order, as save_pretrained does: start a new
  // shard when the next tensor would push the current one past the limit.
  const uint64_t element_size = at::elementSize(dtype_);
  shards_.resize(1);
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    ST_CHECK(tensors_[i].name != "__metadata__",
             "export: a parameter named '__metadata__' cannot be stored in a safetensors file");
    const uint64_t nbytes = static_cast<uint64_t>(numel_of(tensors_[i].shape)) * element_size;
    if (!shards_.back().tensors.empty() && shards_.back().bytes + nbytes > options.max_shard_bytes) {
      shards_.emplace_back();
    }
    shards_.back().tensors.push_back(i);
    shards_.back().bytes += nbytes;
  }
  const std::size_t count = shards_.size();
  for (std::size_t i = 0; i < count; ++i) {
    if (count == 1) {
      shards_[i].file = options.weights_stem + ".safetensors";
    } else {
      std::ostringstream name;
      name << options.weights_stem << "-" << std::setw(5) << std::setfill('0') << (i + 1) << "-of-" << std::setw(5)
           << std::setfill('0') << count << ".safetensors";
      shards_[i].file = name.str();
    }
    shards_[i].header = shard_header(tensors_, shards_[i].tensors, dtype_);
  }
  out_ = fs::absolute(fs::path(out_dir)).lexically_normal();
  if (out_.filename().empty()) out_ = out_.parent_path();  // "dir/" names dir
  try {
    fs::create_directories(out_.parent_path());
    tmp_ = out_.parent_path() / ("." + out_.filename().string() + ".tmp-export-" + std::to_string(::getpid()));
    fs::remove_all(tmp_);  // an export of this process killed earlier
    fs::create_directories(tmp_);
  } catch (const fs::filesystem_error& e) {
    ST_THROW(Error, "export to ", out_.string(), " failed: ", e.what());
  }
}

HfWeightsWriter::~HfWeightsWriter() {
  file_.reset();
  if (!published_ && !tmp_.empty()) {
    std::error_code ignored;
    fs::remove_all(tmp_, ignored);  // leave no half-written export behind
  }
}

void HfWeightsWriter::open_next_shard() {
  const Shard& shard = shards_[current_shard_];
  file_ = std::make_unique<DurableFile>(tmp_ / shard.file, "export");
  const uint64_t header_len = shard.header.size();
  file_->write(&header_len, 8);  // little-endian host, as safetensors.cpp asserts
  file_->write(shard.header.data(), shard.header.size());
}

void HfWeightsWriter::write(const std::string& name, const at::Tensor& value) {
  ST_CHECK(next_tensor_ < tensors_.size(), "export: '", name, "' is one tensor more than planned");
  const ExportTensor& planned = tensors_[next_tensor_];
  ST_CHECK(planned.name == name, "export: expected '", planned.name, "' next, got '", name, "'");
  ST_CHECK(value.numel() == numel_of(planned.shape), "export: '", name, "' has ", value.numel(),
           " elements, its shape needs ", numel_of(planned.shape));
  if (!file_) open_next_shard();
  const at::Tensor data = value.detach().to(at::kCPU, dtype_).contiguous();
  file_->write(data.data_ptr(), static_cast<uint64_t>(data.numel()) * data.element_size());
  ++next_tensor_;
  const Shard& shard = shards_[current_shard_];
  if (next_tensor_ == shard.tensors.back() + 1) {
    ST_CHECK(file_->written() == 8 + shard.header.size() + shard.bytes, "export: ", shard.file, " has ",
             file_->written(), " bytes, expected ", 8 + shard.header.size() + shard.bytes);
    file_->finish();
    file_.reset();
    ++current_shard_;
  }
}

void HfWeightsWriter::finish() {
  ST_CHECK(next_tensor_ == tensors_.size(), "export: finished after ", next_tensor_, " of ", tensors_.size(),
           " tensors");
  try {
    if (shards_.size() > 1) {
      json weight_map = json::object();
      uint64_t total_bytes = 0;
      for (const auto& shard : shards_) {
        total_bytes += shard.bytes;
        for (std::size_t i : shard.tensors) weight_map[tensors_[i].name] = shard.file;
      }
      const json shard_index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
      write_durable_text(tmp_ / (options_.weights_stem + ".safetensors.index.json"), shard_index.dump(2) + "\n",
                         "export");
    }
    for (const auto& [name, text] : options_.text_files) write_durable_text(tmp_ / name, text, "export");
    if (!config_text_.empty()) write_durable_text(tmp_ / "config.json", config_text_, "export");
    publish(tmp_, out_);
    published_ = true;
  } catch (const fs::filesystem_error& e) {
    ST_THROW(Error, "export to ", out_.string(), " failed: ", e.what());
  }
}


}  // namespace shardtrain::checkpoint
