#include "launcher/launch_options.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <CLI/CLI.hpp>
#include <yaml-cpp/yaml.h>

#include "config/config_tree.h"  // lowercase, uppercase
#include "comm/rendezvous/protocol.h"
#include "comm/rendezvous/token_file.h"
#include "shardtrain/error.h"
#include "shardtrain/logging.h"

namespace shardtrain::launcher {
namespace {

namespace fs = std::filesystem;
using config_detail::lowercase;
using config_detail::uppercase;

constexpr const char* kUsage = "usage: shardtrain launch [options] PROGRAM [ARGS...]";

/// A setting together with where it came from, so that error messages can
/// point at the flag or at the line of the config file the user must change.
template <typename T>
struct Setting {
  T value{};
  /// "--num_processes" when typed as a flag, "num_processes" when read from
  /// the config file, "--num_processes" (default) otherwise.
  std::string key;
  enum class Origin { kDefault, kFlag, kConfigFile } origin = Origin::kDefault;
  /// Set when origin is kConfigFile: " (in FILE, line N)".
  std::string location;

  /// "--num_processes 5" or "num_processes: 5 (in cfg.yaml, line 3)".
  std::string describe() const {
    std::ostringstream out;
    if (origin == Origin::kConfigFile) {
      out << key << ": " << value << location;
    } else {
      out << key << " " << value;
      if (origin == Origin::kDefault) out << " (the default)";
    }
    return out.str();
  }
};

template <typename T>
Setting<T> default_setting(const std::string& name, T value) {
  Setting<T> setting;
  setting.value = std::move(value);
  setting.key = "--" + name;
  return setting;
}

/// The values an Accelerate config file contributes; each is optional.
struct ConfigFileValues {
  std::string path;  // absolute
  std::optional<Setting<int>> num_processes;
  std::optional<Setting<int>> num_machines;
  std::optional<Setting<int>> machine_rank;
  std::optional<Setting<std::string>> main_process_ip;
  std::optional<Setting<int>> main_process_port;
  std::optional<Setting<std::string>> mixed_precision;
  std::optional<Setting<std::string>> distributed_type;
  /// The file has a deepspeed_config / fsdp_config section (Accelerate files
  /// from articles sometimes leave distributed_type out).
  bool has_deepspeed_section = false;
  bool has_fsdp_section = false;
  std::optional<Setting<std::string>> deepspeed_config_file;
};

std::string line_of(const std::string& path, const YAML::Mark& mark) {
  std::ostringstream out;
  out << " (in " << path;
  if (!mark.is_null()) out << ", line " << mark.line + 1;
  out << ")";
  return out.str();
}

template <typename T>
std::optional<Setting<T>> read_yaml_value(const YAML::Node& parent, const std::string& key,
                                          const std::string& dotted_key, const std::string& path) {
  const YAML::Node node = parent[key];
  // Accelerate writes `main_process_ip: null` for keys that were not asked;
  // null means "not set" there, not an error.
  if (!node.IsDefined() || node.IsNull()) return std::nullopt;
  Setting<T> setting;
  setting.key = dotted_key;
  setting.origin = Setting<T>::Origin::kConfigFile;
  setting.location = line_of(path, node.Mark());
  if (!node.IsScalar()) {
    ST_THROW(ConfigError, "config file ", path, ": `", dotted_key, "` must be a single value",
             setting.location);
  }
  try {
    setting.value = node.as<T>();
  } catch (const YAML::Exception&) {
    ST_THROW(ConfigError, "config file ", path, ": `", dotted_key, ": ", node.Scalar(),
             "` is not ", std::is_same_v<T, int> ? "an integer" : "a string", setting.location);
  }
  return setting;
}

ConfigFileValues read_config_file(const std::string& given_path) {
  ConfigFileValues values;
  values.path = fs::absolute(given_path).lexically_normal().string();
  std::error_code ignored;
  if (!fs::exists(values.path, ignored)) {
    ST_THROW(ConfigError, "--config_file ", given_path, ": file not found (looked at ", values.path,
             "); pass the path of an Accelerate YAML config such as the one `accelerate config` "
             "writes");
  }
  if (fs::is_directory(values.path, ignored)) {
    ST_THROW(ConfigError, "--config_file ", given_path, " is a directory; pass the YAML file itself");
  }
  std::ifstream in(values.path);
  if (!in) ST_THROW(ConfigError, "--config_file ", values.path, ": cannot be read (permissions?)");
  std::stringstream text;
  text << in.rdbuf();

  YAML::Node root;
  try {
    root = YAML::Load(text.str());
  } catch (const YAML::ParserException& e) {
    ST_THROW(ConfigError, "--config_file ", values.path, ": malformed YAML at line ", e.mark.line + 1,
             ", column ", e.mark.column + 1, ": ", e.msg);
  }
  if (root.IsNull()) return values;  // an empty file sets nothing
  if (!root.IsMap()) {
    ST_THROW(ConfigError, "--config_file ", values.path,
             ": expected a YAML mapping of Accelerate keys (num_processes: 2, ...) at the top level",
             line_of(values.path, root.Mark()));
  }
  const std::string& path = values.path;
  values.num_processes = read_yaml_value<int>(root, "num_processes", "num_processes", path);
  values.num_machines = read_yaml_value<int>(root, "num_machines", "num_machines", path);
  values.machine_rank = read_yaml_value<int>(root, "machine_rank", "machine_rank", path);
  values.main_process_ip = read_yaml_value<std::string>(root, "main_process_ip", "main_process_ip", path);
  values.main_process_port = read_yaml_value<int>(root, "main_process_port", "main_process_port", path);
  values.mixed_precision = read_yaml_value<std::string>(root, "mixed_precision", "mixed_precision", path);
  values.distributed_type =
      read_yaml_value<std::string>(root, "distributed_type", "distributed_type", path);
  const YAML::Node deepspeed = root["deepspeed_config"];
  values.has_deepspeed_section = deepspeed.IsDefined() && deepspeed.IsMap();
  values.has_fsdp_section = root["fsdp_config"].IsDefined() && root["fsdp_config"].IsMap();
  if (deepspeed.IsDefined() && deepspeed.IsMap()) {
    values.deepspeed_config_file = read_yaml_value<std::string>(
        deepspeed, "deepspeed_config_file", "deepspeed_config.deepspeed_config_file", path);
  }
  return values;
}

/// Flag beats config file beats built-in default.
template <typename T>
Setting<T> merge(const std::string& name, const std::optional<T>& flag,
                 const std::optional<Setting<T>>& from_file, T fallback) {
  if (flag) {
    Setting<T> setting;
    setting.value = *flag;
    setting.key = "--" + name;
    setting.origin = Setting<T>::Origin::kFlag;
    return setting;
  }
  if (from_file) return *from_file;
  return default_setting(name, std::move(fallback));
}

/// A DeepSpeed JSON path must name an existing file; relative paths are
/// tried from the working directory (as accelerate does) and, for a path
/// read from a config file, also from that file's directory so that a config
/// folder can be moved as a whole.
std::string resolve_deepspeed_config_path(const Setting<std::string>& setting,
                                          const std::string& config_file_dir) {
  std::error_code ignored;
  std::vector<fs::path> candidates{fs::absolute(setting.value).lexically_normal()};
  if (setting.origin == Setting<std::string>::Origin::kConfigFile && fs::path(setting.value).is_relative()) {
    candidates.push_back((fs::path(config_file_dir) / setting.value).lexically_normal());
  }
  for (const auto& candidate : candidates) {
    if (fs::is_regular_file(candidate, ignored)) return candidate.string();
  }
  std::string tried;
  for (const auto& candidate : candidates) tried += (tried.empty() ? "" : ", ") + candidate.string();
  ST_THROW(ConfigError, setting.describe(), ": DeepSpeed config file not found (tried ", tried,
           "); pass the path of an existing DeepSpeed JSON file");
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

  ConfigFileValues file;
  std::string config_file_dir;
  if (flags.config_file) {
    file = read_config_file(*flags.config_file);
    config_file_dir = fs::path(file.path).parent_path().string();
  }

  const auto num_processes = merge("num_processes", flags.num_processes, file.num_processes, 1);
  const auto num_machines = merge("num_machines", flags.num_machines, file.num_machines, 1);
  const auto machine_rank = merge("machine_rank", flags.machine_rank, file.machine_rank, 0);
  const auto main_process_ip =
      merge("main_process_ip", flags.main_process_ip, file.main_process_ip, std::string("127.0.0.1"));
  const auto main_process_port = merge("main_process_port", flags.main_process_port, file.main_process_port, 29500);
  const auto mixed_precision =
      merge("mixed_precision", flags.mixed_precision, file.mixed_precision, std::string("no"));

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
    ST_THROW(ConfigError, main_process_ip.key, " is empty; give the address of machine 0");
  }
  if (main_process_port.value < 1 || main_process_port.value > 65535) {
    ST_THROW(ConfigError, main_process_port.describe(), " is not a TCP port; use 1 .. 65535 (default 29500)");
  }
  const std::string precision = lowercase(mixed_precision.value);
  if (precision != "no" && precision != "fp16" && precision != "bf16") {
    ST_THROW(ConfigError, mixed_precision.describe(),
             " is not supported; allowed values: no, fp16, bf16");
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

  std::string distributed_type;
  if (flags.use_deepspeed || flags.deepspeed_config_file) {
    distributed_type = "DEEPSPEED";
  } else if (flags.use_fsdp) {
    distributed_type = "FSDP";
  } else if (file.distributed_type) {
    const std::string from_file = uppercase(file.distributed_type->value);
    if (from_file == "DEEPSPEED" || from_file == "FSDP" || from_file == "MULTI_CPU" || from_file == "NO") {
      distributed_type = from_file;
    } else if (from_file == "MULTI_GPU") {
      // The device comes from what the worker sees (backend "auto"), so
      // GPU and CPU data parallelism are one mode for the worker.
      distributed_type = "MULTI_CPU";
    } else {
      ST_THROW(ConfigError, file.distributed_type->describe(),
               " is not supported by shardtrain; use one of NO, MULTI_CPU, MULTI_GPU, DEEPSPEED, FSDP");
    }
  } else if (file.has_deepspeed_section) {
    distributed_type = "DEEPSPEED";  // as the config reader infers it
  } else if (file.has_fsdp_section) {
    distributed_type = "FSDP";
  } else {
    distributed_type = "NO";
  }
  if (distributed_type == "NO" && num_processes.value > 1) distributed_type = "MULTI_CPU";

  LaunchOptions options;
  options.num_processes = num_processes.value;
  options.num_machines = num_machines.value;
  options.machine_rank = machine_rank.value;
  options.main_process_ip = main_process_ip.value;
  options.main_process_port = main_process_port.value;
  options.config_file = file.path;
  options.mixed_precision = precision;
  options.distributed_type = distributed_type;
  options.use_deepspeed = distributed_type == "DEEPSPEED";
  options.use_fsdp = distributed_type == "FSDP";
  if (options.use_deepspeed) {
    std::optional<Setting<std::string>> deepspeed_file = file.deepspeed_config_file;
    if (flags.deepspeed_config_file) {
      deepspeed_file = merge("deepspeed_config_file", flags.deepspeed_config_file, {}, std::string());
    }
    if (deepspeed_file) options.deepspeed_config_file = resolve_deepspeed_config_path(*deepspeed_file, config_file_dir);
  }
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
