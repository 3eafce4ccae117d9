// Checkpoints: exact resume in new processes, resume across engines and world
// sizes, and damaged checkpoints refused with the file and parameter named.

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "checkpoint/format.h"
#include "shardtrain/safetensors.h"

#include "shardtrain/error.h"
#include "support/log_capture.h"
#include "support/multirank.h"
#include "support/run_outputs.h"
#include "support/test_scratch.h"
#include "support/tiny_compare.h"
#include "tiny/tiny_train.h"

namespace {

namespace fs = std::filesystem;
using shardtrain::MixedPrecision;
using shardtrain::testing::MultiRankOptions;
using shardtrain::testing::RankContext;
using shardtrain::testing::run_on_ranks;
using shardtrain::testing::test_scratch_subdir;

struct RunSpec {
  shardtrain::TrainingConfig config;
  int world;
  int micro_batch;  ///< world x micro_batch is the same global batch in every spec
};

RunSpec zero(int stage, int world, int micro) { return {shardtrain::testing::zero_test_config(stage, MixedPrecision::kNo), world, micro}; }

RunSpec fsdp(int world, int micro) {
  shardtrain::TrainingConfig config;
  config.distributed_type = shardtrain::DistributedType::kFsdp;
  config.fsdp.auto_wrap_policy = shardtrain::AutoWrapPolicy::kTransformerBased;
  config.fsdp.transformer_layer_cls_to_wrap = {"TinyBlock"};
  config.optimizer.lr = 1e-3;
  config.optimizer.weight_decay = 0.0;  // as the ZeRO specs' DeepSpeed AdamW block (FusedAdam's default)
  config.steps_per_print = 1000;
  return {config, world, micro};
}

/// Runs train_tiny on spec.world ranks; rank 0 writes the step losses to `losses_out`.
void run(const RunSpec& spec, int steps, const std::string& save_dir, int save_every, int stop_after,
         const std::string& resume_dir, const fs::path& losses_out) {
  MultiRankOptions harness;
  harness.env["CKPT_LOSSES"] = losses_out.string();
  harness.env["CKPT_SAVE"] = save_dir;
  harness.env["CKPT_RESUME"] = resume_dir;
  harness.env["CKPT_SAVE_EVERY"] = std::to_string(save_every);
  harness.env["CKPT_STOP_AFTER"] = std::to_string(stop_after);
  harness.env["CKPT_STEPS"] = std::to_string(steps);
  harness.env["CKPT_MICRO"] = std::to_string(spec.micro_batch);
  const shardtrain::TrainingConfig config = spec.config;
  run_on_ranks(spec.world, [config](RankContext& ctx) {
    tiny::TinyRunOptions options = shardtrain::testing::tiny_run_options(config, ctx, std::atoi(std::getenv("CKPT_STEPS")), 5);
    options.micro_batch = std::atoi(std::getenv("CKPT_MICRO"));
    options.save_dir = std::getenv("CKPT_SAVE");
    options.save_every = std::atoi(std::getenv("CKPT_SAVE_EVERY"));
    options.stop_after = std::atoi(std::getenv("CKPT_STOP_AFTER"));
    options.resume_dir = std::getenv("CKPT_RESUME");
    tiny::TinyRunResult result = tiny::run_tiny(options);
    if (ctx.rank() != 0) return;
    std::ofstream out(std::getenv("CKPT_LOSSES"));
    out.precision(17);
    for (double loss : result.losses) out << loss << "\n";
    // The parameters at the end of the run, in name order, beside the losses.
    std::vector<at::Tensor> params;
    for (const auto& item : result.final_params) params.push_back(item.second);
    torch::save(params, std::string(std::getenv("CKPT_LOSSES")) + ".params");
  }, harness);
}

std::vector<at::Tensor> read_params(const fs::path& losses_path) {
  std::vector<at::Tensor> params;
  torch::load(params, losses_path.string() + ".params");
  return params;
}

TEST(DistCheckpoint, ResumeInNewProcessesIsBitwiseIdenticalInFp32) {
  for (const RunSpec& spec : {zero(3, 2, 4), fsdp(2, 4)}) {
    const fs::path dir = test_scratch_subdir("exact");
    run(spec, 40, "", 0, 0, "", dir / "straight.txt");
    run(spec, 40, (dir / "ckpt").string(), 20, 20, "", dir / "first.txt");
    run(spec, 40, "", 0, 0, (dir / "ckpt").string(), dir / "second.txt");
    if (shardtrain::testing::is_rank_process()) continue;
    const auto straight = shardtrain::testing::read_loss_lines(dir / "straight.txt");
    const auto first = shardtrain::testing::read_loss_lines(dir / "first.txt");
    const auto second = shardtrain::testing::read_loss_lines(dir / "second.txt");
    ASSERT_EQ(straight.size(), 40u);
    ASSERT_EQ(first.size(), 20u);
    ASSERT_EQ(second.size(), 20u);
    EXPECT_TRUE(std::equal(first.begin(), first.end(), straight.begin()));
    EXPECT_TRUE(std::equal(second.begin(), second.end(), straight.begin() + 20))
        << "resumed step 21: " << second[0] << " vs uninterrupted " << straight[20];
    EXPECT_TRUE(fs::exists(dir / "ckpt" / "latest"));
    EXPECT_TRUE(fs::exists(dir / "ckpt" / "step_20" / "index.json"));
  }
}

struct CrossCase {
  RunSpec from;
  RunSpec to;
  const char* name;
};

// What a checkpoint carries maps exactly onto any engine and world size: the
// loaded model is the saved one bit for bit. Where the per-rank arithmetic
// is the same (the same world and micro-batch, either engine) the resumed run
// also continues the uninterrupted one bit for bit; across world sizes the
// ranks add their gradients in another grouping, so the continuation only
// has to train.
TEST(DistCheckpoint, ResumesAcrossEnginesAndWorldSizes) {
  const CrossCase cases[] = {
      {zero(3, 4, 2), fsdp(2, 4), "zero-3 world 4 -> fsdp FULL_SHARD world 2"},
      {fsdp(2, 4), zero(2, 4, 2), "fsdp world 2 -> zero-2 world 4"},
      {zero(3, 2, 4), zero(3, 1, 8), "zero-3 world 2 -> zero-3 world 1"},
      {zero(3, 2, 4), fsdp(2, 4), "zero-3 world 2 -> fsdp FULL_SHARD world 2"},
  };
  for (const auto& c : cases) {
    const fs::path dir = test_scratch_subdir("cross");
    const bool same_arithmetic = c.from.world == c.to.world && c.from.micro_batch == c.to.micro_batch;
    if (same_arithmetic) run(c.from, 30, "", 0, 0, "", dir / "straight.txt");
    run(c.from, 30, (dir / "ckpt").string(), 15, 15, "", dir / "first.txt");
    run(c.to, 15, "", 0, 0, (dir / "ckpt").string(), dir / "loaded.txt");  // loads, trains no step
    run(c.to, 30, "", 0, 0, (dir / "ckpt").string(), dir / "second.txt");
    if (shardtrain::testing::is_rank_process()) continue;
    const auto saved = read_params(dir / "first.txt");
    const auto loaded = read_params(dir / "loaded.txt");
    ASSERT_EQ(saved.size(), loaded.size()) << c.name;
    for (std::size_t i = 0; i < saved.size(); ++i) {
      EXPECT_TRUE(at::equal(saved[i], loaded[i])) << c.name << ": parameter " << i << " changed in the checkpoint";
    }
    const auto first = shardtrain::testing::read_loss_lines(dir / "first.txt");
    const auto second = shardtrain::testing::read_loss_lines(dir / "second.txt");
    ASSERT_EQ(second.size(), 15u) << c.name;
    if (same_arithmetic) {
      const auto straight = shardtrain::testing::read_loss_lines(dir / "straight.txt");
      EXPECT_TRUE(std::equal(second.begin(), second.end(), straight.begin() + 15)) << c.name;
    } else {
      EXPECT_LT(second.back(), first.back()) << c.name << ": the resumed run did not train on";
    }
  }
}

TEST(DistCheckpoint, ResumingAtAnotherWorldSaysWhatChangedInTheBatchAndTheRandomStreams) {
  const fs::path dir = test_scratch_subdir("batch_change");
  run(zero(3, 2, 4), 4, (dir / "ckpt").string(), 2, 2, "", dir / "first.txt");  // global batch 8
  MultiRankOptions harness;
  harness.env["CKPT_DIR"] = (dir / "ckpt").string();
  harness.env["CKPT_LOG"] = (dir / "resume.log").string();
  run_on_ranks(1, [](RankContext& ctx) {
    shardtrain::testing::LogCapture capture;
    tiny::TinyRunOptions options = shardtrain::testing::tiny_run_options(
        shardtrain::testing::zero_test_config(3, MixedPrecision::kNo), ctx, 2, 5);
    options.micro_batch = 4;  // world 1: global batch 4
    options.resume_dir = std::getenv("CKPT_DIR");
    tiny::run_tiny(options);
    std::ofstream(std::getenv("CKPT_LOG")) << capture.text();
  }, harness);
  if (shardtrain::testing::is_rank_process()) return;
  std::ifstream in(dir / "resume.log");
  const std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const std::string needle :
       {"the checkpoint was saved at world 2 with global batch 8 (micro-batch 4 x accumulation 1 x world 2)",
        "this run has world 1 and global batch 4 (micro-batch 4 x accumulation 1 x world 1)",
        "each step now averages 4 samples instead of 8", "the learning-rate schedule continues at step 2",
        "random-number states are kept per rank and restored only at the world size that saved them (2); at "
        "world 1 each rank goes on with its own stream"}) {
    EXPECT_NE(log.find(needle), std::string::npos) << "missing '" << needle << "' in:\n" << log;
  }
}

