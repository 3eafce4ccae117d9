// The safetensors reader and writer: every dtype round trip, metadata, and
// each malformed file refused with a clear error.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "shardtrain/error.h"
#include "shardtrain/safetensors.h"
#include "support/scratch_dir.h"

namespace st = shardtrain::safetensors;
namespace fs = std::filesystem;

namespace {

class UnitSafetensors : public ::testing::Test {
 protected:
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  std::string write_bytes(const std::string& name, const std::string& bytes) const {
    std::string p = path(name);
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    EXPECT_TRUE(out.good()) << p;
    return p;
  }

  // Asserts that opening `bytes` as a safetensors file fails with a message
  // containing every one of `needles` (and the file's name).
  void expect_rejected(const std::string& bytes, const std::vector<std::string>& needles) const {
    std::string p = write_bytes("bad.safetensors", bytes);
    try {
      st::Reader reader(p);
      ADD_FAILURE() << "accepted a malformed file; expected: " << needles.front();
    } catch (const shardtrain::Error& e) {
      std::string what = e.what();
      EXPECT_NE(what.find("bad.safetensors"), std::string::npos) << what;
      for (const auto& needle : needles) {
        EXPECT_NE(what.find(needle), std::string::npos) << "missing '" << needle << "' in: " << what;
      }
    }
  }

  const shardtrain::testing::ScratchDir scratch_;
  const fs::path dir_ = scratch_.path();
};

std::string le64(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return out;
}

std::string file_bytes(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

// 16 data bytes: a valid buffer for one F32 [2, 2] tensor.
const std::string kData16(16, '\x01');

// Bitwise equality: NaN payloads in random bf16/f16 bits must survive too.
void expect_bit_equal(const at::Tensor& expected, const at::Tensor& actual, const std::string& name) {
  ASSERT_EQ(expected.scalar_type(), actual.scalar_type()) << name;
  ASSERT_EQ(expected.sizes(), actual.sizes()) << name;
  at::Tensor e = expected.contiguous();
  // An empty tensor may have no data pointer, and memcmp(nullptr, ..., 0) is
  // undefined (UBSan under scripts/sanitize).
  if (e.numel() == 0) return;
  ASSERT_EQ(std::memcmp(e.data_ptr(), actual.data_ptr(), e.numel() * e.element_size()), 0) << name;
}

TEST_F(UnitSafetensors, RoundTripsEveryDtypeEmptyTensorsAndMetadata) {
  at::manual_seed(7);
  std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"f64", at::randn({3, 2}, at::kDouble)},
      {"f32", at::randn({4, 5})},
      // Random bit patterns (incl. NaNs/subnormals) check the copy is bit-exact.
      {"f16", at::randint(-32768, 32768, {7}, at::kShort).view(at::kHalf)},
      {"bf16", at::randint(-32768, 32768, {3, 3}, at::kShort).view(at::kBFloat16)},
      {"i64", at::randint(-(int64_t{1} << 40), int64_t{1} << 40, {5}, at::kLong)},
      {"i32", at::randint(-100000, 100000, {2, 2, 2}, at::kInt)},
      {"i16", at::randint(-30000, 30000, {3}, at::kShort)},
      {"i8", at::randint(-128, 128, {9}, at::kChar)},
      {"u8", at::randint(0, 256, {1, 6}, at::kByte)},
      {"bool", at::randint(0, 2, {2, 3}, at::kLong).to(at::kBool)},
      {"empty", at::empty({0}, at::kFloat)},
      {"empty_3d", at::empty({3, 0, 2}, at::kBFloat16)},
      {"scalar", at::scalar_tensor(2.5, at::kDouble)},
      // Non-contiguous input is written as its contiguous (row-major) copy.
      {"transposed", at::arange(6, at::kFloat).reshape({2, 3}).t()},
  };
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"step", "1200"},
                                                       {"ünïcode", "välue"}};
  const std::string p = path("model.safetensors");
  st::write_file(p, tensors, metadata);

  st::Reader reader(p);
  EXPECT_EQ(reader.metadata(), metadata);
  EXPECT_EQ(reader.file_size(), fs::file_size(p));
  EXPECT_EQ(reader.data_offset() % 8, 0u) << "writer must align the data buffer";
  std::vector<std::string> expected_names;
  for (const auto& [name, t] : tensors) expected_names.push_back(name);
  EXPECT_EQ(reader.names(), expected_names);
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(reader.contains(name)) << name;
    const auto& info = reader.info(name);
    EXPECT_EQ(info.dtype, t.scalar_type()) << name;
    EXPECT_EQ(info.shape, t.sizes().vec()) << name;
    EXPECT_EQ(info.nbytes(), static_cast<uint64_t>(t.numel() * t.element_size())) << name;
    at::Tensor back = reader.read(name);
    EXPECT_EQ(back.device(), at::kCPU);
    expect_bit_equal(t, back, name);
  }
  EXPECT_FALSE(reader.contains("missing"));
  try {
    reader.read("missing");
    FAIL() << "read of an absent tensor succeeded";
  } catch (const shardtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no tensor 'missing'"), std::string::npos) << e.what();
  }
}

