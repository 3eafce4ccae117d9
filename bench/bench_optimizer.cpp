// bench_optimizer: the engines' fused CPU AdamW against torch's fused CPU
// AdamW (at::_fused_adamw_, what `torch.optim.AdamW(fused=True)` runs), against
// torch::optim::AdamW (per tensor) and against this machine's measured copy
// bandwidth, side by side in one run (interleaved round by round).
//
//   OMP_NUM_THREADS=1 build/bin/bench_optimizer [--numel 50000000] [--rounds 5] [--threads 1]
//
// The lost-update audit's cost is measured the same way: the fused step with
// the bf16 copy, with and without counting (every element), and pure bf16
// AdamW with and without.
//
// Bytes moved per element: fused AdamW reads master, grad, m, v and writes
// master, m, v (28 B; 30 B with the bf16 copy written in the same pass); a
// copy reads and writes 4 B each (8 B). "of copy bandwidth" is the kernel's
// bytes per second over the copy's.

#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include "bench_util.h"
#include "kernels/cpu/cpu_kernels.h"

namespace {

using Clock = std::chrono::steady_clock;

template <typename Fn>
double seconds_of(Fn&& fn) {
  const auto start = Clock::now();
  fn();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_optimizer: fused AdamW vs torch's fused AdamW, torch::optim::AdamW and copy bandwidth"};
  int64_t numel = 50'000'000;
  int rounds = 5;
  int threads = 1;
  app.add_option("--numel", numel, "Parameters in the flat buffer")->capture_default_str();
  app.add_option("--rounds", rounds, "Interleaved rounds; medians are reported")->capture_default_str();
  app.add_option("--threads", threads, "Intra-op threads (set OMP_NUM_THREADS to match)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    at::set_num_threads(threads);
    torch::NoGradGuard no_grad;
    at::Tensor master = at::randn({numel}), grad = at::randn({numel}) * 1e-3;
    at::Tensor m = at::zeros({numel}), v = at::zeros({numel});
    at::Tensor low = at::empty({numel}, at::kBFloat16);
    at::Tensor pure_p = master.to(at::kBFloat16), pure_m = at::zeros({numel}, at::kBFloat16),
               pure_v = at::zeros({numel}, at::kBFloat16), pure_g = grad.to(at::kBFloat16);
    unsigned long long counters[3] = {0, 0, 0};
    shardtrain::kernels::math::AuditSpec audit;
    audit.counts = counters;
    at::Tensor copy_src = at::randn({numel}), copy_dst = at::empty({numel});
    at::Tensor torch_param = master.clone().set_requires_grad(true);
    torch_param.mutable_grad() = grad.clone();
    torch::optim::AdamW torch_adamw({torch_param}, torch::optim::AdamWOptions(1e-4).weight_decay(0.01));
    // torch's fused kernel on its own copy of the same flat buffer, as the
    // Python peers of scripts/bench-vs-pytorch step it (one tensor per
    // parameter there; one flat tensor here, as the engines hold it).
    at::Tensor fused_param = master.clone(), fused_grad = grad.clone();
    at::Tensor fused_m = at::zeros({numel}), fused_v = at::zeros({numel});
    at::Tensor fused_step = at::zeros({}, at::kFloat);
    shardtrain::kernels::cpu::AdamParams p;
    p.lr = 1e-4;
    p.weight_decay = 0.01;

    std::map<std::string, std::vector<double>> times;
    int64_t step = 0;
    for (int round = 0; round <= rounds; ++round) {  // round 0 warms up (first touch of m, v, state)
      const double copy = seconds_of([&] { copy_dst.copy_(copy_src); });
      p.step = ++step;
      const double fused = seconds_of([&] { shardtrain::kernels::cpu::fused_adam(master, m, v, grad, nullptr, p); });
      p.step = ++step;
      const double fused_bf16 = seconds_of([&] { shardtrain::kernels::cpu::fused_adam(master, m, v, grad, &low, p); });
      p.step = ++step;
      const double fused_bf16_audit =
          seconds_of([&] { shardtrain::kernels::cpu::fused_adam(master, m, v, grad, &low, p, audit); });
      p.step = ++step;
      const double pure = seconds_of(
          [&] { shardtrain::kernels::cpu::fused_adam_low_precision(pure_p, pure_m, pure_v, pure_g, p); });
      p.step = ++step;
      const double pure_audit = seconds_of(
          [&] { shardtrain::kernels::cpu::fused_adam_low_precision(pure_p, pure_m, pure_v, pure_g, p, audit); });
      const double reference = seconds_of([&] { torch_adamw.step(); });
      fused_step.add_(1);  // the kernel reads the step count; torch.optim increments it before the call
      const double torch_fused = seconds_of([&] {
        at::_fused_adamw_({fused_param}, {fused_grad}, {fused_m}, {fused_v}, {}, {fused_step}, p.lr, 0.9, 0.999,
                          p.weight_decay, 1e-8, /*amsgrad=*/false, /*maximize=*/false);
      });
      if (round == 0) continue;
      times["torch_fused"].push_back(torch_fused);
      times["fused_bf16_audit"].push_back(fused_bf16_audit);
      times["pure"].push_back(pure);
      times["pure_audit"].push_back(pure_audit);
      times["copy"].push_back(copy);
      times["fused"].push_back(fused);
      times["fused_bf16"].push_back(fused_bf16);
      times["torch"].push_back(reference);
    }
    const double n = static_cast<double>(numel);
    const double copy_bw = 8.0 * n / bench::median(times["copy"]);
    const double torch_time = bench::median(times["torch"]);
    std::printf("%lld fp32 parameters, %d thread(s), median of %d rounds\n", static_cast<long long>(numel), threads,
                rounds);
    std::printf("| kernel | time (ms) | vs torch::optim::AdamW | GB/s | of copy bandwidth |\n|---|---:|---:|---:|---:|\n");
    auto row = [&](const char* label, const std::string& key, double bytes_per_element) {
      const double t = bench::median(times[key]);
      const double bw = bytes_per_element * n / t;
      std::printf("| %s | %.1f | %.2fx faster | %.1f | %.0f%% |\n", label, 1e3 * t, torch_time / t, bw / 1e9,
                  100.0 * bw / copy_bw);
    };
    std::printf("| copy (dst.copy_(src)) | %.1f | - | %.1f | 100%% |\n", 1e3 * bench::median(times["copy"]),
                copy_bw / 1e9);
    row("shardtrain fused AdamW", "fused", 28.0);
    row("shardtrain fused AdamW + bf16 copy", "fused_bf16", 30.0);
    row("shardtrain fused AdamW + bf16 copy + lost-update audit", "fused_bf16_audit", 30.0);
    row("shardtrain pure bf16 AdamW", "pure", 14.0);
    row("shardtrain pure bf16 AdamW + lost-update audit", "pure_audit", 14.0);
    row("torch fused AdamW (at::_fused_adamw_)", "torch_fused", 28.0);
    std::printf("| torch::optim::AdamW | %.1f | 1.00x | - | - |\n", 1e3 * torch_time);
    std::printf("shardtrain fused AdamW / torch fused AdamW, time: %.3f\n",
                bench::median(times["fused"]) / bench::median(times["torch_fused"]));
    std::printf("lost-update audit, time with / without: fused AdamW + bf16 copy %.3f; pure bf16 AdamW %.3f\n",
                bench::median(times["fused_bf16_audit"]) / bench::median(times["fused_bf16"]),
                bench::median(times["pure_audit"]) / bench::median(times["pure"]));
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "bench_optimizer: " << e.what() << std::endl;
    return 1;
  }
}
