// NF4 on the CPU (nf4_cpu.h). Quantization reproduces bitsandbytes 0.50's
// arithmetic on the CPU step by step, so the codes and absmax values are its
// bits (UnitNf4 checks them against bitsandbytes itself):
//  - the 4-bit codes as its quantize_4bit: x * (1 / max(absmax, 1e-38)),
//    clamped to [-1, 1], then the number of level midpoints below it
//    (torch.bucketize over (v[k] + v[k+1]) / 2);
//  - the absmax values as its CPU quantize_blockwise in blocks of 256 after
//    subtracting their mean: y * (1 / absmax256), then its table of 65,536
//    bins over [-1, 1] (absmax_code below), not the nearest map entry.
// This file is compiled with -ffp-contract=off (CMakeLists.txt): each product
// and sum is rounded on its own, as in bitsandbytes, never fused, except the
// one bitsandbytes' own build fuses (absmax_code's bin index, an explicit
// std::fma).

#include "kernels/cpu/nf4_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "kernels/nf4_format.h"
#include "shardtrain/error.h"

namespace shardtrain::kernels::cpu {
namespace {

float load_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

void store_f32(uint8_t* p, float v) { std::memcpy(p, &v, sizeof v); }

// bitsandbytes 0.50's CPU quantize_blockwise does not search the 256-entry
// map: it cuts [-1, 1] into 65,536 equal bins and gives each bin the entry
// nearest the bin's centre. Near 0, where the map's entries lie closer than
// a bin's width (3.1e-5), that is not the entry nearest the value itself:
// 0.19% of a 1408 x 512 weight's absmax codes differ from the nearest entry.
// Its CUDA kernel searches instead, so bitsandbytes' two devices disagree on
// those codes; shardtrain quantizes on the CPU and follows the CPU's table,
// which UnitNf4 checks against bitsandbytes itself on large weights.
constexpr int kAbsmaxBins = 65536;

const std::vector<uint8_t>& absmax_code_bins() {
  static const std::vector<uint8_t> bins = [] {
    const float* code = nf4_absmax_code().data_ptr<float>();
    constexpr int kEntries = kernels::nf4::kAbsmaxCodeSize;
    float midpoints[kEntries - 1];
    for (int i = 0; i < kEntries - 1; ++i) midpoints[i] = 0.5f * (code[i] + code[i + 1]);
    std::vector<uint8_t> table(kAbsmaxBins);
    int entry = 0;
    for (int bin = 0; bin < kAbsmaxBins; ++bin) {
      const float centre = -1.0f + (2.0f * static_cast<float>(bin)) / static_cast<float>(kAbsmaxBins - 1);
      while (entry < kEntries - 1 && midpoints[entry] < centre) ++entry;
      table[bin] = static_cast<uint8_t>(entry);
    }
    return table;
  }();
  return bins;
}

/// The absmax code bitsandbytes' CPU table gives `normed`. Its bin index
/// (clamped + 1) * 0.5 * 65535 + 0.5 has the last product and sum fused
/// into one rounding: libbitsandbytes_cpu.so 0.50.2 compiles it to
/// vfmadd213ss (objdump), so std::fma here, whatever this file's flags.
uint8_t absmax_code(float normed) {
  const float clamped = std::clamp(normed, -1.0f, 1.0f);
  const float half = (clamped + 1.0f) * 0.5f;
  const auto bin = static_cast<uint16_t>(std::fma(half, static_cast<float>(kAbsmaxBins - 1), 0.5f));
  return absmax_code_bins()[bin];
}

/// ATen's intra-op threads set to 1 on this thread while it lives.
class OneThread {
 public:
  OneThread() : threads_(at::get_num_threads()) { at::set_num_threads(1); }
  ~OneThread() { at::set_num_threads(threads_); }
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;

 private:
  int threads_;
};

template <class Out>
void dequantize_as(const uint8_t* buffer, const nf4::Layout& l, const float* code8, Out* out) {
  const uint8_t* codes = buffer + l.codes;
  const uint8_t* absmax_codes = buffer + l.absmax_codes;
  const float offset = load_f32(buffer + l.offset);
  at::parallel_for(0, l.blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float scale = load_f32(buffer + l.absmax_scales + 4 * (b / nf4::kAbsmaxBlock));
      const float scaled = code8[absmax_codes[b]] * scale;
      const float absmax = scaled + offset;
      for (int64_t i = b * nf4::kBlock; i < (b + 1) * nf4::kBlock; i += 2) {
        const uint8_t byte = codes[i / 2];
        out[i] = static_cast<Out>(nf4::value(byte >> 4) * absmax);
        out[i + 1] = static_cast<Out>(nf4::value(byte & 15) * absmax);
      }
    }
  });
}

}  // namespace

const at::Tensor& nf4_absmax_code() {
  static const at::Tensor code = [] {
    // bitsandbytes' create_dynamic_map(signed=True, max_exponent_bits=7,
    // total_bits=8): for each exponent i, the midpoints of
    // linspace(0.1, 1, 2^i + 1) in fp32 scaled by 10^(i-6), both signs, then
    // 0 and 1, sorted. The same ATen calls make the same roundings.
    std::vector<double> data;
    for (int i = 0; i < 7; ++i) {
      const at::Tensor bounds = at::linspace(0.1, 1, (int64_t{1} << i) + 1, at::kFloat);
      const at::Tensor means = (bounds.slice(0, 0, -1) + bounds.slice(0, 1)) / 2.0;
      const double scale = i < 6 ? std::pow(10.0, i - 6) : 1.0;
      for (const at::Tensor& part : {means.mul(scale), means.mul(-scale)}) {
        const float* p = part.data_ptr<float>();
        data.insert(data.end(), p, p + part.numel());
      }
    }
    data.push_back(0.0);
    data.push_back(1.0);
    ST_CHECK(static_cast<int>(data.size()) == nf4::kAbsmaxCodeSize, "the NF4 absmax map has ", data.size(),
             " entries, expected ", nf4::kAbsmaxCodeSize);
    std::sort(data.begin(), data.end());
    return at::tensor(data, at::kDouble).to(at::kFloat);
  }();
  return code;
}

