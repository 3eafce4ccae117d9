#pragma once
// The NF4 format of a quantized frozen weight (QLoRA, Dettmers et al. 2023,
// as bitsandbytes' quantize_4bit with blocksize 64 and compress_statistics,
// i.e. double quantization), and how its pieces lie in one byte buffer.
//
// One buffer per weight, so the engines shard and all-gather it as opaque
// bytes (4.13 bits per weight) and only the consumer decodes it:
//   [codes]        numel/2 bytes: two 4-bit indices into kNf4Values per byte,
//                  the even element in the high nibble (bitsandbytes' packing)
//   [absmax codes] numel/64 bytes: each 64-element block's absmax, quantized
//                  to the signed 8-bit dynamic map (nf4_absmax_code()) in
//                  blocks of 256 after subtracting their mean (the offset)
//   padding to 4 bytes
//   [absmax scale] ceil(blocks/256) fp32: each 256-block's absmax of (absmax - offset)
//   [offset]       one fp32: the mean of the blocks' absmax
// fp32 values are stored little-endian and read with memcpy/byte loads: a
// gathered buffer may start at any byte.
//
// Decoding element i: nf4[code_i] * (code8[absmax_code_b] * scale_(b/256) + offset),
// b = i/64, each product and the sum rounded to fp32 as bitsandbytes does.
//
// Plain C++ on purpose: nvcc includes it for the CUDA kernel.

#include <cstdint>

#ifdef __CUDACC__
#define ST_NF4_HOST_DEVICE __host__ __device__
#else
#define ST_NF4_HOST_DEVICE
#endif

namespace shardtrain::kernels::nf4 {

/// Elements per quantization block (bitsandbytes' and QLoRA's default).
constexpr int64_t kBlock = 64;
/// Blocks per block of the second (absmax) quantization.
constexpr int64_t kAbsmaxBlock = 256;
/// Entries of the 8-bit dynamic map the absmax values are coded with.
constexpr int kAbsmaxCodeSize = 256;

/// The 16 NF4 levels: quantiles of N(0, 1) normalised to [-1, 1] with an exact
/// zero (QLoRA's appendix; the values bitsandbytes' get_4bit_type("nf4") lists).
/// The QLoRA paper defines them; these are its fp32 values.
ST_NF4_HOST_DEVICE constexpr float value(int code) {
  constexpr float kValues[16] = {-1.0f,
                                 -0.6961928009986877f,
                                 -0.5250730514526367f,
                                 -0.39491748809814453f,
                                 -0.28444138169288635f,
                                 -0.18477343022823334f,
                                 -0.09105003625154495f,
                                 0.0f,
                                 0.07958029955625534f,
                                 0.16093020141124725f,
                                 0.24611230194568634f,
                                 0.33791524171829224f,
                                 0.44070982933044434f,
                                 0.5626170039176941f,
                                 0.7229568362236023f,
                                 1.0f};
  return kValues[code & 15];
}

/// Where the pieces of one weight's buffer lie (byte offsets).
struct Layout {
  int64_t numel = 0;
  int64_t blocks = 0;          ///< numel / kBlock
  int64_t absmax_blocks = 0;   ///< ceil(blocks / kAbsmaxBlock)
  int64_t codes = 0;           ///< offset of the packed codes (0)
  int64_t absmax_codes = 0;
  int64_t absmax_scales = 0;   ///< 4-byte aligned
  int64_t offset = 0;
  int64_t bytes = 0;           ///< the whole buffer, a multiple of 4

  ST_NF4_HOST_DEVICE static Layout of(int64_t numel) {
    Layout l;
    l.numel = numel;
    l.blocks = numel / kBlock;
    l.absmax_blocks = (l.blocks + kAbsmaxBlock - 1) / kAbsmaxBlock;
    l.codes = 0;
    l.absmax_codes = numel / 2;
    l.absmax_scales = (l.absmax_codes + l.blocks + 3) / 4 * 4;
    l.offset = l.absmax_scales + 4 * l.absmax_blocks;
    l.bytes = l.offset + 4;
    return l;
  }
};

}  // namespace shardtrain::kernels::nf4
