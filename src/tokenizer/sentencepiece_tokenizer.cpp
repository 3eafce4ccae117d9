// The SentencePiece tokenizer, reached through a small C shim loaded at run
// time (the shim's library is found next to shardtrain's) (tokenizer.h).
#include "shardtrain/tokenizer.h"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "shardtrain/error.h"
#include "tokenizer/spm_shim.h"

namespace shardtrain {

namespace fs = std::filesystem;

namespace {

constexpr const char* kShimEnv = "SHARDTRAIN_SPM_SHIM";
constexpr const char* kShimName = "libshardtrain_spm.so";
constexpr size_t kErrLen = 1024;

/// The shim's entry points. Shims are never dlclose()d: sentencepiece and its
/// protobuf register static state that must outlive every Tokenizer, and
/// unloading buys nothing in a training process.
struct ShimApi {
  std::string path;
  st_spm_create_fn create = nullptr;
  st_spm_destroy_fn destroy = nullptr;
  st_spm_encode_fn encode = nullptr;
  st_spm_decode_fn decode = nullptr;
  st_spm_int_fn vocab_size = nullptr;
  st_spm_int_fn bos_id = nullptr;
  st_spm_int_fn eos_id = nullptr;
  st_spm_int_fn pad_id = nullptr;
  st_spm_int_fn unk_id = nullptr;
  st_spm_piece_to_id_fn piece_to_id = nullptr;
};

/// Directory of the file libshardtrain was loaded from: the shim is built into
/// (and installed to) the same directory.
std::string own_library_dir() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&load_sentencepiece), &info) == 0 || info.dli_fname == nullptr) {
    return {};
  }
  std::error_code ec;
  fs::path lib = fs::canonical(info.dli_fname, ec);
  if (ec) lib = info.dli_fname;
  return lib.parent_path().string();
}

/// The shim's NUL-terminated message without sentencepiece's trailing space.
std::string shim_error(const char* err) {
  std::string message(err);
  while (!message.empty() && (message.back() == ' ' || message.back() == '\n')) message.pop_back();
  return message.empty() ? std::string("no reason given") : message;
}

template <typename Fn>
Fn resolve(void* handle, const std::string& path, const char* name) {
  dlerror();
  void* symbol = dlsym(handle, name);
  ST_CHECK(symbol != nullptr, "'", path, "' is not a shardtrain sentencepiece shim: it has no symbol '", name,
           "'. Point ", kShimEnv, " at the ", kShimName, " built with this shardtrain (", kShimName,
           " is installed next to libshardtrain)");
  return reinterpret_cast<Fn>(symbol);
}

const ShimApi& open_shim(const std::string& path, const std::string& how_found) {
  static std::mutex mutex;
  static std::map<std::string, std::unique_ptr<ShimApi>> opened;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = opened.find(path); it != opened.end()) return *it->second;

  // RTLD_DEEPBIND: the shim and libsentencepiece bind to their own protobuf
  // symbols before the ones LibTorch already put in the global scope.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
  if (handle == nullptr) {
    const char* why = dlerror();
    ST_THROW(Error, "cannot load the sentencepiece shim '", path, "' (", how_found,
             "): ", why != nullptr ? why : "unknown dlopen error",
             ". It must be the ", kShimName, " built with shardtrain (it links libsentencepiece; on Debian: "
             "apt-get install libsentencepiece0)");
  }
  auto api = std::make_unique<ShimApi>();
  api->path = path;
  const auto version = resolve<st_spm_abi_version_fn>(handle, path, "st_spm_abi_version")();
  ST_CHECK(version == ST_SPM_ABI_VERSION, "the sentencepiece shim '", path, "' has ABI version ", version,
           " but this libshardtrain needs ", ST_SPM_ABI_VERSION,
           ": it comes from a different shardtrain build; use the ", kShimName, " installed with this one");
  api->create = resolve<st_spm_create_fn>(handle, path, "st_spm_create");
  api->destroy = resolve<st_spm_destroy_fn>(handle, path, "st_spm_destroy");
  api->encode = resolve<st_spm_encode_fn>(handle, path, "st_spm_encode");
  api->decode = resolve<st_spm_decode_fn>(handle, path, "st_spm_decode");
  api->vocab_size = resolve<st_spm_int_fn>(handle, path, "st_spm_vocab_size");
  api->bos_id = resolve<st_spm_int_fn>(handle, path, "st_spm_bos_id");
  api->eos_id = resolve<st_spm_int_fn>(handle, path, "st_spm_eos_id");
  api->pad_id = resolve<st_spm_int_fn>(handle, path, "st_spm_pad_id");
  api->unk_id = resolve<st_spm_int_fn>(handle, path, "st_spm_unk_id");
  api->piece_to_id = resolve<st_spm_piece_to_id_fn>(handle, path, "st_spm_piece_to_id");
  return *opened.emplace(path, std::move(api)).first->second;
}

