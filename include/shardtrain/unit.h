#pragma once
/// @file unit.h
/// How a model marks its sharding units.
///
/// LibTorch's C++ modules have no forward hooks and forward() is not virtual,
/// so an engine cannot intercept an arbitrary module's call the way Python
/// FSDP and DeepSpeed do. Models cooperate instead: a module that may become a
/// sharding unit (a transformer block, a decoder layer) inherits shardtrain::Unit
/// next to torch::nn::Module, names its class, and runs its forward body
/// through run_unit(). With no engine attached run_unit() is a plain call.
///
///     struct TinyBlockImpl : torch::nn::Module, shardtrain::Unit {
///       TinyBlockImpl() : Unit("TinyBlock") { ... }
///       at::Tensor forward(const at::Tensor& x) {
///         return run_unit(x, [&](const at::Tensor& h) { return h + mlp(norm(h)); });
///       }
///     };
///
/// The Accelerate wrap policy (`fsdp_transformer_layer_cls_to_wrap: TinyBlock`)
/// selects units by this class name; parameters outside every selected unit
/// belong to the root unit, which the prepared model gathers around the whole
/// forward. A unit's kind (Unit::Kind) says what else the engine may do with it.

#include <functional>
#include <string>
#include <utility>

#include <ATen/core/Tensor.h>

namespace shardtrain {

class Unit;

/// The engine side of the protocol (implemented by the zero and fsdp engines).
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  /// Makes the unit's parameters usable (all-gather, wait for prefetch).
  virtual void before_unit_forward(Unit& unit) = 0;
  /// Receives the unit's input and output; may release parameters and attach
  /// backward hooks (to the output: the unit's backward is about to run; to
  /// the input: it has run). Returns the tensor the model continues with.
  virtual at::Tensor after_unit_forward(Unit& unit, const at::Tensor& input, at::Tensor output) = 0;
  /// Activation checkpointing: recompute this unit's forward during backward
  /// instead of keeping its activations.
  virtual bool recompute_in_backward(const Unit& unit) const {
    (void)unit;
    return false;
  }
  /// Runs body(input) so that backward runs it again (with the unit's
  /// parameters gathered) rather than keeping the activations it produced.
  virtual at::Tensor run_recomputed(Unit& unit, std::function<at::Tensor(const at::Tensor&)> body,
                                    const at::Tensor& input) {
    (void)unit;
    return body(input);
  }
};

class Unit {
 public:
  enum class Kind {
    /// A repeated block (a decoder layer): what activation checkpointing recomputes.
    kBlock,
    /// The embeddings or the output head: a unit so that it is gathered only
    /// while it is used, but never recomputed, as Accelerate's and Hugging
    /// Face's checkpointing recompute only the blocks (recomputing the head
    /// would repeat the model's largest GEMM to save one activation).
    kEdge,
    /// Its parameters are also used outside its forward (embeddings tied to
    /// the output head): never selected as a unit, so they stay in the root
    /// unit, gathered for the whole forward and backward.
    kShared,
  };

  explicit Unit(std::string class_name, Kind kind = Kind::kBlock)
      : unit_class_name_(std::move(class_name)), unit_kind_(kind) {}
  virtual ~Unit() = default;

  /// The name wrap policies match, e.g. "LlamaDecoderLayer".
  const std::string& unit_class_name() const { return unit_class_name_; }
  Kind unit_kind() const { return unit_kind_; }
  /// Whether the backward of this unit's forward reads its parameters'
  /// values. An embedding lookup's does not: its weight gradient is the
  /// output's gradient summed into the looked-up rows, and autograd keeps
  /// only the ids. Engines then free the parameters after the forward and
  /// do not gather them again for backward. Override only where the whole
  /// forward is such an operation.
  virtual bool backward_reads_parameters() const { return true; }

  /// Called by engines when they take over (nullptr detaches).
  void attach_unit_hooks(UnitHooks* hooks, int unit_index) {
    hooks_ = hooks;
    unit_index_ = unit_index;
  }
  UnitHooks* unit_hooks() const { return hooks_; }
  /// Index the engine gave this unit; -1 while detached.
  int unit_index() const { return unit_index_; }

 protected:
  /// Runs `body(input)` between the engine's hooks. Call it from forward().
  ///
  /// With activation checkpointing on, the engine calls `body` a second time
  /// during backward: the body must capture BY VALUE whatever else it reads
  /// (masks, position ids) — a reference to a local of forward() dangles by then.
  template <typename Body>
  at::Tensor run_unit(const at::Tensor& input, Body&& body) {
    if (hooks_ == nullptr) return body(input);
    hooks_->before_unit_forward(*this);
    at::Tensor output = hooks_->recompute_in_backward(*this)
                            ? hooks_->run_recomputed(*this, std::function<at::Tensor(const at::Tensor&)>(body), input)
                            : body(input);
    return hooks_->after_unit_forward(*this, input, std::move(output));
  }

 private:
  std::string unit_class_name_;
  Kind unit_kind_;
  UnitHooks* hooks_ = nullptr;
  int unit_index_ = -1;
};

}  // namespace shardtrain
