#pragma once
// Writing a Hugging Face weights directory tensor by tensor: model.safetensors,
// or model-0000i-of-0000N.safetensors shards with model.safetensors.index.json,
// and config.json. Both exports use it: the offline one from a checkpoint's
// files (export.h) and save_model from the live shards (checkpoint.h), so
// neither holds more than one tensor, and save_model writes nothing else.

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace shardtrain::checkpoint {

struct ExportOptions {
  /// "fp32", "bf16" or "fp16": the dtype of the exported weights.
  std::string dtype = "fp32";
  /// Tensor bytes per output file before another shard is started (Hugging
  /// Face's save_pretrained default, 5 GB). One parameter larger than this
  /// gets a shard of its own: tensors are never split across files.
  uint64_t max_shard_bytes = 5000000000ULL;
  /// When non-empty, this model config JSON file is written to OUT/config.json
  /// with its dtype (torch_dtype, and dtype where transformers >= 5 wrote it)
  /// set to the weights' dtype: transformers' from_pretrained loads the
  /// weights in the dtype the config names.
  std::string config_json_path;
  /// The weight files' name: STEM.safetensors, or STEM-0000i-of-0000N.safetensors
  /// with STEM.safetensors.index.json ("adapter_model" for a PEFT adapter).
  std::string weights_stem = "model";
  /// Further files written beside the weights, name and text (a PEFT
  /// adapter's adapter_config.json), published with them.
  std::vector<std::pair<std::string, std::string>> text_files;
};

/// One tensor of an export, in the order it will be written.
struct ExportTensor {
  std::string name;
  std::vector<int64_t> shape;
};

class DurableFile;

class HfWeightsWriter {
 public:
  /// Plans the files (greedy packing in the given order, as save_pretrained
  /// packs) and checks the options; writes into a temporary sibling of
  /// `out_dir`, which finish() publishes.
  HfWeightsWriter(std::vector<ExportTensor> tensors, const std::string& out_dir, const ExportOptions& options);
  /// Removes the temporary directory unless finish() published it.
  ~HfWeightsWriter();
  HfWeightsWriter(const HfWeightsWriter&) = delete;
  HfWeightsWriter& operator=(const HfWeightsWriter&) = delete;

  /// The next tensor, `name` as planned: its values in any floating dtype
  /// (cast to the export dtype), as many elements as its shape.
  void write(const std::string& name, const at::Tensor& value);
  /// After the last tensor: the shard index and config.json, fsynced, then
  /// moved into `out_dir` (earlier weight files there are replaced, other
  /// files kept).
  void finish();
  /// The dtype the tensors are written in (ExportOptions::dtype).
  at::ScalarType dtype() const { return dtype_; }

 private:
  struct Shard;
  void open_next_shard();

  std::vector<ExportTensor> tensors_;
  std::vector<Shard> shards_;
  at::ScalarType dtype_;
  ExportOptions options_;
  std::string config_text_;  // OUT/config.json, when ExportOptions::config_json_path is given
  std::filesystem::path out_;
  std::filesystem::path tmp_;
  std::size_t next_tensor_ = 0;
  std::size_t current_shard_ = 0;
  std::unique_ptr<DurableFile> file_;
  bool published_ = false;
};

}  // namespace shardtrain::checkpoint
