// Precompiled header of the targets written on torch's C++ frontend
// (torch::nn, torch::optim): the models, the examples, the tests and the
// benchmarks. Parsing the frontend costs about 20 s per translation unit on
// a 2-core machine; for the library's own files, which need only ATen, the
// smaller src/pch.h is faster.
#pragma once
#include "pch.h"
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
