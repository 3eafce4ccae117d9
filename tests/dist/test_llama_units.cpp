// The bundled Llama's embeddings and output head as sharding units of their
// own (Unit::Kind::kEdge): which wrap policies select them, that an engine
// then never holds both vocabulary-sized tables gathered at once, that the
// embeddings are not gathered for their backward, which reads no values, that
// activation checkpointing does not recompute them, that tied embeddings stay
// in the root unit, and that none of it changes a bit of training.

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "accelerator_internals.h"
#include "engine/sharded_engine.h"
#include "shardtrain/accelerator.h"
#include "shardtrain/lora.h"
#include "shardtrain/models/llama.h"
#include "support/llama_golden.h"
#include "support/log_capture.h"
#include "support/multirank.h"
#include "support/tiny_compare.h"

namespace {

namespace sm = shardtrain::models;
using shardtrain::testing::RankContext;

// The embeddings and the head hold 2048 x 64 = 131,072 elements each, a
// decoder layer 36,992 and the final norm 64, so one table with every layer
// and the norm (205,120) is less than both tables (262,144): a gathered peak
// below both tables' bytes means they were never gathered at the same time.
constexpr int64_t kVocab = 2048;
constexpr int64_t kTableBytes = kVocab * 64 * 4;  // fp32

struct TrainedRun {
  std::vector<double> losses;
  std::vector<std::pair<std::string, at::Tensor>> weights;
  std::vector<std::string> units;
  int64_t gathered_peak = 0;
  int64_t reducing_peak = 0;
  int64_t gathered_between_steps = 0;
  int64_t param_gather_bytes = 0;   ///< over the three steps
  int64_t frozen_gather_bytes = 0;  ///< over the three steps
  int64_t model_bytes = 0;          ///< every parameter, fp32
  bool embeddings_recomputed = false, head_recomputed = false, layer_recomputed = false;
};

/// Three AdamW steps of the small GQA Llama on rank-dependent batches;
/// `lora`: adapters on q_proj and v_proj, the rest frozen.
/// `hidden_states_before_step`: between each backward and its step, a no-grad
/// forward that stops before the head (PreparedModel::run of the model's
/// trunk), which leaves the head's prefetch unconsumed.
TrainedRun train(const shardtrain::TrainingConfig& config, const sm::LlamaConfig& model_config, RankContext& ctx,
                 bool lora = false, bool hidden_states_before_step = false) {
  auto accelerator = shardtrain::testing::accelerator_for(config, ctx);
  torch::manual_seed(7);
  sm::LlamaForCausalLM model(model_config);
  if (lora) {
    shardtrain::LoraConfig adapters;
    adapters.r = 4;
    adapters.lora_alpha = 8;
    adapters.target_modules = {"q_proj", "v_proj"};
    shardtrain::apply_lora(*model, adapters);
  }
  TrainedRun run;
  for (const auto& p : model->parameters()) run.model_bytes += p.numel() * 4;
  auto prepared = accelerator->prepare(model, {}, shardtrain::testing::micro_batch(2));
  auto& engine =
      dynamic_cast<shardtrain::engine::ShardedEngine&>(shardtrain::AcceleratorInternals::engine(*accelerator));
  for (const std::string& path : engine.unit_paths()) {
    if (std::find(run.units.begin(), run.units.end(), path) == run.units.end()) run.units.push_back(path);
  }
  auto recomputed = [](shardtrain::Unit& unit) {
    return unit.unit_hooks() != nullptr && unit.unit_hooks()->recompute_in_backward(unit);
  };
  run.embeddings_recomputed = recomputed(*model->model->embed_tokens);
  if (model->lm_head) run.head_recomputed = recomputed(*model->lm_head);
  run.layer_recomputed = recomputed(*model->model->layers[0]->as<sm::LlamaDecoderLayerImpl>());
  accelerator->reset_traffic();
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(100 + 10 * step + ctx.rank());
    const at::Tensor ids = torch::randint(0, kVocab, {2, 16}, torch::kLong);
    const at::Tensor loss = sm::causal_lm_loss(prepared(ids), ids);
    accelerator->backward(loss);
    if (hidden_states_before_step) {
      torch::NoGradGuard no_grad;
      prepared.run([&](sm::LlamaForCausalLM& m) { return m->model(ids); });
    }
    accelerator->step();
    accelerator->zero_grad();
    run.losses.push_back(loss.item<double>());
  }
  run.gathered_peak = accelerator->memory().gathered_peak;
  run.reducing_peak = accelerator->memory().reducing_peak;
  run.gathered_between_steps = accelerator->memory().gathered;
  run.param_gather_bytes = accelerator->traffic().param_gather_bytes;
  run.frozen_gather_bytes = accelerator->traffic().frozen_gather_bytes;
  run.weights = accelerator->full_state_dict();
  return run;
}

