#pragma once
// Where the project's data lives at run time: configs/, examples/tiny_llama/
// and bench/models/ under one directory. $SHARDTRAIN_DATA_DIR when set, since
// a GPU bundle (scripts/gpu-bundle) runs far from the tree it was built in and
// carries that data in its share/shardtrain; else the source tree the binary
// was built from.

#include <cstdlib>
#include <string>

#include "build_config.h"  // SHARDTRAIN_SOURCE_DIR

inline std::string shardtrain_data_dir() {
  const char* dir = std::getenv("SHARDTRAIN_DATA_DIR");
  return dir != nullptr && *dir != '\0' ? std::string(dir) : std::string(SHARDTRAIN_SOURCE_DIR);
}
