// `shardtrain launch`'s flags, merged with what the config file says (read
// by the config reader, as the workers read it) and checked (launch_options.h).
#include "launcher/launch_options.h"

#include <cstdlib>
#include <filesystem>
#include <sstream>

#include <CLI/CLI.hpp>

#include "config/launch_settings.h"
#include "comm/rendezvous/protocol.h"
#include "comm/rendezvous/token_file.h"
#include "shardtrain/error.h"
#include "shardtrain/logging.h"

namespace shardtrain::launcher {
namespace {

namespace fs = std::filesystem;
using config_detail::FileValue;
using config_detail::Override;

constexpr const char* kUsage = "usage: shardtrain launch [options] PROGRAM [ARGS...]";

/// A setting together with where it came from, so that error messages can
/// point at the flag or at the line of the config file the user must change.
template <typename T>
struct Setting {
  T value{};
  /// "--num_processes": the flag that sets it.
  std::string flag;
  enum class Origin { kDefault, kFlag, kConfigFile } origin = Origin::kDefault;
  /// Set when origin is kConfigFile, as the config reader words it:
  /// "num_processes: 5 (cfg.yaml:3)".
  std::string file_origin;

  /// "--num_processes 5", "--num_processes 1 (the default)" or the file's origin.
  std::string describe() const {
    if (origin == Origin::kConfigFile) return file_origin;
    std::ostringstream out;
    out << flag << " " << value;
    if (origin == Origin::kDefault) out << " (the default)";
    return out.str();
  }
};

/// Flag beats config file beats built-in default.
template <typename T>
Setting<T> merge(const std::string& name, const std::optional<T>& flag, const std::optional<FileValue<T>>& from_file,
                 T fallback) {
  Setting<T> setting;
  setting.flag = "--" + name;
  if (flag) {
    setting.value = *flag;
    setting.origin = Setting<T>::Origin::kFlag;
  } else if (from_file) {
    setting.value = from_file->value;
    setting.origin = Setting<T>::Origin::kConfigFile;
    setting.file_origin = from_file->origin;
  } else {
    setting.value = std::move(fallback);
  }
  return setting;
}

/// The flags that override the config files: the overrides the workers get as
/// SHARDTRAIN_* variables, so the launcher reads the files as its workers will.
config_detail::Overrides overrides_of(const LaunchFlags& flags) {
  config_detail::Overrides overrides;
  if (flags.mixed_precision) {
    overrides.mixed_precision = Override::from_flag("--mixed_precision", *flags.mixed_precision);
  }
  if (flags.deepspeed_config_file) {
    overrides.deepspeed_config_file = Override::from_flag("--deepspeed_config_file", *flags.deepspeed_config_file);
  }
  if (flags.use_deepspeed) {
    overrides.distributed_type = Override::from_flag("--use_deepspeed", "DEEPSPEED", "--use_deepspeed");
  } else if (flags.deepspeed_config_file) {
    overrides.distributed_type =
        Override::from_flag("--deepspeed_config_file", "DEEPSPEED", overrides.deepspeed_config_file->origin);
  } else if (flags.use_fsdp) {
    overrides.distributed_type = Override::from_flag("--use_fsdp", "FSDP", "--use_fsdp");
  }
  return overrides;
}

/// The --config_file's absolute path, once it is known to be a file.
std::string locate_config_file(const std::string& given_path) {
  const std::string path = fs::absolute(given_path).lexically_normal().string();
  std::error_code ignored;
  if (!fs::exists(path, ignored)) {
    ST_THROW(ConfigError, "--config_file ", given_path, ": file not found (looked at ", path,
             "); pass the path of an Accelerate YAML config such as the one `accelerate config` writes");
  }
  if (fs::is_directory(path, ignored)) {
    ST_THROW(ConfigError, "--config_file ", given_path, " is a directory; pass the YAML file itself");
  }
  return path;
}

}  // namespace

void add_launch_flags(CLI::App& command, LaunchFlags& flags) {
  command.add_option("--num_processes", flags.num_processes,
                     "Processes in the whole job, summed over all machines (default 1)")
      ->type_name("INT");
  command.add_option("--num_machines", flags.num_machines,
                     "Machines in the job; each runs num_processes/num_machines workers (default 1)")
      ->type_name("INT");
  command.add_option("--machine_rank", flags.machine_rank,
                     "Index of this machine, 0 .. num_machines-1 (default 0)")
      ->type_name("INT");
  command.add_option("--main_process_ip", flags.main_process_ip,
                     "Address of machine 0, where rank 0 hosts the rendezvous (default 127.0.0.1)")
      ->type_name("ADDR");
  command.add_option("--main_process_port", flags.main_process_port,
                     "TCP port of the rendezvous on machine 0 (default 29500)")
      ->type_name("PORT");
  command.add_option("--config_file", flags.config_file,
                     "Accelerate YAML config; its values are defaults that these flags override")
      ->type_name("PATH");
  command.add_option("--mixed_precision", flags.mixed_precision,
                     "Compute precision: no, fp16 or bf16 (default no)")
      ->type_name("MODE");
  command.add_flag("--use_deepspeed", flags.use_deepspeed,
                   "Train with the ZeRO engine (DeepSpeed-style sharding)");
  command.add_flag("--use_fsdp", flags.use_fsdp, "Train with the FSDP engine (flat-parameter sharding)");
  command.add_option("--deepspeed_config_file,--deepspeed_config", flags.deepspeed_config_file,
                     "DeepSpeed JSON config for the ZeRO engine; implies --use_deepspeed")
      ->type_name("PATH");
  command.add_option("--grace_period", flags.grace_period_s,
                     "Seconds workers get between SIGTERM and SIGKILL when the job stops (default 5)")
      ->type_name("SECONDS");
  command.add_option("--rdzv_token", flags.rdzv_token,
                     "The job's rendezvous secret; every machine of a job passes the same one (default: "
                     "SHARDTRAIN_RDZV_TOKEN, else machine 0 makes one and prints it). Visible to every local "
                     "user in ps: prefer --rdzv_token_file or SHARDTRAIN_RDZV_TOKEN")
      ->type_name("TOKEN");
  command.add_option("--rdzv_token_file", flags.rdzv_token_file,
                     "A file of yours, mode 0600, that holds the job's rendezvous secret (or set "
                     "SHARDTRAIN_RDZV_TOKEN_FILE)")
      ->type_name("PATH");
  command.add_option("--rdzv_id", flags.rdzv_id,
                     "The job's name: a rank of another job on the same port is refused by it (default: "
                     "SHARDTRAIN_RDZV_ID, else a fresh one on one machine, \"none\" across machines)")
      ->type_name("ID");

  // PROGRAM and ARGS reach the caller through prefix_command() and
  // remaining(). This never-matching positional exists only because CLI11
  // hands a `--` separator back to the parent app when a subcommand has no
  // positionals left, which would break `shardtrain launch -- ./train`.
  command.validate_positionals();
  command
      .add_option("PROGRAM", flags.separator_placeholder)
      ->check(CLI::Validator([](const std::string&) { return std::string("passed through"); }, ""))
      ->group("");
}

void take_program_and_args(std::vector<std::string> remaining, LaunchFlags& flags) {
  if (!remaining.empty() && remaining.front() == "--") remaining.erase(remaining.begin());
  if (!remaining.empty() && remaining.front().size() > 1 && remaining.front()[0] == '-') {
    ST_THROW(ConfigError, "unknown option ", remaining.front(),
             " for shardtrain launch; see `shardtrain launch --help` (", kUsage,
             "; options of PROGRAM go after it)");
  }
  flags.command = std::move(remaining);
}

namespace {

/// The job's rendezvous token and id, from the flags, the environment, or fresh.
void resolve_rendezvous_identity(const LaunchFlags& flags, LaunchOptions& options) {
  ST_CHECK_T(ConfigError, !(flags.rdzv_token && flags.rdzv_token_file),
             "--rdzv_token and --rdzv_token_file both give the rendezvous token; keep one (the file: a token in "
             "the command line is visible in ps)");
  if (flags.rdzv_token) {
    ST_CHECK_T(ConfigError, !flags.rdzv_token->empty(), "--rdzv_token is empty; give the job's secret, e.g. "
               "$(openssl rand -hex 32), the same on every machine");
    ST_LOG_WARN("the rendezvous token given with --rdzv_token is visible to every user of this machine (ps, "
                "/proc/PID/cmdline); pass it with --rdzv_token_file FILE (mode 0600) or SHARDTRAIN_RDZV_TOKEN instead");
    options.rdzv_token = *flags.rdzv_token;
  } else if (flags.rdzv_token_file) {
    options.rdzv_token = comm::rendezvous::read_token_file(*flags.rdzv_token_file);
  } else if (auto token = comm::rendezvous::token_from_environment(std::getenv)) {
    options.rdzv_token = *token;
  } else if (options.machine_rank > 0) {
    ST_THROW(ConfigError, "machine ", options.machine_rank, " of ", options.num_machines,
             " has no rendezvous token: pass the one machine 0's launcher printed (or the one you generated) with "
             "--rdzv_token_file FILE, SHARDTRAIN_RDZV_TOKEN=TOKEN or --rdzv_token TOKEN; rank 0's store refuses "
             "processes without it");
  } else {
    options.rdzv_token = comm::rendezvous::generate_token();
    options.rdzv_token_generated = true;
  }

  if (flags.rdzv_id) {
    options.rdzv_id = *flags.rdzv_id;
  } else if (const char* id = std::getenv("SHARDTRAIN_RDZV_ID"); id != nullptr && *id != '\0') {
    options.rdzv_id = id;
  } else if (options.num_machines == 1) {
    // Each launch its own job: a second job started on the same port with
    // the same (exported) token is refused by the first one's store by name.
    options.rdzv_id = "job-" + comm::rendezvous::generate_token().substr(0, 12);
  } else {
    // Across machines every launcher must name the same job; torchrun's
    // default. Two multi-machine jobs that share a port and a token need --rdzv_id.
    options.rdzv_id = "none";
  }
  ST_CHECK_T(ConfigError, !options.rdzv_id.empty(), "--rdzv_id is empty; name the job, the same on every machine");
  comm::rendezvous::check_job_id(options.rdzv_id);
}

}  // namespace

LaunchOptions resolve_launch_options(const LaunchFlags& flags) {
  if (flags.command.empty() || flags.command.front().empty()) {
    ST_THROW(ConfigError, "missing PROGRAM: nothing to launch (", kUsage,
             ", e.g. shardtrain launch --num_processes 2 ./train --epochs 3)");
  }

  if (flags.use_deepspeed && flags.use_fsdp) {
    ST_THROW(ConfigError,
             "--use_deepspeed and --use_fsdp are mutually exclusive: a run uses one sharding engine; "
             "drop one of them");
  }
  if (flags.use_fsdp && flags.deepspeed_config_file) {
    ST_THROW(ConfigError, "--deepspeed_config_file ", *flags.deepspeed_config_file,
             " was given together with --use_fsdp; a DeepSpeed config selects the ZeRO engine, so "
             "drop one of them");
  }
  if (flags.grace_period_s && !(*flags.grace_period_s >= 0)) {
    ST_THROW(ConfigError, "--grace_period ", *flags.grace_period_s,
             " must be zero or more seconds (default 5)");
  }

  std::optional<std::string> config_file;
  if (flags.config_file) config_file = locate_config_file(*flags.config_file);
  // Every key, check and engine decision as the workers' reading makes them.
  const config_detail::LaunchSettings file = config_detail::read_launch_settings(config_file, overrides_of(flags));

  const auto num_processes = merge("num_processes", flags.num_processes, file.num_processes, 1);
  const auto num_machines = merge("num_machines", flags.num_machines, file.num_machines, 1);
  const auto machine_rank = merge("machine_rank", flags.machine_rank, file.machine_rank, 0);
  const auto main_process_ip =
      merge("main_process_ip", flags.main_process_ip, file.main_process_ip, std::string("127.0.0.1"));
  const auto main_process_port = merge("main_process_port", flags.main_process_port, file.main_process_port, 29500);

  if (num_processes.value < 1) {
    ST_THROW(ConfigError, num_processes.describe(), " must be at least 1 (processes in the whole job)");
  }
  if (num_machines.value < 1) {
    ST_THROW(ConfigError, num_machines.describe(), " must be at least 1");
  }
  if (num_processes.value % num_machines.value != 0) {
    ST_THROW(ConfigError, num_processes.describe(), " is not a multiple of ", num_machines.describe(),
             ": every machine runs the same number of processes (num_processes counts all machines "
             "together, e.g. 8 for 2 machines with 4 each)");
  }
  if (machine_rank.value < 0 || machine_rank.value >= num_machines.value) {
    ST_THROW(ConfigError, machine_rank.describe(), " is out of range for ", num_machines.describe(),
             ": use 0 .. ", num_machines.value - 1, " (0 on the machine that hosts rank 0)");
  }
  if (num_machines.value > 1 && main_process_ip.origin == Setting<std::string>::Origin::kDefault) {
    ST_THROW(ConfigError, num_machines.describe(),
             " needs --main_process_ip: the address of machine 0, where rank 0 hosts the rendezvous "
             "(pass 127.0.0.1 if every machine is this host)");
  }
  if (main_process_ip.value.empty()) {
    ST_THROW(ConfigError, main_process_ip.describe(), " is empty; give the address of machine 0");
  }
  if (main_process_port.value < 1 || main_process_port.value > 65535) {
    ST_THROW(ConfigError, main_process_port.describe(), " is not a TCP port; use 1 .. 65535 (default 29500)");
  }

  std::string distributed_type = to_string(file.distributed_type);
  // The device comes from what the worker sees (backend "auto"), so GPU and
  // CPU data parallelism are one mode for the worker.
  if (file.distributed_type == DistributedType::kMultiGpu) distributed_type = "MULTI_CPU";
  if (distributed_type == "NO" && num_processes.value > 1) distributed_type = "MULTI_CPU";

  LaunchOptions options;
  options.num_processes = num_processes.value;
  options.num_machines = num_machines.value;
  options.machine_rank = machine_rank.value;
  options.main_process_ip = main_process_ip.value;
  options.main_process_port = main_process_port.value;
  options.config_file = config_file.value_or("");
  options.mixed_precision = to_string(file.mixed_precision);
  options.distributed_type = distributed_type;
  options.use_deepspeed = distributed_type == "DEEPSPEED";
  options.use_fsdp = distributed_type == "FSDP";
  if (options.use_deepspeed) options.deepspeed_config_file = file.deepspeed_config_file;
  options.grace_period_s = flags.grace_period_s.value_or(5.0);
  resolve_rendezvous_identity(flags, options);
  options.program = flags.command.front();
  options.program_args.assign(flags.command.begin() + 1, flags.command.end());
  return options;
}

LaunchOptions parse_launch_options(const std::vector<std::string>& args) {
  CLI::App command{"shardtrain launch"};
  LaunchFlags flags;
  add_launch_flags(command, flags);
  command.prefix_command();
  // CLI11 consumes a vector from the back.
  std::vector<std::string> reversed(args.rbegin(), args.rend());
  command.parse(reversed);
  take_program_and_args(command.remaining(), flags);
  return resolve_launch_options(flags);
}

LaunchOptions parse_launch_options(int argc, char** argv) {
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  return parse_launch_options(args);
}

}  // namespace shardtrain::launcher
