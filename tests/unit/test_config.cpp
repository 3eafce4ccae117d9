// Config reading (Accelerate YAML, DeepSpeed JSON, both merged), "auto"
// resolution, the writers, convert_config and config_from_environment.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "support/scoped_environment.h"
#include "support/scratch_dir.h"
#include "build_config.h"
#include "shardtrain/config.h"
#include "shardtrain/error.h"

namespace {

namespace fs = std::filesystem;
using shardtrain::AutoContext;
using shardtrain::AutoWrapPolicy;
using shardtrain::ConfigError;
using shardtrain::DistributedType;
using shardtrain::DType;
using shardtrain::MixedPrecision;
using shardtrain::OffloadDevice;
using shardtrain::ShardingStrategy;
using shardtrain::StateDictType;
using shardtrain::TrainingConfig;

const fs::path kSourceDir = SHARDTRAIN_SOURCE_DIR;
const fs::path kConfigsDir = kSourceDir / "configs";
const fs::path kBadDir = kSourceDir / "tests/data/configs/bad";

using shardtrain::testing::ScratchDir;

using shardtrain::testing::ScopedEnvironment;

const std::vector<const char*> kLauncherVariables = {"SHARDTRAIN_CONFIG_FILE", "SHARDTRAIN_DEEPSPEED_CONFIG_FILE",
                                                     "SHARDTRAIN_MIXED_PRECISION", "SHARDTRAIN_DISTRIBUTED_TYPE"};

std::string config_error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

bool has_warning(const TrainingConfig& config, const std::string& text) {
  for (const auto& warning : config.warnings) {
    if (warning.find(text) != std::string::npos) return true;
  }
  return false;
}

std::string all_warnings(const TrainingConfig& config) {
  std::string text;
  for (const auto& warning : config.warnings) text += "\n  " + warning;
  return text;
}

AutoContext context_for(const TrainingConfig& config) {
  AutoContext context;
  context.world_size = config.num_processes;
  context.micro_batch_size = 4;
  context.hidden_size = 64;
  context.total_steps = 100;
  return context;
}

std::vector<fs::path> config_files(const fs::path& directory) {
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(directory)) {
    if (entry.is_regular_file() && entry.path().extension() != ".md") files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

// ---------------------------------------------------------------- shipped configs

TEST(UnitConfigFiles, EveryShippedConfigLoadsAndResolves) {
  std::vector<fs::path> files = config_files(kConfigsDir);
  for (const char* sub : {"articles", "gpu"}) {
    const std::vector<fs::path> more = config_files(kConfigsDir / sub);
    files.insert(files.end(), more.begin(), more.end());
  }
  ASSERT_GE(files.size(), 21u);
  for (const auto& file : files) {
    SCOPED_TRACE(file.string());
    TrainingConfig config;
    ASSERT_NO_THROW(config = shardtrain::load_config(file.string()));
    TrainingConfig resolved;
    ASSERT_NO_THROW(resolved = shardtrain::resolve_auto(config, context_for(config)));
    EXPECT_TRUE(resolved.train_batch_size.has_value());
    EXPECT_TRUE(resolved.auto_keys.empty());
    // Nothing the shipped files say is unknown to the reader.
    EXPECT_FALSE(has_warning(config, "unknown key")) << all_warnings(config);
  }
}

TEST(UnitConfigFiles, ShippedConfigsSelectTheirMode) {
  struct Expectation {
    const char* file;
    DistributedType type;
    MixedPrecision precision;
    int stage_or_strategy;  // ZeRO stage, or the ShardingStrategy number under FSDP
  };
  const std::vector<Expectation> expectations = {
      {"zero1_bf16.json", DistributedType::kDeepSpeed, MixedPrecision::kBf16, 1},
      {"zero2_bf16.json", DistributedType::kDeepSpeed, MixedPrecision::kBf16, 2},
      {"zero3_bf16.json", DistributedType::kDeepSpeed, MixedPrecision::kBf16, 3},
      {"zero3_fp32.json", DistributedType::kDeepSpeed, MixedPrecision::kNo, 3},
      {"zero3_fp16.json", DistributedType::kDeepSpeed, MixedPrecision::kFp16, 3},
      {"zero3_offload_cpu.json", DistributedType::kDeepSpeed, MixedPrecision::kBf16, 3},
      {"accelerate_zero3_bf16.yaml", DistributedType::kDeepSpeed, MixedPrecision::kBf16, 3},
      {"fsdp_full_shard_bf16.yaml", DistributedType::kFsdp, MixedPrecision::kBf16, 1},
      {"fsdp_shard_grad_op_bf16.yaml", DistributedType::kFsdp, MixedPrecision::kBf16, 2},
      {"fsdp_no_shard.yaml", DistributedType::kFsdp, MixedPrecision::kBf16, 3},
      {"fsdp_hybrid_shard_bf16.yaml", DistributedType::kFsdp, MixedPrecision::kBf16, 4},
      {"fsdp_pure_bf16.yaml", DistributedType::kFsdp, MixedPrecision::kNo, 1},
      {"fsdp_fp32.yaml", DistributedType::kFsdp, MixedPrecision::kNo, 1},
      {"ddp_multi_cpu.yaml", DistributedType::kMultiCpu, MixedPrecision::kNo, 0},
  };
  for (const auto& expected : expectations) {
    SCOPED_TRACE(expected.file);
    const TrainingConfig config = shardtrain::load_config((kConfigsDir / expected.file).string());
    EXPECT_EQ(config.distributed_type, expected.type);
    EXPECT_EQ(config.mixed_precision, expected.precision);
    if (expected.type == DistributedType::kDeepSpeed) {
      EXPECT_EQ(config.zero.stage, expected.stage_or_strategy);
    } else if (expected.type == DistributedType::kFsdp) {
      EXPECT_EQ(static_cast<int>(config.fsdp.sharding_strategy), expected.stage_or_strategy);
      EXPECT_EQ(config.fsdp.transformer_layer_cls_to_wrap, std::vector<std::string>{"TinyBlock"});
      EXPECT_EQ(config.fsdp.auto_wrap_policy, AutoWrapPolicy::kTransformerBased);
    }
    EXPECT_EQ(config.num_processes, expected.type == DistributedType::kDeepSpeed &&
                                            std::string(expected.file).find(".json") != std::string::npos
                                        ? 1
                                        : 2);
  }
  const TrainingConfig pure = shardtrain::load_config((kConfigsDir / "fsdp_pure_bf16.yaml").string());
  EXPECT_EQ(pure.fsdp.pure_low_precision, std::optional<bool>(true));
  const TrainingConfig offload = shardtrain::load_config((kConfigsDir / "zero3_offload_cpu.json").string());
  EXPECT_EQ(offload.zero.offload_optimizer, OffloadDevice::kCpu);
  EXPECT_EQ(offload.zero.offload_param, OffloadDevice::kCpu);
  const TrainingConfig fp16 = shardtrain::load_config((kConfigsDir / "zero3_fp16.json").string());
  EXPECT_TRUE(fp16.fp16.enabled);
  EXPECT_EQ(fp16.fp16.loss_scale, 0.0);
  EXPECT_EQ(fp16.fp16.initial_scale_power, 16);
}

TEST(UnitConfigFiles, AccelerateYamlMergesTheDeepSpeedJsonItNames) {
  const TrainingConfig config = shardtrain::load_config((kConfigsDir / "accelerate_zero3_bf16.yaml").string());
  ASSERT_EQ(config.sources.size(), 2u);
  EXPECT_EQ(fs::path(config.sources[1]).filename(), "zero3_bf16.json");
  EXPECT_TRUE(config.zero3_init_flag);
  EXPECT_EQ(config.scheduler.type, "WarmupLR");
  EXPECT_TRUE(config.bf16);
  EXPECT_TRUE(config.warnings.empty()) << all_warnings(config);
}

TEST(UnitConfigFiles, ArticleConfigsReadAsTheArticlesMeanThem) {
  const fs::path articles = kConfigsDir / "articles";
  const TrainingConfig fsdp = shardtrain::load_config((articles / "fsdp_article_000.yaml").string());
  EXPECT_EQ(fsdp.distributed_type, DistributedType::kFsdp);
  EXPECT_EQ(fsdp.mixed_precision, MixedPrecision::kBf16);
  EXPECT_EQ(fsdp.num_processes, 4);
  EXPECT_EQ(fsdp.fsdp.transformer_layer_cls_to_wrap, std::vector<std::string>{"LlamaDecoderLayer"});
  EXPECT_EQ(fsdp.fsdp.auto_wrap_policy, AutoWrapPolicy::kTransformerBased);
  EXPECT_EQ(fsdp.fsdp.state_dict_type, StateDictType::kFullStateDict);
  EXPECT_TRUE(fsdp.warnings.empty()) << all_warnings(fsdp);

  // The seed's one-line copy is a single YAML comment: an empty config, said aloud.
  const TrainingConfig flattened = shardtrain::load_config((articles / "fsdp_article_000.seed_text.yaml").string());
  EXPECT_EQ(flattened.distributed_type, DistributedType::kNo);
  EXPECT_TRUE(has_warning(flattened, "contains no settings")) << all_warnings(flattened);

  const TrainingConfig accelerate = shardtrain::load_config((articles / "accelerate_article_003.yaml").string());
  EXPECT_EQ(accelerate.distributed_type, DistributedType::kDeepSpeed);
  EXPECT_TRUE(has_warning(accelerate, "has no distributed_type; DEEPSPEED is inferred")) << all_warnings(accelerate);
  EXPECT_EQ(accelerate.zero.stage, 3);
  EXPECT_EQ(accelerate.zero.offload_optimizer, OffloadDevice::kCpu);
  EXPECT_EQ(accelerate.gradient_accumulation_steps, std::optional<int64_t>(4));
  EXPECT_EQ(accelerate.gradient_clipping, std::optional<double>(1.0));
  EXPECT_TRUE(accelerate.zero.stage3_gather_16bit_weights_on_model_save);

  const TrainingConfig ds = shardtrain::load_config((articles / "ds_config_zero3_offload_article_003.json").string());
  EXPECT_EQ(ds.distributed_type, DistributedType::kDeepSpeed);
  EXPECT_EQ(ds.mixed_precision, MixedPrecision::kFp16);
  EXPECT_EQ(ds.zero.stage, 3);
  EXPECT_EQ(ds.zero.allgather_bucket_size, 200000000);  // written 2e8
  EXPECT_EQ(ds.zero.reduce_bucket_size, std::optional<int64_t>(200000000));
  EXPECT_EQ(ds.zero.offload_optimizer, OffloadDevice::kCpu);
  EXPECT_EQ(ds.optimizer.type, "AdamW");
  EXPECT_EQ(ds.optimizer.lr, std::optional<double>(5e-5));
  EXPECT_EQ(ds.scheduler.type, "WarmupDecayLR");
  EXPECT_EQ(ds.scheduler.total_num_steps, std::optional<int64_t>(10000));
  EXPECT_EQ(ds.steps_per_print, 100);
  EXPECT_FALSE(ds.train_batch_size.has_value());

  const TrainingConfig offload = shardtrain::load_config((articles / "offload_param_article_003.json").string());
  EXPECT_EQ(offload.zero.offload_param, OffloadDevice::kCpu);
  EXPECT_EQ(offload.zero.offload_optimizer, OffloadDevice::kCpu);
  EXPECT_EQ(offload.fp16.initial_scale_power, 12);
  EXPECT_TRUE(offload.gradient_checkpointing);  // a top-level extra the struct has

  const TrainingConfig fp16 = shardtrain::load_config((articles / "fp16_loss_scale_article_003.json").string());
  EXPECT_EQ(fp16.distributed_type, DistributedType::kDeepSpeed);
  EXPECT_EQ(fp16.zero.stage, 0);
  EXPECT_TRUE(fp16.fp16.enabled);
  EXPECT_EQ(fp16.fp16.hysteresis, 2);
  EXPECT_EQ(fp16.fp16.min_loss_scale, 1.0);
}

// ---------------------------------------------------------------- errors

struct BadConfig {
  std::string file;
  std::vector<std::string> expected;  // substrings of the ConfigError
};

TEST(UnitConfigErrors, EveryMalformedConfigFailsWithItsMessage) {
  const std::vector<BadConfig> cases = {
      {"distributed_type_typo.yaml",
       {"distributed_type: DEEPSPEEED is not one of NO, MULTI_CPU, MULTI_GPU, DEEPSPEED, FSDP",
        "did you mean DEEPSPEED?", "distributed_type_typo.yaml:2"}},
      {"stage_not_a_number.json", {"zero_optimization.stage must be an integer 0-3, got \"three\""}},
      {"stage_4.json", {"zero_optimization.stage must be an integer 0-3, got 4"}},
      {"fp16_and_bf16.json", {"fp16.enabled and bf16.enabled are both true"}},
      {"precision_conflict.yaml",
       {"mixed_precision: fp16", "conflicts with bf16.enabled: true", "bf16_enabled.json"}},
      {"missing_deepspeed_file.yaml",
       {"deepspeed_config.deepspeed_config_file", "does_not_exist.json not found", "looked at"}},
      {"malformed.yaml", {"malformed.yaml", "malformed YAML at line 4"}},
      {"malformed.json", {"malformed.json", "malformed JSON at line 5, column"}},
      {"strict_unknown_key.json",
       {"strict: true", "unknown key 'zero_optimisation'", "did you mean 'zero_optimization'?"}},
      {"loss_scale_window_zero.json", {"fp16.loss_scale_window must be a positive integer, got 0"}},
      {"min_loss_scale_negative.json", {"fp16.min_loss_scale must be a number > 0, got -1"}},
      {"optimizer_not_implemented.json",
       {"optimizer.type OneBitAdam", "does not implement", "allowed values: AdamW, Adam, SGD"}},
      {"optimizer_unknown.json", {"optimizer.type: Adamm is not one of AdamW, Adam, SGD", "did you mean"}},
      {"scheduler_unknown.json",
       {"scheduler.type: WarmupDecay is not one of WarmupLR, WarmupDecayLR, WarmupCosineLR, linear, cosine, "
        "constant"}},
      {"scheduler_param_of_another.json",
       {"scheduler_param_of_another.json", "scheduler.params.warmup_max_lr is not a parameter of WarmupCosineLR, "
        "which takes total_num_steps, warmup_min_ratio, warmup_num_steps, cos_min_ratio, warmup_type"}},
      {"scheduler_warmup_zero.json",
       {"scheduler.params.warmup_num_steps must be a positive integer or \"auto\" for WarmupLR (DeepSpeed refuses 0)",
        "got 0"}},
      {"gradient_accumulation_zero.json", {"gradient_accumulation_steps must be an integer >= 1", "got 0"}},
      {"mixed_precision_fp32.yaml", {"mixed_precision: fp32 is not one of no, fp16, bf16"}},
      {"bucket_not_integral.json", {"zero_optimization.reduce_bucket_size must be an integer >= 0", "got 1.5"}},
      {"nvme_without_path.json", {"offload_param.device nvme needs zero_optimization.offload_param.nvme_path"}},
      {"duplicate_key.json", {"duplicate key 'stage'"}},
      {"sharding_strategy_7.yaml", {"fsdp_config.fsdp_sharding_strategy must be one of FULL_SHARD", "got 7"}},
      {"local_state_dict.yaml", {"LOCAL_STATE_DICT is not supported", "FULL_STATE_DICT or SHARDED_STATE_DICT"}},
      {"offload_device_typo.yaml",
       {"deepspeed_config.offload_optimizer_device: cpuu is not one of none, cpu, nvme", "did you mean cpu?"}},
  };
  std::set<std::string> covered;
  for (const auto& bad : cases) {
    SCOPED_TRACE(bad.file);
    covered.insert(bad.file);
    const std::string message =
        config_error_of([&] { shardtrain::load_config((kBadDir / bad.file).string()); });
    ASSERT_FALSE(message.empty()) << "no ConfigError";
    for (const auto& expected : bad.expected) {
      EXPECT_NE(message.find(expected), std::string::npos) << "missing '" << expected << "' in: " << message;
    }
  }
  // Each file in bad/ is one case here, so a new file cannot go untested.
  for (const auto& file : config_files(kBadDir)) {
    EXPECT_EQ(covered.count(file.filename().string()), 1u) << file << " has no expected message";
  }
}

TEST(UnitConfigErrors, AnotherSchedulersKeyIsRefusedUnlessItIsNull) {
  // null sets nothing (the unused keys of an older dump); a value would be read and never used.
  const TrainingConfig dumped = shardtrain::parse_config(
      R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "total_num_steps": null,
                                                       "cos_min_ratio": null}}})",
      "json");
  EXPECT_EQ(dumped.scheduler.warmup_num_steps, std::optional<int64_t>(5));
  const std::string message = config_error_of([] {
    (void)shardtrain::parse_config(
        R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "cos_min_ratio": 0.1}}})", "json");
  });
  EXPECT_NE(message.find("scheduler.params.cos_min_ratio is not a parameter of WarmupLR, which takes warmup_min_lr, "
                         "warmup_max_lr, warmup_num_steps, warmup_type"),
            std::string::npos)
      << message;
}

