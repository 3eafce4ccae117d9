#pragma once
/// @file accelerator.h
/// The front end users train with, modelled on Hugging Face Accelerate:
///
///     shardtrain::Accelerator accelerator;                 // config + ranks from the launcher
///     shardtrain::RunInfo run;                             // what "auto" config values resolve from
///     run.hidden_size = 64;
///     run.micro_batch_size = 8;
///     auto model = accelerator.prepare(MyModel(...), {}, run);
///     accelerator.prepare_scheduler(total_steps);
///     for (...) {
///       at::Tensor loss = compute_loss(model(x), y);
///       accelerator.backward(loss);
///       if (accelerator.sync_gradients()) accelerator.clip_grad_norm(1.0);
///       accelerator.step();                                  // optimizer + scheduler
///       accelerator.zero_grad();
///     }
///
/// The engine (zero stages 0-3, or fsdp) is chosen by the config's
/// distributed_type; the optimizer is engine-owned because it steps the
/// sharded FP32 master. At prepare time rank 0 prints the precision plan.

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/comm/rendezvous.h"
#include "shardtrain/config.h"
#include "shardtrain/lora.h"
#include "shardtrain/step_report.h"
#include "shardtrain/data.h"
#include "shardtrain/precision_plan.h"
#include "shardtrain/weight_loading.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace shardtrain {

namespace engine {
class Engine;
}  // namespace engine
class LRScheduler;

struct AcceleratorInternals;

struct AcceleratorOptions {
  /// Config file (Accelerate YAML or DeepSpeed JSON). Unset: the launcher's
  /// environment (SHARDTRAIN_CONFIG_FILE, ...), else a plain run.
  std::optional<std::string> config_path;
  /// A config built in code (wins over config_path).
  std::optional<TrainingConfig> config;
  /// Overrides mixed_precision ("no", "fp16", "bf16").
  std::optional<std::string> mixed_precision;
  std::optional<int64_t> gradient_accumulation_steps;
  InitOptions init;
  /// save_state keeps at most this many checkpoints in a directory (0: all), as Accelerate's total_limit.
  int checkpoint_total_limit = 0;
  /// Rank 0 prints the precision plan at prepare(); off for programs that
  /// prepare many models in one process (benchmarks, tests).
  bool print_plan = true;
  /// Use this communicator instead of connecting from the environment (tests, embedding).
  comm::CommunicatorPtr communicator;
};

/// What the loss given to Accelerator::backward is a mean over.
enum class LossNormalization {
  /// This rank's mean over its micro-batch (Accelerate's convention):
  /// backward divides it by the accumulation steps and the engine averages
  /// gradients over ranks, so every micro-batch of every rank weighs the
  /// same whatever its number of loss tokens. A step's update then depends
  /// on how the global batch is split over ranks and accumulation steps.
  kPerRankMean,
  /// This micro-batch's summed token losses divided by the loss tokens of the
  /// whole accumulation window on all ranks (sum_over_processes), as the
  /// Transformers Trainer's num_items_in_batch: backward multiplies it by the
  /// world size (undoing the engine's mean over ranks) and does not divide by
  /// the accumulation steps, so the update is the mean over the global
  /// batch's tokens, the same at any world size and accumulation split.
  kGlobalTokens,
};

/// Facts about the run that "auto" config values and the precision plan need.
struct RunInfo {
  std::optional<int64_t> hidden_size;       ///< H for reduce_bucket_size = H^2 etc.
  std::optional<int64_t> micro_batch_size;  ///< the data loader's batch size
  std::optional<int64_t> total_steps;       ///< optimizer steps (scheduler "auto")
  std::optional<int64_t> warmup_steps;      ///< scheduler warmup_num_steps "auto" (else 0)
  std::optional<double> max_grad_norm;      ///< gradient_clipping "auto" (else 1.0)
  std::string load_dtype = "fp32";
  /// The run's seed (data order, initialisation): prepare() stops the job
  /// when ranks were given different ones. Unset: not checked.
  std::optional<uint64_t> seed;
  /// Fills the shards of parameters the program built without storage
  /// (release_parameter_storage; see materialize_full_weights()), each rank
  /// reading only its own slices, e.g. models::hf_weight_source. Unset: those
  /// shards come from rank 0, which must then hold the weights.
  WeightSource weight_source;
};

