#pragma once
// The C ABI between libshardtrain and libshardtrain_spm.so (the sentencepiece
// shim). Plain C types only: the shim is opened with dlopen(RTLD_DEEPBIND) and
// nothing C++ (exceptions, std::string, allocators) may cross the boundary,
// because the shim and libshardtrain can resolve the C++ runtime and protobuf
// to different copies.
//
// Every function that can fail writes a NUL-terminated message into `err`
// (at most err_len bytes, truncated) and returns a negative value or NULL.
// Bump ST_SPM_ABI_VERSION whenever a signature or meaning changes, so an old
// installed shim is rejected instead of called with the wrong arguments.

#include <stddef.h>
#include <stdint.h>

#define ST_SPM_ABI_VERSION 1

#ifdef __cplusplus
extern "C" {
#endif

typedef struct st_spm st_spm;

typedef int (*st_spm_abi_version_fn)(void);
/// NULL on failure (file unreadable, not a sentencepiece model).
typedef st_spm* (*st_spm_create_fn)(const char* model_path, char* err, size_t err_len);
typedef void (*st_spm_destroy_fn)(st_spm* spm);
/// Number of ids of `text` (without BOS/EOS). Writes them to `ids` when it fits
/// in `capacity`; a result larger than `capacity` means: call again with a
/// buffer of that size. Negative on error.
typedef int64_t (*st_spm_encode_fn)(const st_spm* spm, const char* text, size_t text_len, int32_t* ids,
                                    size_t capacity, char* err, size_t err_len);
/// Byte length of the decoded text; copies it to `out` when it fits in
/// `capacity` (no NUL added). Negative on error (an id outside the vocabulary).
typedef int64_t (*st_spm_decode_fn)(const st_spm* spm, const int32_t* ids, size_t n_ids, char* out,
                                    size_t capacity, char* err, size_t err_len);
/// Vocabulary size and the special ids (-1 when the model defines none).
typedef int32_t (*st_spm_int_fn)(const st_spm* spm);
/// Id of `piece` (not normalised); the unk id when it is not in the vocabulary.
typedef int32_t (*st_spm_piece_to_id_fn)(const st_spm* spm, const char* piece, size_t piece_len);

#ifdef __cplusplus
}
#endif
