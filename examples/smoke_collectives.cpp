// Smoke job: joins the job described by the environment (run it under
// `shardtrain launch --num_processes N`), runs every collective once in every
// dtype, checks each result against what it must be, and prints a line per check.
// Exit status 0 only if every check passed.
#include <iostream>

#include <ATen/ATen.h>

#include "shardtrain/comm/rendezvous.h"
#include "shardtrain/error.h"

using shardtrain::comm::ReduceOp;

int main() {
  try {
    shardtrain::DistEnv env = shardtrain::detect_dist_env();
    auto comm = shardtrain::init_distributed(env);
    const int rank = comm->rank();
    const int world = comm->world_size();
    // On the backend's device: the CPU under gloo, this rank's GPU under nccl.
    const at::TensorOptions on = at::TensorOptions().device(comm->device());
    int failures = 0;
    auto report = [&](const std::string& what, bool ok) {
      std::cout << (ok ? "ok   " : "FAIL ") << what << std::endl;
      if (!ok) ++failures;
    };
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kLong}) {
      const std::string name = c10::toString(dtype);
      // all-reduce: sum of (rank + 1) over ranks.
      at::Tensor t = at::full({5}, rank + 1, on.dtype(dtype));
      comm->all_reduce(t, ReduceOp::kSum);
      report("all_reduce(sum) " + name,
             at::equal(t, at::full({5}, world * (world + 1) / 2, t.options())));
      // all-gather: rank r contributes r.
      at::Tensor mine = at::full({3}, rank, on.dtype(dtype));
      at::Tensor gathered = at::empty({3 * world}, mine.options());
      comm->all_gather(gathered, mine);
      at::Tensor expect = at::arange(world, on.dtype(at::kLong)).repeat_interleave(3).to(dtype);
      report("all_gather " + name, at::equal(gathered, expect));
      // reduce-scatter: every rank sends 0..W*2-1; chunk r sums to W * values.
      at::Tensor in = at::arange(2 * world, on.dtype(at::kLong)).to(dtype);
      at::Tensor out = at::empty({2}, in.options());
      comm->reduce_scatter(out, in, ReduceOp::kSum);
      report("reduce_scatter(sum) " + name, at::equal(out, (in.narrow(0, 2 * rank, 2).to(at::kLong) * world).to(dtype)));
      // broadcast from the last rank.
      at::Tensor b = at::full({4}, rank == world - 1 ? 42 : 0, on.dtype(dtype));
      comm->broadcast(b, world - 1);
      report("broadcast " + name, at::equal(b, at::full({4}, 42, b.options())));
    }
    comm->barrier();
    std::cout << "smoke job: rank " << rank << " of " << world << " (" << env.source << ", " << comm->backend()
              << " on " << comm->device() << "), "
              << (failures == 0 ? "all checks passed" : std::to_string(failures) + " checks FAILED")
              << std::endl;
    return failures == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "smoke job failed: " << e.what() << std::endl;
    return 1;
  }
}
