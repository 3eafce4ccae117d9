// Selective activation checkpointing of the Llama / Mistral models
// (Megatron-LM's selective recomputation: only the core attention is
// recomputed in backward). Checks that it changes neither the loss nor any
// gradient, that the recomputation really happens, that the [B,heads,T,T]
// attention probabilities are no longer kept between forward and backward,
// and that it composes with full (whole-layer) recomputation — at unit level
// through test hooks, and with the real ZeRO-3 engine on two ranks.

#include <gtest/gtest.h>

#include <torch/torch.h>

#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "shardtrain/accelerator.h"
#include "shardtrain/error.h"
#include "shardtrain/models/llama.h"
#include "shardtrain/unit.h"
#include "support/multirank.h"
#include "support/tiny_compare.h"

namespace {

namespace sm = shardtrain::models;
using sm::ActivationCheckpointing;

constexpr int64_t kBatch = 2;
constexpr int64_t kSeq = 24;
constexpr int64_t kHeads = 4;

/// Small random models: GQA (4 query heads over 2 key/value heads) and a
/// Mistral whose window (5) is shorter than the documents packed below.
sm::LlamaConfig small_model_config(const std::string& model_type) {
  sm::LlamaConfig c;
  c.model_type = model_type;
  c.vocab_size = 101;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 3;
  c.num_attention_heads = kHeads;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  if (model_type == "mistral") c.sliding_window = 5;
  return c;
}

at::Tensor input_ids() {
  return at::remainder(at::arange(kBatch * kSeq, at::kLong) * 37 + 11, 101).view({kBatch, kSeq});
}

/// Packed documents: row 0 holds two (10 + 14 tokens), row 1 three (7 + 9 + 8).
at::Tensor document_ids() {
  at::Tensor doc = at::zeros({kBatch, kSeq}, at::kLong);
  doc[0].slice(0, 10).fill_(1);
  doc[1].slice(0, 7, 16).fill_(1);
  doc[1].slice(0, 16).fill_(2);
  return doc;
}

struct LossAndGrads {
  at::Tensor loss;
  std::vector<std::pair<std::string, at::Tensor>> grads;
};

/// One forward/backward from zeroed gradients.
LossAndGrads loss_and_grads(sm::LlamaForCausalLM& model) {
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
  at::Tensor ids = input_ids();
  at::Tensor loss = sm::causal_lm_loss(model->forward(ids, {}, document_ids()), ids);
  loss.backward();
  LossAndGrads out{loss.detach(), {}};
  for (auto& [name, p] : sm::hf_state_dict(model)) out.grads.emplace_back(name, p.grad().clone());
  return out;
}

void expect_identical(const LossAndGrads& actual, const LossAndGrads& expected, const std::string& what) {
  // Recomputation runs the same kernels on the same inputs, so the results
  // are not just close but bitwise equal on CPU.
  EXPECT_TRUE(at::equal(actual.loss, expected.loss))
      << what << ": loss " << actual.loss.item<double>() << " vs " << expected.loss.item<double>();
  ASSERT_EQ(actual.grads.size(), expected.grads.size());
  for (std::size_t i = 0; i < actual.grads.size(); ++i) {
    const auto& [name, g] = actual.grads[i];
    ASSERT_EQ(name, expected.grads[i].first);
    ASSERT_TRUE(g.defined()) << what << ": no gradient for " << name;
    EXPECT_TRUE(at::equal(g, expected.grads[i].second))
        << what << ": " << name << " differs by " << (g - expected.grads[i].second).abs().max().item<double>();
  }
}

const std::vector<std::string> kModelTypes = {"llama", "mistral"};

TEST(UnitLlamaCheckpointing, SelectiveGivesTheSameLossAndGradients) {
  for (const std::string& model_type : kModelTypes) {
    SCOPED_TRACE(model_type);
    torch::manual_seed(7);
    sm::LlamaForCausalLM model(small_model_config(model_type));
    ASSERT_EQ(model->activation_checkpointing(), ActivationCheckpointing::kNone) << "the default";
    const LossAndGrads plain = loss_and_grads(model);

    model->set_activation_checkpointing(ActivationCheckpointing::kSelective);
    ASSERT_EQ(model->activation_checkpointing(), ActivationCheckpointing::kSelective);
    const int64_t before = model->core_attention_recomputations();
    const LossAndGrads selective = loss_and_grads(model);
    // Otherwise the comparison would compare the plain path with itself.
    ASSERT_EQ(model->core_attention_recomputations() - before, model->config.num_hidden_layers);
    expect_identical(selective, plain, model_type + " selective vs none");
  }
}

// fp16 on the CPU always takes the widened attention (kernels/mixed_attention.h),
// which itself recomputes in backward; inside the selective recomputation it
// is differentiated directly instead (kernels::in_recomputation), and the
// bits must not change for it.
TEST(UnitLlamaCheckpointing, SelectiveOverTheWidenedFp16AttentionGivesTheSameLossAndGradients) {
  torch::manual_seed(8);
  sm::LlamaForCausalLM model(small_model_config("llama"));
  model->to(at::kHalf);
  const LossAndGrads plain = loss_and_grads(model);
  ASSERT_EQ(plain.grads.front().second.scalar_type(), at::kHalf);
  model->set_activation_checkpointing(ActivationCheckpointing::kSelective);
  const int64_t before = model->core_attention_recomputations();
  const LossAndGrads selective = loss_and_grads(model);
  ASSERT_EQ(model->core_attention_recomputations() - before, model->config.num_hidden_layers);
  expect_identical(selective, plain, "fp16 selective vs none");
}

TEST(UnitLlamaCheckpointing, CoreAttentionIsRecomputedOncePerLayerInBackward) {
  for (const std::string& model_type : kModelTypes) {
    SCOPED_TRACE(model_type);
    torch::manual_seed(3);
    sm::LlamaForCausalLM model(small_model_config(model_type));
    const int64_t layers = model->config.num_hidden_layers;
    at::Tensor ids = input_ids();

    // kNone never goes through the checkpointed function.
    sm::causal_lm_loss(model->forward(ids, {}, document_ids()), ids).backward();
    EXPECT_EQ(model->core_attention_recomputations(), 0);

    model->set_activation_checkpointing(ActivationCheckpointing::kSelective);
    at::Tensor loss = sm::causal_lm_loss(model->forward(ids, {}, document_ids()), ids);
    EXPECT_EQ(model->core_attention_recomputations(), 0) << "forward must not count as a recomputation";
    loss.backward();
    EXPECT_EQ(model->core_attention_recomputations(), layers) << "one recomputation per layer per backward";
    for (auto& layer : *model->model->layers) {
      EXPECT_EQ(layer->as<sm::LlamaDecoderLayerImpl>()->self_attn->core_attention_recomputations->load(), 1);
    }

    // The KV-cache path under no-grad stays the plain one: nothing to
    // recompute for, and the logits equal those of a kNone model. 12 + 1
    // tokens: past mistral's window of 5.
    {
      torch::NoGradGuard no_grad;
      auto decode = [&] {
        sm::KVCache cache;
        at::Tensor a = model->forward_cached(ids.slice(1, 0, 12), cache);
        return at::cat({a, model->forward_cached(ids.slice(1, 12, 13), cache)}, 1);
      };
      at::Tensor selective_logits = decode();
      model->set_activation_checkpointing(ActivationCheckpointing::kNone);
      at::Tensor plain_logits = decode();
      EXPECT_TRUE(at::equal(selective_logits, plain_logits));
      EXPECT_FALSE(selective_logits.requires_grad());
    }
    EXPECT_EQ(model->core_attention_recomputations(), layers) << "no-grad forwards recompute nothing";
  }
}

// ---- memory -------------------------------------------------------------------

/// Wraps LibTorch's CPU allocator and keeps the size of every live block, so a
/// test can see which tensors the autograd graph holds between forward and
/// backward, block by block (LibTorch's CPU allocator keeps no per-size
/// counts of live blocks).
class CountingCPUAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = inner_->allocate(n);
    if (n == 0) return inner;
    void* data = inner.get();
    auto* block = new Block{std::move(inner), n, this};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++live_[n];
      live_bytes_ += static_cast<int64_t>(n);
      peak_bytes_ = std::max(peak_bytes_, live_bytes_);
    }
    return {data, block, &CountingCPUAllocator::free_block, c10::Device(c10::DeviceType::CPU)};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  /// Counts every CPU allocation while it lives.
  class Installed {
   public:
    explicit Installed(CountingCPUAllocator& a) : a_(a) {
      a_.inner_ = c10::GetCPUAllocator();
      // The highest priority, so that nothing registered earlier outranks it.
      c10::SetCPUAllocator(&a_, /*priority=*/255);
    }
    ~Installed() { c10::SetCPUAllocator(a_.inner_, /*priority=*/255); }
    Installed(const Installed&) = delete;
    Installed& operator=(const Installed&) = delete;

   private:
    CountingCPUAllocator& a_;
  };

  int64_t live_blocks_of(size_t bytes) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.find(bytes);
    return it == live_.end() ? 0 : it->second;
  }
  int64_t live_bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return live_bytes_;
  }
  int64_t peak_bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return peak_bytes_;
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    peak_bytes_ = live_bytes_;
  }

 private:
  struct Block {
    c10::DataPtr inner;  // frees the memory through the wrapped allocator
    size_t bytes;
    const CountingCPUAllocator* owner;
  };
  static void free_block(void* ctx) {
    auto* block = static_cast<Block*>(ctx);
    {
      const CountingCPUAllocator& a = *block->owner;
      std::lock_guard<std::mutex> lock(a.mutex_);
      if (--a.live_[block->bytes] == 0) a.live_.erase(block->bytes);
      a.live_bytes_ -= static_cast<int64_t>(block->bytes);
    }
    delete block;
  }

  c10::Allocator* inner_ = nullptr;
  mutable std::mutex mutex_;
  mutable std::map<size_t, int64_t> live_;
  mutable int64_t live_bytes_ = 0;
  mutable int64_t peak_bytes_ = 0;
};

