// The offline checkpoint tools (src/checkpoint/export.h and `shardtrain
// checkpoint ...`) on a checkpoint written by hand in save()'s format, so the
// tests need no engine or communicator and control every byte of the files.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <ATen/ATen.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "build_config.h"
#include "checkpoint/export.h"
#include "checkpoint/format.h"
#include "shardtrain/checkpoint_location.h"
#include "support/scratch_dir.h"
#include "shardtrain/error.h"
#include "shardtrain/safetensors.h"

namespace ck = shardtrain::checkpoint;
namespace st = shardtrain::safetensors;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// One slice of one parameter as a rank file stores it.
struct HandSlice {
  std::string param;
  int64_t begin;
  int64_t length;
};

class UnitCheckpointTools : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = dir_ / "ckpt";
    ckpt_ = root_ / "step_4";
    write_checkpoint();
  }

  // Values that bf16 cannot hold exactly, so the bf16 export is a real cast.
  static at::Tensor values(const std::vector<int64_t>& shape, double offset) {
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    return (at::arange(numel, at::kFloat) * 0.3719 + offset).reshape(shape);
  }

  // Three parameters over two rank files, as a 2-rank zero save lays them out:
  // "w" [3,5] split [0,8) on rank 0 and [8,15) on rank 1; "b" [5] whole on
  // rank 1; "layer.norm" [2,2] split [0,1) + [1,4).
  void write_checkpoint() {
    fs::create_directories(ckpt_);
    originals_["w"] = values({3, 5}, 0.013);
    originals_["b"] = values({5}, -1.27);
    originals_["layer.norm"] = values({2, 2}, 3.141);
    const std::vector<std::vector<HandSlice>> ranks = {
        {{"w", 0, 8}, {"layer.norm", 0, 1}},
        {{"w", 8, 7}, {"b", 0, 5}, {"layer.norm", 1, 3}},
    };
    json params = json::object();
    json files = json::object();
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      const std::string file = "rank0000" + std::to_string(r) + ".safetensors";
      std::vector<std::pair<std::string, at::Tensor>> tensors;
      for (const auto& s : ranks[r]) {
        const at::Tensor master = originals_.at(s.param).reshape({-1}).narrow(0, s.begin, s.length).clone();
        const std::string prefix = s.param + "@" + std::to_string(s.begin) + "/";
        tensors.emplace_back(prefix + "master", master);
        tensors.emplace_back(prefix + "exp_avg", master * 0.5);
        tensors.emplace_back(prefix + "exp_avg_sq", master * master);
        auto& p = params[s.param];
        p["shape"] = originals_.at(s.param).sizes().vec();
        p["dtype"] = "Float";
        p["trainable"] = true;
        p["slices"].push_back({{"file", file},
                               {"begin", s.begin},
                               {"length", s.length},
                               {"kinds", {"master", "exp_avg", "exp_avg_sq"}}});
      }
      tensors.emplace_back("rng/cpu", at::zeros({16}, at::kByte));
      const std::string path = (ckpt_ / file).string();
      st::write_file(path, tensors, {{"format", "shardtrain-checkpoint"}, {"rank", std::to_string(r)}}, false);
      files[file] = {{"size", fs::file_size(path)}, {"crc32", st::crc32_of_file(path)}, {"rank", r}};
    }
    const json index = {{"format_version", 1},
                        {"engine", "zero"},
                        {"world_size", 2},
                        {"training_state", {{"step", 4}, {"epoch", 1}}},
                        {"config", "distributed_type: DEEPSPEED\n"},
                        {"precision_plan", "fp32 masters\n"},
                        {"params", params},
                        {"files", files}};
    write_index(index);
    std::ofstream(root_ / "latest") << "step_4\n";
  }

  json read_index() const {
    std::ifstream in(ckpt_ / "index.json");
    return json::parse(in);
  }
  void write_index(const json& index) const { std::ofstream(ckpt_ / "index.json") << index.dump(1); }

  static std::string joined(const std::vector<std::string>& problems) {
    std::string all;
    for (const auto& p : problems) all += p + "\n";
    return all;
  }

  // Asserts verify() reports exactly one problem containing every needle.
  void expect_one_problem(const std::vector<std::string>& needles) const {
    const ck::VerifyReport report = ck::verify(root_.string());
    ASSERT_EQ(report.problems.size(), 1u) << joined(report.problems);
    for (const auto& needle : needles) {
      EXPECT_NE(report.problems[0].find(needle), std::string::npos)
          << "missing '" << needle << "' in: " << report.problems[0];
    }
  }

  // Runs the built CLI; returns its exit code and leaves its output in `output`.
  int run_cli(const std::string& args, std::string& output) const {
    const fs::path log = dir_ / "cli.log";
    const std::string command = std::string(SHARDTRAIN_BIN_DIR) + "/shardtrain " + args + " > " + log.string() + " 2>&1";
    const int status = std::system(command.c_str());
    std::ifstream in(log);
    std::stringstream text;
    text << in.rdbuf();
    output = text.str();
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  const shardtrain::testing::ScratchDir scratch_;
  const fs::path dir_ = scratch_.path();
  fs::path root_;
  fs::path ckpt_;
  std::map<std::string, at::Tensor> originals_;
};

