// An engine destroyed while collectives it issued are still in flight (a
// prefetched gather that no forward consumed because the forward threw) waits
// for them first: the communicator's threads write into buffers the engine
// owns, and freeing those under a running all-gather corrupts the heap (a
// "malloc(): unaligned tcache chunk detected" seen once on rank 1 of a ZeRO-3
// checkpoint test).

#include <atomic>
#include <memory>
#include <stdexcept>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shardtrain/accelerator.h"
#include "shardtrain/unit.h"
#include "support/multirank.h"
#include "support/tiny_compare.h"

using shardtrain::comm::CollectiveEvent;
using shardtrain::comm::CommunicatorPtr;
using shardtrain::comm::ReduceOp;
using shardtrain::comm::WorkPtr;
using shardtrain::testing::RankContext;
using shardtrain::testing::run_on_ranks;

namespace {

/// Counts the collectives issued through it that nobody has waited for.
class WaitCountingCommunicator final : public shardtrain::comm::Communicator {
 public:
  explicit WaitCountingCommunicator(CommunicatorPtr inner)
      : Communicator(inner->rank(), inner->world_size(), inner->global_ranks(), inner->options()),
        inner_(std::move(inner)) {}
  std::string backend() const override { return inner_->backend(); }
  at::Device device() const override { return inner_->device(); }
  int unwaited() const { return *unwaited_; }

 protected:
  class CountedWork final : public shardtrain::comm::Work {
   public:
    CountedWork(WorkPtr inner, std::shared_ptr<std::atomic<int>> unwaited)
        : inner_(std::move(inner)), unwaited_(std::move(unwaited)) {
      ++*unwaited_;
    }
    void wait() override {
      inner_->wait();
      if (!waited_) --*unwaited_;
      waited_ = true;
    }
    bool is_completed() override { return inner_->is_completed(); }

   private:
    WorkPtr inner_;
    std::shared_ptr<std::atomic<int>> unwaited_;
    bool waited_ = false;
  };
  WorkPtr counted(WorkPtr work) { return std::make_shared<CountedWork>(std::move(work), unwaited_); }

  WorkPtr do_all_gather(const at::Tensor& output, const at::Tensor& input, const CollectiveEvent&) override {
    return counted(inner_->all_gather_async(output, input));
  }
  WorkPtr do_all_gather_coalesced(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                                  const CollectiveEvent&) override {
    return counted(inner_->all_gather_coalesced_async(outputs, inputs));
  }
  WorkPtr do_reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                            const CollectiveEvent&) override {
    return counted(inner_->reduce_scatter_async(output, input, op));
  }
  WorkPtr do_reduce_scatter_v(const at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& splits,
                              ReduceOp op, const CollectiveEvent&) override {
    return counted(inner_->reduce_scatter_v_async(output, input, splits, op));
  }
  WorkPtr do_all_reduce(const at::Tensor& tensor, ReduceOp op, const CollectiveEvent&) override {
    return counted(inner_->all_reduce_async(tensor, op));
  }
  WorkPtr do_broadcast(const at::Tensor& tensor, int root, const CollectiveEvent&) override {
    return counted(inner_->broadcast_async(tensor, root));
  }
  void do_barrier(const CollectiveEvent&) override { inner_->barrier(); }
  std::shared_ptr<Communicator> do_new_group(const std::vector<int>&, int64_t) override {
    throw std::logic_error("WaitCountingCommunicator has no sub-groups");
  }

 private:
  CommunicatorPtr inner_;
  std::shared_ptr<std::atomic<int>> unwaited_ = std::make_shared<std::atomic<int>>(0);
};

/// A linear sharding unit whose forward throws when `fail` is set.
struct FailingBlockImpl : torch::nn::Module, shardtrain::Unit {
  FailingBlockImpl(int64_t width, bool* fail)
      : Unit("FailingBlock"), fail(fail), linear(register_module("linear", torch::nn::Linear(width, width))) {}
  at::Tensor forward(const at::Tensor& x) {
    return run_unit(x, [&](const at::Tensor& h) {
      if (*fail) throw std::runtime_error("the block's forward failed");
      return at::tanh(linear(h));
    });
  }
  bool* fail;
  torch::nn::Linear linear;
};
TORCH_MODULE(FailingBlock);

struct StackImpl : torch::nn::Module {
  StackImpl(int64_t width, int64_t depth, const std::vector<std::unique_ptr<bool>>& fails) {
    for (int64_t i = 0; i < depth; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), FailingBlock(width, fails[i].get())));
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& block : blocks) x = block->forward(x);
    return x;
  }
  std::vector<FailingBlock> blocks;
};
TORCH_MODULE(Stack);

}  // namespace

TEST(DistEngineShutdown, DestroyingAnEngineWhoseForwardThrewWaitsForItsPrefetchedGathers) {
  run_on_ranks(2, [](RankContext& ctx) {
    constexpr int64_t kWidth = 64, kDepth = 4;
    std::vector<std::unique_ptr<bool>> fails;
    for (int64_t i = 0; i < kDepth; ++i) fails.push_back(std::make_unique<bool>(false));
    auto counting = std::make_shared<WaitCountingCommunicator>(ctx.comm);
    {
      shardtrain::TrainingConfig config = shardtrain::testing::zero_test_config(3, shardtrain::MixedPrecision::kNo);
      config.zero.stage3_prefetch_bucket_size = 1 << 20;  // room to prefetch every block ahead
      shardtrain::AcceleratorOptions options;
      options.config = config;
      options.communicator = counting;
      options.print_plan = false;
      auto accelerator = std::make_unique<shardtrain::Accelerator>(options);
      torch::manual_seed(3);
      Stack model(kWidth, kDepth, fails);
      auto prepared = accelerator->prepare(model, {}, shardtrain::testing::micro_batch(4));
      const at::Tensor x = at::randn({4, kWidth});
      // Two steps record the unit order, which forward prefetch follows.
      for (int step = 0; step < 2; ++step) {
        accelerator->backward(prepared(x).pow(2).mean());
        accelerator->step();
        accelerator->zero_grad();
      }
      EXPECT_EQ(counting->unwaited(), 0) << "a completed step leaves nothing in flight";
      *fails[1] = true;  // block 1 throws after its own gather has prefetched blocks 2 and 3
      EXPECT_THROW(prepared(x), std::runtime_error);
      EXPECT_GT(counting->unwaited(), 0) << "the forward that threw left prefetched gathers in flight";
      accelerator.reset();
    }
    EXPECT_EQ(counting->unwaited(), 0) << "the engine was destroyed with collectives in flight";
  });
}