/// Optimizer settings given in code; unset fields come from the config's optimizer block.
struct OptimizerOptions {
  std::optional<std::string> type;  ///< AdamW | Adam | SGD
  std::optional<double> lr, weight_decay, eps, momentum;
  std::optional<std::array<double, 2>> betas;
  /// Escape hatch: any torch::optim optimizer over the fp32 master shards.
  /// save_state keeps its state per rank; load_state restores it at the
  /// same world size and wrapping, and elsewhere (it cannot be resharded)
  /// starts it fresh with a warning while the model loads.
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)> custom_factory;
};

class Accelerator;

/// A model whose forward runs the engine's hooks around the module's forward.
template <typename ModuleHolder>
class PreparedModel {
 public:
  PreparedModel(ModuleHolder module, Accelerator* accelerator) : module_(std::move(module)), accelerator_(accelerator) {}
  template <typename... Args>
  at::Tensor operator()(Args&&... args);
  /// The module, with its parameters complete: waits for the gathers step()
  /// left in flight (Accelerator::step()).
  ModuleHolder& module();
  ModuleHolder& operator->() { return module(); }
  /// Runs `f(module())` — any forward of the module other than forward(),
  /// e.g. a KV-cached one — between the engine's begin_forward/end_forward,
  /// as operator() does, so parameters outside the units (the root unit: the
  /// final norm, and the embeddings and LM head unless they are units) are
  /// gathered around it:
  ///     at::Tensor logits = prepared.run([&](auto& m) { return m->forward_cached(ids, cache); });
  /// Collective under ZeRO-3 / FSDP: every rank must make the same calls.
  /// Under torch::NoGradGuard the engine attaches no backward hooks (the units
  /// release their parameters after their forward as usual).
  template <typename F>
  at::Tensor run(F&& f);

 private:
  ModuleHolder module_;
  Accelerator* accelerator_;
};

class Accelerator {
 public:
  explicit Accelerator(AcceleratorOptions options = {});
  ~Accelerator();
  Accelerator(const Accelerator&) = delete;
  Accelerator& operator=(const Accelerator&) = delete;

  // ---- processes
  /// This process's rank in the job (RANK), its rank on this machine
  /// (LOCAL_RANK) and the job's size (WORLD_SIZE), as Accelerate's
  /// process_index, local_process_index and num_processes.
  int process_index() const;
  int local_process_index() const;
  int num_processes() const;
  bool is_main_process() const { return process_index() == 0; }
  bool is_local_main_process() const { return local_process_index() == 0; }
  /// The job's collectives (comm/communicator.h), for a program's own
  /// all-reduces and barriers; every rank must make the same calls.
  comm::Communicator& communicator();
  /// Where this process computes: the communicator's device (cuda:LOCAL_RANK
  /// under nccl, cpu under gloo). Put the model and the batches here before
  /// prepare(), as with Accelerate's accelerator.device.
  at::Device device() const;
  /// The resolved config (after prepare(); before it, as read).
  const TrainingConfig& config() const;

  // ---- prepare
  /// Takes over a model (a TORCH_MODULE holder): shards it per the config and
  /// creates the engine-owned optimizer. Call once.
  template <typename ModuleHolder>
  PreparedModel<ModuleHolder> prepare(ModuleHolder module, const OptimizerOptions& optimizer = {},
                                      const RunInfo& run = {}) {
    prepare_module(module.ptr(), optimizer, run);
    return PreparedModel<ModuleHolder>(std::move(module), this);
  }
  /// The non-template form.
  void prepare_module(std::shared_ptr<torch::nn::Module> module, const OptimizerOptions& optimizer,
                      const RunInfo& run);
  /// LR schedule from the config's scheduler block (or `override`), over `total_steps`.
  void prepare_scheduler(int64_t total_steps, std::optional<SchedulerConfig> override_config = std::nullopt);
  /// This rank's distinct, seed-determined slice of a dataset of `dataset_size`
  /// items. The Accelerator owns it: save_state stores its epoch and position
  /// and load_state restores them, so a resumed run continues at the exact sample.
  DistributedSampler& prepare_sampler(int64_t dataset_size, uint64_t seed, bool shuffle = true,
                                      bool drop_last = false);
  /// Which dtype each stage uses and the bytes per parameter each rank holds,
  /// resolved at prepare() (precision_plan.h); rank 0 prints it then.
  const PrecisionPlan& precision_plan() const;
  /// Whether this rank should build the model with its weights (and load
  /// them). False on ranks other than 0 under fsdp_cpu_ram_efficient_loading
  /// or ZeRO-3's zero3_init_flag: build the model with
  /// release_parameter_storage() there (shardtrain/weight_loading.h) and
  /// prepare() sends each rank its shard from rank 0, so only rank 0 ever
  /// holds the full weights.
  bool materialize_full_weights() const;