TEST_F(UnitSafetensors, NoMetadataAndNoTensors) {
  const std::string p = path("empty.safetensors");
  st::write_file(p, {}, {}, /*fsync=*/false);
  st::Reader reader(p);
  EXPECT_TRUE(reader.names().empty());
  EXPECT_TRUE(reader.metadata().empty());
  EXPECT_EQ(reader.file_size() % 8, 0u);
}

TEST_F(UnitSafetensors, ReadSliceReadsElementsOfTheFlattenedTensor) {
  const std::string p = path("slice.safetensors");
  at::Tensor a = at::arange(24, at::kFloat).reshape({2, 3, 4});
  at::Tensor b = at::arange(10, at::kLong);
  st::write_file(p, {{"a", a}, {"b", b}});
  st::Reader reader(p);
  at::Tensor s = reader.read_slice("a", 5, 7);
  EXPECT_EQ(s.sizes(), (std::vector<int64_t>{7}));
  EXPECT_TRUE(at::equal(s, at::arange(5, 12, at::kFloat)));
  EXPECT_TRUE(at::equal(reader.read_slice("b", 9, 1), at::arange(9, 10, at::kLong)));
  EXPECT_TRUE(at::equal(reader.read_slice("b", 0, 10), b));
  EXPECT_EQ(reader.read_slice("a", 24, 0).numel(), 0);
  for (auto [begin, length] : {std::pair<int64_t, int64_t>{20, 5}, {-1, 2}, {0, -1}, {25, 0}}) {
    try {
      reader.read_slice("a", begin, length);
      FAIL() << "slice " << begin << "+" << length << " accepted";
    } catch (const shardtrain::Error& e) {
      EXPECT_NE(std::string(e.what()).find("outside its 24 elements"), std::string::npos) << e.what();
    }
  }
}

// Bytes laid out the way Python's safetensors.torch.save_file writes
// {"weight": [[1, 2], [3, 4]] f32, "bias": [0.5] f16}, metadata {"format": "pt"}:
// compact JSON, __metadata__ first, tensors sorted by dtype size then name,
// header padded with spaces to a multiple of 8.
TEST_F(UnitSafetensors, ReadsTheReferenceLayout) {
  std::string header =
      R"({"__metadata__":{"format":"pt"},"weight":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
      R"("bias":{"dtype":"F16","shape":[1],"data_offsets":[16,18]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  const unsigned char data[] = {0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0x40,   // 1.0f 2.0f
                                0x00, 0x00, 0x40, 0x40, 0x00, 0x00, 0x80, 0x40,   // 3.0f 4.0f
                                0x00, 0x38};                                      // 0.5 (f16)
  const std::string p = write_bytes(
      "reference.safetensors",
      file_bytes(header, std::string(reinterpret_cast<const char*>(data), sizeof(data))));

  st::Reader reader(p);
  EXPECT_EQ(reader.names(), (std::vector<std::string>{"weight", "bias"}));
  EXPECT_EQ(reader.metadata().at("format"), "pt");
  at::Tensor w = reader.read("weight");
  EXPECT_TRUE(at::equal(w, at::tensor({1.0f, 2.0f, 3.0f, 4.0f}).reshape({2, 2})));
  at::Tensor bias = reader.read("bias");
  EXPECT_EQ(bias.scalar_type(), at::kHalf);
  EXPECT_EQ(bias.item<float>(), 0.5f);
  EXPECT_EQ(reader.info("bias").data_begin, 16u);
  EXPECT_EQ(reader.read_slice("weight", 3, 1).item<float>(), 4.0f);
}

