// Gathering units where they are needed: around each unit's forward and
// backward, with prefetch along the recorded unit order, and regathering
// after the optimizer step or a checkpoint load.

#include "engine/gather_scheduler.h"

#include <algorithm>

#include <ATen/ATen.h>

#include "engine/storage_resize.h"
#include "shardtrain/logging.h"
#include "torch_cuda.h"

namespace shardtrain::engine {

GatherScheduler::GatherScheduler(const EnginePlan& plan, const ShardGroups& groups, const UnitTable& units,
                                 const ShardStorage& storage)
    : plan_(plan), groups_(groups), units_(units), storage_(storage),
      slots_(static_cast<std::size_t>(units.size())) {}

void GatherScheduler::bind(int i, at::Tensor full, bool views_shard) {
  Slot& slot = slots_[static_cast<std::size_t>(i)];
  slot.full = std::move(full);
  slot.views_shard = views_shard;
}

void GatherScheduler::mark_gathered(int i) {
  Slot& slot = slots_[static_cast<std::size_t>(i)];
  slot.gathered = true;
  if (!slot.views_shard) add_live(full_bytes(i));
}

at::ScalarType GatherScheduler::full_dtype(int i) const {
  return units_[i].packed ? at::kByte : plan_.compute_dtype;
}

int64_t GatherScheduler::full_bytes(int i) const {
  return units_[i].layout->full_numel() * static_cast<int64_t>(c10::elementSize(full_dtype(i)));
}

bool GatherScheduler::frees_after_forward(int i) const {
  return plan_.reshard == Reshard::kAfterForward && !units_[i].persistent;
}

bool GatherScheduler::frees_after_backward(int i) const {
  return plan_.reshard != Reshard::kNever && !units_[i].persistent;
}

bool GatherScheduler::stays_gathered(int i) const {
  return plan_.reshard == Reshard::kNever || units_[i].persistent;
}

void GatherScheduler::add_live(int64_t delta) {
  live_bytes_ += delta;
  peak_bytes_ = std::max(peak_bytes_, live_bytes_);
}

comm::WorkPtr GatherScheduler::gather_pieces(const UnitLayout& layout, const at::Tensor& shard,
                                             const at::Tensor& target) const {
  comm::Communicator& comm = groups_.shard();
  const int W = comm.world_size();
  std::vector<at::Tensor> outputs, inputs;
  for (const auto& piece : layout.pieces()) {
    outputs.push_back(target.narrow(0, piece.full_offset, W * piece.chunk));
    inputs.push_back(shard.narrow(0, piece.shard_offset, piece.chunk));
  }
  return comm.all_gather_coalesced_async(outputs, inputs);
}

void GatherScheduler::start(int i) {
  Slot& slot = slots_[static_cast<std::size_t>(i)];
  if (slot.gathered || slot.work || slot.views_shard) return;
  const UnitEntry& u = units_[i];
  const at::Tensor& lp = storage_.unit(i).lp;
  comm::CollectiveScope scope("gather " + u.label());
  // A buffer kept between steps (regather_after_step) still has its storage;
  // resizing it anyway would allocate and copy the whole buffer.
  if (slot.full.storage().nbytes() != static_cast<std::size_t>(full_bytes(i))) {
    pace_gather();
    engine::resize_storage_bytes(slot.full, static_cast<std::size_t>(full_bytes(i)));
  }
  add_live(full_bytes(i));
  if (!plan_.shard_params) {
    slot.staging = lp;  // complete on every rank already; only its dtype differs
    slot.work = comm::completed_work();
    return;
  }
  // What crosses the wire: the full buffer in the shard's dtype.
  const int64_t wire_bytes = u.layout->full_numel() * static_cast<int64_t>(lp.element_size());
  traffic_.param_gather_bytes += wire_bytes;
  if (!u.trainable) traffic_.frozen_gather_bytes += wire_bytes;
  const at::TensorOptions wire_options = slot.full.options().dtype(lp.scalar_type());
  at::Tensor sent = lp;
  if (storage_.params_offloaded()) {
    // The shard lives in host memory: up to the device first. From pinned
    // memory (pageable with pin_memory: false, where the copy returns once the
    // driver has staged it) the copy is queued on the current stream, which the collective
    // waits for; whatever next writes the host values (the optimizer step, a
    // checkpoint load) calls wait_for_uploads() first, which waits for every
    // stream an upload was queued on: a backward hook's gather runs on
    // autograd's thread, whose current stream need not be the caller's.
    slot.upload = at::empty({lp.numel()}, wire_options).copy_(lp, /*non_blocking=*/true);
    if (slot.upload.is_cuda()) {
      void* stream = torch_cuda::current_cuda_stream(slot.upload.device().index());
      if (std::find(upload_streams_.begin(), upload_streams_.end(), stream) == upload_streams_.end()) {
        upload_streams_.push_back(stream);
      }
    }
    add_live(bytes_of(slot.upload));
    sent = slot.upload;
  }
  at::Tensor target = slot.full;
  if (lp.scalar_type() != full_dtype(i)) {
    // fp16 on a CPU computes in fp32: gathered in fp16, then widened.
    slot.staging = at::empty({u.layout->full_numel()}, wire_options);
    add_live(bytes_of(slot.staging));
    target = slot.staging;
  }
  slot.work = gather_pieces(*u.layout, sent, target);
}

void GatherScheduler::finish(int i) {
  Slot& slot = slots_[static_cast<std::size_t>(i)];
  if (slot.gathered) return;
  if (!slot.work) start(i);
  slot.work->wait();
  slot.work.reset();
  if (slot.upload.defined()) {
    add_live(-bytes_of(slot.upload));
    slot.upload = at::Tensor();
  }
  if (slot.staging.defined()) {
    slot.full.copy_(slot.staging);  // the same layout, the compute dtype
    if (plan_.shard_params) add_live(-bytes_of(slot.staging));
    slot.staging = at::Tensor();
  }
  slot.gathered = true;
}

void GatherScheduler::pace_gather() {
  if (!plan_.limit_all_gathers || releases_.size() < 2) return;
  releases_.front().wait();
  releases_.pop_front();
  ++traffic_.paced_gathers;
}

bool GatherScheduler::release(int i) {
  Slot& slot = slots_[static_cast<std::size_t>(i)];
  // A prefetch nothing consumed (a no-grad forward that stopped early, a
  // unit with no backward) is waited for, or it would land after this with
  // values an optimizer step may since have changed. It waits only on a
  // gather this rank issued, as every rank did: the decisions that issue
  // gathers are the same on every rank.
  if (slot.work) finish(i);
  if (!slot.gathered || slot.views_shard) return false;
  engine::resize_storage_bytes(slot.full, 0);
  add_live(-full_bytes(i));
  slot.gathered = false;
  return true;
}

void GatherScheduler::gather_unit(const Unit& unit) {
  for (int idx : units_.entries_of(unit)) start(idx);
  for (int idx : units_.entries_of(unit)) finish(idx);
}

void GatherScheduler::release_unit(const Unit& unit, bool after_forward) {
  bool freed = false;
  for (int idx : units_.entries_of(unit)) {
    if (after_forward ? frees_after_forward(idx) : frees_after_backward(idx)) freed = release(idx) || freed;
  }
  if (!freed || !plan_.limit_all_gathers) return;
  // The device's free of this unit comes after the work queued on this
  // thread's stream so far (a CPU's came when release returned).
  const at::Device device = storage_.fp32_options().device();
  releases_.push_back(device.is_cuda() ? torch_cuda::CudaStreamMark::now_on(
                                             device.index(), torch_cuda::current_cuda_stream(device.index()))
                                       : torch_cuda::CudaStreamMark());
  if (releases_.size() > 2) releases_.pop_front();  // only the last two are ever waited for
}

void GatherScheduler::gather_root() {
  for (int i = 0; i < units_.size(); ++i) {
    if (units_[i].unit == nullptr) start(i);
  }
  for (int i = 0; i < units_.size(); ++i) {
    if (units_[i].unit == nullptr) finish(i);
  }
}

void GatherScheduler::release_after_backward() {
  awaiting_backward_.clear();
  for (int i = 0; i < units_.size(); ++i) {
    if (frees_after_backward(i)) release(i);
  }
}

bool GatherScheduler::gathered_or_pending(const Unit& unit) const {
  for (int idx : units_.entries_of(unit)) {
    const Slot& slot = slots_[static_cast<std::size_t>(idx)];
    if (!slot.gathered && !slot.work) return false;
  }
  return true;
}

void GatherScheduler::prefetch_from(const std::vector<const Unit*>& order, std::size_t first,
                                    int64_t window_elements) {
  if (plan_.reshard != Reshard::kAfterForward && plan_.reshard != Reshard::kAfterBackward) return;
  if (window_elements <= 0 || !units_.trace_valid()) return;
  int64_t live = 0;
  for (int i = 0; i < units_.size(); ++i) {
    const Slot& slot = slots_[static_cast<std::size_t>(i)];
    if (slot.gathered || slot.work) live += units_[i].layout->total_param_numel();
  }
  int64_t window = 0;
  int units_ahead = 0;
  for (std::size_t k = first; k < order.size() && units_ahead < plan_.max_prefetch_units; ++k) {
    const int64_t n = units_.unit_numel(*order[k]);
    if (window + n > window_elements || live + n > plan_.max_live_parameters) break;
    window += n;
    ++units_ahead;
    if (gathered_or_pending(*order[k])) continue;
    for (int idx : units_.entries_of(*order[k])) start(idx);
    live += n;
  }
}

void GatherScheduler::prefetch_for_backward(const Unit* current) {
  // Backward runs the forward's units in reverse, except those whose output
  // needed no gradient: a frozen unit fed by no gradient (the embeddings under
  // LoRA) has no backward, and gathering it would be traffic for nothing.
  const auto& order = units_.forward_order();
  std::vector<const Unit*> reversed;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    if (*it == current || awaiting_backward_.count(*it) != 0) reversed.push_back(*it);
  }
  std::size_t next = 0;  // no unit's backward yet: the first one backward runs
  if (current != nullptr) {
    auto where = std::find(reversed.begin(), reversed.end(), current);
    if (where == reversed.end()) return;
    next = static_cast<std::size_t>(where - reversed.begin()) + 1;
  }
  if (next >= reversed.size()) return;
  // Backward prefetch gathers exactly the next unit, as FSDP does.
  prefetch_from(reversed, next, units_.unit_numel(*reversed[next]));
}