/// Rewrites the text file `path` through `edit` (a hand edit of a checkpoint file).
void edit_text(const fs::path& path, const std::function<void(std::string&)>& edit) {
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  edit(text);
  std::ofstream(path) << text;
}

/// Overwrites a byte near the end of `file`: in its data, which its CRC-32 covers.
void alter_a_byte(const fs::path& file) {
  std::fstream stream(file, std::ios::in | std::ios::out | std::ios::binary);
  stream.seekp(static_cast<std::streamoff>(fs::file_size(file) - 3));
  stream.put('\x7f');
}

/// Loads `dir` on 2 ranks and expects an error containing `needle`.
void expect_load_error(const fs::path& dir, const std::string& needle) {
  MultiRankOptions harness;
  harness.env["CKPT_DIR"] = dir.string();
  harness.env["CKPT_NEEDLE"] = needle;
  run_on_ranks(2, [](RankContext& ctx) {
    tiny::TinyRunOptions options = shardtrain::testing::tiny_run_options(
        shardtrain::testing::zero_test_config(3, MixedPrecision::kNo), ctx, 2, 5);
    options.resume_dir = std::getenv("CKPT_DIR");
    try {
      tiny::run_tiny(options);
      ADD_FAILURE() << "a damaged checkpoint loaded";
    } catch (const shardtrain::Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::getenv("CKPT_NEEDLE")), std::string::npos) << e.what();
    }
  }, harness);
}

