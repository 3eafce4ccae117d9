// `shardtrain launch` options: flag parsing, Accelerate YAML defaults,
// precedence, and the validation messages users see.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <gtest/gtest.h>

#include "support/log_capture.h"
#include "support/scoped_environment.h"
#include "support/scratch_dir.h"
#include "launcher/launch_options.h"
#include "launcher/launcher.h"
#include "shardtrain/config.h"
#include "shardtrain/error.h"

namespace {

using shardtrain::ConfigError;
using shardtrain::launcher::LaunchOptions;
using shardtrain::launcher::parse_launch_options;
namespace fs = std::filesystem;

using shardtrain::testing::ScopedEnvironment;
using shardtrain::testing::ScratchDir;

/// The message of the ConfigError that parsing `args` throws ("" if none).
std::string launch_error_of(const std::vector<std::string>& args) {
  try {
    parse_launch_options(args);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(UnitLaunchOptions, DefaultsWithOnlyProgram) {
  const LaunchOptions options = parse_launch_options({"./train"});
  EXPECT_EQ(options.num_processes, 1);
  EXPECT_EQ(options.num_machines, 1);
  EXPECT_EQ(options.machine_rank, 0);
  EXPECT_EQ(options.main_process_ip, "127.0.0.1");
  EXPECT_EQ(options.main_process_port, 29500);
  EXPECT_EQ(options.mixed_precision, "no");
  EXPECT_EQ(options.distributed_type, "NO");
  EXPECT_FALSE(options.use_deepspeed);
  EXPECT_FALSE(options.use_fsdp);
  EXPECT_TRUE(options.config_file.empty());
  EXPECT_DOUBLE_EQ(options.grace_period_s, 5.0);
  EXPECT_EQ(options.program, "./train");
  EXPECT_TRUE(options.program_args.empty());
  EXPECT_EQ(options.processes_per_machine(), 1);
}

TEST(UnitLaunchOptions, FlagsAreParsed) {
  const LaunchOptions options = parse_launch_options(
      {"--num_processes", "8", "--num_machines=2", "--machine_rank", "1", "--main_process_ip", "10.0.0.7",
       "--main_process_port", "31000", "--mixed_precision", "bf16", "--use_fsdp", "--grace_period", "0.5",
       "--rdzv_token", "the-job-secret", "./train"});
  EXPECT_EQ(options.rdzv_token, "the-job-secret");
  EXPECT_FALSE(options.rdzv_token_generated);
  EXPECT_EQ(options.num_processes, 8);
  EXPECT_EQ(options.num_machines, 2);
  EXPECT_EQ(options.machine_rank, 1);
  EXPECT_EQ(options.processes_per_machine(), 4);
  EXPECT_EQ(options.main_process_ip, "10.0.0.7");
  EXPECT_EQ(options.main_process_port, 31000);
  EXPECT_EQ(options.mixed_precision, "bf16");
  EXPECT_TRUE(options.use_fsdp);
  EXPECT_FALSE(options.use_deepspeed);
  EXPECT_EQ(options.distributed_type, "FSDP");
  EXPECT_DOUBLE_EQ(options.grace_period_s, 0.5);
}

TEST(UnitLaunchOptions, ProgramArgumentsPassThroughUntouched) {
  // ARGS may reuse the launcher's own flag names; they belong to PROGRAM.
  const LaunchOptions options = parse_launch_options(
      {"--num_processes", "2", "./train", "--num_processes", "7", "--help", "-x", "--", "plain"});
  EXPECT_EQ(options.num_processes, 2);
  EXPECT_EQ(options.program, "./train");
  EXPECT_EQ(options.program_args,
            (std::vector<std::string>{"--num_processes", "7", "--help", "-x", "--", "plain"}));
}

TEST(UnitLaunchOptions, DoubleDashSeparatesProgram) {
  const LaunchOptions options = parse_launch_options({"--num_processes", "2", "--", "./train", "--lr", "1"});
  EXPECT_EQ(options.program, "./train");
  EXPECT_EQ(options.program_args, (std::vector<std::string>{"--lr", "1"}));
  EXPECT_EQ(options.distributed_type, "MULTI_CPU");
}

TEST(UnitLaunchOptions, DeepspeedConfigAliasAndAbsolutePath) {
  ScratchDir dir;
  const std::string json = dir.write("ds.json", "{\"zero_optimization\": {\"stage\": 2}}");
  for (const std::string flag : {"--deepspeed_config_file", "--deepspeed_config"}) {
    SCOPED_TRACE(flag);
    const LaunchOptions options = parse_launch_options({flag, json, "./train"});
    EXPECT_EQ(options.deepspeed_config_file, json);
    EXPECT_TRUE(options.use_deepspeed) << "a DeepSpeed config selects the ZeRO engine";
    EXPECT_EQ(options.distributed_type, "DEEPSPEED");
  }
  // A relative path is resolved against the working directory and made absolute.
  const fs::path previous = fs::current_path();
  fs::current_path(dir.path());
  const LaunchOptions relative = parse_launch_options({"--use_deepspeed", "--deepspeed_config", "ds.json", "./t"});
  fs::current_path(previous);
  EXPECT_TRUE(fs::path(relative.deepspeed_config_file).is_absolute());
  EXPECT_EQ(fs::canonical(relative.deepspeed_config_file), fs::canonical(json));
}

TEST(UnitLaunchOptions, RendezvousTokenComesFromTheFlagTheEnvironmentOrIsMade) {
  ScopedEnvironment no_token({{"SHARDTRAIN_RDZV_TOKEN", std::nullopt}, {"SHARDTRAIN_RDZV_TOKEN_FILE", std::nullopt}});
  const LaunchOptions made = parse_launch_options({"--num_processes", "2", "./train"});
  EXPECT_TRUE(made.rdzv_token_generated);
  EXPECT_EQ(made.rdzv_token.size(), 64u);
  EXPECT_NE(parse_launch_options({"./train"}).rdzv_token, made.rdzv_token) << "a token must be fresh per job";
  EXPECT_NE(launch_error_of({"--rdzv_token", "", "./train"}).find("--rdzv_token is empty"), std::string::npos);
  const std::string missing = launch_error_of({"--num_processes", "4", "--num_machines", "2", "--machine_rank", "1",
                                               "--main_process_ip", "10.0.0.1", "./train"});
  EXPECT_NE(missing.find("machine 1 of 2 has no rendezvous token"), std::string::npos) << missing;
  ::setenv("SHARDTRAIN_RDZV_TOKEN", "from-the-environment", 1);
  const LaunchOptions from_env = parse_launch_options({"--num_processes", "4", "--num_machines", "2", "--machine_rank",
                                                       "1", "--main_process_ip", "10.0.0.1", "./train"});
  EXPECT_EQ(from_env.rdzv_token, "from-the-environment");
  EXPECT_FALSE(from_env.rdzv_token_generated);
  EXPECT_EQ(parse_launch_options({"--rdzv_token", "flag-wins", "./train"}).rdzv_token, "flag-wins");
}

TEST(UnitLaunchOptions, YamlValuesAreDefaults) {
  ScratchDir dir;
  // A name that cannot exist in the working directory, so it is found next to the YAML.
  const std::string json_name = "ds_" + fs::path(dir.path()).filename().string() + ".json";
  const std::string json = dir.write(json_name, "{}");
  // As `accelerate config` writes it, including keys shardtrain ignores and nulls.
  const std::string config = dir.write("accelerate.yaml",
                                       "compute_environment: LOCAL_MACHINE\n"
                                       "debug: false\n"
                                       "distributed_type: DEEPSPEED\n"
                                       "deepspeed_config:\n"
                                       "  deepspeed_config_file: " + json_name + "\n"
                                       "  zero3_init_flag: false\n"
                                       "downcast_bf16: 'no'\n"
                                       "machine_rank: 1\n"
                                       "main_process_ip: 192.168.1.10\n"
                                       "main_process_port: 29600\n"
                                       "main_training_function: main\n"
                                       "mixed_precision: bf16\n"
                                       "num_machines: 2\n"
                                       "num_processes: 4\n"
                                       "rdzv_backend: static\n"
                                       "same_network: true\n"
                                       "tpu_env: []\n"
                                       "use_cpu: false\n");
  const LaunchOptions options = parse_launch_options({"--config_file", config, "--rdzv_token", "t", "./train"});
  EXPECT_EQ(options.num_processes, 4);
  EXPECT_EQ(options.num_machines, 2);
  EXPECT_EQ(options.machine_rank, 1);
  EXPECT_EQ(options.processes_per_machine(), 2);
  EXPECT_EQ(options.main_process_ip, "192.168.1.10");
  EXPECT_EQ(options.main_process_port, 29600);
  EXPECT_EQ(options.mixed_precision, "bf16");
  EXPECT_EQ(options.distributed_type, "DEEPSPEED");
  EXPECT_TRUE(options.use_deepspeed);
  EXPECT_EQ(options.config_file, config);
  EXPECT_EQ(fs::canonical(options.deepspeed_config_file), fs::canonical(json));
}

TEST(UnitLaunchOptions, FlagsOverrideYaml) {
  ScratchDir dir;
  const std::string config = dir.write("accelerate.yaml",
                                       "distributed_type: MULTI_GPU\n"
                                       "mixed_precision: fp16\n"
                                       "num_machines: 2\n"
                                       "machine_rank: 1\n"
                                       "main_process_ip: 10.1.1.1\n"
                                       "main_process_port: 29600\n"
                                       "num_processes: 4\n");
  const LaunchOptions options = parse_launch_options(
      {"--config_file", config, "--num_processes", "8", "--machine_rank", "0", "--main_process_port", "30001",
       "--mixed_precision", "no", "--use_fsdp", "./train"});
  EXPECT_EQ(options.num_processes, 8);
  EXPECT_EQ(options.num_machines, 2);  // from the file
  EXPECT_EQ(options.machine_rank, 0);
  EXPECT_EQ(options.main_process_ip, "10.1.1.1");  // from the file
  EXPECT_EQ(options.main_process_port, 30001);
  EXPECT_EQ(options.mixed_precision, "no");
  EXPECT_EQ(options.distributed_type, "FSDP");
  EXPECT_TRUE(options.use_fsdp);
}

TEST(UnitLaunchOptions, YamlDistributedTypes) {
  ScratchDir dir;
  const std::string fsdp = dir.write("fsdp.yaml", "distributed_type: FSDP\nnum_processes: 2\n");
  EXPECT_TRUE(parse_launch_options({"--config_file", fsdp, "./t"}).use_fsdp);
  const std::string gpu = dir.write("gpu.yaml", "distributed_type: MULTI_GPU\nnum_processes: 2\n");
  EXPECT_EQ(parse_launch_options({"--config_file", gpu, "./t"}).distributed_type, "MULTI_CPU");
  const std::string no = dir.write("no.yaml", "distributed_type: 'NO'\nmixed_precision: no\nnum_processes: 1\n");
  const LaunchOptions single = parse_launch_options({"--config_file", no, "./t"});
  EXPECT_EQ(single.distributed_type, "NO");
  EXPECT_EQ(single.mixed_precision, "no");
  const std::string xla = dir.write("xla.yaml", "distributed_type: XLA\n");
  const std::string message = launch_error_of({"--config_file", xla, "./t"});
  EXPECT_NE(message.find("distributed_type: XLA"), std::string::npos) << message;
  EXPECT_NE(message.find("DEEPSPEED, FSDP"), std::string::npos) << message;
}

/// What a worker of this launch reads: config_from_environment() under the
/// variables the launcher gives its workers.
shardtrain::TrainingConfig read_by_a_worker(const LaunchOptions& options) {
  ScopedEnvironment::Values variables;
  for (const auto& [name, value] : shardtrain::launcher::worker_environment(options, 0)) {
    variables.emplace_back(name, value);
  }
  ScopedEnvironment environment(variables);
  const std::optional<shardtrain::TrainingConfig> config = shardtrain::config_from_environment();
  if (!config) throw std::runtime_error("the worker found no config in its environment");
  return *config;
}

TEST(UnitLaunchOptions, TheLauncherReadsTheConfigAsItsWorkersDo) {
  ScratchDir dir;
  // A name that cannot exist in the working directory, so it is found next to the YAML.
  const std::string json_name = "ds_" + fs::path(dir.path()).filename().string() + ".json";
  const std::string json = dir.write(json_name, "{\"bf16\": {\"enabled\": true}, \"zero_optimization\": {\"stage\": 2}}");
  {
    SCOPED_TRACE("an engine configured by its block alone; mixed_precision as PyYAML writes `no`");
    const std::string yaml = dir.write("fsdp.yaml", "mixed_precision: false\nnum_processes: 2\n"
                                                    "fsdp_config:\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n");
    const LaunchOptions options = parse_launch_options({"--config_file", yaml, "./t"});
    EXPECT_EQ(options.distributed_type, "FSDP");
    EXPECT_EQ(options.mixed_precision, "no");
    const shardtrain::TrainingConfig worker = read_by_a_worker(options);
    EXPECT_EQ(worker.distributed_type, shardtrain::DistributedType::kFsdp);
    EXPECT_EQ(worker.mixed_precision, shardtrain::MixedPrecision::kNo);
    EXPECT_EQ(worker.fsdp.sharding_strategy, shardtrain::ShardingStrategy::kShardGradOp);
  }
  const std::string deepspeed_yaml = dir.write("ds.yaml", "distributed_type: DEEPSPEED\nmixed_precision: 'no'\n"
                                                          "deepspeed_config:\n  deepspeed_config_file: " + json_name + "\n");
  {
    SCOPED_TRACE("Accelerate's \"no\" and a DeepSpeed JSON that enables bf16: the JSON's precision, silently");
    const LaunchOptions options = parse_launch_options({"--config_file", deepspeed_yaml, "./t"});
    EXPECT_EQ(options.distributed_type, "DEEPSPEED");
    EXPECT_EQ(options.mixed_precision, "no");
    EXPECT_EQ(options.deepspeed_config_file, json);
    const shardtrain::TrainingConfig worker = read_by_a_worker(options);
    EXPECT_EQ(worker.distributed_type, shardtrain::DistributedType::kDeepSpeed);
    EXPECT_EQ(worker.mixed_precision, shardtrain::MixedPrecision::kBf16);
    EXPECT_EQ(worker.zero.stage, 2);
    EXPECT_TRUE(worker.warnings.empty()) << worker.warnings.front();
  }
  {
    SCOPED_TRACE("flags over the same file");
    const LaunchOptions options =
        parse_launch_options({"--config_file", deepspeed_yaml, "--use_fsdp", "--mixed_precision", "fp16", "./t"});
    EXPECT_EQ(options.distributed_type, "FSDP");
    EXPECT_EQ(options.mixed_precision, "fp16");
    const shardtrain::TrainingConfig worker = read_by_a_worker(options);
    EXPECT_EQ(worker.distributed_type, shardtrain::DistributedType::kFsdp);
    EXPECT_EQ(worker.mixed_precision, shardtrain::MixedPrecision::kFp16);
  }
  {
    SCOPED_TRACE("data parallel: MULTI_GPU, and no type with several processes");
    for (const std::string& text : {std::string("distributed_type: MULTI_GPU\nnum_processes: 2\n"),
                                    std::string("num_processes: 2\n")}) {
      const std::string yaml = dir.write("dp.yaml", text);
      const LaunchOptions options = parse_launch_options({"--config_file", yaml, "./t"});
      EXPECT_EQ(options.distributed_type, "MULTI_CPU");
      EXPECT_EQ(read_by_a_worker(options).distributed_type, shardtrain::DistributedType::kMultiCpu);
    }
  }
  {
    SCOPED_TRACE("a DeepSpeed JSON given alone");
    const LaunchOptions options = parse_launch_options({"--deepspeed_config_file", json, "./t"});
    EXPECT_EQ(options.distributed_type, "DEEPSPEED");
    const shardtrain::TrainingConfig worker = read_by_a_worker(options);
    EXPECT_EQ(worker.distributed_type, shardtrain::DistributedType::kDeepSpeed);
    EXPECT_EQ(worker.zero.stage, 2);
    EXPECT_EQ(worker.mixed_precision, shardtrain::MixedPrecision::kBf16);
  }
}

TEST(UnitLaunchOptions, AConfigItsWorkersWouldRefuseIsRefusedBeforeAnyStarts) {
  ScratchDir dir;
  const std::string typo = dir.write("typo.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHRAD\n");
  std::string message = launch_error_of({"--config_file", typo, "./t"});
  EXPECT_NE(message.find(typo + ":3: fsdp_config.fsdp_sharding_strategy: FULL_SHRAD is not one of"), std::string::npos)
      << message;
  EXPECT_NE(message.find("did you mean FULL_SHARD?"), std::string::npos) << message;
  // mixed_precision against the DeepSpeed JSON's precision: the workers' conflict, named at launch.
  const std::string json = dir.write("fp16.json", "{\"fp16\": {\"enabled\": true}}");
  const std::string yaml = dir.write("bf16.yaml", "distributed_type: DEEPSPEED\nmixed_precision: bf16\n"
                                                  "deepspeed_config:\n  deepspeed_config_file: " + json + "\n");
  message = launch_error_of({"--config_file", yaml, "./t"});
  EXPECT_NE(message.find("mixed_precision: bf16 (" + yaml + ":2) conflicts with fp16.enabled: true"),
            std::string::npos)
      << message;
  message = launch_error_of({"--config_file", yaml, "--mixed_precision", "fp16", "./t"});
  EXPECT_EQ(message, "") << "the flag settles the conflict for the launcher and its workers alike";
}

TEST(UnitLaunchOptions, ErrorNotAMultipleOfMachines) {
  const std::string message =
      launch_error_of({"--num_processes", "5", "--num_machines", "2", "--main_process_ip", "10.0.0.1", "./t"});
  EXPECT_NE(message.find("--num_processes 5 is not a multiple of --num_machines 2: every machine runs the "
                         "same number of processes"),
            std::string::npos)
      << message;
}

TEST(UnitLaunchOptions, ErrorMachineRankOutOfRange) {
  std::string message = launch_error_of(
      {"--num_processes", "4", "--num_machines", "2", "--machine_rank", "2", "--main_process_ip", "10.0.0.1", "./t"});
  EXPECT_NE(message.find("--machine_rank 2 is out of range"), std::string::npos) << message;
  EXPECT_NE(message.find("0 .. 1"), std::string::npos) << message;
  message = launch_error_of({"--machine_rank", "-1", "./t"});
  EXPECT_NE(message.find("--machine_rank -1 is out of range"), std::string::npos) << message;
}

TEST(UnitLaunchOptions, ErrorSeveralMachinesNeedMainProcessIp) {
  const std::string message = launch_error_of({"--num_processes", "4", "--num_machines", "2", "./t"});
  EXPECT_NE(message.find("--num_machines 2 needs --main_process_ip"), std::string::npos) << message;
}

TEST(UnitLaunchOptions, ErrorMissingProgram) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{}, {"--num_processes", "2"}, {"--num_processes", "2", "--"}}) {
    const std::string message = launch_error_of(args);
    EXPECT_NE(message.find("missing PROGRAM"), std::string::npos) << message;
  }
}