void GatherScheduler::regather_after_step() {
  // Issued in the order the next forward uses them (the root first: the
  // forward's start waits for it; then the units as the last forward ran
  // them) and not waited for: each unit's forward waits for its own gather
  // (gather_unit), so the all-gather runs under the forward instead of after
  // the step. Gloo runs a communicator's collectives in the order they were
  // issued, so the first unit's gather is not queued behind the last one's.
  // Each entry once: a unit the forward runs twice is in the trace twice.
  std::vector<int> order;
  std::vector<bool> listed(static_cast<std::size_t>(units_.size()), false);
  auto add = [&](int i) {
    if (!listed[static_cast<std::size_t>(i)]) order.push_back(i);
    listed[static_cast<std::size_t>(i)] = true;
  };
  for (int i = 0; i < units_.size(); ++i) {
    if (units_[i].unit == nullptr) add(i);
  }
  for (const Unit* unit : units_.forward_order()) {
    for (int idx : units_.entries_of(*unit)) add(idx);
  }
  for (int i = 0; i < units_.size(); ++i) add(i);  // units the recorded forward did not run, last
  for (int i : order) {
    const UnitEntry& u = units_[i];
    if (!u.trainable || views_shard(i)) continue;  // a shard view already holds the stepped values
    // Gathered on demand by the next forward. Released here too: a no-grad
    // forward after the last backward left it gathered with pre-step values.
    if (!stays_gathered(i)) {
      release(i);
      continue;
    }
    // Kept gathered: the stepped values land in the buffer the parameters
    // already view. Not freed and allocated again: on a CPU that is a fresh,
    // zero-filled allocation of the whole model every step.
    Slot& slot = slots_[static_cast<std::size_t>(i)];
    if (slot.work) finish(i);
    if (slot.gathered) {
      slot.gathered = false;
      add_live(-full_bytes(i));
    }
    start(i);
  }
}