// A checkpoint that some ranks cannot find (a file system not shared alike
// between machines): every rank stops, naming the rank that could not,
// instead of the others waiting for it in the load's first collective.
TEST(DistCheckpoint, ACheckpointOneRankCannotFindStopsEveryRankNamingIt) {
  const fs::path base = test_scratch_subdir("unshared");
  run(zero(3, 2, 4), 4, (base / "good").string(), 2, 2, "", base / "losses.txt");
  MultiRankOptions harness;
  harness.env["CKPT_DIR"] = (base / "good").string();
  harness.comm_timeout = std::chrono::seconds(20);  // a wait that never ends fails sooner
  run_on_ranks(2, [](RankContext& ctx) {
    tiny::TinyRunOptions options = shardtrain::testing::tiny_run_options(
        shardtrain::testing::zero_test_config(3, MixedPrecision::kNo), ctx, 2, 5);
    options.resume_dir = std::string(std::getenv("CKPT_DIR")) + (ctx.rank() == 1 ? "-not-here" : "");
    try {
      tiny::run_tiny(options);
      ADD_FAILURE() << "a checkpoint rank 1 cannot find loaded";
    } catch (const shardtrain::Error& e) {
      EXPECT_NE(std::string(e.what()).find("rank 1: no checkpoint in"), std::string::npos) << e.what();
    }
  }, harness);
}

