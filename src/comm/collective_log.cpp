// Hang forensics: the ring of recent collectives and the cross-rank report
// (see collective_log.h).

#include "comm/collective_log.h"

#include <algorithm>
#include <sstream>
#include <thread>

#include <c10/core/ScalarType.h>

#include "comm/work_util.h"
#include "shardtrain/error.h"

namespace shardtrain::comm {
namespace {

thread_local std::vector<std::string> scope_stack;
/// The joined chain, rebuilt when a scope opens or closes, so that logging a
/// collective copies one string instead of joining on every call.
thread_local std::string scope_chain;

void rebuild_chain() {
  scope_chain.clear();
  for (const auto& scope : scope_stack) {
    if (!scope_chain.empty()) scope_chain += " > ";
    scope_chain += scope;
  }
}

/// Tabs and newlines would break the line format; nothing else is special.
std::string flatten(const std::string& text) {
  std::string out = text;
  std::replace_if(out.begin(), out.end(), [](char c) { return c == '\t' || c == '\n' || c == '\r'; }, ' ');
  return out;
}

std::string op_name(const CollectiveEvent& event) {
  std::string name = event.op;
  if (event.op == "all_reduce" || event.op == "reduce_scatter") name += std::string("(") + to_string(event.reduce) + ")";
  if (event.op == "broadcast") name += "(root " + std::to_string(event.root) + ")";
  return name;
}

std::string rank_name(int rank, const std::vector<int>& global_ranks) {
  std::string name = "rank " + std::to_string(rank);
  if (rank < static_cast<int>(global_ranks.size()) && global_ranks[rank] != rank) {
    name += " (global " + std::to_string(global_ranks[rank]) + ")";
  }
  return name;
}

}  // namespace

CollectiveScope::CollectiveScope(std::string what) {
  scope_stack.push_back(std::move(what));
  rebuild_chain();
}

CollectiveScope::~CollectiveScope() {
  scope_stack.pop_back();
  rebuild_chain();
}

std::string CollectiveScope::current() { return scope_chain; }

std::string LoggedCollective::describe() const {
  std::string text = context.empty() ? "" : context + " > ";
  text += op;
  if (op != "barrier") {
    text += "(" + dtype + ", " + std::to_string(input_numel) + " -> " + std::to_string(output_numel) + ")";
  }
  return text;
}

std::string serialize_log(const std::vector<LoggedCollective>& entries) {
  std::ostringstream out;
  for (const auto& e : entries) {
    out << e.seq << '\t' << e.op << '\t' << e.dtype << '\t' << e.input_numel << '\t' << e.output_numel << '\t'
        << flatten(e.context) << '\n';
  }
  return out.str();
}

std::vector<LoggedCollective> parse_log(const std::string& text) {
  std::vector<LoggedCollective> entries;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    std::vector<std::string> fields;
    std::size_t start = 0;
    while (fields.size() < 5) {
      const std::size_t tab = line.find('\t', start);
      if (tab == std::string::npos) break;
      fields.push_back(line.substr(start, tab - start));
      start = tab + 1;
    }
    if (fields.size() != 5) continue;  // not one of ours: skip rather than guess
    LoggedCollective e;
    try {
      e.seq = std::stoll(fields[0]);
      e.input_numel = std::stoll(fields[3]);
      e.output_numel = std::stoll(fields[4]);
    } catch (const std::exception&) {
      continue;
    }
    e.op = fields[1];
    e.dtype = fields[2];
    e.context = line.substr(start);
    entries.push_back(std::move(e));
  }
  return entries;
}

std::string diagnose_hang(const RankLogs& logs, const std::vector<int>& global_ranks,
                          std::chrono::milliseconds answer_window) {
  const int world = static_cast<int>(global_ranks.size());
  std::ostringstream out;
  out << "hang report (recent collectives of the group's " << world << " ranks, compared over the store):";
  std::vector<int> missing;
  for (int r = 0; r < world; ++r) {
    if (!logs.count(r)) missing.push_back(r);
  }
  // Divergence: the first sequence number that every answering rank still
  // holds and where their calls differ.
  int64_t low = -1, high = INT64_MAX;
  std::map<int, std::map<int64_t, const LoggedCollective*>> by_seq;
  for (const auto& [rank, entries] : logs) {
    if (entries.empty()) {
      high = -1;
      continue;
    }
    low = std::max(low, entries.front().seq);
    high = std::min(high, entries.back().seq);
    for (const auto& e : entries) by_seq[rank][e.seq] = &e;
  }
  bool diverged = false;
  for (int64_t seq = std::max<int64_t>(low, 0); seq <= high && !diverged && logs.size() > 1; ++seq) {
    const LoggedCollective* first = nullptr;
    bool differs = false;
    for (const auto& [rank, entries] : by_seq) {
      auto found = entries.find(seq);
      if (found == entries.end()) continue;
      if (first == nullptr) {
        first = found->second;
      } else if (!first->same_call(*found->second)) {
        differs = true;
      }
    }
    if (!differs) continue;
    diverged = true;
    out << "\n  the ranks diverge at seq " << seq << ":";
    bool lead = true;
    for (const auto& [rank, entries] : by_seq) {
      out << (lead ? " " : ", ") << rank_name(rank, global_ranks) << (lead ? " is in " : " in ")
          << entries.at(seq)->describe();
      lead = false;
    }
  }
  // Where each rank is now: its last collective, the one it is blocked in.
  int64_t furthest = -1;
  for (const auto& [rank, entries] : logs) {
    if (!entries.empty()) furthest = std::max(furthest, entries.back().seq);
  }
  out << "\n  latest:";
  bool lead = true;
  for (const auto& [rank, entries] : logs) {
    out << (lead ? " " : "; ") << rank_name(rank, global_ranks);
    lead = false;
    if (entries.empty()) {
      out << " has issued no collective";
    } else {
      out << " at seq " << entries.back().seq << ", " << entries.back().describe();
    }
  }
  for (const auto& [rank, entries] : logs) {
    const int64_t last = entries.empty() ? -1 : entries.back().seq;
    if (last < furthest) {
      out << "\n  " << rank_name(rank, global_ranks) << " is behind: " << furthest - last
          << " collective(s) fewer than the furthest rank";
    }
  }
  if (!diverged && logs.size() > 1 && low > high) {
    out << "\n  the logs do not overlap (the ranks are more than " << CollectiveLog::kCapacity
        << " collectives apart), so the divergence is older than they reach";
  } else if (!diverged && logs.size() > 1) {
    out << "\n  no divergence in the logged window: every answering rank issued the same calls";
  }
  for (int r : missing) {
    out << "\n  " << rank_name(r, global_ranks) << " is missing: it sent no log within " << answer_window.count()
        << " ms (it died, or it is busy outside any collective: a rank-dependent branch, a long computation, a hang "
           "in user code)";
  }
  return out.str();
}