TEST_F(UnitSafetensors, RejectsMalformedFilesNamingFileTensorAndProblem) {
  const std::string w_ok = R"("dtype":"F32","shape":[2,2],"data_offsets":[0,16])";
  auto one = [&](const std::string& entry) { return file_bytes(R"({"w":{)" + entry + "}}", kData16); };

  expect_rejected("abc", {"3 bytes, shorter than the 8-byte header length"});
  expect_rejected(le64(100) + "{}", {"header length 100 runs past the end of the file"});
  expect_rejected(le64(uint64_t{1} << 62) + "{}", {"absurdly large"});
  expect_rejected(file_bytes(R"({"w": {"dtype": )", kData16), {"header is not valid JSON", "parse error"});
  expect_rejected(file_bytes("[1, 2, 3]", ""), {"header is not a JSON object"});
  expect_rejected(file_bytes(R"({"w": 3})", ""), {"tensor 'w': entry is number"});
  expect_rejected(one(R"("shape":[2,2],"data_offsets":[0,16])"), {"tensor 'w': missing 'dtype'"});
  expect_rejected(one(R"("dtype":"F32","data_offsets":[0,16])"), {"tensor 'w': missing 'shape'"});
  expect_rejected(one(R"("dtype":"F32","shape":[2,2])"), {"tensor 'w': missing 'data_offsets'"});
  expect_rejected(one(R"("dtype":"C64","shape":[2,2],"data_offsets":[0,16])"),
                  {"tensor 'w': unknown dtype 'C64'", "BF16"});
  expect_rejected(one(R"("dtype":"F32","shape":[-2,-2],"data_offsets":[0,16])"),
                  {"tensor 'w': shape [-2,-2] has a negative dimension -2"});
  expect_rejected(one(R"("dtype":"F32","shape":[2.5,2],"data_offsets":[0,16])"),
                  {"tensor 'w': shape [2.5,2] has a non-integer dimension"});
  expect_rejected(one(R"("dtype":"F32","shape":["2",2],"data_offsets":[0,16])"),
                  {"tensor 'w': shape", "non-integer dimension \"2\""});
  expect_rejected(one(R"("dtype":"F32","shape":[2,2],"data_offsets":[0])"),
                  {"tensor 'w': data_offsets [0] is not [begin, end]"});
  expect_rejected(one(R"("dtype":"F32","shape":[2,2],"data_offsets":[16,0])"),
                  {"tensor 'w': data_offsets [16, 0] has begin after end"});
  expect_rejected(one(R"("dtype":"F32","shape":[2,2],"data_offsets":[0,32])"),
                  {"tensor 'w': data_offsets [0, 32] run past the end of the data buffer, which holds 16 bytes"});
  expect_rejected(one(R"("dtype":"F32","shape":[2,2],"data_offsets":[0,12])"),
                  {"bad.safetensors: tensor 'w': data_offsets [0, 12] hold 12 bytes but shape [2, 2] of F32 needs 16"});
  expect_rejected(one(R"("dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,16])"),
                  {"tensor 'w':", "is too large"});
  expect_rejected(one(R"("dtype":"U8","shape":[0,4294967296,4294967296],"data_offsets":[0,0])"),
                  {"tensor 'w':", "is too large"});
  expect_rejected(file_bytes(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                             R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
                             std::string(24, '\0')),
                  {"tensor 'b': data_offsets [8, 24] overlap tensor 'a' at [0, 16]"});
  expect_rejected(file_bytes(R"({"w":{)" + w_ok + R"(},"w":{)" + w_ok + "}}", kData16),
                  {"header lists 'w' twice"});
  expect_rejected(file_bytes(R"({"__metadata__":{"epoch":3},"w":{)" + w_ok + "}}", kData16),
                  {"__metadata__ value for 'epoch' is number"});
  expect_rejected(file_bytes(R"({"__metadata__":[1],"w":{)" + w_ok + "}}", kData16),
                  {"__metadata__ is array"});
}