  // ---- training step
  /// Backward with loss scaling (fp16) and division by the accumulation steps.
  void backward(const at::Tensor& loss);
  /// Backward of a loss normalised as `normalization` says (see LossNormalization).
  void backward(const at::Tensor& loss, LossNormalization normalization);
  /// Sum over all processes of `local_count` (collective): the global number
  /// of loss tokens of an accumulation window, the denominator of
  /// LossNormalization::kGlobalTokens.
  int64_t sum_over_processes(int64_t local_count);
  /// True when the next step() applies the optimizer (end of an accumulation window).
  bool sync_gradients() const;
  /// The next backward() ends the accumulation window even when it holds
  /// fewer than gradient_accumulation_steps micro-batches: call it before the
  /// last micro-batch of the data, so that its step() applies the short
  /// window's update instead of carrying its gradients into the next epoch
  /// (or dropping them at the end of training). As Accelerate syncs at the
  /// end of a dataloader, each micro-batch's loss is still divided by
  /// gradient_accumulation_steps under kPerRankMean; under kGlobalTokens the
  /// window's own token count normalises it (the Trainer's num_items_in_batch).
  void end_accumulation_early();
  int64_t gradient_accumulation_steps() const;
  /// Global gradient norm over the sharded gradients (fp64), clipping to
  /// max_norm at the next step(); only at an accumulation boundary. Returns the norm.
  double clip_grad_norm(double max_norm);
  /// Optimizer + scheduler step at an accumulation boundary; otherwise a no-op.
  /// ZeRO-1/2 all-gather the stepped parameters. With overlap_comm on
  /// (DeepSpeed's default is off for these stages) the gathers run under the
  /// next forward, each unit's forward waiting for its own: read the
  /// parameters through PreparedModel::module() or operator->, which wait for
  /// the rest first, not through another handle to the module kept from
  /// before prepare(). With it off, step() returns with them complete. The
  /// parameters other engines keep whole (ZeRO-3's persisted ones, FSDP
  /// NO_SHARD units that do not alias their shard) follow the first rule;
  /// FSDP always overlaps.
  void step();
  /// Clears the gradients, as optimizer.zero_grad() in an Accelerate loop:
  /// at an accumulation boundary or before a window's first backward; inside
  /// a window it keeps the gradients accumulated so far (as Accelerate's
  /// accumulate() does).
  void zero_grad();
  /// The learning rate the next optimizer update uses (the scheduler's, else the optimizer's).
  double current_lr() const;
  /// What the last step() did: its number, whether it updated or skipped
  /// (fp16 overflow), the loss scale and the gradient norm (step_report.h).
  const StepInfo& last_step() const;

  // ---- collectives for metrics
  /// Concatenates every rank's tensor along dim 0 (same shape on every rank).
  /// Tensors on another device than device() travel there for the
  /// collective; the result comes back on the input's device.
  at::Tensor gather_for_metrics(const at::Tensor& tensor);
  /// All-reduces a copy ("sum", "mean" or "max"), with gather_for_metrics's device rule.
  at::Tensor reduce(const at::Tensor& tensor, const std::string& op = "mean");
  /// A barrier over every rank (with the collective timeout).
  void wait_for_everyone();
  /// Prints on the main process only.
  void print(const std::string& text) const;

