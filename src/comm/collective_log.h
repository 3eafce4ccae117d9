#pragma once
// Hang forensics (private header). Each communicator keeps a ring of its most
// recent collectives: sequence number, operation, dtype, sizes and the
// CollectiveScope chain that issued it. When a collective times out or a
// peer dies, the ranks still alive post their rings to the store and each
// builds the same report: the first sequence number where the ranks'
// collectives differ, which rank is behind or missing, and what each was
// doing there. A collective that only hangs names itself; this names the
// mistake (a unit one rank skipped, a save_state() only rank 0 called).
//
// Hot path: record() copies a few fields into a preallocated slot under an
// uncontended mutex (bench_collectives --log-ablation measures it). The store
// is touched only after a failure, or while a wait has already lasted a
// polling interval, to notice that a peer reported one.

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "comm/c10d.h"
#include "shardtrain/comm/communicator.h"

namespace shardtrain::comm {

/// One logged collective, in the form ranks exchange.
struct LoggedCollective {
  int64_t seq = -1;
  std::string op;        ///< "all_gather", ... with "(sum)" / "(root 0)" where it applies
  std::string dtype;
  int64_t input_numel = 0;
  int64_t output_numel = 0;
  std::string context;   ///< CollectiveScope chain, "" when none

  /// What identifies the call on every rank alike (output sizes may differ
  /// legitimately: an uneven reduce-scatter gives each rank its own split).
  bool same_call(const LoggedCollective& other) const {
    return op == other.op && dtype == other.dtype && input_numel == other.input_numel && context == other.context;
  }
  /// "save_state() > all_reduce(max)(Long, 1 -> 1)".
  std::string describe() const;
};

/// The rings of the ranks that answered, by group rank.
using RankLogs = std::map<int, std::vector<LoggedCollective>>;

/// The diagnosis every rank computes from the exchanged logs. Pure, so that
/// unit tests pin its wording.
std::string diagnose_hang(const RankLogs& logs, const std::vector<int>& global_ranks,
                          std::chrono::milliseconds answer_window);

/// Text form of a ring (one tab-separated line per entry) and back.
std::string serialize_log(const std::vector<LoggedCollective>& entries);
std::vector<LoggedCollective> parse_log(const std::string& text);

class CollectiveLog {
 public:
  static constexpr int kCapacity = 64;
  /// How often a long wait looks whether a peer has reported a failure.
  static constexpr std::chrono::milliseconds kPollInterval{500};

  CollectiveLog(int rank, std::vector<int> global_ranks);

  /// Logs `event` with the calling thread's scope chain; returns its sequence number.
  int64_t record(const CollectiveEvent& event);
  /// The store the ranks exchange logs through, under `key_prefix` (the
  /// group's own, so sub-groups do not mix). Without one, reports hold only
  /// this rank's log.
  void attach_store(comm::StorePtr store, std::string key_prefix, std::chrono::milliseconds timeout);
  /// Whether any rank of the group has posted a failure report (one store
  /// round trip; false without a store or when the store cannot answer).
  bool peer_reported();
  /// Posts this rank's ring, collects the others' for a short window, and
  /// returns the diagnosis. The exchange happens once per communicator;
  /// later calls return the same text.
  std::string report();
  /// This rank's ring, oldest first.
  std::vector<LoggedCollective> snapshot() const;

 private:
  std::string exchange();

  int rank_;
  std::vector<int> global_ranks_;
  mutable std::mutex mutex_;
  std::vector<CollectiveEvent> events_;
  std::vector<std::string> contexts_;
  int64_t next_seq_ = 0;
  comm::StorePtr store_;
  std::string key_prefix_;
  std::chrono::milliseconds window_{0};
  std::mutex report_mutex_;
  bool reported_ = false;
  std::string report_;
};

}  // namespace shardtrain::comm