TEST(UnitLaunchOptions, ErrorUnknownOptionBeforeProgram) {
  const std::string message = launch_error_of({"--num_procs", "2", "./t"});
  EXPECT_NE(message.find("unknown option --num_procs"), std::string::npos) << message;
}

TEST(UnitLaunchOptions, ErrorMixedPrecisionNamesAllowedValues) {
  // In the config reader's words, as a worker would say them of SHARDTRAIN_MIXED_PRECISION.
  std::string message = launch_error_of({"--mixed_precision", "fp32", "./t"});
  EXPECT_NE(message.find("--mixed_precision: fp32 is not one of no, fp16, bf16"), std::string::npos) << message;
  message = launch_error_of({"--mixed_precision", "fp8", "./t"});
  EXPECT_NE(message.find("--mixed_precision: fp8 is recognised but not implemented"), std::string::npos) << message;
}

TEST(UnitLaunchOptions, ErrorDeepspeedAndFsdpTogether) {
  const std::string message = launch_error_of({"--use_deepspeed", "--use_fsdp", "./t"});
  EXPECT_NE(message.find("--use_deepspeed and --use_fsdp are mutually exclusive"), std::string::npos) << message;
}

TEST(UnitLaunchOptions, ErrorDeepspeedConfigFileMissing) {
  const std::string message = launch_error_of({"--deepspeed_config", "/nonexistent/ds.json", "./t"});
  EXPECT_NE(message.find("/nonexistent/ds.json"), std::string::npos) << message;
  EXPECT_NE(message.find("not found"), std::string::npos) << message;
}