/// Blocks allocated while installed may be freed after, and still come back
/// here, so the allocator lives forever.
CountingCPUAllocator& counting_allocator() {
  static auto* allocator = new CountingCPUAllocator();
  return *allocator;
}

struct MemoryAfterForward {
  int64_t probs_blocks = 0;  // live blocks of exactly one layer's fp32 [B,heads,T,T]
  int64_t graph_bytes = 0;   // live bytes the forward added (what the graph keeps, plus logits/loss)
  int64_t peak_bytes = 0;    // peak over forward + backward, above the start
};

MemoryAfterForward measure(sm::LlamaForCausalLM& model, ActivationCheckpointing mode) {
  model->set_activation_checkpointing(mode);
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
  at::Tensor ids = input_ids();
  at::Tensor docs = document_ids();
  const size_t probs_bytes = static_cast<size_t>(kBatch * kHeads * kSeq * kSeq) * sizeof(float);
  CountingCPUAllocator& alloc = counting_allocator();
  CountingCPUAllocator::Installed installed(alloc);
  MemoryAfterForward m;
  const int64_t start = alloc.live_bytes();
  alloc.reset_peak();
  {
    at::Tensor loss = sm::causal_lm_loss(model->forward(ids, {}, docs), ids);
    m.probs_blocks = alloc.live_blocks_of(probs_bytes);
    m.graph_bytes = alloc.live_bytes() - start;
    loss.backward();
  }
  m.peak_bytes = alloc.peak_bytes() - start;
  return m;
}