TEST_F(UnitCheckpointTools, ResolvesRootAndTagDirectories) {
  EXPECT_EQ(fs::path(ck::resolve_checkpoint_dir(root_.string())), ckpt_);
  EXPECT_EQ(fs::path(ck::resolve_checkpoint_dir(ckpt_.string())), ckpt_);
  EXPECT_THROW(ck::resolve_checkpoint_dir((dir_ / "nowhere").string()), shardtrain::Error);
  EXPECT_THROW(ck::resolve_checkpoint_dir(dir_.string()), shardtrain::Error);  // neither latest nor index.json
}

TEST_F(UnitCheckpointTools, VerifyAcceptsAnIntactCheckpoint) {
  for (const fs::path& path : {root_, ckpt_}) {
    const ck::VerifyReport report = ck::verify(path.string());
    EXPECT_TRUE(report.ok()) << joined(report.problems);
    EXPECT_EQ(report.files, 2u);
    EXPECT_EQ(report.params, 3u);
  }
}

TEST_F(UnitCheckpointTools, ExportFp32ReproducesTheParametersExactly) {
  const fs::path out = dir_ / "hf";
  ck::export_hf(root_.string(), out.string());
  EXPECT_FALSE(fs::exists(out / "model.safetensors.index.json"));
  st::Reader reader((out / "model.safetensors").string());
  EXPECT_EQ(reader.metadata().at("format"), "pt");
  EXPECT_EQ(reader.data_offset() % 8, 0u);
  const auto names = reader.names();
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()), (std::set<std::string>{"w", "b", "layer.norm"}));
  for (const auto& [name, original] : originals_) {
    const at::Tensor exported = reader.read(name);
    EXPECT_EQ(exported.scalar_type(), at::kFloat) << name;
    EXPECT_EQ(exported.sizes(), original.sizes()) << name;
    EXPECT_TRUE(at::equal(exported, original)) << name;
  }
  // Nothing but the export itself is left next to it.
  for (const auto& entry : fs::directory_iterator(dir_)) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp-export"), std::string::npos) << entry.path();
  }
}

TEST_F(UnitCheckpointTools, ExportBf16CastsEachParameter) {
  const fs::path out = dir_ / "hf_bf16";
  ck::ExportOptions options;
  options.dtype = "bf16";
  ck::export_hf(ckpt_.string(), out.string(), options);
  st::Reader reader((out / "model.safetensors").string());
  for (const auto& [name, original] : originals_) {
    const at::Tensor exported = reader.read(name);
    EXPECT_EQ(exported.scalar_type(), at::kBFloat16) << name;
    EXPECT_TRUE(at::equal(exported, original.to(at::kBFloat16))) << name;
  }
  // fp16 (DeepSpeed's 16-bit model of an fp16 run), and the config.json
  // written names the weights' dtype under both names transformers reads.
  const fs::path config = dir_ / "fp16_config.json";
  std::ofstream(config) << R"({"model_type": "tiny", "torch_dtype": "float32", "dtype": "bfloat16"})";
  options.dtype = "fp16";
  options.config_json_path = config.string();
  ck::export_hf(ckpt_.string(), (dir_ / "hf_fp16").string(), options);
  st::Reader half((dir_ / "hf_fp16" / "model.safetensors").string());
  for (const auto& [name, original] : originals_) {
    EXPECT_TRUE(at::equal(half.read(name), original.to(at::kHalf))) << name;
  }
  const json written = json::parse(std::ifstream(dir_ / "hf_fp16" / "config.json"));
  EXPECT_EQ(written.at("torch_dtype"), "float16");
  EXPECT_EQ(written.at("dtype"), "float16");
  EXPECT_EQ(written.at("model_type"), "tiny");
  options.dtype = "int8";
  EXPECT_THROW(ck::export_hf(ckpt_.string(), (dir_ / "hf_int8").string(), options), shardtrain::Error);
}