TEST(DistCheckpoint, DamagedCheckpointsAreRefusedNamingTheProblem) {
  const fs::path base = test_scratch_subdir("damage");
  run(zero(3, 2, 4), 4, (base / "good").string(), 2, 2, "", base / "losses.txt");
  auto fresh = [&](const std::string& name) {
    const fs::path copy = base / name;
    if (!shardtrain::testing::is_rank_process()) fs::copy(base / "good", copy, fs::copy_options::recursive);
    return copy;
  };
  {  // truncated shard file
    const fs::path d = fresh("truncated");
    if (!shardtrain::testing::is_rank_process()) {
      const fs::path f = d / "step_2" / "rank00001.safetensors";
      fs::resize_file(f, fs::file_size(f) - 7);
    }
    expect_load_error(d, "rank00001.safetensors has");
  }
  {  // altered byte
    const fs::path d = fresh("altered");
    if (!shardtrain::testing::is_rank_process()) alter_a_byte(d / "step_2" / "rank00000.safetensors");
    expect_load_error(d, "rank00000.safetensors fails its CRC-32 check");
  }
  {  // altered byte in the file another rank checks: every rank learns of it and refuses
    const fs::path d = fresh("altered_other");
    if (!shardtrain::testing::is_rank_process()) alter_a_byte(d / "step_2" / "rank00001.safetensors");
    expect_load_error(d, "rank 1: checkpoint");
    expect_load_error(d, "rank00001.safetensors fails its CRC-32 check");
  }
  {  // missing file
    const fs::path d = fresh("missing");
    if (!shardtrain::testing::is_rank_process()) fs::remove(d / "step_2" / "rank00001.safetensors");
    expect_load_error(d, "file rank00001.safetensors (rank 1) is missing");
  }
  {  // edited index: a shape that no longer matches the model
    const fs::path d = fresh("edited");
    if (!shardtrain::testing::is_rank_process()) {
      edit_text(d / "step_2" / "index.json", [](std::string& text) {
        const auto at = text.find("\"head.weight\"");
        ASSERT_NE(at, std::string::npos);
        text.replace(text.find("256", at), 3, "255");
      });
    }
    // The index's checksums catch the edit before the shape is compared with the model's.
    expect_load_error(d, "index.json was edited after the save; these fields no longer match their checksums: "
                         "params.head.weight");
  }
  {  // edited index: the step a resume continues from (the weights stay step 2's)
    const fs::path d = fresh("edited_step");
    if (!shardtrain::testing::is_rank_process()) {
      edit_text(d / "step_2" / "index.json", [](std::string& text) {
        const auto at = text.find("\"step\": 2");
        ASSERT_NE(at, std::string::npos) << text.substr(0, 400);
        text.replace(at, 9, "\"step\": 1");
      });
    }
    expect_load_error(d, "these fields no longer match their checksums: training_state.step");
  }
  {  // a rank's random-number state that its generator cannot take, in a file
     // whose size, CRC-32 and index all match (a writer's bug, not damage):
     // every rank refuses it before loading, where rank 1 alone used to fail
     // after loading the weights and leave rank 0 waiting for it
    const fs::path d = fresh("bad_rng");
    if (!shardtrain::testing::is_rank_process()) {
      const fs::path f = d / "step_2" / "rank00001.safetensors";
      std::vector<std::pair<std::string, at::Tensor>> tensors;
      std::map<std::string, std::string> metadata;
      {
        const shardtrain::safetensors::Reader reader(f.string());
        metadata = reader.metadata();
        for (const std::string& name : reader.names()) {
          tensors.emplace_back(name, name == "rng/cpu" ? at::zeros({16}, at::kByte) : reader.read(name));
        }
      }
      shardtrain::safetensors::write_file(f.string(), tensors, metadata);
      const fs::path index_path = d / "step_2" / "index.json";
      nlohmann::json index = nlohmann::json::parse(std::ifstream(index_path));
      index["files"]["rank00001.safetensors"]["size"] = fs::file_size(f);
      index["files"]["rank00001.safetensors"]["crc32"] = shardtrain::safetensors::crc32_of_file(f.string());
      index.erase("checksums");
      shardtrain::checkpoint::seal_index(index);
      std::ofstream(index_path) << index.dump(1);
    }
    expect_load_error(d, "a random-number state cannot be restored (rank 1:");
  }
  {  // no checkpoint at all
    const fs::path d = base / "empty";
    if (!shardtrain::testing::is_rank_process()) fs::create_directories(d);
    expect_load_error(d, "does not exist (save_state writes it)");
  }
}

