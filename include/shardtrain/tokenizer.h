#pragma once
/// @file tokenizer.h
/// Text <-> token ids for the fine-tune examples and `generate`.
///
/// load_sentencepiece() reads a sentencepiece `tokenizer.model` (Llama 2,
/// Mistral). Debian's libsentencepiece carries its own protobuf-lite and
/// crashes a process that also loads Debian's LibTorch, so shardtrain never
/// links it: a small shim library (libshardtrain_spm.so, the only thing that
/// links sentencepiece) is opened with dlopen(RTLD_NOW | RTLD_LOCAL |
/// RTLD_DEEPBIND), which keeps its protobuf symbols private.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace shardtrain {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  /// Token ids of `text`, without BOS/EOS (sentencepiece's EncodeAsIds: the
  /// model's normalizer adds the leading "▁" dummy prefix as configured).
  virtual std::vector<int64_t> encode(const std::string& text) const = 0;
  /// Text of `ids` (control tokens such as BOS/EOS are dropped).
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  /// -1 when the model defines none.
  virtual int64_t bos_id() const = 0;
  virtual int64_t eos_id() const = 0;
  virtual int64_t pad_id() const = 0;
  virtual int64_t unk_id() const = 0;
  /// Id of a piece ("▁the", "<s>"); unk_id() when unknown.
  virtual int64_t piece_to_id(const std::string& piece) const = 0;
};

/// Loads a sentencepiece model file through the shim. Throws shardtrain::Error
/// naming the file (missing, not a sentencepiece model) or naming the shim
/// library and where it was looked for (SHARDTRAIN_SPM_SHIM overrides the path).
/// The shim is the file named by the environment variable SHARDTRAIN_SPM_SHIM
/// when it is set, otherwise libshardtrain_spm.so in the directory
/// libshardtrain itself was loaded from (build/lib, or the installed lib
/// directory). It is opened once per process and never unloaded.
std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& model_path);

}  // namespace shardtrain