CollectiveLog::CollectiveLog(int rank, std::vector<int> global_ranks)
    : rank_(rank), global_ranks_(std::move(global_ranks)), events_(kCapacity), contexts_(kCapacity) {}

int64_t CollectiveLog::record(const CollectiveEvent& event) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t seq = next_seq_++;
  const std::size_t slot = static_cast<std::size_t>(seq % kCapacity);
  events_[slot] = event;
  events_[slot].seq = seq;
  contexts_[slot].assign(scope_chain);  // reuses the slot's capacity: no allocation once warm
  return seq;
}

std::vector<LoggedCollective> CollectiveLog::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<LoggedCollective> entries;
  const int64_t first = std::max<int64_t>(0, next_seq_ - kCapacity);
  for (int64_t seq = first; seq < next_seq_; ++seq) {
    const std::size_t slot = static_cast<std::size_t>(seq % kCapacity);
    const CollectiveEvent& e = events_[slot];
    entries.push_back({seq, op_name(e), c10::toString(e.dtype), e.input_numel, e.output_numel, contexts_[slot]});
  }
  return entries;
}

void CollectiveLog::attach_store(comm::StorePtr store, std::string key_prefix, std::chrono::milliseconds timeout) {
  store_ = std::move(store);
  key_prefix_ = std::move(key_prefix) + "hang/";
  // Long enough for peers blocked in a collective to notice (they look every
  // kPollInterval), short enough that the report adds little to the timeout.
  window_ = std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(5));
}

bool CollectiveLog::peer_reported() {
  if (!store_) return false;
  try {
    return store_->check({key_prefix_ + "reported"});
  } catch (const std::exception&) {
    return false;  // the store's host is gone: this rank's own timeout will say so
  }
}

std::string CollectiveLog::report() {
  std::lock_guard<std::mutex> lock(report_mutex_);
  if (!reported_) {
    report_ = exchange();
    reported_ = true;
  }
  return report_;
}

std::string CollectiveLog::exchange() {
  const std::vector<LoggedCollective> mine = snapshot();
  RankLogs logs;
  logs[rank_] = mine;
  const int world = static_cast<int>(global_ranks_.size());
  if (!store_ || world == 1) return diagnose_hang(logs, global_ranks_, window_);
  try {
    const std::string text = serialize_log(mine);
    store_->set(key_prefix_ + "log/" + std::to_string(rank_), std::vector<uint8_t>(text.begin(), text.end()));
    store_->set(key_prefix_ + "reported", std::vector<uint8_t>{1});
    const auto deadline = std::chrono::steady_clock::now() + window_;
    std::vector<bool> have(world, false);
    have[rank_] = true;
    int count = 1;
    while (count < world) {
      for (int r = 0; r < world; ++r) {
        if (have[r] || !store_->check({key_prefix_ + "log/" + std::to_string(r)})) continue;
        const std::vector<uint8_t> bytes = store_->get(key_prefix_ + "log/" + std::to_string(r));
        logs[r] = parse_log(std::string(bytes.begin(), bytes.end()));
        have[r] = true;
        ++count;
      }
      if (count == world || std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    // Rank 0 hosts the store: had it thrown (and its process exited) as soon
    // as its own report was complete, a rank still reading would lose the
    // logs. So every rank waits, within the window, until each rank it heard
    // from has read the others too.
    const std::string done_key = key_prefix_ + "done";
    store_->add(done_key, 1);
    const auto done_deadline = std::chrono::steady_clock::now() + window_;
    while (store_->add(done_key, 0) < count && std::chrono::steady_clock::now() < done_deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  } catch (const std::exception& failure) {
    return diagnose_hang(logs, global_ranks_, window_) +
           "\n  (the other ranks' logs are unavailable: the store did not answer: " + backend_message(failure) + ")";
  }
  return diagnose_hang(logs, global_ranks_, window_);
}

}  // namespace shardtrain::comm