TEST(UnitLaunchOptions, ErrorConfigFileNotFound) {
  const std::string message = launch_error_of({"--config_file", "/nonexistent/accelerate.yaml", "./t"});
  EXPECT_NE(message.find("--config_file /nonexistent/accelerate.yaml: file not found"), std::string::npos)
      << message;
}

TEST(UnitLaunchOptions, ErrorMalformedYamlNamesFileAndLine) {
  ScratchDir dir;
  const std::string config = dir.write("broken.yaml", "num_processes: 2\nnum_machines: [1\nmachine_rank: 0\n");
  const std::string message = launch_error_of({"--config_file", config, "./t"});
  EXPECT_NE(message.find(config), std::string::npos) << message;
  EXPECT_NE(message.find("malformed YAML at line"), std::string::npos) << message;
}

TEST(UnitLaunchOptions, ErrorBadYamlValueNamesKeyAndLine) {
  ScratchDir dir;
  const std::string config = dir.write("typo.yaml", "mixed_precision: bf16\nnum_processes: two\n");
  const std::string message = launch_error_of({"--config_file", config, "./t"});
  EXPECT_NE(message.find(config + ":2: num_processes must be a positive integer, got \"two\""), std::string::npos)
      << message;
}

TEST(UnitLaunchOptions, ErrorFromYamlNamesTheFile) {
  ScratchDir dir;
  const std::string config = dir.write("odd.yaml", "num_processes: 3\nnum_machines: 2\nmain_process_ip: 1.2.3.4\n");
  const std::string message = launch_error_of({"--config_file", config, "./t"});
  EXPECT_NE(message.find("num_processes: 3 (" + config + ":1) is not a multiple of num_machines: 2 (" + config + ":2)"),
            std::string::npos)
      << message;
}