TEST(UnitConfigErrors, BatchTripleMismatchNamesAllValuesAndWorldSize) {
  const TrainingConfig config = shardtrain::parse_config(
      R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})", "json");
  AutoContext context;
  context.world_size = 2;
  const std::string message = config_error_of([&] { shardtrain::resolve_auto(config, context); });
  EXPECT_NE(message.find("train_batch_size 32 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 2 "
                         "* world size 2 = 16"),
            std::string::npos)
      << message;
}

TEST(UnitConfigErrors, UnderivableBatchAndMissingRunFactsAreErrors) {
  AutoContext context;
  context.world_size = 2;
  const TrainingConfig indivisible =
      shardtrain::parse_config(R"({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4})", "json");
  EXPECT_NE(config_error_of([&] { shardtrain::resolve_auto(indivisible, context); })
                .find("train_batch_size 30 is not a multiple of train_micro_batch_size_per_gpu 4 * world size 2"),
            std::string::npos);

  const TrainingConfig no_micro = shardtrain::parse_config(R"({"train_micro_batch_size_per_gpu": "auto"})", "json");
  EXPECT_NE(config_error_of([&] { shardtrain::resolve_auto(no_micro, context); }).find("--micro-batch"), std::string::npos);

  const TrainingConfig decay = shardtrain::parse_config(
      R"({"train_micro_batch_size_per_gpu": 2,
          "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}})",
      "json");
  EXPECT_NE(config_error_of([&] { shardtrain::resolve_auto(decay, context); })
                .find("scheduler WarmupDecayLR needs scheduler.params.total_num_steps"),
            std::string::npos);
  context.total_steps = 50;
  EXPECT_EQ(shardtrain::resolve_auto(decay, context).scheduler.total_num_steps, std::optional<int64_t>(50));
}

TEST(UnitConfigErrors, PrecisionConflictsAcrossYamlAndJson) {
  // mixed_precision fp16 with fp16 explicitly disabled in the JSON.
  ScratchDir dir;
  dir.write("ds.json", R"({"fp16": {"enabled": false}, "zero_optimization": {"stage": 2}})");
  const std::string yaml = dir.write("acc.yaml",
                                     "distributed_type: DEEPSPEED\nmixed_precision: fp16\n"
                                     "deepspeed_config:\n  deepspeed_config_file: ds.json\n");
  EXPECT_NE(config_error_of([&] { shardtrain::load_config(yaml); }).find("conflicts with fp16.enabled: false"),
            std::string::npos);

  // A config built in code is checked by resolve_auto as well.
  TrainingConfig config;
  config.fp16.enabled = true;
  config.bf16 = true;
  config.train_micro_batch_size_per_gpu = 1;
  EXPECT_NE(config_error_of([&] { shardtrain::resolve_auto(config, AutoContext{}); })
                .find("fp16.enabled and bf16.enabled are both true"),
            std::string::npos);
}