TEST_F(UnitSafetensors, EmptyTensorsMayShareAnOffset) {
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},)"
      R"("b":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
      R"("c":{"dtype":"I8","shape":[2,0],"data_offsets":[16,16]}})";
  st::Reader reader(write_bytes("e.safetensors", file_bytes(header, kData16)));
  EXPECT_EQ(reader.read("a").numel(), 0);
  EXPECT_EQ(reader.read("c").sizes(), (std::vector<int64_t>{2, 0}));
}

TEST_F(UnitSafetensors, OneByteTruncationNamesTheTensorMissingBytes) {
  const std::string p = path("t.safetensors");
  st::write_file(p, {{"first", at::ones({3})}, {"last", at::arange(2, at::kLong)}});
  { st::Reader intact(p); }  // the intact file is accepted
  fs::resize_file(p, fs::file_size(p) - 1);
  try {
    st::Reader reader(p);
    FAIL() << "truncated file accepted";
  } catch (const shardtrain::Error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("t.safetensors: tensor 'last'"), std::string::npos) << what;
    EXPECT_NE(what.find("run past the end of the data buffer"), std::string::npos) << what;
  }
}

TEST_F(UnitSafetensors, BoolBytesOtherThanZeroOrOneAreRejectedOnRead) {
  const std::string header = R"({"m":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})";
  st::Reader reader(write_bytes("b.safetensors", file_bytes(header, std::string("\x01\x00\x07", 3))));
  try {
    reader.read("m");
    FAIL() << "bool byte 7 accepted";
  } catch (const shardtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'm': BOOL element 2 has byte value 7"),
              std::string::npos)
        << e.what();
  }
  // at::tensor({true, false}) is unimplemented in LibTorch 1.13; compare as bytes.
  EXPECT_TRUE(at::equal(reader.read_slice("m", 0, 2).to(at::kByte), at::tensor({1, 0}).to(at::kByte)));
}

TEST_F(UnitSafetensors, WriterRejectsBadInputsAndNamesPathOnIoErrors) {
  const std::string p = path("w.safetensors");
  auto expect_write_error = [&](const std::string& target,
                                const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                const std::string& needle) {
    try {
      st::write_file(target, tensors);
      FAIL() << "write accepted; expected " << needle;
    } catch (const shardtrain::Error& e) {
      std::string what = e.what();
      EXPECT_NE(what.find(needle), std::string::npos) << what;
      EXPECT_NE(what.find(target), std::string::npos) << what;
    }
  };
  expect_write_error(p, {{"x", at::ones({1})}, {"x", at::ones({1})}}, "tensor 'x' appears twice");
  expect_write_error(p, {{"__metadata__", at::ones({1})}}, "reserved");
  expect_write_error(p, {{"", at::ones({1})}}, "must not be empty");
  expect_write_error(p, {{"c", at::ones({1}, at::kComplexFloat)}}, "has dtype ComplexFloat");
  expect_write_error(p, {{"u", at::Tensor()}}, "tensor 'u' is undefined");
  expect_write_error(path("no/such/dir/x.safetensors"), {{"x", at::ones({1})}},
                     "No such file or directory");
}

TEST_F(UnitSafetensors, Crc32OfFileMatchesZlib) {
  // The standard CRC-32 check value of "123456789".
  EXPECT_EQ(st::crc32_of_file(write_bytes("c.txt", "123456789")), 0xCBF43926u);
  EXPECT_EQ(st::crc32_of_file(write_bytes("empty.txt", "")), 0u);
  try {
    st::crc32_of_file(path("absent"));
    FAIL();
  } catch (const shardtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("absent"), std::string::npos) << e.what();
  }
}

}  // namespace
