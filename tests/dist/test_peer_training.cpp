// shardtrain's ZeRO-3 and FSDP (standard, fp32) engines against the real
// peers: PyTorch 2.11's FSDP2 `fully_shard`, and DeepSpeed's ZeRO-3 (CPU
// accelerator), training Hugging Face transformers' LlamaForCausalLM over
// Gloo (scripts/peer_train.py), on the same initial weights (the golden
// Llama's model.safetensors), the same batches and the same optimizer
// settings, 20 steps at world 2. The per-step losses must agree within a
// tolerance derived below.

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "shardtrain/accelerator.h"
#include "shardtrain/lora.h"
#include "shardtrain/models/hf_weights.h"
#include "shardtrain/models/llama.h"
#include "shardtrain/quantization.h"
#include "shardtrain/safetensors.h"
#include "support/llama_golden.h"
#include "support/multirank.h"
#include "support/peer_python.h"
#include "support/test_scratch.h"
#include "support/tiny_compare.h"

namespace fs = std::filesystem;
using shardtrain::models::LlamaForCausalLM;
using shardtrain::testing::MultiRankOptions;
using shardtrain::testing::RankContext;
using shardtrain::testing::run_on_ranks;

namespace {

constexpr int kWorld = 2;
constexpr int kSteps = 20;
const char* const kCase = "llama";

/// Runs the peer (parent process only) into `dir`; `extra` are further
/// arguments of scripts/peer_train.py (--engine deepspeed: DeepSpeed's ZeRO-3).
///
/// One rerun when a rank of the peer died by a signal (run_peer_command): a
/// DeepSpeed ZeRO-3 rank over Gloo has aborted in native code ("terminate
/// called without an active exception", right after deepspeed.initialize) in
/// two full-suite runs, and in none of 32 runs of two such peers at once
/// outside the suite. That is the reference crashing, not a result of it; the
/// crash's log (with each thread's Python stack, from peer_train.py's
/// faulthandler) is printed, and a second crash fails the test.
void run_peer(const fs::path& dir, const std::string& extra = "") {
  const std::string command = "OMP_NUM_THREADS=1 TRANSFORMERS_VERBOSITY=error " +
                              shardtrain::testing::peer_python() + " " +
                              SHARDTRAIN_SOURCE_DIR + "/scripts/peer_train.py " +
                              shardtrain::testing::golden_dir(kCase) + " " + dir.string() +
                              " --steps " + std::to_string(kSteps) + " --world " + std::to_string(kWorld) + " " +
                              extra;
  fs::create_directories(dir);
  // Bounded as every wait in the suite: the slowest peer (PEFT making its
  // base) ran its whole test in 88 s here; a run past 480 s is a hang.
  const shardtrain::testing::PeerRun run =
      shardtrain::testing::run_peer_command(command, dir / "peer.log", std::chrono::seconds(480));
  ASSERT_EQ(run.result.exit_code, 0) << "the peer failed" << (run.result.timed_out ? " (timed out)" : "") << ": "
                                     << command << "\n" << run.result.output;
}

/// `zero_stage`: the ZeRO stage where not `fsdp`.
shardtrain::TrainingConfig peer_engine_config(bool fsdp, const std::string& optimizer, int zero_stage = 3) {
  shardtrain::TrainingConfig config = shardtrain::testing::fp32_llama_engine_config(fsdp);
  if (!fsdp) config.zero.stage = zero_stage;
  // The peer's settings (scripts/peer_train.py OPTIMIZERS).
  if (optimizer == "adamw") {
    config.optimizer.type = "AdamW";
    config.optimizer.lr = 1e-3;
    config.optimizer.betas = std::array<double, 2>{0.9, 0.999};
    config.optimizer.eps = 1e-8;
    config.optimizer.weight_decay = 0.01;
  } else {
    config.optimizer.type = "SGD";
    config.optimizer.lr = 0.5;
    config.optimizer.weight_decay = 0.0;
  }
  return config;
}

struct PeerCase {
  bool fsdp;
  const char* optimizer;
  int zero_stage = 3;  ///< where not fsdp
};

class DistPeerFsdp2 : public ::testing::TestWithParam<PeerCase> {};
class DistPeerDeepSpeed : public ::testing::TestWithParam<PeerCase> {};

}  // namespace

