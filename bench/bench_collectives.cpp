// Collective bandwidth benchmark in the format of nccl-tests: for each size,
// the time of one collective (max over ranks), algorithm bandwidth
// (bytes / time) and bus bandwidth (algbw x the collective's traffic factor:
// (n-1)/n for all-gather and reduce-scatter, 2(n-1)/n for all-reduce), so
// numbers compare across world sizes and against hardware link speed.
//
// Run: build/bin/shardtrain launch --num_processes 2 build/bin/bench_collectives
//
// --log-cost instead measures what hang forensics adds to every collective:
// one CollectiveLog::record() (under a two-deep scope chain, as the engine
// issues them) against the cheapest collective there is, a 4-byte
// all-reduce, in interleaved rounds; it prints both and their ratio.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include "comm/collective_log.h"
#include "shardtrain/comm/rendezvous.h"
#include "shardtrain/error.h"

namespace {

using shardtrain::comm::Communicator;
using shardtrain::comm::ReduceOp;

struct Result {
  double seconds = 0;
};

double bus_factor(const std::string& op, int world) {
  const double n = world;
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  return (n - 1) / n;
}

/// Times `iters` back-to-back collectives after `warmup`; returns the slowest rank's mean.
double time_collective(Communicator& comm, const std::string& op, int64_t bytes, at::ScalarType dtype,
                       int warmup, double target_seconds, int min_iters) {
  const int W = comm.world_size();
  const int64_t elem = c10::elementSize(dtype);
  const int64_t total = std::max<int64_t>(W, bytes / elem / W * W);  // divisible by the world
  at::Tensor big = at::ones({total}, at::TensorOptions().dtype(dtype));
  at::Tensor small = at::ones({total / W}, at::TensorOptions().dtype(dtype));
  auto run_once = [&]() {
    if (op == "all_gather") comm.all_gather(big, small);
    else if (op == "reduce_scatter") comm.reduce_scatter(small, big, ReduceOp::kSum);
    else comm.all_reduce(big, ReduceOp::kSum);
  };
  for (int i = 0; i < warmup; ++i) run_once();
  // Every rank must run the same count: rank 0 decides from a probe.
  comm.barrier();
  auto probe_start = std::chrono::steady_clock::now();
  run_once();
  at::Tensor probe = at::full({1}, std::chrono::duration<double>(std::chrono::steady_clock::now() - probe_start).count(),
                              at::kDouble);
  comm.all_reduce(probe, ReduceOp::kMax);
  const int iters = std::max(min_iters, static_cast<int>(target_seconds / std::max(probe.item<double>(), 1e-6)));
  comm.barrier();
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) run_once();
  at::Tensor elapsed = at::full({1}, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters,
                                at::kDouble);
  comm.all_reduce(elapsed, ReduceOp::kMax);
  return elapsed.item<double>();
}