TEST(UnitConfigErrors, WrongTypesNameKeyValueAndExpectation) {
  EXPECT_NE(config_error_of([] { shardtrain::parse_config("num_processes: two\n", "yaml"); })
                .find("num_processes must be a positive integer, got \"two\""),
            std::string::npos);
  EXPECT_NE(config_error_of([] { shardtrain::parse_config(R"({"bf16": {"enabled": "maybe"}})", "json"); })
                .find("bf16.enabled must be true or false, got \"maybe\""),
            std::string::npos);
  EXPECT_NE(config_error_of([] { shardtrain::parse_config(R"({"zero_optimization": [3]})", "json"); })
                .find("zero_optimization must be a mapping"),
            std::string::npos);
  EXPECT_NE(config_error_of([] { shardtrain::parse_config(R"({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}})",
                                                   "json"); })
                .find("optimizer.params.betas must be a list of two numbers"),
            std::string::npos);
  EXPECT_NE(config_error_of([] { shardtrain::parse_config("distributed_type: XLA\n", "yaml"); })
                .find("distributed_type: XLA is not supported by shardtrain"),
            std::string::npos);
  EXPECT_NE(config_error_of([] { shardtrain::parse_config("machine_rank: 2\nnum_machines: 2\n", "yaml"); })
                .find("machine_rank: 2 ((yaml text):1) is out of range for num_machines: 2 ((yaml text):2)"),
            std::string::npos);
  EXPECT_NE(config_error_of([] { shardtrain::parse_config("machine_rank: 1\n", "yaml"); })
                .find("machine_rank: 1 ((yaml text):1) is out of range for num_machines 1 (the default)"),
            std::string::npos);
}

// ---------------------------------------------------------------- warnings

TEST(UnitConfigWarnings, UnknownKeySuggestsTheNearestKnownKey) {
  const TrainingConfig config =
      shardtrain::parse_config(R"({"zero_optimisation": {"stage": 3}, "zero_optimization": {"stgae": 2}})", "json");
  EXPECT_TRUE(has_warning(config, "unknown key 'zero_optimisation' in (json text); did you mean 'zero_optimization'?"))
      << all_warnings(config);
  EXPECT_TRUE(has_warning(config, "unknown key 'zero_optimization.stgae' in (json text); did you mean "
                                  "'zero_optimization.stage'?"))
      << all_warnings(config);

  const TrainingConfig yaml = shardtrain::parse_config(
      "distributed_type: FSDP\nfsdp_config:\n  fsdp_ofload_params: true\nnum_proceses: 2\nfoo: 1\n", "yaml");
  EXPECT_TRUE(has_warning(yaml, "did you mean 'fsdp_config.fsdp_offload_params'? (line 3)")) << all_warnings(yaml);
  EXPECT_TRUE(has_warning(yaml, "unknown key 'num_proceses' in (yaml text); did you mean 'num_processes'?"))
      << all_warnings(yaml);
  EXPECT_TRUE(has_warning(yaml, "unknown key 'foo' in (yaml text); it is ignored")) << all_warnings(yaml);
}

TEST(UnitConfigWarnings, StrictTurnsUnknownKeysIntoErrorsInEitherFormat) {
  const std::string message =
      config_error_of([] { shardtrain::parse_config("strict: true\ndistributed_type: FSDP\nfsdp_confg: {}\n", "yaml"); });
  EXPECT_NE(message.find("unknown key 'fsdp_confg'"), std::string::npos) << message;
  EXPECT_NE(message.find("did you mean 'fsdp_config'?"), std::string::npos) << message;
  // Not-implemented keys are known keys: strict leaves them warnings.
  const TrainingConfig config = shardtrain::parse_config(
      R"({"strict": true, "zero_optimization": {"stage": 3, "zero_quantized_weights": true}})", "json");
  EXPECT_TRUE(config.strict);
}

TEST(UnitConfigWarnings, NotImplementedKeysAreReportedAsSuch) {
  const TrainingConfig config = shardtrain::parse_config(
      R"({"zero_optimization": {"stage": 3, "zero_quantized_weights": true, "mics_shard_size": 8,
                                "use_multi_rank_bucket_allreduce": false,
                                "offload_param": {"device": "cpu", "buffer_count": 4}},
          "wall_clock_breakdown": false, "fp16": {"enabled": true, "auto_cast": true}})",
      "json");
  for (const char* key : {"zero_optimization.zero_quantized_weights", "zero_optimization.mics_shard_size",
                          "zero_optimization.offload_param.buffer_count", "fp16.auto_cast"}) {
    const std::string expected = std::string(key) + " is recognised but not implemented by shardtrain; it is ignored";
    EXPECT_TRUE(has_warning(config, expected))
        << key << all_warnings(config);
  }
  // A switch left off asks for nothing missing: no warning (15 of the
  // collected public configs write wall_clock_breakdown: false).
  for (const char* key : {"zero_optimization.use_multi_rank_bucket_allreduce", "wall_clock_breakdown"}) {
    EXPECT_FALSE(has_warning(config, key)) << key << all_warnings(config);
  }
  EXPECT_FALSE(has_warning(config, "unknown key")) << all_warnings(config);
}

TEST(UnitConfigWarnings, EveryZeroOptimizationKeyDeepSpeedDocumentsIsKnown) {
  // reference/deepspeed.md §3: each key is either read into ZeroConfig or
  // reported as not implemented; none may come out as "unknown".
  const std::vector<std::string> implemented = {
      "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "allgather_partitions",
      "allgather_bucket_size", "overlap_comm", "round_robin_gradients", "sub_group_size",
      "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
      "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save", "offload_param", "offload_optimizer"};
  const std::vector<std::string> not_implemented = {
      "use_multi_rank_bucket_allreduce", "ignore_unused_parameters", "legacy_stage1", "load_from_fp32_weights",
      "elastic_checkpoint", "pipeline_loading_checkpoint", "zenflow", "stage3_model_persistence_threshold",
      "stage3_module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
      "memory_efficient_linear", "override_module_apply", "leaf_module", "zero_hpz_partition_size",
      "zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
      "zeropp_loco_param", "mics_shard_size", "mics_hierarchical_params_gather", "log_trace_cache_warnings",
      "enable_sanity_checks", "save_muon_momentum_buffer_in_memory"};
  const std::map<std::string, std::string> values = {
      {"stage", "3"}, {"offload_param", R"({"device": "cpu", "nvme_path": "/nvme", "buffer_count": 5,
                                           "buffer_size": 1e8, "max_in_cpu": 1e9, "pin_memory": true})"},
      {"offload_optimizer", R"({"device": "cpu", "nvme_path": "/nvme", "buffer_count": 4, "pin_memory": true,
                                "pipeline_read": false, "pipeline_write": false, "fast_init": false, "ratio": 1.0,
                                "super_offload": false, "cpuadam_cores_perc": 0.8})"},
      {"overlap_comm", "true"}, {"contiguous_gradients", "true"}, {"reduce_scatter", "true"},
      {"allgather_partitions", "true"}, {"round_robin_gradients", "false"},
      {"stage3_gather_16bit_weights_on_model_save", "true"}};
  std::string json = R"({"zero_optimization": {)";
  bool first = true;
  for (const auto* keys : {&implemented, &not_implemented}) {
    for (const auto& key : *keys) {
      const auto value = values.find(key);
      json += std::string(first ? "" : ", ") + "\"" + key + "\": " + (value != values.end() ? value->second : "1");
      first = false;
    }
  }
  json += "}}";
  const TrainingConfig config = shardtrain::parse_config(json, "json");
  EXPECT_FALSE(has_warning(config, "unknown key")) << all_warnings(config);
  for (const auto& key : not_implemented) {
    EXPECT_TRUE(has_warning(config, "zero_optimization." + key + " is recognised but not implemented")) << key;
  }
  for (const auto& key : implemented) {
    EXPECT_FALSE(has_warning(config, "zero_optimization." + key + " is recognised")) << key;
  }
  EXPECT_EQ(config.zero.offload_param_nvme_path, "/nvme");
  EXPECT_TRUE(has_warning(config, "zero_optimization.offload_optimizer.cpuadam_cores_perc is recognised"));
}

TEST(UnitConfigWarnings, DeprecatedAliasesStillWork) {
  const TrainingConfig config = shardtrain::parse_config(
      R"({"bfloat16": {"enabled": true},
          "zero_optimization": {"stage": 3, "cpu_offload": true, "cpu_offload_param": true,
                                "stage3_gather_fp16_weights_on_model_save": true}})",
      "json");
  EXPECT_TRUE(config.bf16);
  EXPECT_EQ(config.zero.offload_optimizer, OffloadDevice::kCpu);
  EXPECT_EQ(config.zero.offload_param, OffloadDevice::kCpu);
  EXPECT_TRUE(config.zero.stage3_gather_16bit_weights_on_model_save);
  EXPECT_TRUE(
      has_warning(config, "zero_optimization.cpu_offload is deprecated; use zero_optimization.offload_optimizer"))
      << all_warnings(config);
  EXPECT_TRUE(has_warning(config, "zero_optimization.stage3_gather_fp16_weights_on_model_save is deprecated"));
  // DeepSpeed reads the old "bfloat16" section without a warning.
  EXPECT_FALSE(has_warning(config, "bfloat16")) << all_warnings(config);
}

TEST(UnitConfigWarnings, AccelerateKeysItWritesAreAcceptedSilently) {
  const TrainingConfig config = shardtrain::parse_config(
      "compute_environment: LOCAL_MACHINE\ndebug: false\ndistributed_type: MULTI_GPU\ndowncast_bf16: 'no'\n"
      "enable_cpu_affinity: false\ngpu_ids: all\nmachine_rank: 0\nmain_training_function: main\n"
      "mixed_precision: no\nnum_machines: 1\nnum_processes: 8\nrdzv_backend: static\nsame_network: true\n"
      "tpu_env: []\ntpu_use_cluster: false\ntpu_use_sudo: false\nuse_cpu: false\n"
      "dynamo_config:\n  dynamo_backend: INDUCTOR\n",
      "yaml");
  EXPECT_TRUE(config.warnings.empty()) << all_warnings(config);
  EXPECT_EQ(config.distributed_type, DistributedType::kMultiGpu);
  EXPECT_EQ(config.mixed_precision, MixedPrecision::kNo);  // unquoted `no` is the string "no"
  EXPECT_EQ(config.num_processes, 8);
}