bool has_unit(const TrainedRun& run, const std::string& path) {
  return std::find(run.units.begin(), run.units.end(), path) != run.units.end();
}

void expect_same_training(const TrainedRun& actual, const TrainedRun& expected, const std::string& what) {
  EXPECT_EQ(actual.losses, expected.losses) << what;
  // By name: a state dict lists the units' parameters in unit order.
  const std::map<std::string, at::Tensor> have(actual.weights.begin(), actual.weights.end());
  const std::map<std::string, at::Tensor> want(expected.weights.begin(), expected.weights.end());
  ASSERT_EQ(have.size(), want.size()) << what;
  for (const auto& [name, value] : want) {
    ASSERT_EQ(have.count(name), 1u) << what << ": " << name;
    EXPECT_TRUE(at::equal(have.at(name), value)) << what << ": " << name;
  }
}

/// FSDP FULL_SHARD, fp32, wrapping the listed classes.
shardtrain::TrainingConfig fsdp_wrapping(std::vector<std::string> classes) {
  shardtrain::TrainingConfig config = shardtrain::testing::fp32_llama_engine_config(true);
  config.fsdp.transformer_layer_cls_to_wrap = std::move(classes);
  return config;
}

/// ZeRO-3, fp32, freeing every unit after its forward and prefetching
/// nothing, so the gathered peak shows the units rather than DeepSpeed's
/// defaults (which keep a model this small gathered from forward to backward).
shardtrain::TrainingConfig zero3_freeing_after_forward() {
  shardtrain::TrainingConfig config = shardtrain::testing::fp32_llama_engine_config(false);
  config.zero.stage3_max_reuse_distance = 0;
  config.zero.stage3_prefetch_bucket_size = 0;
  config.zero.stage3_param_persistence_threshold = 0;
  return config;
}

sm::LlamaConfig model_config(bool tied, int64_t layers = 2) {
  sm::LlamaConfig c = shardtrain::testing::small_gqa_llama_config(kVocab);
  c.tie_word_embeddings = tied;
  c.num_hidden_layers = layers;
  return c;
}

TEST(DistLlamaUnits, EmbeddingsAndHeadAreUnitsUnderZeroAndWhenTheWrapListNamesThemAndTrainTheSame) {
  shardtrain::testing::run_on_ranks(2, [](RankContext& ctx) {
    const TrainedRun layers_only = train(fsdp_wrapping({"LlamaDecoderLayer"}), model_config(false), ctx);
    const TrainedRun with_edges = train(fsdp_wrapping({"LlamaDecoderLayer", "Embedding", "Linear"}), model_config(false), ctx);
    const TrainedRun zero3 = train(zero3_freeing_after_forward(), model_config(false), ctx);
    const TrainedRun unnamed = train(fsdp_wrapping({}), model_config(false), ctx);

    // Accelerate's transformer-based policy wraps only the classes it names,
    // and with none named the model's blocks (_no_split_modules).
    for (const TrainedRun* run : {&layers_only, &unnamed}) {
      EXPECT_FALSE(has_unit(*run, "model.embed_tokens"));
      EXPECT_FALSE(has_unit(*run, "lm_head"));
      EXPECT_TRUE(has_unit(*run, "model.layers.1"));
    }
    for (const TrainedRun* run : {&with_edges, &zero3}) {
      EXPECT_TRUE(has_unit(*run, "model.embed_tokens"));
      EXPECT_TRUE(has_unit(*run, "lm_head"));
      // The decoder layers' own Linear layers belong to their layer's unit.
      EXPECT_FALSE(has_unit(*run, "model.layers.0.self_attn.q_proj"));
      EXPECT_TRUE(has_unit(*run, "model.layers.0"));
    }

    // The root unit holds both tables for the whole step; as units they are
    // gathered one at a time (see kVocab).
    EXPECT_GE(layers_only.gathered_peak, 2 * kTableBytes);
    EXPECT_LT(with_edges.gathered_peak, 2 * kTableBytes);
    EXPECT_LT(zero3.gathered_peak, 2 * kTableBytes);

    // The root unit (both tables, the norm) is gathered once a step and every
    // layer twice (forward, backward). As units, the head is gathered twice
    // too, the embeddings once: a lookup's backward reads no table values
    // (LlamaEmbeddingImpl::backward_reads_parameters), so it is not
    // regathered. One table more per step, over three steps.
    EXPECT_EQ(with_edges.param_gather_bytes, layers_only.param_gather_bytes + 3 * kTableBytes);
    EXPECT_EQ(zero3.param_gather_bytes, layers_only.param_gather_bytes + 3 * kTableBytes);

    // Where a unit ends changes when its parameters exist, not one value.
    expect_same_training(with_edges, layers_only, "fsdp with the edges as units");
    expect_same_training(zero3, layers_only, "zero-3");
    expect_same_training(unnamed, layers_only, "fsdp naming no class");
  });
}