TEST(DistCheckpoint, SavingInsideAnAccumulationWindowIsRefused) {
  run_on_ranks(2, [](RankContext& ctx) {
    auto accelerator = shardtrain::testing::accelerator_for(shardtrain::testing::zero_test_config(2, MixedPrecision::kNo, 2), ctx);
    torch::manual_seed(0);
    tiny::TinyConfig model_config;
    tiny::TinyModel model(model_config);
    auto prepared = accelerator->prepare(model, {}, shardtrain::testing::micro_batch(1));
    at::Tensor tokens = tiny::synthetic_sample(0, ctx.rank(), model_config).unsqueeze(0);
    accelerator->backward(prepared(tokens).mean());
    try {
      accelerator->save_state((shardtrain::testing::test_scratch_dir() / "never").string());
      ADD_FAILURE() << "saved in the middle of an accumulation window";
    } catch (const shardtrain::Error& e) {
      EXPECT_NE(std::string(e.what()).find("middle of a gradient-accumulation window"), std::string::npos) << e.what();
    }
  });
}

}  // namespace

namespace {

TEST(DistCheckpoint, ExportedHuggingFaceWeightsGiveTheTrainedModelsLogits) {
  MultiRankOptions harness;
  const fs::path dir = test_scratch_subdir("export");
  harness.env["EXPORT_DIR"] = dir.string();
  run_on_ranks(2, [](RankContext& ctx) {
    auto config = shardtrain::testing::zero_test_config(3, MixedPrecision::kBf16);
    auto accelerator = shardtrain::testing::accelerator_for(config, ctx);
    torch::manual_seed(9);
    tiny::TinyConfig model_config;
    tiny::TinyModel model(model_config);
    auto prepared = accelerator->prepare(model, {}, shardtrain::testing::micro_batch(2));
    at::Tensor tokens = at::stack({tiny::synthetic_sample(3, 0, model_config), tiny::synthetic_sample(3, 1, model_config)});
    for (int step = 0; step < 3; ++step) {
      accelerator->backward(prepared(tokens).mean());
      accelerator->step();
    }
    at::Tensor trained_logits;
    {
      at::NoGradGuard no_grad;
      trained_logits = prepared(tokens);
    }
    const std::string out = std::string(std::getenv("EXPORT_DIR")) + "/hf";
    accelerator->save_model(out, "fp32", /*max_shard_bytes=*/200000);  // small shards: the index path
    if (ctx.rank() != 0) return;
    EXPECT_TRUE(fs::exists(out + "/model.safetensors.index.json"));
    // Load the Hugging Face directory into a plain (unsharded) model.
    std::ifstream index_file(out + "/model.safetensors.index.json");
    const nlohmann::json index = nlohmann::json::parse(index_file);
    torch::manual_seed(123);  // different init: every value must come from the files
    tiny::TinyModel plain(model_config);
    auto params = plain->named_parameters();
    ASSERT_EQ(index.at("weight_map").size(), params.size());
    {
      at::NoGradGuard no_grad;
      for (const auto& [name, file] : index.at("weight_map").items()) {
        shardtrain::safetensors::Reader reader(out + "/" + file.get<std::string>());
        params[name].copy_(reader.read(name));
      }
    }
    // Same bf16 compute as the engine ran: the exported fp32 masters rounded to bf16.
    plain->to(at::kBFloat16);
    at::NoGradGuard no_grad;
    at::Tensor plain_logits = plain->forward(tokens);
    EXPECT_TRUE(at::equal(plain_logits, trained_logits)) << "max diff "
        << (plain_logits - trained_logits).abs().max().item<double>();
  }, harness);
}

}  // namespace

