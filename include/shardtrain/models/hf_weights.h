#pragma once
/// @file models/hf_weights.h
/// Loading Hugging Face weights so that no rank holds the whole model.
///
///     auto config = models::LlamaConfig::from_json_file(dir + "/config.json");
///     auto checkpoint = std::make_shared<models::HfCheckpoint>(dir);
///     models::LlamaForCausalLM model = models::make_llama_without_weights(config);
///     checkpoint->check_against(*model);            // every parameter present, shapes right
///     shardtrain::RunInfo run;
///     run.weight_source = models::hf_weight_source(checkpoint);
///     auto prepared = accelerator.prepare(model, {}, run);  // each rank reads only its slices
///
/// Each rank builds the model without parameter storage (one module at a
/// time, each released right after it is built), and prepare() asks the
/// source for exactly the elements of its own shard, which HfCheckpoint reads
/// with safetensors::Reader::read_slice (pread of those bytes only). So a
/// rank's peak is its shard plus one module, and it reads about 1/W of the
/// files (ZeRO-3, FULL_SHARD).

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/models/llama.h"
#include "shardtrain/safetensors.h"
#include "shardtrain/weight_loading.h"

namespace shardtrain::models {

/// Random access to the tensors of a Hugging Face model directory:
/// model.safetensors, or the shards model.safetensors.index.json maps. The
/// constructor opens and validates every file's header (no tensor data is
/// read); reads are thread-safe.
class HfCheckpoint {
 public:
  /// Throws shardtrain::Error naming the file when neither weights file is
  /// there, the index is malformed, or it maps a tensor to a file without it.
  explicit HfCheckpoint(const std::string& model_dir);

  const std::string& dir() const { return dir_; }
  /// Whether some file of the directory holds tensor `name`.
  bool contains(const std::string& name) const;
  /// Throws shardtrain::Error naming the tensor and the directory when absent.
  const safetensors::TensorInfo& info(const std::string& name) const;
  /// The file that holds `name`.
  const std::string& file_of(const std::string& name) const;
  /// Tensor names, sorted.
  std::vector<std::string> names() const;

  /// Elements [begin, begin + length) of the flattened tensor `name`, converted
  /// into `out` (`length` elements, any floating dtype). Reads only those bytes.
  void read_slice(const std::string& name, int64_t begin, int64_t length, const at::Tensor& out) const;

  /// Every parameter of `model` is present with its shape (else shardtrain::Error
  /// naming the parameter, the shapes and the file). Reads headers only. Call
  /// it before prepare(): a missing tensor then fails on every rank at once.
  /// Tensors the model has no parameter for are named in a warning when
  /// `warn_unexpected` (pass false on all ranks but one).
  void check_against(torch::nn::Module& model, bool warn_unexpected = true) const;

  /// Bytes of tensor data read so far (all read_slice calls).
  int64_t bytes_read() const { return bytes_read_.load(); }
  /// Bytes of all tensor data in the directory's files.
  int64_t total_tensor_bytes() const;

 private:
  void warn_of_unexpected_tensors(torch::nn::Module& model) const;
  std::string dir_;
  std::string where_;  // the file or index named in messages
  std::map<std::string, std::unique_ptr<safetensors::Reader>> readers_;  // by path
  std::map<std::string, const safetensors::Reader*> by_tensor_;
  mutable std::atomic<int64_t> bytes_read_{0};
};

/// The engine's weight source (RunInfo::weight_source) over `checkpoint`,
/// which it keeps alive.
WeightSource hf_weight_source(std::shared_ptr<const HfCheckpoint> checkpoint);

/// A LlamaForCausalLM (or Mistral) whose parameters have their shapes and
/// `dtype` on `device` but no storage (shardtrain::is_storage_released), built one module
/// at a time — the embedding, each decoder layer, the LM head — each released
/// right after it is built, so the process never holds more than one of them.
/// Its values come from prepare() (a weight source, or rank 0 under
/// fsdp_cpu_ram_efficient_loading / zero3_init_flag). Do not run it before
/// prepare(): until then its parameters have no data.
LlamaForCausalLM make_llama_without_weights(const LlamaConfig& config, at::ScalarType dtype = at::kFloat,
                                            at::Device device = at::Device(at::kCPU));

}  // namespace shardtrain::models
