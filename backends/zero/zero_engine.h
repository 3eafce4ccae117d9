#pragma once
// DeepSpeed-style ZeRO engine, stages 1-3.
//
// Every trainable parameter is partitioned per parameter (rank r owns
// [r*c, (r+1)*c) of it, c = ceil(n/W)); a unit's owned chunks form its shard.
// Every rank keeps an FP32 master partition of what it owns whatever the load
// dtype (DeepSpeed's _create_fp32_partitions), the optimizer state of it, an
// FP32 gradient partition, and a low-precision copy of the master (the
// all-gather input).
//  * stage 1: parameters stay gathered; full-size fp32 gradients accumulate
//    locally and are reduce-scattered at the accumulation boundary.
//  * stage 2: parameters stay gathered; each unit's gradients are
//    reduce-scattered into the fp32 partition as soon as its backward is done.
//  * stage 3: as stage 2, and a unit's parameters are gathered just before its
//    forward/backward and freed after (prefetching the next units in the order
//    recorded on the first step).

#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/loss_scaler.h"
#include "engine/unit_layout.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/config.h"

namespace torch::nn {
class Module;
}

namespace shardtrain::zero {

struct ZeroOptions {
  int stage = 3;
  /// dtype the module computes in (the gathered parameters): bf16, fp16 on
  /// CUDA, fp32 (also for fp16 on CPU, which has no fp16 matmul).
  at::ScalarType compute_dtype = at::kFloat;
  /// dtype of the low-precision partition and of the all-gather.
  at::ScalarType param_dtype = at::kFloat;
  /// dtype of the gradient reduce-scatter (communication_data_type).
  at::ScalarType reduce_dtype = at::kFloat;
  bool overlap_comm = true;
  int64_t reduce_bucket_size = 500000000;  ///< elements of gradients per reduce-scatter
  int64_t sub_group_size = 1000000000;
  int64_t prefetch_bucket_size = 50000000;    ///< elements gathered ahead (stage 3)
  int64_t param_persistence_threshold = 100000;  ///< units smaller than this stay gathered (stage 3)
  int64_t max_live_parameters = 1000000000;
  bool offload_optimizer = false;
  LossScaleConfig loss_scale;
  bool fp16 = false;
  engine::OptimizerSpec optimizer;
};

class ZeroEngine final : public engine::Engine {
 public:
  ZeroEngine(std::shared_ptr<torch::nn::Module> model, comm::CommunicatorPtr comm, ZeroOptions options);
  ~ZeroEngine() override;

  std::string name() const override;
  void before_unit_forward(Unit& unit) override;
  at::Tensor after_unit_forward(Unit& unit, at::Tensor output) override;
  void begin_forward() override;
  at::Tensor end_forward(at::Tensor output) override;
  void backward(const at::Tensor& loss, bool sync) override;
  double clip_grad_norm(double max_norm) override;
  engine::StepResult step(double lr) override;
  void zero_grad() override;
  double loss_scale() const override;
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict() override;
  engine::MemoryStats memory() const override;
  void reset_gathered_peak() override;

  // ---- introspection for tests
  /// The fp32 master partition (all units, this rank).
  const at::Tensor& master_partition() const;
  /// The low-precision partition (aliases the master in fp32 runs).
  const at::Tensor& low_precision_partition() const;
  int num_units() const;
  /// Owned element ranges by parameter name: (name, begin, length, offset in master).
  struct OwnedRange {
    std::string name;
    int64_t begin;
    int64_t length;
    int64_t master_offset;
  };
  std::vector<OwnedRange> owned_ranges() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace shardtrain::zero