namespace {

/// fsdp pure (bf16 load, mixed_precision: no) <-> fsdp standard (bf16 mixed precision).
shardtrain::TrainingConfig fsdp_precision(bool pure) {
  RunSpec spec = fsdp(2, 4);
  spec.config.mixed_precision = pure ? MixedPrecision::kNo : MixedPrecision::kBf16;
  spec.config.bf16 = !pure;
  return spec.config;
}

std::vector<std::pair<std::string, at::Tensor>> train_and_state(RankContext& ctx, bool pure, const std::string& save,
                                                                const std::string& load) {
  auto accelerator = shardtrain::testing::accelerator_for(fsdp_precision(pure), ctx);
  torch::manual_seed(1);
  tiny::TinyConfig model_config;
  tiny::TinyModel model(model_config);
  if (pure) model->to(at::kBFloat16);
  auto prepared = accelerator->prepare(model, {}, shardtrain::testing::micro_batch(2));
  if (!load.empty()) accelerator->load_state(load);
  at::Tensor tokens = at::stack({tiny::synthetic_sample(4, ctx.rank(), model_config)});
  for (int step = 0; step < 2 && load.empty(); ++step) {
    accelerator->backward(prepared(tokens).mean());
    accelerator->step();
  }
  if (!save.empty()) accelerator->save_state(save);
  return accelerator->full_state_dict();
}

TEST(DistCheckpoint, PureLowPrecisionAndStandardCheckpointsConvert) {
  MultiRankOptions harness;
  const fs::path dir = test_scratch_subdir("precision");
  harness.env["PRECISION_DIR"] = dir.string();
  run_on_ranks(2, [](RankContext& ctx) {
    const std::string base = std::getenv("PRECISION_DIR");
    // pure -> standard: the bf16 parameters are upcast exactly into fp32 masters.
    auto saved_pure = train_and_state(ctx, /*pure=*/true, base + "/pure", "");
    auto loaded_standard = train_and_state(ctx, /*pure=*/false, "", base + "/pure");
    ASSERT_EQ(saved_pure.size(), loaded_standard.size());
    for (std::size_t i = 0; i < saved_pure.size(); ++i) {
      EXPECT_TRUE(at::equal(saved_pure[i].second, loaded_standard[i].second)) << saved_pure[i].first;
    }
    // standard -> pure: fp32 masters are rounded to bf16 (with a warning).
    auto saved_standard = train_and_state(ctx, /*pure=*/false, base + "/standard", "");
    auto loaded_pure = train_and_state(ctx, /*pure=*/true, "", base + "/standard");
    for (std::size_t i = 0; i < saved_standard.size(); ++i) {
      EXPECT_TRUE(at::equal(saved_standard[i].second.to(at::kBFloat16).to(at::kFloat), loaded_pure[i].second))
          << saved_standard[i].first;
    }
  }, harness);
}

}  // namespace

