#!/usr/bin/env python3
"""The bitsandbytes peer of UnitNf4 (tests/unit/test_nf4.cpp): bitsandbytes'
own NF4 quantization of the tensors shardtrain quantized.

  peer_bnb_nf4.py IN.safetensors OUT.safetensors

For every tensor NAME in IN, bitsandbytes.functional.quantize_4bit(NAME,
blocksize=64, quant_type="nf4", compress_statistics=True) on the CPU, and
writes to OUT:
  NAME.codes             the packed 4-bit codes (uint8, flattened)
  NAME.absmax            the double-quantized absmax codes (uint8)
  NAME.nested_absmax     the absmax values' own absmax per 256 (fp32)
  NAME.offset            the mean subtracted before (fp32, 1 element)
  NAME.nested_quant_map  the 256-entry map the absmax codes index (fp32)
  NAME.dequant_f32       dequantize_4bit(...) in fp32
  NAME.dequant_bf16      dequantize_4bit(...) in bf16
"""
import sys

import bitsandbytes.functional as F
import torch
from safetensors.torch import load_file, save_file


def main():
    inputs = load_file(sys.argv[1])
    out = {}
    for name, weight in inputs.items():
        packed, state = F.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
        out[name + ".codes"] = packed.reshape(-1).contiguous()
        out[name + ".absmax"] = state.absmax.reshape(-1).contiguous()
        out[name + ".nested_absmax"] = state.state2.absmax.reshape(-1).float().contiguous()
        out[name + ".offset"] = state.offset.reshape(1).float().contiguous()
        out[name + ".nested_quant_map"] = state.state2.code.reshape(-1).float().contiguous()
        for suffix, dtype in (("dequant_f32", torch.float32), ("dequant_bf16", torch.bfloat16)):
            state.dtype = dtype
            out[name + "." + suffix] = F.dequantize_4bit(packed, state).reshape(-1).contiguous()
    save_file(out, sys.argv[2])


if __name__ == "__main__":
    main()