/// SHARDTRAIN_SPM_SHIM when set (and then nothing else, so a wrong value is
/// reported rather than silently bypassed), otherwise next to libshardtrain.
const ShimApi& find_shim() {
  if (const char* env = std::getenv(kShimEnv); env != nullptr && *env != '\0') {
    std::error_code ec;
    ST_CHECK(fs::is_regular_file(env, ec), kShimEnv, "='", env, "' does not name a file. Set it to the path of ",
             kShimName, " or unset it to use the one next to libshardtrain");
    // Absolute, because dlopen() searches the library path for a name without a "/".
    return open_shim(fs::absolute(env).string(), std::string("from ") + kShimEnv);
  }
  const std::string dir = own_library_dir();
  const std::string candidate = dir.empty() ? std::string() : (fs::path(dir) / kShimName).string();
  std::error_code ec;
  ST_CHECK(!candidate.empty() && fs::is_regular_file(candidate, ec), "the sentencepiece shim ", kShimName,
           " was not found: looked in ", (dir.empty() ? std::string("<directory of libshardtrain unknown>") : dir),
           " (the directory of libshardtrain). Build the target shardtrain_spm (it needs libsentencepiece-dev), "
           "or set ", kShimEnv, " to the shim's path");
  return open_shim(candidate, "next to libshardtrain");
}

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(const ShimApi& api, st_spm* spm) : api_(api), spm_(spm) {}
  ~SentencePieceTokenizer() override { api_.destroy(spm_); }
  SentencePieceTokenizer(const SentencePieceTokenizer&) = delete;
  SentencePieceTokenizer& operator=(const SentencePieceTokenizer&) = delete;

  std::vector<int64_t> encode(const std::string& text) const override {
    char err[kErrLen] = {0};
    // One id per byte plus the dummy prefix covers almost every input (byte
    // fallback is one id per byte); the shim reports the size when it does not.
    std::vector<int32_t> ids(text.size() + 8);
    int64_t n = api_.encode(spm_, text.data(), text.size(), ids.data(), ids.size(), err, sizeof(err));
    if (n > static_cast<int64_t>(ids.size())) {
      ids.resize(static_cast<size_t>(n));
      n = api_.encode(spm_, text.data(), text.size(), ids.data(), ids.size(), err, sizeof(err));
    }
    ST_CHECK(n >= 0 && n <= static_cast<int64_t>(ids.size()), "sentencepiece failed to encode a text of ",
             text.size(), " bytes: ", shim_error(err));
    return std::vector<int64_t>(ids.begin(), ids.begin() + n);
  }

  std::string decode(const std::vector<int64_t>& ids) const override {
    const int64_t vocab = vocab_size();
    std::vector<int32_t> in(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      ST_CHECK(ids[i] >= 0 && ids[i] < vocab, "cannot decode token id ", ids[i], " at position ", i,
               ": it is outside the tokenizer's vocabulary [0, ", vocab, ")");
      in[i] = static_cast<int32_t>(ids[i]);
    }
    char err[kErrLen] = {0};
    std::string text(ids.size() * 4 + 16, '\0');
    int64_t n = api_.decode(spm_, in.data(), in.size(), text.data(), text.size(), err, sizeof(err));
    if (n > static_cast<int64_t>(text.size())) {
      text.resize(static_cast<size_t>(n));
      n = api_.decode(spm_, in.data(), in.size(), text.data(), text.size(), err, sizeof(err));
    }
    ST_CHECK(n >= 0 && n <= static_cast<int64_t>(text.size()), "sentencepiece failed to decode ", ids.size(),
             " ids: ", shim_error(err));
    text.resize(static_cast<size_t>(n));
    return text;
  }

  int64_t vocab_size() const override { return api_.vocab_size(spm_); }
  int64_t bos_id() const override { return api_.bos_id(spm_); }
  int64_t eos_id() const override { return api_.eos_id(spm_); }
  int64_t pad_id() const override { return api_.pad_id(spm_); }
  int64_t unk_id() const override { return api_.unk_id(spm_); }
  int64_t piece_to_id(const std::string& piece) const override {
    return api_.piece_to_id(spm_, piece.data(), piece.size());
  }

 private:
  const ShimApi& api_;
  st_spm* spm_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& model_path) {
  // Checked here so a wrong path is reported as such even when the shim is missing.
  std::error_code ec;
  ST_CHECK(fs::exists(model_path, ec), "tokenizer model '", model_path,
           "' does not exist (expected a sentencepiece tokenizer.model file)");
  ST_CHECK(fs::is_regular_file(model_path, ec), "tokenizer model '", model_path,
           "' is not a regular file (expected a sentencepiece tokenizer.model file)");
  const ShimApi& api = find_shim();
  char err[kErrLen] = {0};
  st_spm* spm = api.create(model_path.c_str(), err, sizeof(err));
  ST_CHECK(spm != nullptr, "cannot load '", model_path, "' as a sentencepiece model: ", shim_error(err),
           ". Expected a sentencepiece tokenizer.model (Llama 2 / Mistral style); "
           "tokenizer.json (Hugging Face fast tokenizers) is not supported");
  return std::make_unique<SentencePieceTokenizer>(api, spm);
}

}  // namespace shardtrain