void GatherScheduler::finish_in_flight() {
  for (int i = 0; i < units_.size(); ++i) {
    if (slots_[static_cast<std::size_t>(i)].work) finish(i);
  }
}

int GatherScheduler::in_flight() const {
  return static_cast<int>(std::count_if(slots_.begin(), slots_.end(), [](const Slot& s) { return s.work != nullptr; }));
}

void GatherScheduler::release_all() {
  for (int i = 0; i < units_.size(); ++i) release(i);
}

void GatherScheduler::wait_for_uploads() {
  // A CPU "upload" (the offload forced on the CPU in tests) is a plain copy, done when it returns.
  const at::Device device = storage_.fp32_options().device();
  for (void* stream : upload_streams_) torch_cuda::synchronize_cuda_stream(device.index(), stream);
  upload_streams_.clear();
}

void GatherScheduler::gather_kept() {
  for (int i = 0; i < units_.size(); ++i) {
    if (stays_gathered(i)) start(i);
  }
  finish_in_flight();
}

void GatherScheduler::settle_in_flight(const std::string& engine_name) noexcept {
  for (int i = 0; i < units_.size(); ++i) {
    const comm::WorkPtr& work = slots_[static_cast<std::size_t>(i)].work;
    if (!work) continue;
    try {
      work->wait();
    } catch (const std::exception& e) {
      ST_LOG_WARN("{}: the gather of {} still in flight at shutdown failed: {}", engine_name, units_[i].label(),
                  e.what());
    }
  }
  // An upload still reading an offloaded shard (a prefetch no forward
  // consumed) must end before the host partition is freed; the queued
  // collectives it waits behind are bounded by the communicator's timeout.
  try {
    wait_for_uploads();
  } catch (const std::exception& e) {
    ST_LOG_WARN("{}: waiting for the uploads still in flight at shutdown failed: {}", engine_name, e.what());
  }
}

}  // namespace shardtrain::engine
