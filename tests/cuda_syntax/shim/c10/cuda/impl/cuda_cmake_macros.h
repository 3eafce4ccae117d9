#pragma once
// Stand-in for the header a CUDA build of LibTorch generates at its own
// configure time (Debian's CPU LibTorch ships c10/cuda without it). Used only
// by the syntax-only compile of the CUDA-LibTorch code (check.cmake).
#define C10_CUDA_BUILD_SHARED_LIBS
