// `shardtrain checkpoint inspect|verify|export`: offline tools for the
// checkpoints save_state writes (see src/checkpoint/export.h).
#include <cctype>
#include <cstdint>
#include <iostream>
#include <memory>
#include <string>

#include "checkpoint/export.h"
#include "checkpoint/format.h"
#include "cli/commands.h"
#include "shardtrain/error.h"
#include "shardtrain/logging.h"

namespace shardtrain::cli {
namespace {

struct ExportFlags {
  std::string path;
  std::string out;
  std::string dtype = "fp32";
  std::string max_shard_size = "5GB";
  std::string config_json;
};

/// "5000000000", "5GB", "500MB", "2GiB": Hugging Face writes max_shard_size
/// with units (decimal KB/MB/GB; binary KiB/MiB/GiB), so the flag takes both.
uint64_t parse_size(const std::string& text) {
  std::size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  ST_CHECK(digits > 0 && digits <= 18, "--max-shard-size '", text, "' is not a byte count (e.g. 5000000000 or 5GB)");
  const uint64_t number = std::stoull(text.substr(0, digits));
  std::string unit = text.substr(digits);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  uint64_t scale = 0;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "KB") scale = 1000ULL;
  else if (unit == "MB") scale = 1000ULL * 1000;
  else if (unit == "GB") scale = 1000ULL * 1000 * 1000;
  else if (unit == "KIB") scale = 1ULL << 10;
  else if (unit == "MIB") scale = 1ULL << 20;
  else if (unit == "GIB") scale = 1ULL << 30;
  ST_CHECK(scale != 0, "--max-shard-size '", text, "' has unknown unit '", text.substr(digits),
           "' (use B, KB, MB, GB, KiB, MiB or GiB)");
  ST_CHECK(number > 0 && number <= UINT64_MAX / scale, "--max-shard-size '", text, "' is out of range");
  return number * scale;
}

/// Runs a subcommand body; a shardtrain::Error (no checkpoint there, an
/// unreadable index, a damaged checkpoint to export) is reported with exit
/// code 2, leaving 1 to mean "verify found problems".
template <typename Body>
void run_reporting_errors(const char* command, int& exit_code, Body body) {
  try {
    exit_code = body();
  } catch (const Error& e) {
    std::cerr << "shardtrain checkpoint " << command << ": error: " << e.what() << "\n";
    exit_code = 2;
  }
}

}  // namespace

void register_checkpoint_command(CLI::App& app, int& exit_code) {
  auto* checkpoint = app.add_subcommand("checkpoint", "Inspect, verify or export a saved checkpoint");
  checkpoint->require_subcommand(1);

  auto* inspect = checkpoint->add_subcommand("inspect", "Print a checkpoint's parameters, files and training state");
  auto inspect_path = std::make_shared<std::string>();
  inspect->add_option("PATH", *inspect_path, "Checkpoint DIR (uses DIR/latest) or DIR/TAG")->required();
  inspect->callback([inspect_path, &exit_code]() {
    run_reporting_errors("inspect", exit_code, [&] {
      std::cout << checkpoint::inspect(*inspect_path);
      return 0;
    });
  });

  auto* verify = checkpoint->add_subcommand(
      "verify",
      "Check the index's checksums, file sizes, CRC-32s and slice coverage; exit 0 if intact, 1 if damaged "
      "(a missing index included), 2 if PATH holds no checkpoint");
  auto verify_path = std::make_shared<std::string>();
  verify->add_option("PATH", *verify_path, "Checkpoint DIR (uses DIR/latest) or DIR/TAG")->required();
  verify->callback([verify_path, &exit_code]() {
    run_reporting_errors("verify", exit_code, [&] {
      const checkpoint::VerifyReport report = checkpoint::verify(*verify_path);
      if (report.ok()) {
        std::cout << "OK: " << report.files << " files, " << report.params << " parameters verified ("
                  << report.checkpoint_dir << ")\n";
        return 0;
      }
      std::cout << "DAMAGED: " << report.checkpoint_dir << " has " << report.problems.size() << " problem"
                << (report.problems.size() == 1 ? "" : "s") << ":\n";
      for (const auto& problem : report.problems) std::cout << "  - " << problem << "\n";
      return 1;
    });
  });

  auto* exporter = checkpoint->add_subcommand(
      "export", "Write the parameters as a Hugging Face safetensors directory (verifies first)");
  auto flags = std::make_shared<ExportFlags>();
  exporter->add_option("PATH", flags->path, "Checkpoint DIR (uses DIR/latest) or DIR/TAG")->required();
  exporter->add_option("--out", flags->out, "Output directory (created; existing weight files are replaced)")
      ->required();
  exporter->add_option("--dtype", flags->dtype, "Weights dtype")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();
  exporter->add_option("--max-shard-size", flags->max_shard_size,
                       "Bytes per safetensors file before sharding (e.g. 5000000000, 5GB, 500MB)")
      ->capture_default_str();
  exporter->add_option("--config-json", flags->config_json,
                       "The model's config.json, written to the output with its torch_dtype set to --dtype "
                       "(transformers cannot load the directory without one)");
  exporter->callback([flags, &exit_code]() {
    run_reporting_errors("export", exit_code, [&] {
      checkpoint::ExportOptions options;
      options.dtype = flags->dtype;
      options.max_shard_bytes = parse_size(flags->max_shard_size);
      options.config_json_path = flags->config_json;
      if (flags->config_json.empty()) {
        // A checkpoint holds the training state, not the model's architecture: only the user has its config.json.
        ST_LOG_WARN("no --config-json: {} gets the weights without a config.json, which transformers' "
                    "from_pretrained needs; pass the model's config.json (the fine-tune writes the one it trained "
                    "to OUTPUT/model_config.json)",
                    flags->out);
      }
      checkpoint::export_hf(flags->path, flags->out, options);
      std::cout << "exported " << checkpoint::resolve_checkpoint_dir(flags->path) << " to " << flags->out << " ("
                << flags->dtype << ")\n";
      return 0;
    });
  });
}

}  // namespace shardtrain::cli