/// Live blocks of one layer's fp32 [B,heads,T,T] probabilities that an
/// explicit softmax(q k^T) v keeps for its backward: the probe's positive
/// control, so that the model's zero below means "none kept", not "the probe
/// cannot see them".
int64_t probability_blocks_explicit_attention_keeps() {
  const int64_t head_dim = 8;
  at::Tensor q = torch::randn({kBatch, kHeads, kSeq, head_dim}, torch::requires_grad());
  at::Tensor k = torch::randn({kBatch, kHeads, kSeq, head_dim}, torch::requires_grad());
  at::Tensor v = torch::randn({kBatch, kHeads, kSeq, head_dim}, torch::requires_grad());
  const size_t probs_bytes = static_cast<size_t>(kBatch * kHeads * kSeq * kSeq) * sizeof(float);
  CountingCPUAllocator& alloc = counting_allocator();
  CountingCPUAllocator::Installed installed(alloc);
  at::Tensor out = at::matmul(at::softmax(at::matmul(q, k.transpose(2, 3)), -1), v);
  const int64_t kept = alloc.live_blocks_of(probs_bytes);
  out.sum().backward();
  return kept;
}

TEST(UnitLlamaCheckpointing, SelectiveKeepsNoAttentionProbabilitiesBetweenForwardAndBackward) {
  torch::manual_seed(5);
  sm::LlamaConfig config = small_model_config("llama");
  sm::LlamaForCausalLM model(config);

  // The block size is unique to the fp32 probabilities (no other activation
  // of these shapes is 2*4*24*24 floats), so counting live blocks of that size
  // counts saved probabilities; an explicit attention keeps one.
  ASSERT_GE(probability_blocks_explicit_attention_keeps(), 1) << "the probe must see saved probabilities";
  // The model's attention is SDPA: its fused kernels save the output and the
  // log-sum-exp, never the probabilities. Selective recomputation saves only
  // q, k, v and the bool mask, so it keeps less still.
  const MemoryAfterForward none = measure(model, ActivationCheckpointing::kNone);
  const MemoryAfterForward selective = measure(model, ActivationCheckpointing::kSelective);
  EXPECT_EQ(none.probs_blocks, 0) << "SDPA keeps no probabilities";
  EXPECT_EQ(selective.probs_blocks, 0) << "selective checkpointing must not keep the probabilities";
  EXPECT_LT(selective.graph_bytes, none.graph_bytes)
      << "kept after forward: none " << none.graph_bytes << " B, selective " << selective.graph_bytes << " B";
  std::cout << "[ memory ] kept after forward: none " << none.graph_bytes << " B, selective " << selective.graph_bytes
            << " B; peak over forward+backward: none " << none.peak_bytes << " B, selective "
            << selective.peak_bytes << " B" << std::endl;
}