/// Median of `values` (sorted in place).
double median(std::vector<double>& values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

void measure_log_cost(Communicator& comm, int rounds) {
  shardtrain::comm::CollectiveLog log(comm.rank(), comm.global_ranks());
  shardtrain::comm::CollectiveEvent event{"all_gather", at::kBFloat16, 1 << 20, 2 << 20};
  at::Tensor tiny = at::ones({1});
  constexpr int kRecords = 100000, kCollectives = 300;
  std::vector<double> record_ns, collective_us;
  using Clock = std::chrono::steady_clock;
  for (int round = 0; round < rounds; ++round) {
    {
      shardtrain::comm::CollectiveScope outer("backward()");
      shardtrain::comm::CollectiveScope inner("gather model.layers.31 (LlamaDecoderLayer)");
      const auto start = Clock::now();
      for (int i = 0; i < kRecords; ++i) log.record(event);
      record_ns.push_back(std::chrono::duration<double, std::nano>(Clock::now() - start).count() / kRecords);
    }
    comm.barrier();
    const auto start = Clock::now();
    for (int i = 0; i < kCollectives; ++i) comm.all_reduce(tiny);
    collective_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count() / kCollectives);
  }
  const double record = median(record_ns), collective = median(collective_us);
  if (comm.rank() == 0) {
    std::printf("# hang-forensics log cost: %d interleaved rounds, medians\n", rounds);
    std::printf("record()                     %10.1f ns\n", record);
    std::printf("all_reduce(4 bytes, world %d) %10.1f us\n", comm.world_size(), collective);
    std::printf("ratio record/collective      %10.5f\n", record / (collective * 1000.0));
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Collective bandwidth benchmark (nccl-tests format). Run under `shardtrain launch`."};
  int64_t min_bytes = 1024;
  int64_t max_bytes = 64ll << 20;
  int step_factor = 4;
  std::string dtype_name = "float32";
  std::string backend = "auto";
  std::vector<std::string> ops{"all_gather", "reduce_scatter", "all_reduce"};
  double target_seconds = 0.25;
  app.add_option("--min-bytes", min_bytes, "Smallest size in bytes")->capture_default_str();
  app.add_option("--max-bytes", max_bytes, "Largest size in bytes")->capture_default_str();
  app.add_option("--step-factor", step_factor, "Multiply the size by this between rows")->capture_default_str();
  app.add_option("--dtype", dtype_name, "float32 | bfloat16 | float16")->capture_default_str()
      ->check(CLI::IsMember({"float32", "bfloat16", "float16"}));
  app.add_option("--backend", backend, "auto | gloo | nccl")->capture_default_str();
  app.add_option("--ops", ops, "Collectives to time")->capture_default_str();
  app.add_option("--seconds-per-size", target_seconds, "Timed seconds per row")->capture_default_str();
  bool log_cost = false;
  app.add_flag("--log-cost", log_cost, "Measure the hang-forensics log's cost per collective instead");
  CLI11_PARSE(app, argc, argv);

  try {
    const at::ScalarType dtype = dtype_name == "float32" ? at::kFloat
                                 : dtype_name == "bfloat16" ? at::kBFloat16 : at::kHalf;
    shardtrain::InitOptions init;
    init.backend = backend;
    auto comm = shardtrain::init_distributed(shardtrain::detect_dist_env(), init);
    const int W = comm->world_size();
    const bool print = comm->rank() == 0;
    if (log_cost) {
      measure_log_cost(*comm, 7);
      return 0;
    }
    if (print) {
      std::printf("# shardtrain collectives benchmark: backend %s, world %d, dtype %s, threads/rank %d\n",
                  comm->backend().c_str(), W, dtype_name.c_str(), at::get_num_threads());
      std::printf("# size = bytes of the full buffer (all-gather output, reduce-scatter input, all-reduce buffer)\n");
    }
    for (const auto& op : ops) {
      ST_CHECK(op == "all_gather" || op == "reduce_scatter" || op == "all_reduce", "unknown op '", op,
               "'; use all_gather, reduce_scatter or all_reduce");
      if (print) {
        std::printf("#\n# %s\n# %12s %12s %10s %12s %10s %10s\n", op.c_str(), "size(B)", "count(elem)", "type",
                    "time(us)", "algbw(GB/s)", "busbw(GB/s)");
      }
      for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= step_factor) {
        const double seconds = time_collective(*comm, op, bytes, dtype, 2, target_seconds, 3);
        const int64_t count = std::max<int64_t>(W, bytes / c10::elementSize(dtype) / W * W);
        const double actual_bytes = static_cast<double>(count) * c10::elementSize(dtype);
        const double algbw = actual_bytes / seconds / 1e9;
        if (print) {
          std::printf("  %12.0f %12lld %10s %12.1f %10.3f %10.3f\n", actual_bytes, static_cast<long long>(count),
                      dtype_name.c_str(), seconds * 1e6, algbw, algbw * bus_factor(op, W));
          std::fflush(stdout);
        }
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "bench_collectives: " << e.what() << std::endl;
    return 1;
  }
}