TEST(UnitLaunchOptions, ErrorPortAndCountsOutOfRange) {
  EXPECT_NE(launch_error_of({"--main_process_port", "70000", "./t"}).find("--main_process_port 70000"),
            std::string::npos);
  EXPECT_NE(launch_error_of({"--num_processes", "0", "./t"}).find("--num_processes 0 must be at least 1"),
            std::string::npos);
  EXPECT_NE(launch_error_of({"--grace_period", "-1", "./t"}).find("--grace_period -1"), std::string::npos);
}

TEST(UnitLaunchOptions, MalformedFlagValueIsAParseError) {
  EXPECT_THROW(parse_launch_options({"--num_processes", "abc", "./t"}), CLI::ParseError);
}

TEST(UnitLaunchOptions, RendezvousTokenFromAPrivateFileAndAWarningForArgv) {
  ScopedEnvironment no_token({{"SHARDTRAIN_RDZV_TOKEN", std::nullopt}});
  ScopedEnvironment no_file({{"SHARDTRAIN_RDZV_TOKEN_FILE", std::nullopt}});
  ScratchDir dir;
  const std::string path = dir.path() + "/token";
  {
    std::ofstream out(path);
    out << "from-the-file\n";
  }
  ::chmod(path.c_str(), 0600);
  {
    shardtrain::testing::LogCapture log;
    const LaunchOptions options = parse_launch_options({"--rdzv_token_file", path, "./train"});
    EXPECT_EQ(options.rdzv_token, "from-the-file");
    EXPECT_FALSE(options.rdzv_token_generated);
    EXPECT_EQ(log.text().find("visible"), std::string::npos) << log.text();
  }
  {
    ScopedEnvironment file({{"SHARDTRAIN_RDZV_TOKEN_FILE", path}});
    EXPECT_EQ(parse_launch_options({"./train"}).rdzv_token, "from-the-file");
  }
  {
    shardtrain::testing::LogCapture log;
    EXPECT_EQ(parse_launch_options({"--rdzv_token", "in-argv", "./train"}).rdzv_token, "in-argv");
    EXPECT_NE(log.text().find("visible to every user of this machine"), std::string::npos) << log.text();
    EXPECT_NE(log.text().find("--rdzv_token_file"), std::string::npos) << log.text();
  }
  EXPECT_NE(launch_error_of({"--rdzv_token", "x", "--rdzv_token_file", path, "./train"}).find("keep one"),
            std::string::npos);
  ::chmod(path.c_str(), 0644);
  const std::string readable = launch_error_of({"--rdzv_token_file", path, "./train"});
  EXPECT_NE(readable.find("has mode 0644"), std::string::npos) << readable;
  EXPECT_NE(readable.find("chmod 600 " + path), std::string::npos) << readable;
  ::chmod(path.c_str(), 0600);
  { std::ofstream truncate(path, std::ios::trunc); }
  EXPECT_NE(launch_error_of({"--rdzv_token_file", path, "./train"}).find("is empty"), std::string::npos);
  EXPECT_NE(launch_error_of({"--rdzv_token_file", dir.path(), "./train"}).find("not a regular file"),
            std::string::npos);
}

