#pragma once
// Options of `shardtrain launch`, named as in `accelerate launch`.
//
// Two steps, so the merge rules can be tested without a command line:
//  1. add_launch_flags() registers the flags on a CLI11 (sub)command and
//     records only what the user actually typed (LaunchFlags);
//  2. resolve_launch_options() merges an Accelerate YAML config file (its
//     values are defaults) with those flags (they override), applies the
//     built-in defaults and validates the result.
// Every problem is a ConfigError whose message names the key and the fix.

#include <optional>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace shardtrain::launcher {

/// What the command line said; an empty optional means "not given".
struct LaunchFlags {
  std::optional<int> num_processes;
  std::optional<int> num_machines;
  std::optional<int> machine_rank;
  std::optional<std::string> main_process_ip;
  std::optional<int> main_process_port;
  std::optional<std::string> config_file;
  std::optional<std::string> mixed_precision;
  bool use_deepspeed = false;
  bool use_fsdp = false;
  std::optional<std::string> deepspeed_config_file;
  std::optional<double> grace_period_s;
  std::optional<std::string> rdzv_token;
  std::optional<std::string> rdzv_token_file;
  std::optional<std::string> rdzv_id;
  /// PROGRAM followed by its ARGS, untouched.
  std::vector<std::string> command;
  /// Never set; see add_launch_flags().
  std::string separator_placeholder;
};

/// The resolved run: what the launcher starts on this machine.
struct LaunchOptions {
  /// Processes over all machines.
  int num_processes = 1;
  int num_machines = 1;
  int machine_rank = 0;
  std::string main_process_ip = "127.0.0.1";
  int main_process_port = 29500;
  /// Absolute path, or empty when no --config_file was given.
  std::string config_file;
  /// "no", "fp16" or "bf16".
  std::string mixed_precision = "no";
  /// "DEEPSPEED", "FSDP", "MULTI_CPU" or "NO".
  std::string distributed_type = "NO";
  bool use_deepspeed = false;
  bool use_fsdp = false;
  /// Absolute path, or empty.
  std::string deepspeed_config_file;
  /// Seconds between SIGTERM and SIGKILL when stopping workers.
  double grace_period_s = 5.0;
  /// The job's rendezvous secret, handed to the workers as SHARDTRAIN_RDZV_TOKEN:
  /// --rdzv_token, --rdzv_token_file, SHARDTRAIN_RDZV_TOKEN,
  /// SHARDTRAIN_RDZV_TOKEN_FILE, else a fresh one (machine 0 only).
  std::string rdzv_token;
  /// True when this launcher made the token (the other machines need it too).
  bool rdzv_token_generated = false;
  /// The job's name in the rendezvous handshake, handed to the workers as
  /// SHARDTRAIN_RDZV_ID: --rdzv_id, else SHARDTRAIN_RDZV_ID, else a fresh one on
  /// a single machine and "none" (torchrun's default) across machines, which
  /// must all pass the same.
  std::string rdzv_id;
  std::string program;
  std::vector<std::string> program_args;

  /// Workers this launcher starts (LOCAL_WORLD_SIZE).
  int processes_per_machine() const { return num_processes / num_machines; }
};

/// Registers every flag of `shardtrain launch` on `command`, writing into
/// `flags` (which must outlive parsing). PROGRAM and ARGS are not registered:
/// the caller sets prefix_command() and moves remaining() into flags.command.
void add_launch_flags(CLI::App& command, LaunchFlags& flags);

/// Merges the config file named by flags.config_file (if any) with the
/// flags, fills in defaults and validates. Throws ConfigError.
LaunchOptions resolve_launch_options(const LaunchFlags& flags);

/// Parses the arguments that follow `shardtrain launch` (flags, PROGRAM,
/// ARGS) and resolves them. Throws CLI::ParseError for malformed flags and
/// ConfigError for invalid values.
LaunchOptions parse_launch_options(const std::vector<std::string>& args);

/// argc/argv form of the above; argv[0] is the program name and is skipped.
LaunchOptions parse_launch_options(int argc, char** argv);

/// Moves CLI11's leftover arguments (PROGRAM and ARGS) into flags.command,
/// rejecting an unknown option that came before PROGRAM.
void take_program_and_args(std::vector<std::string> remaining, LaunchFlags& flags);

}  // namespace shardtrain::launcher
