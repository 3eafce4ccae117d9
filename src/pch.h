// Precompiled header for every shardtrain target: parsing LibTorch's headers
// costs ~20 s per translation unit on a 2-core machine.
#pragma once
#include <ATen/ATen.h>
#include <torch/torch.h>
#include "build_config.h"
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <spdlog/spdlog.h>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>