// Tolerance. Both sides run the same ATen kernels of the same torch on the
// same machine, in fp32, so the CPU's kernels cancel out; what differs is the
// composition around them: shardtrain's flat shards against FSDP2's
// DTensors, the Adam arithmetic (shardtrain's fused kernel against
// torch.optim.AdamW's single-tensor loop) and the clip norm (fp64 against
// fp32). A step's update therefore differs by a few roundings, and a stored
// weight then lands on the same float or an adjacent one: after t steps each
// weight differs by at most t ulps, |dw_i| <= t * 2^-23 * |w_i|. To first
// order the loss then differs by sum_i |g_i| |dw_i| <= t * 2^-23 * ||g|| ||w||
// (Cauchy-Schwarz), with g the loss's gradient at this step (the clip norm
// returns its norm) and w the weights (the full state dict). Doubled (G = 2)
// for the divergence's feedback into later updates, which is second order
// here: dw is O(t * 2^-23 * |w|) and lr * curvature < 1 at these learning
// rates. Plus the loss's own evaluation: the same kernels up to the
// composition of RMSNorm and rotary (a few roundings of O(1) values), 4 ulps.
// At step 20 of this model that is ~2.3e-4 (||g|| ~ 1.8, ||w|| ~ 28), while
// the two sides measured 0 to 1 ulp (4.8e-7) apart at every step. Mutations
// this test was seen to catch (zero3, 2-core Xeon): AdamW's weight decay 0
// for 0.01 (off by 8.9e-5 at step 5 against 4.7e-5, 3.7e-4 at step 20); SGD
// with the gradient summed over the ranks instead of averaged (its lr
// doubled: off by 0.13 at step 8). Not detectable at this bound: an eps of
// 1e-6 for 1e-8 (moves the losses by at most 2.4e-5).
double loss_tolerance(double loss, int steps_taken, double grad_norm, double weight_norm) {
  const double ulp_of_loss = std::ldexp(1.0, std::ilogb(loss) - 23);
  constexpr double kFeedback = 2.0;
  return 4 * ulp_of_loss + kFeedback * steps_taken * std::ldexp(1.0, -23) * grad_norm * weight_norm;
}

/// The norm of the tensors of `state` whose name contains `filter` (all when empty).
double norm_of(const std::vector<std::pair<std::string, at::Tensor>>& state, const std::string& filter = "") {
  double sum = 0;
  for (const auto& [name, tensor] : state) {
    if (name.find(filter) != std::string::npos) sum += tensor.to(at::kDouble).pow(2).sum().item<double>();
  }
  return std::sqrt(sum);
}

/// Trains kSteps steps of `forward` on this rank's micro-batches of `batches`
/// (clipping at `max_norm`; 0 only measures the norm) and expects each step's
/// global loss within loss_tolerance of the peer's `expected`, the weight
/// norm taken over the state whose names contain `weights_filter`. Rank 0
/// writes the differences to peer_dir/differences.txt; the parent prints
/// them with print_differences.
void train_and_expect_peer_losses(shardtrain::Accelerator& accelerator,
                                  const std::function<at::Tensor(const at::Tensor&)>& forward,
                                  const at::Tensor& batches, int rank, double max_norm,
                                  const std::string& weights_filter, const std::vector<double>& expected,
                                  const std::string& peer_name, const fs::path& peer_dir) {
  std::vector<double> losses, tolerances;
  for (int step = 0; step < kSteps; ++step) {
    const double weight_norm = norm_of(accelerator.full_state_dict(), weights_filter);
    const at::Tensor ids = batches[step][rank];
    at::Tensor loss = shardtrain::models::causal_lm_loss(forward(ids), ids);
    accelerator.backward(loss);
    const double grad_norm = accelerator.clip_grad_norm(max_norm);
    accelerator.step();
    accelerator.zero_grad();
    losses.push_back(accelerator.reduce(loss.detach().reshape({1}), "mean").item<double>());
    tolerances.push_back(loss_tolerance(losses.back(), step, grad_norm, weight_norm));
  }
  if (rank != 0) return;
  std::ofstream table(peer_dir / "differences.txt");
  for (int step = 0; step < kSteps; ++step) {
    EXPECT_NEAR(losses[step], expected[step], tolerances[step]) << "step " << step + 1;
    table << "step " << step + 1 << "  shardtrain " << losses[step] << "  " << peer_name << " " << expected[step]
          << "  diff " << losses[step] - expected[step] << "  tolerance " << tolerances[step] << "\n";
  }
}

/// In the parent: prints the ranks' measured differences, for the record.
void print_differences(const fs::path& dir) {
  std::ifstream table(dir / "differences.txt");
  std::cout << table.rdbuf();
}

