// libshardtrain_spm.so: the only code that links Debian's libsentencepiece.
// That library carries its own protobuf-lite and exports it; in a process that
// also loads Debian's LibTorch (libprotobuf, libonnx_proto) the clashing static
// initialisers crash before main. libshardtrain therefore dlopen()s this shim
// with RTLD_LOCAL | RTLD_DEEPBIND, so sentencepiece's protobuf stays private.
// This file must not include LibTorch. Only the st_spm_* functions are
// exported (the target builds with -fvisibility=hidden).

#include "tokenizer/spm_shim.h"

#include <sentencepiece_processor.h>

#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#define ST_SPM_EXPORT __attribute__((visibility("default")))

struct st_spm {
  sentencepiece::SentencePieceProcessor processor;
};

namespace {

void set_error(char* err, size_t err_len, std::string_view message) {
  if (err == nullptr || err_len == 0) return;
  const size_t n = message.size() < err_len - 1 ? message.size() : err_len - 1;
  std::memcpy(err, message.data(), n);
  err[n] = '\0';
}

}  // namespace

extern "C" {

ST_SPM_EXPORT int st_spm_abi_version(void) { return ST_SPM_ABI_VERSION; }

ST_SPM_EXPORT st_spm* st_spm_create(const char* model_path, char* err, size_t err_len) {
  // No exception may leave a C function: the caller cannot catch it across the
  // dlopen boundary.
  try {
    auto spm = std::make_unique<st_spm>();
    const auto status = spm->processor.Load(model_path);
    if (!status.ok()) {
      set_error(err, err_len, status.ToString());
      return nullptr;
    }
    return spm.release();
  } catch (const std::exception& e) {
    set_error(err, err_len, e.what());
  } catch (...) {
    set_error(err, err_len, "unknown exception in sentencepiece");
  }
  return nullptr;
}

ST_SPM_EXPORT void st_spm_destroy(st_spm* spm) { delete spm; }

ST_SPM_EXPORT int64_t st_spm_encode(const st_spm* spm, const char* text, size_t text_len, int32_t* ids,
                                    size_t capacity, char* err, size_t err_len) {
  try {
    std::vector<int> out;
    const auto status = spm->processor.Encode(std::string_view(text, text_len), &out);
    if (!status.ok()) {
      set_error(err, err_len, status.ToString());
      return -1;
    }
    if (out.size() <= capacity) {
      for (size_t i = 0; i < out.size(); ++i) ids[i] = static_cast<int32_t>(out[i]);
    }
    return static_cast<int64_t>(out.size());
  } catch (const std::exception& e) {
    set_error(err, err_len, e.what());
  } catch (...) {
    set_error(err, err_len, "unknown exception in sentencepiece Encode");
  }
  return -1;
}

ST_SPM_EXPORT int64_t st_spm_decode(const st_spm* spm, const int32_t* ids, size_t n_ids, char* out,
                                    size_t capacity, char* err, size_t err_len) {
  try {
    const int size = spm->processor.GetPieceSize();
    std::vector<int> in(n_ids);
    for (size_t i = 0; i < n_ids; ++i) {
      // sentencepiece 0.1.97 indexes its piece table without a bounds check.
      if (ids[i] < 0 || ids[i] >= size) {
        set_error(err, err_len,
                  "token id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                      " is outside the vocabulary [0, " + std::to_string(size) + ")");
        return -1;
      }
      in[i] = ids[i];
    }
    std::string text;
    const auto status = spm->processor.Decode(in, &text);
    if (!status.ok()) {
      set_error(err, err_len, status.ToString());
      return -1;
    }
    if (text.size() <= capacity && !text.empty()) std::memcpy(out, text.data(), text.size());
    return static_cast<int64_t>(text.size());
  } catch (const std::exception& e) {
    set_error(err, err_len, e.what());
  } catch (...) {
    set_error(err, err_len, "unknown exception in sentencepiece Decode");
  }
  return -1;
}

ST_SPM_EXPORT int32_t st_spm_vocab_size(const st_spm* spm) { return spm->processor.GetPieceSize(); }
ST_SPM_EXPORT int32_t st_spm_bos_id(const st_spm* spm) { return spm->processor.bos_id(); }
ST_SPM_EXPORT int32_t st_spm_eos_id(const st_spm* spm) { return spm->processor.eos_id(); }
ST_SPM_EXPORT int32_t st_spm_pad_id(const st_spm* spm) { return spm->processor.pad_id(); }
ST_SPM_EXPORT int32_t st_spm_unk_id(const st_spm* spm) { return spm->processor.unk_id(); }

ST_SPM_EXPORT int32_t st_spm_piece_to_id(const st_spm* spm, const char* piece, size_t piece_len) {
  return spm->processor.PieceToId(std::string_view(piece, piece_len));
}

}  // extern "C"

// The definitions above must keep the signatures the loader casts dlsym()
// results to; a mismatch fails here at compile time instead of at run time.
static_assert(std::is_same_v<decltype(&st_spm_abi_version), st_spm_abi_version_fn>);
static_assert(std::is_same_v<decltype(&st_spm_create), st_spm_create_fn>);
static_assert(std::is_same_v<decltype(&st_spm_destroy), st_spm_destroy_fn>);
static_assert(std::is_same_v<decltype(&st_spm_encode), st_spm_encode_fn>);
static_assert(std::is_same_v<decltype(&st_spm_decode), st_spm_decode_fn>);
static_assert(std::is_same_v<decltype(&st_spm_vocab_size), st_spm_int_fn>);
static_assert(std::is_same_v<decltype(&st_spm_piece_to_id), st_spm_piece_to_id_fn>);
