#pragma once
// Sub-commands of the `shardtrain` command-line tool. Each registers itself on
// the app and returns the exit code through the callback it installs.

#include <CLI/CLI.hpp>

namespace shardtrain::cli {

/// `shardtrain launch [options] PROGRAM [ARGS...]`; sets `exit_code` when run.
void register_launch_command(CLI::App& app, int& exit_code);
/// `shardtrain env [--json] [--no-bench]`.
void register_env_command(CLI::App& app, int& exit_code);
/// `shardtrain config check FILE [...]` and `shardtrain config convert FILE --to fsdp|deepspeed`.
void register_config_command(CLI::App& app, int& exit_code);
/// `shardtrain checkpoint inspect|verify PATH` and `shardtrain checkpoint export PATH --out DIR [...]`.
void register_checkpoint_command(CLI::App& app, int& exit_code);
/// `shardtrain plot RUN.jsonl... -o curves.png|svg [--label L ...]`.
void register_plot_command(CLI::App& app, int& exit_code);

}  // namespace shardtrain::cli