// ---- parsing --------------------------------------------------------------------

TEST(UnitLlamaCheckpointing, ParseAcceptsNoneAndSelectiveAndNamesThemOtherwise) {
  EXPECT_EQ(sm::parse_activation_checkpointing("none"), ActivationCheckpointing::kNone);
  EXPECT_EQ(sm::parse_activation_checkpointing("selective"), ActivationCheckpointing::kSelective);
  EXPECT_EQ(sm::to_string(ActivationCheckpointing::kSelective), "selective");
  EXPECT_EQ(sm::to_string(ActivationCheckpointing::kNone), "none");
  for (const std::string bad : {"full", "Selective", ""}) {
    try {
      sm::parse_activation_checkpointing(bad);
      ADD_FAILURE() << "'" << bad << "' should be rejected";
    } catch (const shardtrain::ConfigError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("activation checkpointing '" + bad + "' is not supported (none, selective"),
                std::string::npos)
          << message;
      // "full" is a real mode, just not the model's: point at the engine's switches.
      EXPECT_NE(message.find("fsdp_activation_checkpointing"), std::string::npos) << message;
    }
  }
}

TEST(UnitLlamaCheckpointing, DoubleBackwardThroughTheFunctionThrows) {
  // The recomputed graph hangs off detached inputs: a second derivative
  // through it would be silently wrong, so create_graph is refused.
  at::Tensor q = at::randn({1, 2, 3, 4}).requires_grad_();
  at::Tensor k = at::randn({1, 2, 3, 4});
  at::Tensor v = at::randn({1, 2, 3, 4});
  at::Tensor allowed = at::ones({1, 1, 3, 3}, at::kBool).tril();
  at::Tensor out = sm::checkpointed_core_attention(q, k, v, allowed).sum();
  EXPECT_THROW(torch::autograd::grad({out}, {q}, {}, /*retain_graph=*/true, /*create_graph=*/true),
               shardtrain::Error);
  // Without create_graph it works and matches the plain core attention.
  at::Tensor g = torch::autograd::grad({out}, {q})[0];
  at::Tensor q2 = q.detach().requires_grad_();
  at::Tensor g2 = torch::autograd::grad({sm::core_attention(q2, k, v, allowed).sum()}, {q2})[0];
  EXPECT_TRUE(at::equal(g, g2));
}

