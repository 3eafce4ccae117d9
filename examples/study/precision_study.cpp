// The precision study (see precision_study.h): seven fine-tune runs, their
// table and picture, and the seeds' relations checked on the measured numbers.

#include "study/precision_study.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "finetune/finetune.h"
#include "shardtrain/error.h"
#include "shardtrain/metrics_plot.h"

namespace study {
namespace {

namespace fs = std::filesystem;

std::string lr_text(double lr) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", lr);
  return text;
}

std::string fixed(double x, int digits = 4) {
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", digits, x);
  return text;
}

std::string percent(double x) { return fixed(100.0 * x, 1) + "%"; }

double mean_of_range(const std::vector<double>& v, size_t begin, size_t end) {
  double sum = 0;
  for (size_t i = begin; i < end; ++i) sum += v[i];
  return end > begin ? sum / static_cast<double>(end - begin) : NAN;
}

struct Plan {
  std::string mode, config_file, stem;
  double lr;
};

/// What the base and every fine-tune share: the tiny Llama's data, the
/// study's batch shape, no checkpoint, no console output.
finetune::FinetuneOptions study_run_options(const StudyOptions& options) {
  finetune::FinetuneOptions f;
  f.data = options.model_dir + "/data/train.jsonl";
  f.seq_len = options.seq_len;
  f.micro_batch = options.micro_batch;
  f.no_save = true;
  f.quiet = true;
  return f;
}

const StudyRun& find_run(const std::vector<StudyRun>& runs, const std::string& mode, double lr) {
  for (const auto& run : runs) {
    if (run.mode == mode && run.lr == lr) return run;
  }
  ST_THROW(shardtrain::Error, "precision study: no ", mode, " run at lr ", lr_text(lr));
}

double max_abs_difference(const std::vector<double>& a, const std::vector<double>& b) {
  ST_CHECK(a.size() == b.size(), "precision study: runs of different lengths (", a.size(), " and ", b.size(), ")");
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

}  // namespace

bool StudyResult::all_hold() const {
  return std::all_of(relations.begin(), relations.end(), [](const Relation& r) { return r.holds; });
}

std::vector<Relation> check_relations(const std::vector<StudyRun>& runs) {
  // The lrs are whatever the runs used: the three of run_precision_study, smallest first.
  std::vector<double> lrs;
  for (const auto& run : runs) {
    if (std::find(lrs.begin(), lrs.end(), run.lr) == lrs.end()) lrs.push_back(run.lr);
  }
  std::sort(lrs.begin(), lrs.end());
  ST_CHECK(lrs.size() == 3, "precision study: expected runs at 3 learning rates, got ", lrs.size());
  const double small = lrs[0], scaled = lrs[1], large = lrs[2];
  const StudyRun& zero_small = find_run(runs, "zero-3", small);
  const StudyRun& standard_small = find_run(runs, "fsdp standard", small);
  const StudyRun& pure_small = find_run(runs, "fsdp pure", small);
  const StudyRun& pure_scaled = find_run(runs, "fsdp pure", scaled);
  const StudyRun& zero_large = find_run(runs, "zero-3", large);
  const StudyRun& standard_large = find_run(runs, "fsdp standard", large);
  const StudyRun& pure_large = find_run(runs, "fsdp pure", large);
  std::vector<Relation> relations;

  {
    // Both keep an fp32 master and run the same fused kernel on the same
    // reduced gradients: the engines agree bit for bit, so the claim is exact.
    const double d_small = max_abs_difference(zero_small.losses, standard_small.losses);
    const double d_large = max_abs_difference(zero_large.losses, standard_large.losses);
    relations.push_back({"zero-3 and fsdp standard have identical loss curves",
                         "largest per-step loss difference " + fixed(d_small, 9) + " at lr " + lr_text(small) +
                             ", " + fixed(d_large, 9) + " at lr " + lr_text(large),
                         d_small == 0 && d_large == 0});
  }
  relations.push_back(
      {"fsdp pure at lr " + lr_text(small) + " stays flat: its eval loss falls less than a quarter as far as standard's",
       "eval loss fell " + fixed(pure_small.loss_drop) + " (pure) vs " + fixed(standard_small.loss_drop) + " (standard)",
       standard_small.loss_drop > 0 && pure_small.loss_drop < 0.25 * standard_small.loss_drop});
  relations.push_back({"... and most of its updates are lost (mean lost_update_frac > 50%)",
                       "mean lost_update_frac " + percent(pure_small.mean_lost_update_frac),
                       pure_small.mean_lost_update_frac > 0.5});
  relations.push_back(
      {"fsdp pure at lr " + lr_text(scaled) + " (the seeds' x4) recovers in part: its eval loss falls further and it "
       "loses fewer updates than at " + lr_text(small) + ", but most of them (> 50%) are still lost",
       "lost " + percent(pure_scaled.mean_lost_update_frac) + " vs " + percent(pure_small.mean_lost_update_frac) +
           "; eval loss fell " + fixed(pure_scaled.loss_drop) + " vs " + fixed(pure_small.loss_drop) + " (pure at " +
           lr_text(small) + ") and " + fixed(standard_small.loss_drop) + " (standard at " + lr_text(small) + ")",
       pure_scaled.mean_lost_update_frac < pure_small.mean_lost_update_frac &&
           pure_scaled.loss_drop > pure_small.loss_drop && pure_scaled.mean_lost_update_frac > 0.5});
  {
    const double least = std::min({zero_large.loss_drop, standard_large.loss_drop, pure_large.loss_drop});
    relations.push_back(
        {"every mode learns at lr " + lr_text(large) +
             ": each eval loss falls at least half as far as standard's, and pure mode loses under half its updates",
         "eval loss fell " + fixed(zero_large.loss_drop) + " (zero-3), " + fixed(standard_large.loss_drop) +
             " (standard), " + fixed(pure_large.loss_drop) + " (pure); pure lost " +
             percent(pure_large.mean_lost_update_frac),
         least > 0.5 * standard_large.loss_drop && pure_large.mean_lost_update_frac < 0.5});
  }
  relations.push_back(
      {"the detector shows it inside one fp32-master run: the master loses under 1%, a bf16 master would lose "
       "over 50%",
       "fsdp standard at " + lr_text(small) + ": lost " + percent(standard_small.mean_lost_update_frac) +
           ", lost if bf16 " + percent(standard_small.mean_lost_update_frac_if_bf16),
       standard_small.mean_lost_update_frac < 0.01 && standard_small.mean_lost_update_frac_if_bf16 > 0.5});
  return relations;
}

std::string study_markdown(const StudyResult& result, const StudyOptions& options) {
  std::ostringstream out;
  out << "Base: the tiny Llama (examples/tiny_llama) trained " << options.base_steps << " steps at lr "
      << lr_text(options.base_lr) << " from its random init (zero-3, seed " << options.base_seed
      << "). Each run fine-tunes that base loaded in bf16: " << options.steps << " steps, seq " << options.seq_len
      << " x micro-batch " << options.micro_batch << ", warm-up " << options.warmup << " then cosine to 0.1x, seed "
      << options.seed << ", world 1. Eval loss: on the 200 held-out examples of data/eval.jsonl, before and after "
      << "the run (the same examples for every run); final train loss: mean of the last 10 steps.\n\n";
  out << "| run | mode | lr | eval loss before | eval loss after | drop | final train loss | mean lost_update_frac "
         "| mean lost if bf16 master | optimizer bytes/param |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const auto& run : result.runs) {
    out << "| " << run.name << " | " << run.mode << " | " << lr_text(run.lr) << " | " << fixed(run.eval_before) << " | "
        << fixed(run.eval_after) << " | " << fixed(run.loss_drop) << " | " << fixed(run.final_train_loss) << " | "
        << percent(run.mean_lost_update_frac)
        << " | " << percent(run.mean_lost_update_frac_if_bf16) << " | " << fixed(run.optimizer_bytes_per_param, 1)
        << " |\n";
  }
  out << "\n| the seeds' claim | measured | holds |\n|---|---|---|\n";
  for (const auto& r : result.relations) {
    out << "| " << r.claim << " | " << r.measured << " | " << (r.holds ? "yes" : "**no**") << " |\n";
  }
  return out.str();
}