TEST(UnitLaunchOptions, EachJobGetsItsOwnRendezvousId) {
  ScopedEnvironment no_id({{"SHARDTRAIN_RDZV_ID", std::nullopt}});
  ScopedEnvironment token({{"SHARDTRAIN_RDZV_TOKEN", "shared"}});
  const std::string first = parse_launch_options({"./train"}).rdzv_id;
  const std::string second = parse_launch_options({"./train"}).rdzv_id;
  EXPECT_EQ(first.rfind("job-", 0), 0u) << first;
  EXPECT_NE(first, second) << "two launches on one machine must not share a job id";
  // Across machines every launcher must name the same job: torchrun's default.
  EXPECT_EQ(parse_launch_options({"--num_processes", "4", "--num_machines", "2", "--main_process_ip", "10.0.0.1",
                                  "./train"})
                .rdzv_id,
            "none");
  EXPECT_EQ(parse_launch_options({"--rdzv_id", "finetune-42", "./train"}).rdzv_id, "finetune-42");
  {
    ScopedEnvironment id({{"SHARDTRAIN_RDZV_ID", "from-env"}});
    EXPECT_EQ(parse_launch_options({"./train"}).rdzv_id, "from-env");
  }
  EXPECT_NE(launch_error_of({"--rdzv_id", std::string(129, 'x'), "./train"}).find("at most 128"), std::string::npos);
}

}  // namespace