// ---- composition with full (whole-layer) recomputation ----------------------------

/// Keeps a unit body alive in the autograd context until backward.
struct BodyHolder : torch::CustomClassHolder {
  explicit BodyHolder(std::function<at::Tensor(const at::Tensor&)> f) : fn(std::move(f)) {}
  std::function<at::Tensor(const at::Tensor&)> fn;
};

/// Whole-unit recomputation the way the sharding engine does it
/// (src/engine/gather_scheduler.cpp, RecomputeFunction, which is private to the
/// engine): forward runs the body without a graph, backward runs it again
/// with grad on and differentiates w.r.t. the input and the unit's parameters.
struct UnitRecompute : torch::autograd::Function<UnitRecompute> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, at::TensorList params,
                            c10::IValue body) {
    std::vector<at::Tensor> saved{input};
    saved.insert(saved.end(), params.begin(), params.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["body"] = body;
    at::NoGradGuard no_grad;
    return c10::static_intrusive_pointer_cast<BodyHolder>(body.toCapsule())->fn(input);
  }
  static std::vector<at::Tensor> backward(torch::autograd::AutogradContext* ctx, std::vector<at::Tensor> grads) {
    auto saved = ctx->get_saved_variables();
    auto body = c10::static_intrusive_pointer_cast<BodyHolder>(ctx->saved_data["body"].toCapsule());
    at::Tensor input = saved[0].detach().requires_grad_(saved[0].requires_grad());
    std::vector<at::Tensor> wrt{input};
    wrt.insert(wrt.end(), saved.begin() + 1, saved.end());
    at::Tensor output;
    {
      at::AutoGradMode enable(true);
      output = body->fn(input);
    }
    auto computed = torch::autograd::grad({output}, wrt, {grads[0]}, false, false, /*allow_unused=*/true);
    computed.emplace_back();  // the body
    return computed;
  }
};

/// UnitHooks with full checkpointing and nothing to gather; counts body runs.
class FullRecomputeHooks : public shardtrain::UnitHooks {
 public:
  void before_unit_forward(shardtrain::Unit&) override {}
  at::Tensor after_unit_forward(shardtrain::Unit&, const at::Tensor&, at::Tensor output) override { return output; }
  bool recompute_in_backward(const shardtrain::Unit&) const override { return true; }
  at::Tensor run_recomputed(shardtrain::Unit& unit, std::function<at::Tensor(const at::Tensor&)> body,
                            const at::Tensor& input) override {
    auto counted = [this, body = std::move(body)](const at::Tensor& h) {
      ++body_runs;
      return body(h);
    };
    auto params = dynamic_cast<torch::nn::Module&>(unit).parameters();
    return UnitRecompute::apply(input, at::TensorList(params),
                                c10::IValue::make_capsule(c10::make_intrusive<BodyHolder>(counted)));
  }
  int body_runs = 0;
};

