// `shardtrain launch [options] PROGRAM [ARGS...]`, modelled on `accelerate launch`.
#include <memory>
#include <string>

#include "cli/commands.h"
#include "launcher/launch_options.h"
#include "launcher/launcher.h"

namespace shardtrain::cli {
namespace {

/// CLI11 cannot describe a pass-through command line in its usage line
/// (PROGRAM and ARGS are not options), so the line is written here.
class LaunchHelpFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App* /*app*/, std::string name) const override {
    return get_label("Usage") + ": " + name + " [" + get_label("OPTIONS") + "] PROGRAM [ARGS...]\n";
  }
};

}  // namespace

void register_launch_command(CLI::App& app, int& exit_code) {
  auto* launch = app.add_subcommand(
      "launch", "Start PROGRAM [ARGS...] as this machine's workers of a data-parallel job (like `accelerate launch`)");
  // Everything from PROGRAM on belongs to PROGRAM, including its own --flags.
  launch->prefix_command();
  launch->formatter(std::make_shared<LaunchHelpFormatter>());
  launch->footer(
      "Options go before PROGRAM; everything after PROGRAM is passed to it unchanged.\n"
      "Each worker gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,\n"
      "MASTER_PORT, SHARDTRAIN_MIXED_PRECISION, SHARDTRAIN_DISTRIBUTED_TYPE, SHARDTRAIN_CONFIG_FILE,\n"
      "SHARDTRAIN_DEEPSPEED_CONFIG_FILE and ACCELERATE_* equivalents; its output lines are prefixed\n"
      "with [rank N]. When a worker fails, or on SIGINT/SIGTERM, every worker is stopped (SIGTERM,\n"
      "then SIGKILL after --grace_period seconds).\n"
      "\n"
      "Examples:\n"
      "  shardtrain launch --num_processes 2 ./train --epochs 3\n"
      "  shardtrain launch --config_file accelerate.yaml --mixed_precision bf16 ./train\n"
      "  two machines with 4 processes each (run on both, with --machine_rank 0 and 1):\n"
      "  shardtrain launch --num_processes 8 --num_machines 2 --machine_rank 0 \\\n"
      "      --main_process_ip 10.0.0.1 --main_process_port 29500 ./train");
  // The flags must outlive the parse that fills them; the app owns the callback.
  auto flags = std::make_shared<launcher::LaunchFlags>();
  launcher::add_launch_flags(*launch, *flags);
  launch->callback([launch, flags, &exit_code]() {
    launcher::take_program_and_args(launch->remaining(), *flags);
    const launcher::LaunchOptions options = launcher::resolve_launch_options(*flags);
    exit_code = launcher::run_launch(options);
  });
}

}  // namespace shardtrain::cli