// ---------------------------------------------------------------- reading details

TEST(UnitConfigParse, FsdpKeysAcceptAccelerateSpellings) {
  const TrainingConfig numbered = shardtrain::parse_config(
      "distributed_type: FSDP\nmixed_precision: bf16\nfsdp_config:\n  fsdp_sharding_strategy: 2\n"
      "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer, MistralDecoderLayer\n"
      "  fsdp_cpu_ram_efficient_loading: true\n  fsdp_sync_module_states: false\n"
      "  fsdp_param_dtype: bfloat16\n  fsdp_reduce_dtype: torch.float32\n  fsdp_offload_params: 'true'\n",
      "yaml");
  EXPECT_EQ(numbered.fsdp.sharding_strategy, ShardingStrategy::kShardGradOp);
  EXPECT_EQ(numbered.fsdp.transformer_layer_cls_to_wrap,
            (std::vector<std::string>{"LlamaDecoderLayer", "MistralDecoderLayer"}));
  EXPECT_EQ(numbered.fsdp.auto_wrap_policy, AutoWrapPolicy::kTransformerBased);  // implied by the classes
  EXPECT_TRUE(numbered.fsdp.sync_module_states);  // forced by cpu_ram_efficient_loading
  EXPECT_TRUE(has_warning(numbered, "needs fsdp_sync_module_states"));
  EXPECT_EQ(numbered.fsdp.param_dtype, std::optional<DType>(DType::kBf16));
  EXPECT_EQ(numbered.fsdp.reduce_dtype, std::optional<DType>(DType::kFp32));
  EXPECT_TRUE(numbered.fsdp.offload_params);

  const TrainingConfig named = shardtrain::parse_config(
      "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: hybrid_shard\n", "yaml");
  EXPECT_EQ(named.fsdp.sharding_strategy, ShardingStrategy::kHybridShard);
  const TrainingConfig reshard = shardtrain::parse_config(
      "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: false\n", "yaml");
  EXPECT_EQ(reshard.fsdp.sharding_strategy, ShardingStrategy::kShardGradOp);
}

TEST(UnitConfigParse, JsonFloatsForIntegerKeysAndQuotedNumbers) {
  const TrainingConfig config = shardtrain::parse_config(
      R"({"zero_optimization": {"stage": "3", "reduce_bucket_size": 5e8, "sub_group_size": 1e9,
                                "stage3_max_live_parameters": 1e9}})",
      "json");
  EXPECT_EQ(config.zero.stage, 3);
  EXPECT_EQ(config.zero.reduce_bucket_size, std::optional<int64_t>(500000000));
  EXPECT_EQ(config.zero.sub_group_size, 1000000000);
  // Comments are accepted: DeepSpeed reads its JSON with hjson.
  EXPECT_NO_THROW(shardtrain::parse_config("{\n  // ZeRO-2\n  \"zero_optimization\": {\"stage\": 2}\n}", "json"));
}

TEST(UnitConfigParse, YamlDeepSpeedPluginFillsWhatTheJsonLeavesAuto) {
  ScratchDir dir;
  dir.write("ds.json", R"({
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": 0.5,
    "zero_optimization": {"stage": 2}
  })");
  const std::string yaml = dir.write("acc.yaml",
                                     "distributed_type: DEEPSPEED\nmixed_precision: bf16\n"
                                     "deepspeed_config:\n  deepspeed_config_file: ds.json\n"
                                     "  gradient_accumulation_steps: 4\n  gradient_clipping: 1.0\n"
                                     "  zero_stage: 3\n  offload_optimizer_device: cpu\n"
                                     "  zero3_save_16bit_model: true\n");
  const TrainingConfig config = shardtrain::load_config(yaml);
  EXPECT_EQ(config.gradient_accumulation_steps, std::optional<int64_t>(4));  // JSON said "auto"
  EXPECT_EQ(config.gradient_clipping, std::optional<double>(0.5));           // JSON's value wins
  EXPECT_EQ(config.zero.stage, 2);
  EXPECT_EQ(config.zero.offload_optimizer, OffloadDevice::kCpu);  // JSON left it out
  EXPECT_TRUE(config.zero.stage3_gather_16bit_weights_on_model_save);
  EXPECT_TRUE(config.bf16);  // mixed_precision fills the absent bf16 block
  EXPECT_TRUE(has_warning(config, "deepspeed_config.zero_stage: 3"));
  EXPECT_TRUE(has_warning(config, "is overridden by zero_optimization.stage: 2"));
  EXPECT_TRUE(has_warning(config, "deepspeed_config.gradient_clipping: 1.0"));
}

TEST(UnitConfigParse, YamlWithDeepSpeedAndNoJsonGetsThePluginsDefaults) {
  const TrainingConfig config =
      shardtrain::parse_config("distributed_type: DEEPSPEED\nmixed_precision: bf16\n", "yaml");
  EXPECT_EQ(config.distributed_type, DistributedType::kDeepSpeed);
  EXPECT_EQ(config.zero.stage, 2);  // Accelerate's DeepSpeedPlugin: zero_stage absent is 2
  EXPECT_EQ(config.zero.allgather_bucket_size, 500000000);
  EXPECT_TRUE(config.bf16);
  EXPECT_FALSE(config.fp16.enabled);
}

TEST(UnitConfigParse, DeepSpeedJsonPrecisionWinsOverAYamlNo) {
  ScratchDir dir;
  dir.write("ds.json", R"({"bf16": {"enabled": true}})");
  const std::string yaml = dir.write("acc.yaml",
                                     "distributed_type: DEEPSPEED\nmixed_precision: 'no'\n"
                                     "deepspeed_config:\n  deepspeed_config_file: ds.json\n");
  const TrainingConfig config = shardtrain::load_config(yaml);
  EXPECT_EQ(config.mixed_precision, MixedPrecision::kBf16);
  EXPECT_TRUE(has_warning(config, "mixed_precision: no")) << all_warnings(config);
}

TEST(UnitConfigParse, OffloadOutsideItsStageIsIgnoredWithAWarning) {
  const TrainingConfig config = shardtrain::parse_config(
      R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"},
                                "offload_optimizer": {"device": "cpu"}}})",
      "json");
  EXPECT_EQ(config.zero.offload_param, OffloadDevice::kNone);
  EXPECT_EQ(config.zero.offload_optimizer, OffloadDevice::kCpu);
  EXPECT_TRUE(has_warning(config, "offload_param.device cpu needs ZeRO stage 3"));
}

// ---------------------------------------------------------------- auto

TEST(UnitConfigAuto, HiddenSizeFormulasApplyOnlyToAuto) {
  const TrainingConfig config = shardtrain::parse_config(
      R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto",
          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                "stage3_param_persistence_threshold": "auto"}})",
      "json");
  AutoContext context;
  context.world_size = 4;
  context.micro_batch_size = 2;
  context.hidden_size = 4096;
  const TrainingConfig resolved = shardtrain::resolve_auto(config, context);
  EXPECT_EQ(resolved.zero.reduce_bucket_size, std::optional<int64_t>(4096LL * 4096));
  EXPECT_EQ(resolved.zero.stage3_prefetch_bucket_size, std::optional<int64_t>(15099494));  // floor(0.9 * 4096^2)
  EXPECT_EQ(resolved.zero.stage3_param_persistence_threshold, std::optional<int64_t>(40960));
  EXPECT_EQ(resolved.zero.overlap_comm, std::optional<bool>(true));  // stage 3
  EXPECT_EQ(resolved.train_micro_batch_size_per_gpu, std::optional<int64_t>(2));
  EXPECT_EQ(resolved.gradient_accumulation_steps, std::optional<int64_t>(1));
  EXPECT_EQ(resolved.train_batch_size, std::optional<int64_t>(8));
  EXPECT_EQ(resolved.gradient_clipping, std::optional<double>(1.0));
  EXPECT_EQ(resolved.num_processes, 4);
  EXPECT_TRUE(resolved.auto_keys.empty());

  // Without H, and for absent keys, DeepSpeed's fixed defaults.
  context.hidden_size.reset();
  const TrainingConfig unknown_h = shardtrain::resolve_auto(config, context);
  EXPECT_EQ(unknown_h.zero.reduce_bucket_size, std::optional<int64_t>(500000000));
  EXPECT_EQ(unknown_h.zero.stage3_prefetch_bucket_size, std::optional<int64_t>(50000000));
  EXPECT_EQ(unknown_h.zero.stage3_param_persistence_threshold, std::optional<int64_t>(100000));
  const TrainingConfig absent = shardtrain::parse_config(R"({"zero_optimization": {"stage": 2}})", "json");
  context.hidden_size = 4096;
  const TrainingConfig absent_resolved = shardtrain::resolve_auto(absent, context);
  EXPECT_EQ(absent_resolved.zero.reduce_bucket_size, std::optional<int64_t>(500000000));
  EXPECT_EQ(absent_resolved.zero.overlap_comm, std::optional<bool>(false));
  EXPECT_EQ(absent_resolved.gradient_clipping, std::optional<double>(0.0));  // absent = off
}

TEST(UnitConfigAuto, BatchTripleDerivesTheMissingValue) {
  AutoContext context;
  context.world_size = 2;
  const auto resolve = [&](const std::string& json) {
    return shardtrain::resolve_auto(shardtrain::parse_config(json, "json"), context);
  };
  const TrainingConfig from_total_and_micro =
      resolve(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})");
  EXPECT_EQ(from_total_and_micro.gradient_accumulation_steps, std::optional<int64_t>(4));
  const TrainingConfig from_total_and_accumulation =
      resolve(R"({"train_batch_size": 32, "gradient_accumulation_steps": 2})");
  EXPECT_EQ(from_total_and_accumulation.train_micro_batch_size_per_gpu, std::optional<int64_t>(8));
  const TrainingConfig from_micro_and_accumulation =
      resolve(R"({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5})");
  EXPECT_EQ(from_micro_and_accumulation.train_batch_size, std::optional<int64_t>(30));
  const TrainingConfig total_only = resolve(R"({"train_batch_size": 16})");
  EXPECT_EQ(total_only.train_micro_batch_size_per_gpu, std::optional<int64_t>(8));
  EXPECT_EQ(total_only.gradient_accumulation_steps, std::optional<int64_t>(1));
  // The data loader's batch size stands in for an "auto" micro batch.
  context.micro_batch_size = 4;
  const TrainingConfig loader = resolve(R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto"})");
  EXPECT_EQ(loader.gradient_accumulation_steps, std::optional<int64_t>(2));
}

