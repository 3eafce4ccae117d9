#pragma once
// Access to an Accelerator's engine for shardtrain's own tests and tools. Not
// installed: the engine types live in src/ and change without notice.

#include "engine/engine.h"
#include "shardtrain/accelerator.h"

namespace shardtrain {

struct AcceleratorInternals {
  /// The engine prepare() created (throws before prepare()).
  static engine::Engine& engine(Accelerator& accelerator) { return accelerator.engine(); }
};

}  // namespace shardtrain
