#pragma once
// The fields of one metrics-file line that every training program here
// writes alike (the fine-tune, train_tiny and its plain reference), so
// `shardtrain plot` and a diff read them all; each program adds its own
// token and memory fields.

#include <cstdint>

#include <nlohmann/json.hpp>

#include "shardtrain/accelerator.h"

namespace examples {

inline nlohmann::json step_metrics(int64_t step, double loss, const shardtrain::StepInfo& info) {
  // null where the step did not measure it (-1: precision_audit off, an fp16 overflow)
  auto fraction_or_null = [](double value) { return value >= 0 ? nlohmann::json(value) : nlohmann::json(); };
  return {{"step", step},
          {"loss", loss},
          {"lr", info.lr},
          {"grad_norm", info.grad_norm},
          {"loss_scale", info.loss_scale},
          {"skipped", info.skipped},
          {"non_finite_total", info.non_finite_total},
          {"lost_update_frac", fraction_or_null(info.lost_update_frac)},
          {"lost_update_frac_if_bf16", fraction_or_null(info.lost_update_frac_if_bf16)}};
}

}  // namespace examples