TEST(UnitConfigAuto, OptimizerSchedulerAndFsdpDefaults) {
  const TrainingConfig config = shardtrain::parse_config(
      R"({"train_micro_batch_size_per_gpu": 1,
          "optimizer": {"type": "adam",
                        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
          "scheduler": {"type": "warmuplr", "params": {"warmup_max_lr": "auto", "warmup_num_steps": "auto"}}})",
      "json");
  EXPECT_EQ(config.optimizer.type, "Adam");
  EXPECT_EQ(config.scheduler.type, "WarmupLR");
  AutoContext context;
  context.warmup_steps = 30;
  const TrainingConfig resolved = shardtrain::resolve_auto(config, context);
  EXPECT_EQ(resolved.optimizer.lr, std::optional<double>(1e-3));
  ASSERT_TRUE(resolved.optimizer.betas.has_value());
  EXPECT_EQ(*resolved.optimizer.betas, (std::array<double, 2>{0.9, 0.999}));
  EXPECT_EQ(resolved.optimizer.eps, std::optional<double>(1e-8));
  EXPECT_EQ(resolved.optimizer.weight_decay, std::optional<double>(0.0));  // Adam: none
  EXPECT_EQ(resolved.optimizer.adam_w_mode, std::optional<bool>(true));   // DeepSpeed's Adam is AdamW by default
  EXPECT_EQ(resolved.scheduler.warmup_max_lr, std::optional<double>(1e-3));
  EXPECT_EQ(resolved.scheduler.warmup_min_lr, std::optional<double>(0.0));
  EXPECT_EQ(resolved.scheduler.warmup_num_steps, std::optional<int64_t>(30));
  // A run without warmup fills "auto" with 1, as transformers does: DeepSpeed's schedulers refuse 0.
  EXPECT_EQ(shardtrain::resolve_auto(config, AutoContext{}).scheduler.warmup_num_steps, std::optional<int64_t>(1));

  const TrainingConfig adamw = shardtrain::resolve_auto(
      shardtrain::parse_config(R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
                                   "scheduler": {"type": "WarmupLR"}})",
                               "json"),
      AutoContext{});
  // DeepSpeed builds FusedAdam for an "AdamW" block: no decay unless asked;
  // without a block the program's torch.optim.AdamW decays by 0.01.
  EXPECT_EQ(adamw.optimizer.weight_decay, std::optional<double>(0.0));
  EXPECT_EQ(shardtrain::resolve_auto(shardtrain::parse_config(R"({"train_micro_batch_size_per_gpu": 1})", "json"),
                                     AutoContext{})
                .optimizer.weight_decay,
            std::optional<double>(0.01));
  EXPECT_EQ(adamw.scheduler.warmup_num_steps, std::optional<int64_t>(1000));  // absent: DeepSpeed's default
  // WarmupDecayLR passes its own warmup_max_lr default (1e-3) on; "auto" is the lr, as Transformers fills it.
  auto decay_peak = [](const char* max_lr) {
    const std::string json = std::string(R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW",
        "params": {"lr": 1e-4}}, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100)") +
                             max_lr + "}}}";
    return shardtrain::resolve_auto(shardtrain::parse_config(json, "json"), AutoContext{}).scheduler.warmup_max_lr;
  };
  EXPECT_EQ(decay_peak(""), std::optional<double>(1e-3));
  EXPECT_EQ(decay_peak(R"(, "warmup_max_lr": "auto")"), std::optional<double>(1e-4));

  const TrainingConfig fsdp = shardtrain::resolve_auto(
      shardtrain::load_config((kConfigsDir / "fsdp_full_shard_bf16.yaml").string()), [] {
        AutoContext c;
        c.world_size = 2;
        c.micro_batch_size = 1;
        return c;
      }());
  EXPECT_EQ(fsdp.fsdp.param_dtype, std::optional<DType>(DType::kBf16));
  EXPECT_EQ(fsdp.fsdp.reduce_dtype, std::optional<DType>(DType::kBf16));
  EXPECT_EQ(fsdp.fsdp.buffer_dtype, std::optional<DType>(DType::kBf16));
  const TrainingConfig pure = shardtrain::resolve_auto(
      shardtrain::load_config((kConfigsDir / "fsdp_pure_bf16.yaml").string()), [] {
        AutoContext c;
        c.world_size = 2;
        c.micro_batch_size = 1;
        return c;
      }());
  EXPECT_FALSE(pure.fsdp.param_dtype.has_value());  // the load dtype
  EXPECT_EQ(pure.fsdp.pure_low_precision, std::optional<bool>(true));
}

// ---------------------------------------------------------------- writers