// FSDP (overlap_comm) issues a unit's reduce-scatter as soon as its gradients
// are in, and the reduction holds them, unsharded, until it is finished. At
// most two reductions are in flight (GradientReducer::kMaxBucketsInFlight),
// so the gradients held at once are two units', not the whole model's, which
// an unbounded queue held at the end of backward.
TEST(DistLlamaUnits, ReductionsInFlightHoldAtMostTwoUnitsGradients) {
  shardtrain::testing::run_on_ranks(2, [](RankContext& ctx) {
    const TrainedRun run =
        train(fsdp_wrapping({"LlamaDecoderLayer", "Embedding", "Linear"}), model_config(false, /*layers=*/8), ctx);
    // The largest units are the tables: a fp32 gradient and its half after
    // the reduce-scatter at world 2.
    const int64_t largest_reduction = kTableBytes + kTableBytes / 2;
    // Every unit's gradients with their halves: what the unbounded queue held.
    const int64_t every_reduction = run.model_bytes + run.model_bytes / 2;
    ASSERT_GT(every_reduction, 2 * largest_reduction) << "the model is too small to tell the two apart";
    EXPECT_GT(run.reducing_peak, 0);
    EXPECT_LE(run.reducing_peak, 2 * largest_reduction);
  });
}

// A no-grad forward that stops before the head, between backward and step:
// the head, prefetched after the last layer under ZeRO-3's default window,
// is never consumed. Its gather must not land after the step and be taken
// for the stepped weights by the next forward.
TEST(DistLlamaUnits, AnUnconsumedPrefetchDoesNotOutliveTheStep) {
  shardtrain::testing::run_on_ranks(2, [](RankContext& ctx) {
    const shardtrain::TrainingConfig zero3 = shardtrain::testing::fp32_llama_engine_config(false);
    const TrainedRun plain = train(zero3, model_config(false), ctx);
    const TrainedRun with_trunk_forward = train(zero3, model_config(false), ctx, false, true);
    EXPECT_EQ(with_trunk_forward.gathered_between_steps, plain.gathered_between_steps);
    expect_same_training(with_trunk_forward, plain, "a no-grad trunk forward before each step");
  });
}

// Under LoRA the embeddings and the head are frozen: no gradient of theirs
// says when their backward is done. The embeddings' output needs no
// gradient, so they are not gathered again in backward; the head is freed by
// its input's gradient. Either way nothing stays gathered between steps.
TEST(DistLlamaUnits, FrozenEdgesUnderLoraAreFreedAndTrainTheSame) {
  shardtrain::testing::run_on_ranks(2, [](RankContext& ctx) {
    const TrainedRun layers_only = train(fsdp_wrapping({"LlamaDecoderLayer"}), model_config(false), ctx, true);
    const TrainedRun with_edges =
        train(fsdp_wrapping({"LlamaDecoderLayer", "Embedding", "Linear"}), model_config(false), ctx, true);
    const TrainedRun zero3 = train(zero3_freeing_after_forward(), model_config(false), ctx, true);
    // DeepSpeed's reuse distance keeps a unit gathered from its forward to its
    // backward; the frozen embeddings have none, so they are freed at once.
    shardtrain::TrainingConfig zero3_keeping = zero3_freeing_after_forward();
    zero3_keeping.zero.stage3_max_reuse_distance = shardtrain::ZeroConfig::kDefaultMaxReuseDistance;
    const TrainedRun kept = train(zero3_keeping, model_config(false), ctx, true);
    EXPECT_LE(kept.gathered_peak, kept.model_bytes - kTableBytes);
    expect_same_training(kept, layers_only, "zero-3 with DeepSpeed's reuse distance, LoRA");
    for (const TrainedRun* run : {&with_edges, &zero3, &kept}) {
      EXPECT_TRUE(has_unit(*run, "model.embed_tokens"));
      EXPECT_TRUE(has_unit(*run, "lm_head"));
      EXPECT_EQ(run->gathered_between_steps, 0);
    }
    EXPECT_LT(with_edges.gathered_peak, 2 * kTableBytes);
    EXPECT_LT(zero3.gathered_peak, 2 * kTableBytes);
    // Each step the root gathers both tables once. As units, the head is
    // gathered again for its backward (its input's gradient reads it) and
    // the embeddings are not: one table more per step, not two.
    EXPECT_EQ(with_edges.frozen_gather_bytes, layers_only.frozen_gather_bytes + 3 * kTableBytes);
    EXPECT_EQ(zero3.frozen_gather_bytes, with_edges.frozen_gather_bytes);
    expect_same_training(with_edges, layers_only, "fsdp with the edges as units, LoRA");
    expect_same_training(zero3, layers_only, "zero-3, LoRA");
  });
}

