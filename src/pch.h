// Precompiled header of the library and the CLI: ATen and the standard and
// logging headers every file uses. Not torch/torch.h: the library's files use
// ATen, and a header that holds the whole C++ frontend makes each of them
// instantiate and compile its inline code (measured with GCC 12 -O3 on one
// translation unit: 13.5 s with the frontend in the header, 6.5 s without).
// Targets on the frontend (torch::nn: the models, the examples, the tests and
// the benchmarks) use src/pch_frontend.h.
#pragma once
#include <ATen/ATen.h>
#include "build_config.h"
#include <spdlog/spdlog.h>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>