/// Trains `c` for kSteps steps at world 2 beside the peer that `peer_args`
/// selects (`peer_name` in the printed table) and compares the losses.
void expect_peer_losses(const PeerCase& c, const std::string& peer_name, const std::string& peer_args) {
  const fs::path dir = shardtrain::testing::test_scratch_dir();
  if (!shardtrain::testing::is_rank_process()) {
    run_peer(dir, peer_args);
    if (::testing::Test::HasFatalFailure()) return;
  }
  MultiRankOptions harness;
  harness.timeout = std::chrono::seconds(300);
  run_on_ranks(kWorld, [c, peer_name, peer_dir = dir](RankContext& ctx) {
    std::ifstream peer_file(peer_dir / "peer.json");
    const nlohmann::json peer = nlohmann::json::parse(peer_file);
    const std::vector<double> expected = peer.at(c.optimizer).get<std::vector<double>>();
    ASSERT_EQ(expected.size(), static_cast<size_t>(kSteps));
    const at::Tensor batches =
        shardtrain::safetensors::Reader((peer_dir / "batches.safetensors").string()).read("input_ids");
    ASSERT_EQ(batches.sizes().vec(), (std::vector<int64_t>{kSteps, kWorld, 2, 16}));

    auto accelerator = shardtrain::testing::accelerator_for(peer_engine_config(c.fsdp, c.optimizer, c.zero_stage), ctx);
    LlamaForCausalLM model = shardtrain::testing::load_golden_case(kCase);
    model->train();
    auto prepared = accelerator->prepare(model, {}, shardtrain::testing::micro_batch(2));
    // AdamW clips to 1.0 as the peer does; for SGD a max_norm of 0 only measures the norm.
    const double max_norm = std::string(c.optimizer) == "adamw" ? 1.0 : 0.0;
    train_and_expect_peer_losses(*accelerator, prepared, batches, ctx.rank(), max_norm, "", expected, peer_name,
                                 peer_dir);
  }, harness);
  if (!shardtrain::testing::is_rank_process()) print_differences(dir);
}

TEST_P(DistPeerFsdp2, TwentyFp32StepsMatchPyTorchFsdp2Losses) { expect_peer_losses(GetParam(), "FSDP2", ""); }

// DeepSpeed's ZeRO at stages 3, 2 and 1 against shardtrain's same stage
// (deepspeed from PyPI, DS_ACCELERATOR=cpu), fp32, with torch's AdamW or SGD
// as its client optimizer stepping its flat fp32 partitions, and its own
// clipping (gradient_clipping) and averaging over the ranks. The same bound
// as above: the same kernels, composed around a flat partition as
// shardtrain's are. Measured (Intel Xeon with AMX, 2 cores): DeepSpeed's
// losses are 0 or 1 ulp from FSDP2's at every step, at every stage and in
// both optimizers.
TEST_P(DistPeerDeepSpeed, TwentyFp32StepsMatchDeepSpeedZeroLosses) {
  const PeerCase c = GetParam();
  expect_peer_losses(c, "DeepSpeed", "--engine deepspeed --zero-stage " + std::to_string(c.zero_stage));
}

std::string peer_case_name(const ::testing::TestParamInfo<PeerCase>& info) {
  return (info.param.fsdp ? std::string("fsdp_standard") : "zero" + std::to_string(info.param.zero_stage)) + "_" +
         info.param.optimizer;
}

INSTANTIATE_TEST_SUITE_P(DistPeers, DistPeerFsdp2,
                         ::testing::Values(PeerCase{false, "adamw"}, PeerCase{true, "adamw"},
                                           PeerCase{false, "sgd"}, PeerCase{true, "sgd"}),
                         peer_case_name);
// SGD at every stage as well: AdamW clipped to 1.0 cannot tell a gradient
// summed over the ranks from one averaged (its update is nearly
// scale-free), SGD's update doubles with it.
INSTANTIATE_TEST_SUITE_P(DistPeers, DistPeerDeepSpeed,
                         ::testing::Values(PeerCase{false, "adamw"}, PeerCase{false, "sgd"},
                                           PeerCase{false, "adamw", 2}, PeerCase{false, "sgd", 2},
                                           PeerCase{false, "adamw", 1}, PeerCase{false, "sgd", 1}),
                         peer_case_name);