  // ---- checkpoints (both engines, any world size; docs/checkpoints.md)
  /// Saves the run's whole state under DIR/TAG (TAG empty: "step_<N>", N the
  /// steps taken, fp16-skipped ones included, as DeepSpeed's global_step) and
  /// points DIR/latest at it once it is complete. Collective. Returns DIR/TAG.
  /// Call it after step() (not inside an accumulation window: that throws).
  /// A save that fails on any rank (disk full, EACCES, a write error) fails
  /// on all of them after removing what it wrote, leaving `latest` and the
  /// training state as they were; then with checkpoint_on_error: continue
  /// (the default) every rank warns and it returns "" (the next save tries
  /// again), with checkpoint_on_error: stop it throws CheckpointSaveError.
  std::string save_state(const std::string& dir, const std::string& tag = "");
  /// Restores the state under DIR/TAG (empty: the tag DIR/latest names), saved
  /// by either engine at any world size. Collective. Damaged or mismatched
  /// checkpoints throw before anything is changed.
  void load_state(const std::string& dir, const std::string& tag = "");
  /// Writes a consolidated Hugging Face weights directory (model.safetensors,
  /// or shards of at most `max_shard_bytes` with model.safetensors.index.json;
  /// `config_json`, a model config.json, written as config.json with its
  /// torch_dtype set to the weights' dtype when given). dtype "auto": what
  /// Accelerate's save_model writes, the training's 16-bit dtype under
  /// DeepSpeed (at stage 3 with zero3_save_16bit_model /
  /// stage3_gather_16bit_weights_on_model_save only) and under FSDP's pure low
  /// precision, else fp32 (the master). Streams from the live shards: the ranks gather one unit at a
  /// time and rank 0 writes each parameter as it arrives, so no rank holds
  /// the whole model and nothing but the export is written to disk (no
  /// optimizer state). A failure (a full disk) throws CheckpointSaveError on
  /// every rank and leaves no partial export. Collective.
  /// A model with LoRA adapters (lora.h) is exported merged, as PEFT's
  /// merge_and_unload: each adapted weight is W + scaling * B @ A and no
  /// adapter tensor is written, so transformers loads it as a plain model.
  void save_model(const std::string& out_dir, const std::string& dtype = "auto",
                  uint64_t max_shard_bytes = 5000000000ULL, const std::string& config_json = "");
  /// Writes the LoRA adapter as PEFT saves one: adapter_model.safetensors
  /// (the trainable parameters, fp32, under PEFT's keys) and
  /// adapter_config.json from `config`, through the same crash-safe path as
  /// save_model (a temporary directory published whole). Collective.
  void save_lora_adapter(const std::string& out_dir, const LoraConfig& config);
  /// Integers stored with the checkpoint for the training loop (data position, epoch, ...).
  std::map<std::string, int64_t>& checkpoint_extras();

  // ---- state
  /// Every parameter's full fp32 value by name (a quantized weight: its NF4
  /// bytes), and the buffers; collective; rank 0 gets all, so do others. In
  /// host memory whatever the device, as Accelerate's FSDP state dict
  /// (offload_to_cpu): a GPU holds one unit's full values at a time. A model
  /// too big for every rank's host memory is written with save_model, which
  /// streams from the shards.
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict();
  /// The bytes this rank's engine holds, by kind (parameter shards,
  /// gradients, master, optimizer state, gathered buffers, their peaks since
  /// reset_memory_peaks()); step_report.h.
  MemoryReport memory() const;
  void reset_memory_peaks();
  /// Parameter bytes all-gathered since the last reset_traffic() (zero before prepare()).
  TrafficReport traffic() const;
  void reset_traffic();

 private:
  // The forward's frame, which only PreparedModel opens and closes.
  template <typename ModuleHolder>
  friend class PreparedModel;
  void begin_forward();
  at::Tensor end_forward(at::Tensor output);
  /// Waits for the parameter gathers step() left in flight (see step()).
  void complete_parameters();

  // The engine is not part of the installed API; shardtrain's own tests reach
  // it through src/accelerator_internals.h.
  friend struct AcceleratorInternals;
  engine::Engine& engine();

  struct State;
  std::unique_ptr<State> state_;
};

template <typename ModuleHolder>
template <typename... Args>
at::Tensor PreparedModel<ModuleHolder>::operator()(Args&&... args) {
  accelerator_->begin_forward();
  at::Tensor output = module_->forward(std::forward<Args>(args)...);
  return accelerator_->end_forward(std::move(output));
}

template <typename ModuleHolder>
ModuleHolder& PreparedModel<ModuleHolder>::module() {
  accelerator_->complete_parameters();
  return module_;
}

template <typename ModuleHolder>
template <typename F>
at::Tensor PreparedModel<ModuleHolder>::run(F&& f) {
  accelerator_->begin_forward();
  at::Tensor output = std::forward<F>(f)(module_);
  return accelerator_->end_forward(std::move(output));
}

/// Peak resident set size of this process (VmHWM), bytes.
int64_t peak_rss_bytes();

}  // namespace shardtrain