namespace {

TEST(DistCheckpoint, SamplerPositionAndKeepLastN) {
  MultiRankOptions harness;
  const fs::path dir = test_scratch_subdir("sampler");
  harness.env["SAMPLER_DIR"] = dir.string();
  run_on_ranks(2, [](RankContext& ctx) {
    const std::string base = std::getenv("SAMPLER_DIR");
    std::vector<int64_t> expected_next;
    {
      shardtrain::AcceleratorOptions options;
      options.config = shardtrain::testing::zero_test_config(2, MixedPrecision::kNo);
      options.communicator = ctx.comm;
      options.checkpoint_total_limit = 2;
      shardtrain::Accelerator accelerator(options);
      tiny::TinyModel model(tiny::TinyConfig{});
      accelerator.prepare(model, {}, shardtrain::testing::micro_batch(2));
      auto& sampler = accelerator.prepare_sampler(100, /*seed=*/3);
      sampler.set_epoch(2);
      sampler.advance(7);
      expected_next = sampler.remaining_indices();
      for (const char* tag : {"a", "b", "c"}) accelerator.save_state(base, tag);
    }
    if (ctx.rank() == 0) {
      EXPECT_FALSE(fs::exists(base + "/a")) << "keep-last 2 must remove the oldest checkpoint";
      EXPECT_TRUE(fs::exists(base + "/b/index.json"));
      EXPECT_TRUE(fs::exists(base + "/c/index.json"));
    }
    shardtrain::AcceleratorOptions options;
    options.config = shardtrain::testing::zero_test_config(2, MixedPrecision::kNo);
    options.communicator = ctx.comm;
    shardtrain::Accelerator accelerator(options);
    tiny::TinyModel model(tiny::TinyConfig{});
    accelerator.prepare(model, {}, shardtrain::testing::micro_batch(2));
    auto& sampler = accelerator.prepare_sampler(100, /*seed=*/3);
    accelerator.load_state(base);
    EXPECT_EQ(sampler.epoch(), 2);
    EXPECT_EQ(sampler.position(), 7);
    EXPECT_EQ(sampler.remaining_indices(), expected_next) << "the resumed sampler continues at the exact sample";
    // Other data (60 rows): the run goes on after the same 14 samples of epoch 2, and says the data changed.
    auto& other_data = accelerator.prepare_sampler(60, /*seed=*/3);
    shardtrain::testing::LogCapture capture;
    accelerator.load_state(base);
    EXPECT_EQ(other_data.epoch(), 2);
    EXPECT_EQ(other_data.position(), 7);
    const std::string warned = "the training data has 60 rows, the checkpoint's sampler was over 100";
    EXPECT_EQ(capture.text().find(warned) != std::string::npos, ctx.rank() == 0) << capture.text();
  }, harness);
}

}  // namespace

namespace {

/// save_model's "auto" writes what Accelerate's save_model writes from each
/// peer: DeepSpeed's 16-bit module at stage 2, and at stage 3 with
/// stage3_gather_16bit_weights_on_model_save (without it, the fp32 master, as
/// zero_to_fp32 gives); FSDP's parameters in their own dtype, fp32 in
/// standard mixed precision and bf16 in pure mode.
TEST(DistCheckpoint, SaveModelAutoWritesTheDtypeThePeersSaveWrites) {
  MultiRankOptions harness;
  const fs::path dir = test_scratch_subdir("export_auto");
  harness.env["EXPORT_DIR"] = dir.string();
  run_on_ranks(1, [](RankContext& ctx) {
    const std::string out = std::getenv("EXPORT_DIR");
    std::ofstream(out + "/config.json") << R"({"model_type": "tiny", "torch_dtype": "float32"})";
    auto zero_gathering = [](bool gather_16bit) {
      auto config = shardtrain::testing::zero_test_config(3, MixedPrecision::kBf16);
      config.zero.stage3_gather_16bit_weights_on_model_save = gather_16bit;
      return config;
    };
    const std::vector<std::tuple<std::string, shardtrain::TrainingConfig, bool, at::ScalarType>> cases = {
        {"zero2", shardtrain::testing::zero_test_config(2, MixedPrecision::kBf16), false, at::kBFloat16},
        {"zero3", zero_gathering(false), false, at::kFloat},
        {"zero3_16bit", zero_gathering(true), false, at::kBFloat16},
        {"fsdp_standard", fsdp_precision(false), false, at::kFloat},
        {"fsdp_pure", fsdp_precision(true), true, at::kBFloat16},
    };
    for (const auto& [name, config, pure, expected] : cases) {
      auto accelerator = shardtrain::testing::accelerator_for(config, ctx);
      tiny::TinyModel model(tiny::TinyConfig{});
      if (pure) model->to(at::kBFloat16);
      accelerator->prepare(model, {}, shardtrain::testing::micro_batch(2));
      accelerator->save_model(out + "/" + name, "auto", 5000000000ULL, out + "/config.json");
      const shardtrain::safetensors::Reader reader(out + "/" + name + "/model.safetensors");
      for (const auto& tensor : reader.names()) EXPECT_EQ(reader.read(tensor).scalar_type(), expected) << name;
      const nlohmann::json written = nlohmann::json::parse(std::ifstream(out + "/" + name + "/config.json"));
      EXPECT_EQ(written.at("torch_dtype"), expected == at::kFloat ? "float32" : "bfloat16") << name;
    }
  }, harness);
}

}  // namespace
