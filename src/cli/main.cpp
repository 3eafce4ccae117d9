// `shardtrain`: the project's command-line tool (launch, env, ...).
#include <iostream>

#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "shardtrain/env_report.h"
#include "shardtrain/error.h"
#include "shardtrain/version.h"

namespace shardtrain::cli {

void register_env_command(CLI::App& app, int& exit_code) {
  auto* env = app.add_subcommand("env", "Print versions and capabilities for bug reports (like `accelerate env`)");
  auto* json = env->add_flag("--json", "Print as JSON");
  auto* no_bench = env->add_flag("--no-bench", "Skip the 1-second GEMM speed measurement");
  env->callback([&exit_code, json, no_bench]() {
    EnvReport report = collect_env_report(!*no_bench);
    std::cout << (*json ? report.to_json() + "\n" : report.to_text());
    exit_code = 0;
  });
}

}  // namespace shardtrain::cli

int main(int argc, char** argv) {
  CLI::App app{"shardtrain " SHARDTRAIN_VERSION_STRING
               ": sharded data-parallel training (ZeRO and FSDP engines) for LibTorch"};
  app.set_version_flag("--version", SHARDTRAIN_VERSION_STRING);
  app.require_subcommand(1);
  int exit_code = 0;
  shardtrain::cli::register_launch_command(app, exit_code);
  shardtrain::cli::register_env_command(app, exit_code);
  shardtrain::cli::register_config_command(app, exit_code);
  shardtrain::cli::register_checkpoint_command(app, exit_code);
  shardtrain::cli::register_plot_command(app, exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const shardtrain::Error& e) {
    std::cerr << "shardtrain: error: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "shardtrain: unexpected error: " << e.what() << "\n";
    return 1;
  }
  return exit_code;
}