// LoRA against PEFT: r 8 on q/k/v/o of a 7.3M Llama (tests/data/peer/llama_peft_base.json:
// hidden 256, 4 layers, vocab 8000; every Linear a whole number of NF4's
// 64-element blocks; random weights the peer makes and saves), fp32, world 2, 20 AdamW steps
// (and in one case 20 SGD steps, which see a summed gradient where AdamW does not);
// PEFT's FSDP2 run and shardtrain's start from the same base and from PEFT's
// own adapter initialisation (lora_init, loaded with load_lora_adapter) and
// train on the same batches. The bound is the one above with the trainable
// weights only: the base is frozen on both sides, so only the adapters
// differ, w is the adapters' state and g the gradient the clip measures
// (theirs). Measured (AMD EPYC with AVX-512 BF16, 2 cores): 0 or 1 ulp apart
// at every step, in all four cases. A mutation it catches: the adapter update
// scaled by half its alpha / r (off by 1.9e-4 at step 2 against a bound of
// 4.6e-6). The base was the 58M Llama of the benchmarks until its four cases
// took a fifth of the suite's test time (100 s each under ctest -j2; about 20 s
// each alone now, 53 s before).
//
// The QLoRA cases put the base in NF4 on both sides: shardtrain's
// quantize_frozen_base, and on the peer's side transformers' load_in_4bit
// through bitsandbytes (Linear4bit, compute dtype fp32; scripts/peer_train.py
// --qlora). The same bound holds unchanged: the two quantizations give the
// same bytes and decode to the same fp32 weights bit for bit
// (UnitNf4.QuantizationEqualsBitsandbytesBitForBit), and both layers then
// multiply by the decoded weight in fp32, so the base is again the same
// frozen fp32 weights on both sides and only the adapters differ.
struct PeftCase {
  bool fsdp;
  bool qlora;
  /// SGD as well as AdamW: AdamW clipped to 1.0 cannot tell adapter gradients
  /// summed over the ranks from averaged ones, SGD's update doubles with them
  /// (the peer run at twice the lr, the summed gradient's update, moves the
  /// loss by 3.4e-3 at step 2 against this test's bound of 5.5e-6 there).
  const char* optimizer = "adamw";
};

class DistPeerPeft : public ::testing::TestWithParam<PeftCase> {};

TEST_P(DistPeerPeft, TwentyFp32LoraStepsMatchPeftLosses) {
  const PeftCase c = GetParam();
  const fs::path dir = shardtrain::testing::test_scratch_dir();
  if (!shardtrain::testing::is_rank_process()) {
    run_peer(dir, std::string("--lora 8 ") + (c.qlora ? "--qlora " : "") + "--optimizers " + c.optimizer +
                      " --make-base " + SHARDTRAIN_SOURCE_DIR + "/tests/data/peer/llama_peft_base.json");
    if (::testing::Test::HasFatalFailure()) return;
  }
  MultiRankOptions harness;
  harness.timeout = std::chrono::seconds(600);
  run_on_ranks(kWorld, [c, peer_dir = dir](RankContext& ctx) {
    std::ifstream peer_file(peer_dir / "peer.json");
    const nlohmann::json peer = nlohmann::json::parse(peer_file);
    const std::vector<double> expected = peer.at(c.optimizer).get<std::vector<double>>();
    ASSERT_EQ(expected.size(), static_cast<size_t>(kSteps));
    const at::Tensor batches =
        shardtrain::safetensors::Reader((peer_dir / "batches.safetensors").string()).read("input_ids");

    auto accelerator = shardtrain::testing::accelerator_for(peer_engine_config(c.fsdp, c.optimizer), ctx);
    const std::string base = (peer_dir / "base").string();
    LlamaForCausalLM model(shardtrain::models::LlamaConfig::from_json_file(base + "/config.json"));
    shardtrain::models::load_hf_weights(model, base);
    shardtrain::load_lora_adapter(*model, (peer_dir / "lora_init").string());
    if (c.qlora) {
      shardtrain::QuantizationConfig nf4;
      nf4.compute_dtype = at::kFloat;  // the peer's bnb_4bit_compute_dtype
      const auto summary = shardtrain::quantize_frozen_base(*model, nf4);
      // What transformers quantizes: every decoder layer's seven Linear layers (lm_head skipped).
      ASSERT_EQ(summary.quantized_modules.size(), 7u * model->config.num_hidden_layers) << summary.describe();
    }
    model->train();
    auto prepared = accelerator->prepare(model, {}, shardtrain::testing::micro_batch(2));
    // AdamW clips to 1.0 as the peer does; for SGD a max_norm of 0 only measures the norm.
    const double max_norm = std::string(c.optimizer) == "adamw" ? 1.0 : 0.0;
    train_and_expect_peer_losses(*accelerator, prepared, batches, ctx.rank(), max_norm, ".lora_", expected,
                                 c.qlora ? "PEFT+bnb" : "PEFT", peer_dir);
  }, harness);
  if (!shardtrain::testing::is_rank_process()) print_differences(dir);
}

INSTANTIATE_TEST_SUITE_P(DistPeers, DistPeerPeft,
                         ::testing::Values(PeftCase{false, false}, PeftCase{true, false}, PeftCase{false, true},
                                           PeftCase{true, true}, PeftCase{false, false, "sgd"}),
                         [](const auto& info) {
                           return std::string(info.param.fsdp ? "fsdp_standard" : "zero3") +
                                  (info.param.qlora ? "_qlora" : "") +
                                  (std::string(info.param.optimizer) == "sgd" ? "_sgd" : "");
                         });