TEST(UnitConfigOutput, YamlAndJsonDumpsReadBackToTheSameConfig) {
  for (const char* file : {"zero3_fp16.json", "accelerate_zero3_bf16.yaml", "fsdp_pure_bf16.yaml",
                           "zero3_offload_cpu.json", "ddp_multi_cpu.yaml"}) {
    SCOPED_TRACE(file);
    const TrainingConfig loaded = shardtrain::load_config((kConfigsDir / file).string());
    const TrainingConfig resolved = shardtrain::resolve_auto(loaded, context_for(loaded));
    const std::string yaml = shardtrain::to_yaml(resolved);
    const std::string json = shardtrain::to_json(resolved);
    const TrainingConfig from_yaml = shardtrain::parse_config(yaml, "yaml");
    const TrainingConfig from_json = shardtrain::parse_config(json, "json");
    EXPECT_EQ(shardtrain::to_yaml(from_yaml), yaml);
    EXPECT_EQ(shardtrain::to_yaml(from_json), yaml);
    EXPECT_TRUE(from_yaml.warnings.empty()) << all_warnings(from_yaml);
    // Unresolved configs keep their "auto"s through a dump.
    const TrainingConfig unresolved = shardtrain::parse_config(shardtrain::to_yaml(loaded), "yaml");
    EXPECT_EQ(shardtrain::to_json(unresolved), shardtrain::to_json(loaded));
  }
  const TrainingConfig zero3 = shardtrain::load_config((kConfigsDir / "zero3_bf16.json").string());
  const std::string yaml = shardtrain::to_yaml(zero3);
  EXPECT_NE(yaml.find("reduce_bucket_size: auto"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("mixed_precision: bf16"), std::string::npos);
  const std::string fp32_yaml = shardtrain::to_yaml(shardtrain::load_config((kConfigsDir / "fsdp_fp32.yaml").string()));
  EXPECT_NE(fp32_yaml.find("mixed_precision: 'no'"), std::string::npos) << fp32_yaml;
}

// ---------------------------------------------------------------- convert

TrainingConfig convert_and_read(const TrainingConfig& config, const std::string& target,
                                std::vector<std::string>& notes) {
  const std::string text = shardtrain::convert_config(config, target, notes);
  return shardtrain::parse_config(text, target == "fsdp" ? "yaml" : "json");
}

bool has_note(const std::vector<std::string>& notes, const std::string& text) {
  for (const auto& note : notes) {
    if (note.find(text) != std::string::npos) return true;
  }
  return false;
}

TEST(UnitConfigConvert, FsdpStrategiesRoundTripThroughZeroStages) {
  struct Case {
    ShardingStrategy strategy;
    int stage;
    ShardingStrategy back;
    const char* note;  // "" when the mapping is exact
  };
  const std::vector<Case> cases = {
      {ShardingStrategy::kFullShard, 3, ShardingStrategy::kFullShard, ""},
      {ShardingStrategy::kShardGradOp, 2, ShardingStrategy::kShardGradOp, ""},
      {ShardingStrategy::kNoShard, 0, ShardingStrategy::kNoShard, ""},
      {ShardingStrategy::kHybridShard, 3, ShardingStrategy::kFullShard, "ZeRO++ hpZ"},
      {ShardingStrategy::kHybridShardZero2, 2, ShardingStrategy::kShardGradOp, "ZeRO++ hpZ"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(shardtrain::to_string(c.strategy));
    TrainingConfig fsdp = shardtrain::load_config((kConfigsDir / "fsdp_full_shard_bf16.yaml").string());
    fsdp.fsdp.sharding_strategy = c.strategy;
    std::vector<std::string> notes;
    const TrainingConfig zero = convert_and_read(fsdp, "deepspeed", notes);
    EXPECT_EQ(zero.distributed_type, DistributedType::kDeepSpeed);
    EXPECT_EQ(zero.zero.stage, c.stage);
    EXPECT_EQ(zero.mixed_precision, MixedPrecision::kBf16);
    if (*c.note != '\0') {
      EXPECT_TRUE(has_note(notes, c.note));
    }
    std::vector<std::string> back_notes;
    const TrainingConfig back = convert_and_read(zero, "fsdp", back_notes);
    EXPECT_EQ(back.distributed_type, DistributedType::kFsdp);
    EXPECT_EQ(back.fsdp.sharding_strategy, c.back);
    EXPECT_EQ(back.mixed_precision, MixedPrecision::kBf16);
    EXPECT_EQ(back.fsdp.pure_low_precision, std::optional<bool>(false));
  }
}

TEST(UnitConfigConvert, ZeroStagesMapToFsdpStrategies) {
  const std::map<int, ShardingStrategy> expected = {{0, ShardingStrategy::kNoShard},
                                                    {1, ShardingStrategy::kShardGradOp},
                                                    {2, ShardingStrategy::kShardGradOp},
                                                    {3, ShardingStrategy::kFullShard}};
  for (const auto& [stage, strategy] : expected) {
    SCOPED_TRACE(stage);
    TrainingConfig zero = shardtrain::load_config((kConfigsDir / "zero3_bf16.json").string());
    zero.zero.stage = stage;
    std::vector<std::string> notes;
    const TrainingConfig fsdp = convert_and_read(zero, "fsdp", notes);
    EXPECT_EQ(fsdp.fsdp.sharding_strategy, strategy);
    EXPECT_EQ(has_note(notes, "FSDP has no optimizer-state-only sharding"), stage == 1);
    std::vector<std::string> back_notes;
    EXPECT_EQ(convert_and_read(fsdp, "deepspeed", back_notes).zero.stage, stage == 1 ? 2 : stage);
  }
}

TEST(UnitConfigConvert, ADeepSpeedFileCarriesNoKeyItsEngineRefusesAtItsDefault) {
  // DeepSpeed refuses an explicit fp32 grad_accum_dtype under bf16 at stage 0,
  // and not every version reads raise_error_at_min_scale: at their defaults
  // they are left out; set otherwise they are written.
  TrainingConfig fsdp = shardtrain::load_config((kConfigsDir / "fsdp_full_shard_bf16.yaml").string());
  fsdp.fsdp.sharding_strategy = ShardingStrategy::kNoShard;
  std::vector<std::string> notes;
  const std::string text = shardtrain::convert_config(fsdp, "deepspeed", notes);
  EXPECT_EQ(text.find("grad_accum_dtype"), std::string::npos) << text;
  EXPECT_EQ(text.find("raise_error_at_min_scale"), std::string::npos) << text;
  TrainingConfig zero = shardtrain::load_config((kConfigsDir / "zero3_bf16.json").string());
  zero.fp16.raise_error_at_min_scale = false;
  zero.zero.grad_accum_dtype = DType::kBf16;
  const TrainingConfig back = convert_and_read(zero, "deepspeed", notes);
  EXPECT_FALSE(back.fp16.raise_error_at_min_scale);
  EXPECT_EQ(back.zero.grad_accum_dtype, DType::kBf16);
}

TEST(UnitConfigConvert, OffloadLoadingCheckpointAndPrecisionCarryOver) {
  TrainingConfig fsdp = shardtrain::load_config((kConfigsDir / "fsdp_full_shard_bf16.yaml").string());
  fsdp.fsdp.offload_params = true;
  fsdp.fsdp.cpu_ram_efficient_loading = true;
  fsdp.fsdp.state_dict_type = StateDictType::kShardedStateDict;
  std::vector<std::string> notes;
  const TrainingConfig zero = convert_and_read(fsdp, "deepspeed", notes);
  EXPECT_EQ(zero.zero.offload_param, OffloadDevice::kCpu);
  EXPECT_EQ(zero.zero.offload_optimizer, OffloadDevice::kCpu);
  EXPECT_TRUE(zero.zero3_init_flag);
  EXPECT_FALSE(zero.zero.stage3_gather_16bit_weights_on_model_save);
  EXPECT_TRUE(has_note(notes, "fsdp_offload_params"));
  EXPECT_TRUE(has_note(notes, "launch settings (num_processes 2)"));

  std::vector<std::string> back_notes;
  const TrainingConfig back = convert_and_read(zero, "fsdp", back_notes);
  EXPECT_TRUE(back.fsdp.offload_params);
  EXPECT_TRUE(back.fsdp.cpu_ram_efficient_loading);
  EXPECT_EQ(back.fsdp.state_dict_type, StateDictType::kShardedStateDict);

  // Offloading only the optimizer cannot be said in FSDP: all or nothing.
  const TrainingConfig article =
      shardtrain::load_config((kConfigsDir / "articles/ds_config_zero3_offload_article_003.json").string());
  std::vector<std::string> article_notes;
  const TrainingConfig converted = convert_and_read(article, "fsdp", article_notes);
  EXPECT_TRUE(converted.fsdp.offload_params);
  EXPECT_EQ(converted.mixed_precision, MixedPrecision::kFp16);
  EXPECT_TRUE(has_note(article_notes, "all-or-nothing"));
  EXPECT_TRUE(has_note(article_notes, "optimizer AdamW and scheduler WarmupDecayLR"));

  // Pure low precision has no ZeRO twin.
  std::vector<std::string> pure_notes;
  shardtrain::convert_config(shardtrain::load_config((kConfigsDir / "fsdp_pure_bf16.yaml").string()), "deepspeed",
                             pure_notes);
  EXPECT_TRUE(has_note(pure_notes, "fsdp_pure_low_precision has no DeepSpeed equivalent"));

  EXPECT_NE(config_error_of([&] { shardtrain::convert_config(fsdp, "megatron", notes); })
                .find("convert target megatron is not one of fsdp, deepspeed"),
            std::string::npos);
}

// ---------------------------------------------------------------- environment

TEST(UnitConfigEnvironment, NothingSetMeansNoConfig) {
  ScopedEnvironment env({{"SHARDTRAIN_CONFIG_FILE", std::nullopt},
                         {"SHARDTRAIN_DEEPSPEED_CONFIG_FILE", std::nullopt},
                         {"SHARDTRAIN_MIXED_PRECISION", ""},
                         {"SHARDTRAIN_DISTRIBUTED_TYPE", std::nullopt}});
  EXPECT_FALSE(shardtrain::config_from_environment().has_value());
}

TEST(UnitConfigEnvironment, LauncherVariablesSelectFilesAndOverride) {
  const std::string yaml = (kConfigsDir / "fsdp_full_shard_bf16.yaml").string();
  const std::string json = (kConfigsDir / "zero3_fp16.json").string();
  {
    ScopedEnvironment env({{"SHARDTRAIN_CONFIG_FILE", yaml},
                           {"SHARDTRAIN_DEEPSPEED_CONFIG_FILE", ""},
                           {"SHARDTRAIN_MIXED_PRECISION", "fp16"},
                           {"SHARDTRAIN_DISTRIBUTED_TYPE", "FSDP"}});
    const auto config = shardtrain::config_from_environment();
    ASSERT_TRUE(config.has_value());
    EXPECT_EQ(config->distributed_type, DistributedType::kFsdp);
    EXPECT_EQ(config->mixed_precision, MixedPrecision::kFp16);  // the environment overrides the file's bf16
    EXPECT_TRUE(has_warning(*config, "is overridden by SHARDTRAIN_MIXED_PRECISION=fp16"));
  }
  {
    // Only the JSON: loaded alone. The launcher's default "no" does not undo its fp16.
    ScopedEnvironment env({{"SHARDTRAIN_CONFIG_FILE", std::nullopt},
                           {"SHARDTRAIN_DEEPSPEED_CONFIG_FILE", json},
                           {"SHARDTRAIN_MIXED_PRECISION", "no"},
                           {"SHARDTRAIN_DISTRIBUTED_TYPE", "DEEPSPEED"}});
    const auto config = shardtrain::config_from_environment();
    ASSERT_TRUE(config.has_value());
    EXPECT_EQ(config->distributed_type, DistributedType::kDeepSpeed);
    EXPECT_EQ(config->mixed_precision, MixedPrecision::kFp16);
    EXPECT_EQ(config->zero.stage, 3);
    EXPECT_TRUE(config->warnings.empty()) << all_warnings(*config);
  }
  {
    // YAML plus a JSON from the launcher's --deepspeed_config_file.
    ScratchDir dir;
    const std::string accelerate = dir.write("acc.yaml", "distributed_type: DEEPSPEED\nnum_processes: 2\n");
    ScopedEnvironment env({{"SHARDTRAIN_CONFIG_FILE", accelerate},
                           {"SHARDTRAIN_DEEPSPEED_CONFIG_FILE", json},
                           {"SHARDTRAIN_MIXED_PRECISION", "bf16"},
                           {"SHARDTRAIN_DISTRIBUTED_TYPE", "DEEPSPEED"}});
    const std::string message = config_error_of([] { shardtrain::config_from_environment(); });
    EXPECT_NE(message.find("SHARDTRAIN_MIXED_PRECISION=bf16 conflicts with fp16.enabled: true"), std::string::npos)
        << message;
  }
  {
    ScopedEnvironment env({{"SHARDTRAIN_CONFIG_FILE", std::nullopt},
                           {"SHARDTRAIN_DEEPSPEED_CONFIG_FILE", std::nullopt},
                           {"SHARDTRAIN_MIXED_PRECISION", "bf16"},
                           {"SHARDTRAIN_DISTRIBUTED_TYPE", "MULTI_CPU"}});
    const auto config = shardtrain::config_from_environment();
    ASSERT_TRUE(config.has_value());
    EXPECT_EQ(config->distributed_type, DistributedType::kMultiCpu);
    EXPECT_EQ(config->mixed_precision, MixedPrecision::kBf16);
  }
  {
    ScopedEnvironment env({{"SHARDTRAIN_CONFIG_FILE", std::nullopt},
                           {"SHARDTRAIN_DEEPSPEED_CONFIG_FILE", std::nullopt},
                           {"SHARDTRAIN_MIXED_PRECISION", "fp8"},
                           {"SHARDTRAIN_DISTRIBUTED_TYPE", std::nullopt}});
    EXPECT_NE(config_error_of([] { shardtrain::config_from_environment(); }).find("SHARDTRAIN_MIXED_PRECISION: fp8"),
              std::string::npos);
  }
}

TEST(UnitConfigEnvironment, EngineInferredFromTheFileSurvivesAPlainDataParallelOverride) {
  // SHARDTRAIN_DISTRIBUTED_TYPE=NO set by hand (shardtrain launch exports the
  // engine it inferred) does not undo the DeepSpeed the article's YAML
  // configures without naming it.
  ScopedEnvironment env({{"SHARDTRAIN_CONFIG_FILE", (kConfigsDir / "articles/accelerate_article_003.yaml").string()},
                         {"SHARDTRAIN_DEEPSPEED_CONFIG_FILE", ""},
                         {"SHARDTRAIN_MIXED_PRECISION", "no"},
                         {"SHARDTRAIN_DISTRIBUTED_TYPE", "NO"}});
  const auto config = shardtrain::config_from_environment();
  ASSERT_TRUE(config.has_value());
  EXPECT_EQ(config->distributed_type, DistributedType::kDeepSpeed);
  EXPECT_TRUE(has_warning(*config, "SHARDTRAIN_DISTRIBUTED_TYPE=NO is ignored")) << all_warnings(*config);
}

// ---------------------------------------------------------------- CLI

/// Runs the shardtrain CLI; returns its exit status and stdout+stderr.
std::pair<int, std::string> run_cli(const std::string& arguments) {
  const std::string command = std::string(SHARDTRAIN_BIN_DIR) + "/shardtrain " + arguments + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return {-1, ""};
  std::string output;
  std::array<char, 4096> buffer{};
  while (fgets(buffer.data(), buffer.size(), pipe) != nullptr) output += buffer.data();
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

TEST(UnitConfigCli, CheckPrintsWarningsAndTheResolvedConfig) {
  const std::string article = (kConfigsDir / "articles/accelerate_article_003.yaml").string();
  const auto [status, output] = run_cli("config check " + article + " --micro-batch 2 --world-size 2 --hidden-size 8");
  EXPECT_EQ(status, 0) << output;
  EXPECT_NE(output.find("# warning: "), std::string::npos) << output;
  EXPECT_NE(output.find("train_batch_size: 16"), std::string::npos) << output;  // 2 * 4 * 2
  EXPECT_NE(output.find("distributed_type: DEEPSPEED"), std::string::npos) << output;

  const auto [bad_status, bad_output] = run_cli("config check " + (kBadDir / "stage_4.json").string());
  EXPECT_EQ(bad_status, 2) << bad_output;
  EXPECT_NE(bad_output.find("zero_optimization.stage must be an integer 0-3, got 4"), std::string::npos) << bad_output;
}

TEST(UnitConfigCli, ConvertWritesTheOtherEnginesConfigAndNotes) {
  ScratchDir dir;
  const std::string out = dir.path() + "/ds.json";
  const auto [status, output] =
      run_cli("config convert " + (kConfigsDir / "fsdp_hybrid_shard_bf16.yaml").string() + " --to deepspeed -o " + out);
  EXPECT_EQ(status, 0) << output;
  EXPECT_NE(output.find("note: HYBRID_SHARD becomes ZeRO stage 3"), std::string::npos) << output;
  const TrainingConfig converted = shardtrain::load_config(out);
  EXPECT_EQ(converted.zero.stage, 3);
  EXPECT_TRUE(converted.bf16);
}

}  // namespace

// ---------------------------------------------------------------- users' habits (issue 14)

namespace {

/// Runs `body` with the working directory set to `directory`, restoring it after.
template <typename Body>
void in_directory(const std::string& directory, Body body) {
  const fs::path previous = fs::current_path();
  fs::current_path(directory);
  try {
    body();
  } catch (...) {
    fs::current_path(previous);
    throw;
  }
  fs::current_path(previous);
}

}  // namespace

TEST(UnitConfigHabits, DeepSpeedFileResolvesFromTheWorkingDirectoryThenNextToTheYaml) {
  ScratchDir dir;
  fs::create_directories(dir.file("run/configs"));
  const std::string yaml = dir.write("run/configs/acc.yaml",
                                     "distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                     "  deepspeed_config_file: ds.json\n");
  dir.write("run/ds.json", R"({"zero_optimization": {"stage": 3}})");
  dir.write("run/configs/ds.json", R"({"zero_optimization": {"stage": 1}})");
  // Accelerate opens the path as given, so from the working directory: stage 3.
  in_directory(dir.file("run"), [&] { EXPECT_EQ(shardtrain::load_config(yaml).zero.stage, 3); });
  // Not there: the file next to the YAML.
  fs::remove(dir.file("run/ds.json"));
  in_directory(dir.file("run"), [&] { EXPECT_EQ(shardtrain::load_config(yaml).zero.stage, 1); });
  // Neither: the error names both places it looked.
  fs::remove(dir.file("run/configs/ds.json"));
  in_directory(dir.file("run"), [&] {
    const std::string message = config_error_of([&] { shardtrain::load_config(yaml); });
    const std::string cwd = fs::weakly_canonical(dir.file("run")).string();
    EXPECT_NE(message.find(cwd + "/ds.json"), std::string::npos) << message;
    EXPECT_NE(message.find(cwd + "/configs/ds.json"), std::string::npos) << message;
  });
}

TEST(UnitConfigHabits, AnAccelerateDeepSpeedPluginWithoutAFileRunsZeroStageTwo) {
  // Accelerate's DeepSpeedPlugin: zero_stage absent is 2; a DeepSpeed JSON's absent stage is 0.
  ScratchDir dir;
  const std::string plugin = dir.write("plugin.yaml", "distributed_type: DEEPSPEED\nmixed_precision: bf16\n"
                                                      "deepspeed_config:\n  offload_optimizer_device: none\n");
  EXPECT_EQ(shardtrain::load_config(plugin).zero.stage, 2);
  const std::string three = dir.write("three.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n");
  EXPECT_EQ(shardtrain::load_config(three).zero.stage, 3);
  const std::string json = dir.write("ds.json", R"({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true}})");
  EXPECT_EQ(shardtrain::load_config(json).zero.stage, 0);
  const std::string with_file = dir.write("file.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                                       "  deepspeed_config_file: " + json + "\n");
  EXPECT_EQ(shardtrain::load_config(with_file).zero.stage, 0);
}

TEST(UnitConfigHabits, DuplicateYamlKeyKeepsTheLastValueAndNamesBothLines) {
  const TrainingConfig config = shardtrain::parse_config(
      "distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 2\nmixed_precision: 'no'\n", "yaml");
  EXPECT_EQ(config.mixed_precision, shardtrain::MixedPrecision::kNo);  // PyYAML's dict keeps the last
  ASSERT_FALSE(config.warnings.empty());
  const std::string& warning = config.warnings.front();
  EXPECT_NE(warning.find(":4: duplicate key 'mixed_precision' (first given at line 2)"), std::string::npos)
      << warning;
  // DeepSpeed reads JSON with dict_raise_error_on_duplicate_keys: still an error there.
  EXPECT_NE(config_error_of([] { shardtrain::parse_config(R"({"steps_per_print": 1, "steps_per_print": 2})", "json"); })
                .find("duplicate key 'steps_per_print'"),
            std::string::npos);
}

TEST(UnitConfigHabits, DeepSpeedEdgeValuesReadAsDeepSpeedReadsThem) {
  const TrainingConfig config = shardtrain::parse_config(R"({
    "zero_optimization": {"stage": 3, "sub_group_size": 0, "reduce_bucket_size": 1e5,
                          "prefetch_bucket_size": 1.0e+7, "param_persistence_threshold": 1e4,
                          "max_live_parameters": 3e8, "max_reuse_distance": 2e8,
                          "gather_16bit_weights_on_model_save": true},
    "optimizer": {"type": "AdamW", "params": {"betas": "auto"}}})",
                                                         "json");
  EXPECT_EQ(config.zero.sub_group_size, 0);  // Field(ge=0): one sub-group per parameter
  EXPECT_EQ(config.zero.reduce_bucket_size, std::optional<int64_t>(100000));
  // DeepSpeed's field names, besides their stage3_ aliases.
  EXPECT_EQ(config.zero.stage3_prefetch_bucket_size, std::optional<int64_t>(10000000));
  EXPECT_EQ(config.zero.stage3_param_persistence_threshold, std::optional<int64_t>(10000));
  EXPECT_EQ(config.zero.stage3_max_live_parameters, 300000000);
  EXPECT_EQ(config.zero.stage3_max_reuse_distance, 200000000);
  EXPECT_TRUE(config.zero.stage3_gather_16bit_weights_on_model_save);
  EXPECT_TRUE(config.warnings.empty()) << config.warnings.front();
  EXPECT_FALSE(config.optimizer.betas.has_value());  // "auto": the run's
  // The oldest format, a boolean: DeepSpeed reads true as stage 1 and warns.
  const TrainingConfig legacy = shardtrain::parse_config(R"({"zero_optimization": true})", "json");
  EXPECT_EQ(legacy.zero.stage, 1);
  ASSERT_EQ(legacy.warnings.size(), 1u);
  EXPECT_NE(legacy.warnings[0].find("is deprecated"), std::string::npos) << legacy.warnings[0];
}

TEST(UnitConfigHabits, FeaturesShardtrainLacksAreRecognisedNotUnknown) {
  const TrainingConfig mesh = shardtrain::parse_config(
      "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_cpu_offload: true\n"
      "parallelism_config:\n  parallelism_config_dp_shard_size: 2\n  parallelism_config_tp_size: 1\n"
      "  parallelism_config_cp_backend: torch\n",
      "yaml");
  EXPECT_TRUE(mesh.fsdp.offload_params);  // some FSDP2 configs' spelling of fsdp_offload_params
  ASSERT_EQ(mesh.warnings.size(), 2u);
  EXPECT_NE(mesh.warnings[0].find("fsdp_cpu_offload is not Accelerate's key"), std::string::npos) << mesh.warnings[0];
  EXPECT_NE(mesh.warnings[1].find("parallelism_config_dp_shard_size: 2 is recognised but not implemented"),
            std::string::npos)
      << mesh.warnings[1];
  const std::string tensor_parallel = config_error_of([] {
    shardtrain::parse_config("distributed_type: FSDP\nparallelism_config:\n  parallelism_config_tp_size: 2\n", "yaml");
  });
  EXPECT_NE(tensor_parallel.find("asks for tensor parallelism, which shardtrain recognises but does not implement"),
            std::string::npos)
      << tensor_parallel;
  EXPECT_EQ(tensor_parallel.find("unknown key"), std::string::npos) << tensor_parallel;
  const std::string fp8 = config_error_of([] { shardtrain::parse_config("mixed_precision: fp8\n", "yaml"); });
  EXPECT_NE(fp8.find("fp8 is recognised but not implemented"), std::string::npos) << fp8;
  // Older `accelerate config` files carry empty plugin blocks: nothing to say.
  EXPECT_TRUE(shardtrain::parse_config("distributed_type: MULTI_GPU\nmegatron_lm_config: {}\nfp8_config: {}\n", "yaml")
                  .warnings.empty());
}

TEST(UnitConfigCli, CheckWithoutRunFlagsShowsWhatTheRunDecidesAndFlagsFillItIn) {
  const std::string file = (kConfigsDir / "zero3_bf16.json").string();
  const auto [status, output] = run_cli("config check " + file);
  EXPECT_EQ(status, 0) << output;  // failed with "the run gave no micro batch size" before
  for (const char* line : {"# train_micro_batch_size_per_gpu: auto (from the data loader",
                           "# train_batch_size: auto (from the data loader",
                           "# zero_optimization.reduce_bucket_size: auto (from the model"}) {
    EXPECT_NE(output.find(line), std::string::npos) << line << "\n" << output;
  }
  EXPECT_NE(output.find("\ntrain_micro_batch_size_per_gpu: auto\n"), std::string::npos) << output;
  EXPECT_NE(output.find("# optimizer.params.lr: auto (from the run"), std::string::npos) << output;
  EXPECT_NE(output.find("\n    lr: auto\n"), std::string::npos) << output;  // not a made-up 1e-3
  // The printout reads back as a config.
  ScratchDir dir;
  const auto [again_status, again] = run_cli("config check " + dir.write("resolved.yaml", output));
  EXPECT_EQ(again_status, 0) << again;

  const auto [filled_status, filled] = run_cli("config check " + file + " --micro-batch 4 --hidden-size 8 --world-size 2");
  EXPECT_EQ(filled_status, 0) << filled;
  EXPECT_EQ(filled.find("auto (from the data loader"), std::string::npos) << filled;
  EXPECT_EQ(filled.find("auto (from the model"), std::string::npos) << filled;
  EXPECT_NE(filled.find("train_batch_size: 8\n"), std::string::npos) << filled;  // 4 x 1 x 2
  EXPECT_NE(filled.find("reduce_bucket_size: 64\n"), std::string::npos) << filled;  // 8^2
}

// With --device cuda the precision plan splits an offloaded run's model
// states between the device and pinned host memory. 1B parameters, bf16,
// ZeRO-3 over 4 ranks, per rank: bf16 shard 0.5 B/param, fp32 gradient 1,
// master 1, Adam's two moments 2 (4.5 GB in all). The host holds the master,
// the moments, the gradient and the 16-bit partition (a copy the step
// writes, or the partition itself under offload_param): 4.5 GB. The device
// keeps the partition (500 MB) unless offload_param moved it too (nothing).
// With pin_memory: false the same bytes are in pageable host memory. On the
// CPU nothing moves, and the plan says so.
TEST(UnitConfigCli, CheckOnCudaSplitsAnOffloadedRunBetweenTheDeviceAndPinnedHostMemory) {
  const std::string both = (kConfigsDir / "zero3_offload_cpu.json").string();
  std::ifstream in(both);
  std::string optimizer_only((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string param_block = R"("offload_param": {
      "device": "cpu",
      "pin_memory": true
    })";
  const std::size_t at_block = optimizer_only.find(param_block);
  ASSERT_NE(at_block, std::string::npos) << "zero3_offload_cpu.json changed its offload_param block";
  optimizer_only.replace(at_block, param_block.size(), R"("offload_param": {"device": "none"})");
  std::string pageable = optimizer_only;
  const std::string pinned_key = R"("pin_memory": true)";
  const std::size_t at_key = pageable.find(pinned_key);
  ASSERT_NE(at_key, std::string::npos) << "zero3_offload_cpu.json no longer says " << pinned_key;
  pageable.replace(at_key, pinned_key.size(), R"("pin_memory": false)");
  ScratchDir dir;
  const std::string flags = " --world-size 4 --num-params 1000000000 --hidden-size 8 --micro-batch 1";
  for (const auto& [file, device_gb, host_row] :
       {std::tuple{both, "0.00 B", "in pinned host memory    "},
        std::tuple{dir.write("optimizer_only.json", optimizer_only), "500.00 MB", "in pinned host memory    "},
        std::tuple{dir.write("pageable.json", pageable), "500.00 MB", "in pageable host memory  "}}) {
    SCOPED_TRACE(file);
    const auto [status, output] = run_cli("config check " + file + flags + " --device cuda");
    ASSERT_EQ(status, 0) << output;
    EXPECT_NE(output.find("total model states       4.500 B/param/rank  = 4.50 GB per rank"), std::string::npos)
        << output;
    EXPECT_NE(output.find(std::string("#     on the device            ") + device_gb + " per rank"), std::string::npos)
        << output;
    EXPECT_NE(output.find(std::string("#     ") + host_row + "4.50 GB per rank"), std::string::npos) << output;
  }
  const auto [status, output] = run_cli("config check " + both + flags);
  ASSERT_EQ(status, 0) << output;
  EXPECT_NE(output.find("#   offload: asked for, nothing to move: the model is on the CPU"), std::string::npos)
      << output;
  EXPECT_EQ(output.find("pinned host memory"), std::string::npos) << output;
}

// ---------------------------------------------------------------- hostile documents
// Each limit (src/config/config_tree.h) stops a document before it takes the
// memory or stack it asks for; the message names the limit.

namespace hostile {

/// The "billion laughs": level k is a list of nine aliases of level k-1, so
/// about 500 bytes expand to 9^9 (387 million) values.
std::string alias_bomb() {
  std::string text = "a0: &a0 [\"lol\"]\n";
  for (int level = 1; level <= 9; ++level) {
    const std::string previous = "*a" + std::to_string(level - 1);
    text += "a" + std::to_string(level) + ": &a" + std::to_string(level) + " [";
    for (int k = 0; k < 9; ++k) text += (k ? ", " : "") + previous;
    text += "]\n";
  }
  return text + "mixed_precision: bf16\n";
}

std::string nested_yaml(int depth) { return "key: " + std::string(depth, '[') + std::string(depth, ']') + "\n"; }

std::string nested_json(int depth) {
  std::string text;
  for (int i = 0; i < depth; ++i) text += "{\"a\":";
  text += "1";
  text += std::string(depth, '}');
  return text;
}

}  // namespace hostile

TEST(UnitConfigHostile, AYamlAliasBombIsRefusedByItsExpandedSize) {
  const std::string bomb = hostile::alias_bomb();
  ASSERT_LT(bomb.size(), 600u);
  const std::string message = config_error_of([&] { shardtrain::parse_config(bomb, "yaml"); });
  EXPECT_NE(message.find("expands to more than 100000 values"), std::string::npos) << message;
  EXPECT_NE(message.find("YAML aliases"), std::string::npos) << message;
}

TEST(UnitConfigHostile, AliasesOfALongValueAreRefusedByTheirExpandedBytes) {
  // 20 aliases of a 1 MiB string: 21 values, 21 MiB of text once expanded.
  std::string text = "long: &long \"" + std::string(1 << 20, 'x') + "\"\nrepeats: [";
  for (int k = 0; k < 20; ++k) text += (k ? ", " : "") + std::string("*long");
  text += "]\n";
  const std::string message = config_error_of([&] { shardtrain::parse_config(text, "yaml"); });
  EXPECT_NE(message.find("expand to more than 16 MiB"), std::string::npos) << message;
}

TEST(UnitConfigHostile, DeepNestingIsRefusedByNameInYamlAndJson) {
  // Within yaml-cpp's own guard: shardtrain's limit speaks.
  std::string message = config_error_of([&] { shardtrain::parse_config(hostile::nested_yaml(100), "yaml"); });
  EXPECT_NE(message.find("nest deeper than 64 levels"), std::string::npos) << message;
  // Beyond it (yaml-cpp alone said "bad file"): still named as nesting.
  message = config_error_of([&] { shardtrain::parse_config(hostile::nested_yaml(10000), "yaml"); });
  EXPECT_NE(message.find("nest deeper than yaml-cpp reads"), std::string::npos) << message;
  // 15,000 levels of JSON crashed the reader with SIGSEGV.
  message = config_error_of([&] { shardtrain::parse_config(hostile::nested_json(15000), "json"); });
  EXPECT_NE(message.find("nests objects and arrays deeper than 64 levels"), std::string::npos) << message;
  // The limit, not a smaller one: 64 levels are read (and the nested key is then unknown).
  const TrainingConfig deep = shardtrain::parse_config(hostile::nested_json(64), "json");
  EXPECT_TRUE(has_warning(deep, "unknown key 'a'")) << all_warnings(deep);
  message = config_error_of([&] { shardtrain::parse_config(hostile::nested_json(65), "json"); });
  EXPECT_NE(message.find("deeper than 64 levels"), std::string::npos) << message;
}

TEST(UnitConfigHostile, AFileOverTheSizeLimitIsRefusedBeforeItIsRead) {
  const shardtrain::testing::ScratchDir dir;
  const fs::path path = fs::path(dir.path()) / "huge.yaml";
  {
    std::ofstream out(path);
    out << "mixed_precision: bf16\n";
    const std::string comment = "# " + std::string(1000, 'x') + "\n";
    for (int k = 0; k < 5000; ++k) out << comment;  // ~5 MB, all comments
  }
  const std::string message = config_error_of([&] { shardtrain::load_config(path.string()); });
  EXPECT_NE(message.find("over the 4 MiB a config file may be"), std::string::npos) << message;
  EXPECT_NE(message.find(path.string()), std::string::npos) << message;
}

TEST(UnitConfigHostile, RepeatedWarningsAreSummarisedAfterTheFirstFive) {
  // The same key given 50 times, then 50 different unknown keys.
  std::string text;
  for (int k = 0; k < 50; ++k) text += "mixed_precision: bf16\n";
  for (int k = 0; k < 50; ++k) text += "zzqq_made_up_" + std::to_string(k) + ": 1\n";
  const TrainingConfig config = shardtrain::parse_config(text, "yaml");
  int duplicates = 0, unknown = 0;
  for (const auto& warning : config.warnings) {
    if (warning.find("more warning(s) like the") != std::string::npos) continue;  // the summaries, checked below
    if (warning.find("duplicate key 'mixed_precision'") != std::string::npos) ++duplicates;
    if (warning.find("unknown key 'zzqq_made_up_") != std::string::npos) ++unknown;
  }
  EXPECT_EQ(duplicates, 5) << all_warnings(config);
  EXPECT_EQ(unknown, 5) << all_warnings(config);
  EXPECT_TRUE(has_warning(config, "44 more warning(s) like the 5 above were not shown")) << all_warnings(config);
  EXPECT_TRUE(has_warning(config, "45 more warning(s) like the 5 above were not shown")) << all_warnings(config);
  EXPECT_LE(config.warnings.size(), 14u) << all_warnings(config);
}
