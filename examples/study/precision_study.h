#pragma once
// The seeds' precision study, reproduced on the bundled tiny Llama. The seeds
// fine-tune a pretrained base loaded in bf16, so the study first trains the
// tiny Llama from its random init into a base (ZeRO-3, fp32 master, a large
// learning rate) and exports it; every run then fine-tunes that base, loaded
// in bf16, with the same data, seed and schedule under ZeRO-3 (fp32 master), FSDP standard mode
// (fp32 master) and FSDP pure bf16 (no master) at a small learning rate, pure
// bf16 at 4x that rate (the seeds' "scale the learning rate by 4 GPUs"), and
// all three at a large rate. Each run writes its metrics file; the study
// writes a table, a picture and the relations the seeds report, each checked
// against the measured numbers. A library so a test runs a short study.

#include <cstdint>
#include <string>
#include <vector>

namespace study {

struct StudyOptions {
  /// The base model: this many steps at base_lr from the random init (seed base_seed).
  int64_t base_steps = 150;
  double base_lr = 1e-3;
  uint64_t base_seed = 1;
  /// Each fine-tune run.
  int64_t steps = 300;
  int64_t seq_len = 128;
  int64_t micro_batch = 8;
  int64_t warmup = 30;
  uint64_t seed = 0;
  double small_lr = 1e-5;
  double scaled_lr = 4e-5;
  double large_lr = 1e-3;
  std::string output_dir = "precision-study";
  /// zero3_bf16.json, fsdp_standard_bf16.yaml and fsdp_pure_bf16.yaml live here.
  std::string configs_dir;
  /// The bundled tiny Llama: config.json, tokenizer.model, data/train.jsonl.
  std::string model_dir;
  /// Also draw study.png (needs gnuplot).
  bool plot = true;
  bool quiet = false;
};

struct StudyRun {
  std::string name;         ///< file stem: "zero3_lr1e-05"
  std::string mode;         ///< "zero-3", "fsdp standard", "fsdp pure"
  std::string config_path;
  double lr = 0;
  std::string metrics_path;
  std::vector<double> losses;
  double final_train_loss = 0;  ///< mean train loss of the last 10 steps
  /// Loss on the held-out eval set (data/eval.jsonl) before and after the
  /// run: the same examples for every run, so runs compare without the
  /// batch-to-batch noise of train losses.
  double eval_before = 0, eval_after = 0;
  double loss_drop = 0;  ///< eval_before - eval_after
  double mean_lost_update_frac = 0;
  double mean_lost_update_frac_if_bf16 = 0;
  double optimizer_bytes_per_param = 0;  ///< master + optimizer state, per parameter (precision plan)
};

/// One of the seeds' claims and whether the measured numbers bear it out.
struct Relation {
  std::string claim;
  std::string measured;
  bool holds = false;
};

struct StudyResult {
  std::vector<StudyRun> runs;
  std::vector<Relation> relations;
  bool all_hold() const;
};

/// Trains the base, runs the seven fine-tunes in turn on this process (world
/// 1), then checks the relations. Writes OUTPUT_DIR/base (the exported base
/// model), OUTPUT_DIR/RUN.jsonl per run, study.md (table and relations),
/// study.json and, with options.plot, study.png.
StudyResult run_precision_study(const StudyOptions& options);

/// The seeds' relations over runs named as run_precision_study names them.
std::vector<Relation> check_relations(const std::vector<StudyRun>& runs);

/// The table and the relations as Markdown.
std::string study_markdown(const StudyResult& result, const StudyOptions& options);

}  // namespace study