TEST(UnitLlamaCheckpointing, SelectiveComposesWithFullLayerRecomputation) {
  for (const std::string& model_type : kModelTypes) {
    SCOPED_TRACE(model_type);
    torch::manual_seed(11);
    sm::LlamaForCausalLM model(small_model_config(model_type));
    const int64_t layers = model->config.num_hidden_layers;
    const LossAndGrads plain = loss_and_grads(model);

    FullRecomputeHooks hooks;
    int index = 0;
    for (auto& layer : *model->model->layers) {
      layer->as<sm::LlamaDecoderLayerImpl>()->attach_unit_hooks(&hooks, index++);
    }
    const LossAndGrads full = loss_and_grads(model);
    EXPECT_EQ(hooks.body_runs, 2 * layers) << "every layer body runs again in backward";
    EXPECT_EQ(model->core_attention_recomputations(), 0);
    expect_identical(full, plain, model_type + " full vs none");

    model->set_activation_checkpointing(ActivationCheckpointing::kSelective);
    hooks.body_runs = 0;
    const LossAndGrads both = loss_and_grads(model);
    EXPECT_EQ(hooks.body_runs, 2 * layers);
    // The first run is under no-grad (plain attention); the backward re-run
    // records the checkpointed attention, whose own backward recomputes it.
    EXPECT_EQ(model->core_attention_recomputations(), layers);
    expect_identical(both, plain, model_type + " full + selective vs none");
    for (auto& layer : *model->model->layers) layer->as<sm::LlamaDecoderLayerImpl>()->attach_unit_hooks(nullptr, -1);
  }
}

// ---- with the real engine -----------------------------------------------------------

TEST(DistLlamaCheckpointing, SelectiveWithZero3GradientCheckpointingTrainsIdentically) {
  // ZeRO-3 frees each layer's parameters after its forward and gathers them
  // again for the recomputation in backward; the checkpointed attention has
  // no parameters of its own, so training must not change at all.
  using shardtrain::testing::RankContext;
  shardtrain::testing::run_on_ranks(2, [](RankContext& ctx) {
    struct Run {
      bool gradient_checkpointing;
      ActivationCheckpointing mode;
    };
    const std::vector<Run> runs = {{false, ActivationCheckpointing::kNone},
                                   {false, ActivationCheckpointing::kSelective},
                                   {true, ActivationCheckpointing::kSelective}};
    std::vector<std::vector<double>> losses(runs.size());
    std::vector<std::vector<std::pair<std::string, at::Tensor>>> weights(runs.size());
    std::vector<int64_t> recomputations(runs.size());
    for (std::size_t r = 0; r < runs.size(); ++r) {
      auto config = shardtrain::testing::zero_test_config(3, shardtrain::MixedPrecision::kNo);
      config.gradient_checkpointing = runs[r].gradient_checkpointing;
      auto accelerator = shardtrain::testing::accelerator_for(config, ctx);
      torch::manual_seed(13);
      sm::LlamaForCausalLM model(small_model_config("mistral"));
      model->set_activation_checkpointing(runs[r].mode);
      shardtrain::RunInfo run = shardtrain::testing::micro_batch(kBatch);
      run.hidden_size = model->config.hidden_size;
      auto prepared = accelerator->prepare(model, {}, run);
      for (int step = 0; step < 3; ++step) {
        at::Tensor ids = at::remainder(input_ids() + 5 * (ctx.rank() + 2 * step), 101);
        at::Tensor loss = sm::causal_lm_loss(prepared(ids, at::Tensor(), document_ids()), ids);
        accelerator->backward(loss);
        accelerator->step();
        losses[r].push_back(loss.item<double>());
      }
      recomputations[r] = model->core_attention_recomputations();
      weights[r] = accelerator->full_state_dict();
    }
    const int64_t layers = small_model_config("mistral").num_hidden_layers;
    EXPECT_EQ(recomputations[0], 0);
    EXPECT_EQ(recomputations[1], 3 * layers);
    EXPECT_EQ(recomputations[2], 3 * layers);
    for (std::size_t r = 1; r < runs.size(); ++r) {
      EXPECT_EQ(losses[r], losses[0]) << "run " << r;
      ASSERT_EQ(weights[r].size(), weights[0].size());
      for (std::size_t i = 0; i < weights[0].size(); ++i) {
        EXPECT_TRUE(at::equal(weights[r][i].second, weights[0][i].second))
            << "run " << r << ": " << weights[0][i].first;
      }
    }
  });
}

}  // namespace