TEST_F(UnitCheckpointTools, ExportShardsWhenPastTheLimitAndWritesAnIndex) {
  const fs::path out = dir_ / "hf_sharded";
  fs::create_directories(out);
  std::ofstream(out / "tokenizer.json") << "{}";  // an existing model directory's other files stay
  const fs::path config = dir_ / "model_config.json";
  std::ofstream(config) << R"({"model_type": "tiny", "hidden_size": 5})";
  ck::ExportOptions options;
  options.max_shard_bytes = 20;  // b (20 B), layer.norm (16 B), w (60 B): one shard each
  options.config_json_path = config.string();
  ck::export_hf(root_.string(), out.string(), options);

  EXPECT_FALSE(fs::exists(out / "model.safetensors"));
  EXPECT_TRUE(fs::exists(out / "tokenizer.json"));
  std::ifstream config_in(out / "config.json");
  const json written_config = json::parse(config_in);
  EXPECT_EQ(written_config.at("model_type"), "tiny");
  EXPECT_EQ(written_config.at("torch_dtype"), "float32");  // added: from_pretrained reads it
  EXPECT_FALSE(written_config.contains("dtype"));           // transformers < 5 would not know it
  std::ifstream index_in(out / "model.safetensors.index.json");
  const json index = json::parse(index_in);
  EXPECT_EQ(index.at("metadata").at("total_size").get<uint64_t>(), (15u + 5u + 4u) * 4u);
  const json& weight_map = index.at("weight_map");
  ASSERT_EQ(weight_map.size(), originals_.size());
  std::set<std::string> shard_files;
  for (const auto& [name, original] : originals_) {
    ASSERT_TRUE(weight_map.contains(name)) << name;
    const std::string file = weight_map.at(name).get<std::string>();
    shard_files.insert(file);
    st::Reader reader((out / file).string());
    ASSERT_TRUE(reader.contains(name)) << name << " not in " << file;
    EXPECT_TRUE(at::equal(reader.read(name), original)) << name;
  }
  EXPECT_EQ(shard_files, (std::set<std::string>{"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                                "model-00003-of-00003.safetensors"}));

  // Exporting again unsharded replaces the shards: a stale index would
  // otherwise point loaders at the old files.
  ck::export_hf(root_.string(), out.string());
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
  EXPECT_FALSE(fs::exists(out / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(out / "model-00001-of-00003.safetensors"));
  EXPECT_TRUE(fs::exists(out / "tokenizer.json"));
}

TEST_F(UnitCheckpointTools, VerifyReportsATruncatedFileAndExportRefusesIt) {
  const fs::path file = ckpt_ / "rank00001.safetensors";
  fs::resize_file(file, fs::file_size(file) - 4);
  expect_one_problem({"rank00001.safetensors", "truncated"});
  try {
    ck::export_hf(root_.string(), (dir_ / "hf").string());
    ADD_FAILURE() << "exported a damaged checkpoint";
  } catch (const shardtrain::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("refusing to export"), std::string::npos) << what;
    EXPECT_NE(what.find("rank00001.safetensors"), std::string::npos) << what;
  }
  EXPECT_FALSE(fs::exists(dir_ / "hf"));
}

TEST_F(UnitCheckpointTools, VerifyReportsACrcMismatch) {
  const fs::path file = ckpt_ / "rank00000.safetensors";
  {
    std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(-1, std::ios::end);
    const char last = static_cast<char>(io.get());
    io.seekp(-1, std::ios::end);
    io.put(static_cast<char>(last ^ 0x5a));
  }
  expect_one_problem({"rank00000.safetensors", "fails its CRC-32 check"});
}

TEST_F(UnitCheckpointTools, VerifyReportsAMissingFile) {
  fs::remove(ckpt_ / "rank00001.safetensors");
  expect_one_problem({"rank00001.safetensors", "is missing"});
}

TEST_F(UnitCheckpointTools, VerifyReportsGapsAndOverlapsInSlices) {
  json index = read_index();
  index["params"]["w"]["slices"].erase(1);  // drops [8, 15)
  write_index(index);
  expect_one_problem({"parameter 'w'", "[8, 15)", "gap"});

  index["params"]["b"]["slices"].push_back(index["params"]["b"]["slices"][0]);
  write_index(index);
  const ck::VerifyReport report = ck::verify(ckpt_.string());
  ASSERT_EQ(report.problems.size(), 2u) << joined(report.problems);
  EXPECT_NE(joined(report.problems).find("parameter 'b': elements [0, 5) are in more than one slice"),
            std::string::npos)
      << joined(report.problems);
}

TEST_F(UnitCheckpointTools, VerifyReportsAnIndexThatDisagreesWithItsFile) {
  json index = read_index();
  index["params"]["b"]["slices"][0]["begin"] = 1;  // no tensor "b@1/master" in the file
  index["params"]["b"]["slices"][0]["length"] = 4;
  write_index(index);
  const std::string all = joined(ck::verify(root_.string()).problems);
  EXPECT_NE(all.find("has no tensor 'b@1/master'"), std::string::npos) << all;
  EXPECT_NE(all.find("parameter 'b': elements [0, 1) are in no slice"), std::string::npos) << all;
}

TEST_F(UnitCheckpointTools, AnotherFormatVersionIsReportedAsSuchWhateverItsLayout) {
  // A later version may lay out files and params differently: the version is
  // the one problem to report, not a field of this version's layout.
  write_index({{"format_version", 3}, {"files", {{"shards", json::array()}}}});
  expect_one_problem({"format version 3", "this shardtrain reads versions 1 and 2"});
}

TEST_F(UnitCheckpointTools, AShapeWithMoreElementsThanAnInt64IsRefusedByName) {
  json index = read_index();
  index["params"]["b"]["shape"] = {int64_t{1} << 40, int64_t{1} << 40};
  write_index(index);
  expect_one_problem({"parameter 'b'", "more elements than an int64 counts"});
}

TEST_F(UnitCheckpointTools, InspectListsParametersFilesAndState) {
  const std::string text = ck::inspect(root_.string());
  for (const std::string needle : {"w", "b", "layer.norm", "[3, 5]", "[5]", "[2, 2]", "Float", "15",
                                   "rank00000.safetensors", "rank00001.safetensors", "zero", "world size 2",
                                   "\"step\": 4"}) {
    EXPECT_NE(text.find(needle), std::string::npos) << "missing '" << needle << "' in:\n" << text;
  }
}

TEST_F(UnitCheckpointTools, CliVerifyAndExportExitCodes) {
  std::string output;
  EXPECT_EQ(run_cli("checkpoint verify " + root_.string(), output), 0) << output;
  EXPECT_NE(output.find("OK: 2 files, 3 parameters verified"), std::string::npos) << output;

  EXPECT_EQ(run_cli("checkpoint export " + root_.string() + " --out " + (dir_ / "cli_hf").string() +
                        " --dtype bf16 --max-shard-size 20",
                    output),
            0)
      << output;
  EXPECT_TRUE(fs::exists(dir_ / "cli_hf" / "model.safetensors.index.json")) << output;

  EXPECT_EQ(run_cli("checkpoint inspect " + ckpt_.string(), output), 0) << output;
  EXPECT_NE(output.find("layer.norm"), std::string::npos) << output;

  fs::resize_file(ckpt_ / "rank00000.safetensors", 10);
  EXPECT_EQ(run_cli("checkpoint verify " + root_.string(), output), 1) << output;
  EXPECT_NE(output.find("rank00000.safetensors"), std::string::npos) << output;
  EXPECT_EQ(run_cli("checkpoint export " + root_.string() + " --out " + (dir_ / "cli_hf2").string(), output), 2)
      << output;
  EXPECT_EQ(run_cli("checkpoint verify " + (dir_ / "nowhere").string(), output), 2) << output;
  EXPECT_NE(output.find("does not exist"), std::string::npos) << output;

  // A checkpoint that lost its index is damaged (1), as --help says, not "no checkpoint" (2).
  fs::remove(ckpt_ / "index.json");
  for (const fs::path& path : {root_, ckpt_}) {
    EXPECT_EQ(run_cli("checkpoint verify " + path.string(), output), 1) << output;
    EXPECT_NE(output.find("index.json is missing"), std::string::npos) << output;
  }
  EXPECT_EQ(run_cli("checkpoint verify --help", output), 0) << output;
  EXPECT_NE(output.find("1 if damaged (a missing index included), 2 if PATH holds no checkpoint"), std::string::npos)
      << output;
}

TEST_F(UnitCheckpointTools, AnEditedIndexIsRefusedNamingTheFieldItChanged) {
  json sealed = read_index();
  sealed["format_version"] = ck::kFormatVersion;
  ck::seal_index(sealed);
  write_index(sealed);
  ASSERT_TRUE(ck::verify(root_.string()).ok()) << joined(ck::verify(root_.string()).problems);
  // What a resume reads (the step, the sampler, the loss scaler live in the
  // training state), what it loads (params, files), and the checksums themselves.
  const std::vector<std::pair<std::function<void(json&)>, std::string>> edits = {
      {[](json& j) { j["training_state"]["step"] = 1; }, "training_state.step"},
      {[](json& j) { j["training_state"]["sampler"] = {{"position", 0}}; }, "training_state.sampler (added)"},
      {[](json& j) { j["training_state"].erase("epoch"); }, "training_state.epoch (removed)"},
      {[](json& j) { j["params"]["b"]["dtype"] = "BFloat16"; }, "params.b"},
      {[](json& j) { j["files"]["rank00000.safetensors"]["crc32"] = 7; }, "files.rank00000.safetensors"},
      {[](json& j) { j["world_size"] = 4; }, "world_size"},
      {[](json& j) { j.erase("checksums"); }, "checksums (missing)"},
  };
  for (const auto& [edit, field] : edits) {
    json edited = sealed;
    edit(edited);
    write_index(edited);
    expect_one_problem({"index.json was edited after the save", field});
  }
  // The same index sealed again after the edit is intact: only the checksums decide.
  json resealed = sealed;
  resealed["training_state"]["step"] = 1;
  ck::seal_index(resealed);
  write_index(resealed);
  EXPECT_TRUE(ck::verify(root_.string()).ok()) << joined(ck::verify(root_.string()).problems);
}

TEST_F(UnitCheckpointTools, IndexesAndHeadersNestedBeyondTheLimitAreRefusedByName) {
  std::string deep;
  for (int i = 0; i < 20000; ++i) deep += "{\"a\":";
  deep += "1" + std::string(20000, '}');
  std::ofstream(ckpt_ / "index.json") << deep;
  expect_one_problem({"index.json", "nests objects and arrays deeper than 64 levels"});
  // A safetensors header: 8 bytes of length, then the JSON.
  const fs::path file = dir_ / "deep.safetensors";
  {
    std::ofstream out(file, std::ios::binary);
    const uint64_t length = deep.size();
    out.write(reinterpret_cast<const char*>(&length), sizeof length);
    out << deep;
  }
  try {
    st::Reader reader(file.string());
    FAIL() << "a header nested 20000 deep was read";
  } catch (const shardtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("deeper than 64 levels"), std::string::npos) << e.what();
  }
}


// --resume as Trainer and Accelerate users write it: the run's output
// directory, its checkpoints directory, one checkpoint, or `latest`; anything
// else lists what is there.
TEST(UnitCheckpointLocation, ResumeFindsTheCheckpointTheWayUsersPointAtIt) {
  shardtrain::testing::ScratchDir scratch;
  const fs::path run = scratch.file("run");
  fs::create_directories(run / "checkpoints" / "step_5");
  fs::create_directories(run / "checkpoints" / "step_10");
  std::ofstream(run / "checkpoints" / "step_5" / "index.json") << "{}";
  std::ofstream(run / "checkpoints" / "step_10" / "index.json") << "{}";
  std::ofstream(run / "checkpoints" / "latest") << "step_10\n";
  const std::string checkpoints = (run / "checkpoints").string();

  auto output_dir = shardtrain::find_checkpoint(run.string(), "unused");
  EXPECT_EQ(output_dir.dir, checkpoints);
  EXPECT_EQ(output_dir.tag, "");
  EXPECT_EQ(shardtrain::find_checkpoint(checkpoints, "unused").dir, checkpoints);
  auto one = shardtrain::find_checkpoint((run / "checkpoints" / "step_5").string(), "unused");
  EXPECT_EQ(one.dir, checkpoints);
  EXPECT_EQ(one.tag, "step_5");
  EXPECT_EQ(shardtrain::find_checkpoint("latest", run.string()).dir, checkpoints);

  try {
    shardtrain::find_checkpoint(scratch.file(""), "unused");
    ADD_FAILURE() << "resumed from a directory without a checkpoint";
  } catch (const shardtrain::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("no checkpoint there"), std::string::npos) << e.what();
  }
  fs::remove(run / "checkpoints" / "latest");  // a run killed before its first `latest`
  try {
    shardtrain::find_checkpoint(run.string(), "unused");
    ADD_FAILURE() << "resumed from a run without `latest`";
  } catch (const shardtrain::ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("found: " + checkpoints + "/step_5, " + checkpoints + "/step_10"), std::string::npos) << what;
  }
  EXPECT_EQ(shardtrain::describe_checkpoints_under(scratch.file("nothing-here")),
            "no checkpoint under " + scratch.file("nothing-here"));
}

}  // namespace