StudyResult run_precision_study(const StudyOptions& options) {
  ST_CHECK(options.steps >= 20, "precision study: --steps must be at least 20 (start and final loss average 10 steps)");
  ST_CHECK(!options.configs_dir.empty() && !options.model_dir.empty(),
           "precision study: configs_dir and model_dir must be set");
  const fs::path out(options.output_dir);
  fs::create_directories(out);
  const std::vector<Plan> plans = {
      {"zero-3", "zero3_bf16.json", "zero3", options.small_lr},
      {"fsdp standard", "fsdp_standard_bf16.yaml", "fsdp_standard", options.small_lr},
      {"fsdp pure", "fsdp_pure_bf16.yaml", "fsdp_pure", options.small_lr},
      {"fsdp pure", "fsdp_pure_bf16.yaml", "fsdp_pure", options.scaled_lr},
      {"zero-3", "zero3_bf16.json", "zero3", options.large_lr},
      {"fsdp standard", "fsdp_standard_bf16.yaml", "fsdp_standard", options.large_lr},
      {"fsdp pure", "fsdp_pure_bf16.yaml", "fsdp_pure", options.large_lr},
  };
  // The base the fine-tunes start from (the seeds' pretrained checkpoint).
  const std::string base_dir = (out / "base").string();
  {
    finetune::FinetuneOptions b = study_run_options(options);
    b.config_path = (fs::path(options.configs_dir) / "zero3_bf16.json").string();
    b.model_config = options.model_dir + "/config.json";
    b.tokenizer = options.model_dir + "/tokenizer.model";
    b.max_steps = options.base_steps;
    b.warmup = std::min<int64_t>(options.warmup, options.base_steps / 2);
    b.lr = options.base_lr;
    b.seed = options.base_seed;
    b.output_dir = base_dir;
    b.metrics_out = (out / "base.jsonl").string();
    if (!options.quiet) {
      std::cout << "precision study: the base, " << options.base_steps << " steps at lr " << lr_text(options.base_lr)
                << " from the random init" << std::endl;
    }
    const finetune::FinetuneSummary summary = finetune::run_finetune(b);
    ST_CHECK(summary.ok && !summary.export_dir.empty(), "precision study: training the base model failed");
  }
  const std::string base_model = base_dir + "/hf";

  StudyResult result;
  for (const auto& plan : plans) {
    StudyRun run;
    run.name = plan.stem + "_lr" + lr_text(plan.lr);
    run.mode = plan.mode;
    run.lr = plan.lr;
    run.config_path = (fs::path(options.configs_dir) / plan.config_file).string();
    run.metrics_path = (out / (run.name + ".jsonl")).string();
    finetune::FinetuneOptions f = study_run_options(options);
    f.config_path = run.config_path;
    f.model_dir = base_model;
    f.eval_data = options.model_dir + "/data/eval.jsonl";
    f.eval_generate = false;
    f.load_dtype = "bf16";  // the seeds load the checkpoint in bf16
    f.max_steps = options.steps;
    f.warmup = options.warmup;
    f.lr = plan.lr;
    f.seed = options.seed;
    f.output_dir = (out / run.name).string();
    f.metrics_out = run.metrics_path;
    f.no_export = true;
    if (!options.quiet) std::cout << "precision study: " << run.name << " (" << run.config_path << ")" << std::endl;
    const finetune::FinetuneSummary summary = finetune::run_finetune(f);
    ST_CHECK(summary.ok, "precision study: the run ", run.name, " failed");
    run.losses = summary.losses;
    const size_t n = run.losses.size(), window = std::min<size_t>(10, n);
    run.final_train_loss = mean_of_range(run.losses, n - window, n);
    run.eval_before = summary.eval_before.loss;
    run.eval_after = summary.eval_after.loss;
    run.loss_drop = run.eval_before - run.eval_after;
    // The study's claims rest on the detector: a run it did not measure is an error, not a silent pass.
    ST_CHECK(summary.lost_update_fracs.size() == n, "precision study: the lost-update detector measured ",
             summary.lost_update_fracs.size(), " of ", n, " steps of ", run.name,
             "; precision_audit.sample_fraction must not be 0 in ", run.config_path);
    run.mean_lost_update_frac = finetune::mean_of(summary.lost_update_fracs);
    run.mean_lost_update_frac_if_bf16 = finetune::mean_of(summary.lost_update_fracs_if_bf16);
    run.optimizer_bytes_per_param = summary.plan.optimizer_bytes_per_param_total();
    // Only the metrics file is kept; the run's own output directory stays empty.
    std::error_code ignored;
    fs::remove_all(f.output_dir, ignored);
    result.runs.push_back(std::move(run));
  }
  result.relations = check_relations(result.runs);

  std::ofstream md(out / "study.md");
  md << study_markdown(result, options);
  ST_CHECK(md.good(), "precision study: cannot write ", (out / "study.md").string());
  nlohmann::json j;
  for (const auto& run : result.runs) {
    j["runs"].push_back({{"name", run.name},
                         {"mode", run.mode},
                         {"config", run.config_path},
                         {"lr", run.lr},
                         {"metrics", run.metrics_path},
                         {"eval_loss_before", run.eval_before},
                         {"eval_loss_after", run.eval_after},
                         {"final_train_loss", run.final_train_loss},
                         {"loss_drop", run.loss_drop},
                         {"mean_lost_update_frac", run.mean_lost_update_frac},
                         {"mean_lost_update_frac_if_bf16", run.mean_lost_update_frac_if_bf16},
                         {"optimizer_bytes_per_param", run.optimizer_bytes_per_param}});
  }
  for (const auto& r : result.relations) {
    j["relations"].push_back({{"claim", r.claim}, {"measured", r.measured}, {"holds", r.holds}});
  }
  std::ofstream js(out / "study.json");
  js << j.dump(2) << "\n";
  ST_CHECK(js.good(), "precision study: cannot write ", (out / "study.json").string());
  if (options.plot) {
    std::vector<shardtrain::PlotRun> plot_runs;
    for (const auto& run : result.runs) plot_runs.push_back({run.metrics_path, run.mode + " lr " + lr_text(run.lr)});
    shardtrain::PlotOptions plot;
    plot.smooth = 20;  // per-step losses of different batches: the trend shows over a window
    plot.metrics = {"loss", "lost_update_frac", "lost_update_frac_if_bf16"};
    shardtrain::plot_metrics(plot_runs, (out / "study.png").string(), plot);
  }
  return result;
}

}  // namespace study
