// checkpoint/durable_file.h: the checked, fsynced writes under every
// checkpoint, safetensors file and export. A full disk (/dev/full answers
// every write with ENOSPC), a missing directory and a failed fsync each
// become an error that names the save and the file.
#include <filesystem>
#include <fstream>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "checkpoint/durable_file.h"
#include "shardtrain/error.h"
#include "shardtrain/safetensors.h"
#include "support/contains.h"
#include "support/scratch_dir.h"

namespace fs = std::filesystem;
using shardtrain::checkpoint::DurableFile;
using shardtrain::testing::error_message_of;

namespace {

std::string read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

TEST(UnitDurableFile, WritesEveryByteAndCountsThem) {
  const shardtrain::testing::ScratchDir scratch;
  const fs::path path = scratch.file("data.bin");
  std::string bytes(100000, '\0');
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7);
  DurableFile file(path, "checkpoint");
  file.write(bytes.data(), 3);
  file.write(bytes.data() + 3, bytes.size() - 3);
  EXPECT_EQ(file.written(), bytes.size());
  file.finish();
  EXPECT_EQ(read_all(path), bytes);
  // A second file of the same name replaces the first.
  shardtrain::checkpoint::write_durable_text(path, "short\n", "checkpoint");
  EXPECT_EQ(read_all(path), "short\n");
}

TEST(UnitDurableFile, AFullDiskAMissingDirectoryAndAFailedSyncNameTheSaveAndTheFile) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full here";
  const std::string full = error_message_of([] {
    DurableFile file("/dev/full", "export");
    const char byte = 1;
    file.write(&byte, 1);
  });
  EXPECT_TRUE(shardtrain::testing::contains(full, "export: writing /dev/full failed: No space left on device"))
      << full;
  const shardtrain::testing::ScratchDir scratch;
  const std::string missing = error_message_of([&] { DurableFile file(scratch.file("no/such/dir/x"), "checkpoint"); });
  EXPECT_TRUE(shardtrain::testing::contains(missing, "checkpoint: cannot create " + scratch.file("no/such/dir/x") +
                                                         ": No such file or directory"))
      << missing;
  const std::string sync = error_message_of(
      [&] { shardtrain::checkpoint::sync_directory(scratch.file("absent"), "checkpoint"); });
  EXPECT_TRUE(shardtrain::testing::contains(sync, "checkpoint: cannot open " + scratch.file("absent") + " to fsync it"))
      << sync;
  // The public safetensors writer goes through it too.
  const std::string tensors = error_message_of([] {
    shardtrain::safetensors::write_file("/dev/full", {{"w", at::ones({4})}}, {}, /*fsync=*/false);
  });
  EXPECT_TRUE(shardtrain::testing::contains(tensors, "safetensors: writing /dev/full failed: No space left on device"))
      << tensors;
}

}  // namespace