// The embeddings' backward reads no table values, so the table is freed
// after their forward even where units otherwise stay gathered from forward
// to backward: FSDP's SHARD_GRAD_OP and DeepSpeed's reuse distance. Kept, it
// would be gathered with the head at the step's peak.
TEST(DistLlamaUnits, EmbeddingsAreFreedAfterTheirForwardWhereUnitsWaitForBackward) {
  shardtrain::testing::run_on_ranks(2, [](RankContext& ctx) {
    const TrainedRun layers_only = train(fsdp_wrapping({"LlamaDecoderLayer"}), model_config(false), ctx);
    shardtrain::TrainingConfig shard_grad_op = fsdp_wrapping({"LlamaDecoderLayer", "Embedding", "Linear"});
    shard_grad_op.fsdp.sharding_strategy = shardtrain::ShardingStrategy::kShardGradOp;
    shardtrain::TrainingConfig zero3_keeping = zero3_freeing_after_forward();
    zero3_keeping.zero.stage3_max_reuse_distance = shardtrain::ZeroConfig::kDefaultMaxReuseDistance;
    for (const auto& [config, name] :
         {std::pair{shard_grad_op, "fsdp SHARD_GRAD_OP"}, std::pair{zero3_keeping, "zero-3 keeping by reuse distance"}}) {
      const TrainedRun run = train(config, model_config(false), ctx);
      EXPECT_TRUE(has_unit(run, "model.embed_tokens")) << name;
      // Every layer, the norm and the head stay gathered into backward: one
      // table with them is below both tables (see kVocab).
      EXPECT_LT(run.gathered_peak, 2 * kTableBytes) << name;
      EXPECT_EQ(run.gathered_between_steps, 0) << name;
      expect_same_training(run, layers_only, name);
    }
  });
}

TEST(DistLlamaUnits, TiedEmbeddingsStayInTheRootUnitAndTrainTheSame) {
  shardtrain::testing::run_on_ranks(2, [](RankContext& ctx) {
    const TrainedRun zero3 = train(zero3_freeing_after_forward(), model_config(true), ctx);
    shardtrain::testing::LogCapture log;
    const TrainedRun listed = train(fsdp_wrapping({"LlamaDecoderLayer", "Embedding"}), model_config(true), ctx);
    if (ctx.rank() == 0) {
      EXPECT_NE(log.text().find("names 'Embedding', whose parameters this model also uses outside it (tied "
                                "embeddings); they stay in the root unit"),
                std::string::npos)
          << log.text();
    }
    const TrainedRun layers_only = train(fsdp_wrapping({"LlamaDecoderLayer"}), model_config(true), ctx);
    // The head reads the embedding table after the last layer: a unit would
    // have freed it by then.
    for (const TrainedRun* run : {&zero3, &listed}) {
      EXPECT_FALSE(has_unit(*run, "model.embed_tokens"));
      EXPECT_TRUE(has_unit(*run, "model.layers.1"));
    }
    expect_same_training(zero3, layers_only, "zero-3, tied");
    expect_same_training(listed, layers_only, "fsdp listing Embedding, tied");
  });
}

TEST(DistLlamaUnits, ActivationCheckpointingRecomputesTheLayersButNotTheEdges) {
  shardtrain::testing::run_on_ranks(2, [](RankContext& ctx) {
    shardtrain::TrainingConfig zero3 = zero3_freeing_after_forward();
    zero3.gradient_checkpointing = true;
    shardtrain::TrainingConfig fsdp = fsdp_wrapping({"LlamaDecoderLayer", "Embedding", "Linear"});
    fsdp.fsdp.activation_checkpointing = true;
    const TrainedRun plain = train(fsdp_wrapping({"LlamaDecoderLayer"}), model_config(false), ctx);
    for (const auto& [config, name] : {std::pair{zero3, "zero-3"}, std::pair{fsdp, "fsdp"}}) {
      const TrainedRun run = train(config, model_config(false), ctx);
      EXPECT_TRUE(run.layer_recomputed) << name;
      EXPECT_FALSE(run.embeddings_recomputed) << name;
      EXPECT_FALSE(run.head_recomputed) << name;
      expect_same_training(run, plain, std::string(name) + " with activation checkpointing");
    }
  });
}

}  // namespace