at::Tensor nf4_quantize(const at::Tensor& weight) {
  ST_CHECK(weight.defined() && weight.is_cpu(), "nf4_quantize: the weight must be a CPU tensor");
  ST_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16 ||
               weight.scalar_type() == at::kHalf,
           "nf4_quantize: the weight must be fp32, bf16 or fp16, got ", weight.scalar_type());
  const int64_t n = weight.numel();
  ST_CHECK(n > 0 && n % nf4::kBlock == 0, "nf4_quantize: ", n, " elements are not a whole number of ",
           nf4::kBlock, "-element blocks");
  const at::Tensor values = weight.reshape({-1}).to(at::kFloat).contiguous();
  ST_CHECK(at::isfinite(values).all().item<bool>(), "nf4_quantize: the weight holds inf or NaN");
  const nf4::Layout l = nf4::Layout::of(n);
  at::Tensor buffer = at::zeros({l.bytes}, at::kByte);
  uint8_t* out = buffer.data_ptr<uint8_t>();
  const float* x = values.data_ptr<float>();
  at::Tensor absmax = at::empty({l.blocks}, at::kFloat);
  float* am = absmax.data_ptr<float>();

  // Level midpoints, as bitsandbytes computes them: (v[k] + v[k+1]) / 2 in fp32.
  float midpoints[15];
  for (int k = 0; k < 15; ++k) midpoints[k] = (nf4::value(k) + nf4::value(k + 1)) / 2.0f;
  at::parallel_for(0, l.blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* block = x + b * nf4::kBlock;
      float m = 0.0f;
      for (int64_t j = 0; j < nf4::kBlock; ++j) m = std::max(m, std::fabs(block[j]));
      am[b] = m;
      // torch.clamp(absmax, min=1e-38): the double 1e-38 rounded to fp32.
      const float inverse = 1.0f / std::max(m, static_cast<float>(1e-38));
      for (int64_t j = 0; j < nf4::kBlock; j += 2) {
        uint8_t q[2];
        for (int h = 0; h < 2; ++h) {
          const float s = std::min(1.0f, std::max(-1.0f, block[j + h] * inverse));
          q[h] = static_cast<uint8_t>(std::lower_bound(midpoints, midpoints + 15, s) - midpoints);
        }
        out[l.codes + (b * nf4::kBlock + j) / 2] = static_cast<uint8_t>((q[0] << 4) | q[1]);
      }
    }
  });

  // Double quantization: the mean (ATen's, as bitsandbytes takes it with
  // torch) is the offset; the centred values are coded in blocks of 256.
  // On one thread: above 32K blocks ATen's parallel reduction rounds by its
  // thread count, and every rank (and a resume) must make the same bytes
  // whatever its OMP_NUM_THREADS; bitsandbytes on one thread computes this
  // mean. With OpenMP (PyPI's LibTorch) the thread count set here is this
  // thread's own, restored at once.
  at::Tensor offset;
  {
    const OneThread one_thread;
    offset = absmax.mean();
  }
  const at::Tensor centred = absmax - offset;
  const float* c = centred.data_ptr<float>();
  for (int64_t a = 0; a < l.absmax_blocks; ++a) {
    const int64_t begin = a * nf4::kAbsmaxBlock, end = std::min(l.blocks, begin + nf4::kAbsmaxBlock);
    float scale = 0.0f;
    for (int64_t b = begin; b < end; ++b) scale = std::max(scale, std::fabs(c[b]));
    store_f32(out + l.absmax_scales + 4 * a, scale);
    // A 256-block of equal absmax values has scale 0: each is the offset
    // itself, and bitsandbytes codes them 0 (any code decodes to the offset),
    // as the zeroed buffer already holds.
    if (scale == 0.0f) continue;
    const float inverse = 1.0f / scale;
    for (int64_t b = begin; b < end; ++b) out[l.absmax_codes + b] = absmax_code(c[b] * inverse);
  }
  store_f32(out + l.offset, offset.item<float>());
  return buffer;
}

void nf4_dequantize(const at::Tensor& buffer, at::Tensor& out) {
  ST_CHECK(buffer.is_cpu() && buffer.is_contiguous(), "nf4_dequantize: the buffer must be a contiguous CPU tensor");
  ST_CHECK(out.defined() && out.is_cpu() && out.is_contiguous(), "nf4_dequantize: out must be a contiguous CPU tensor");
  const nf4::Layout l = nf4::Layout::of(out.numel());
  const uint8_t* in = buffer.data_ptr<uint8_t>();
  const float* code8 = nf4_absmax_code().data_ptr<float>();
  switch (out.scalar_type()) {
    case at::kFloat: dequantize_as(in, l, code8, out.data_ptr<float>()); break;
    case at::kBFloat16: dequantize_as(in, l, code8, out.data_ptr<at::BFloat16>()); break;
    case at::kHalf: dequantize_as(in, l, code8, out.data_ptr<at::Half>()); break;
    default: ST_THROW(Error, "nf4_dequantize: out must be fp32, bf16 or fp16, got ", out.scalar_type());
  }
}

}  // namespace shardtrain::kernels::cpu
