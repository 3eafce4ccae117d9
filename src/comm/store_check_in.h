#pragma once
// Keeps the job's key-value store up until every rank is done with it.
//
// The store lives in global rank 0's process (rendezvous.cpp). Connecting a
// group (Gloo's full-mesh connect) can return on rank 0 while another member
// still reads the store, and a program with nothing left to do (or an error
// on rank 0 alone) then exits and takes the store with it: the other rank
// fails its connect with "Connection reset by peer". So after connecting,
// every member but rank 0 checks in with one store request, and rank 0 waits
// until the store has counted all of them. The store sends each reply in the
// round that made it (rendezvous/server.cpp), so by the time rank 0 reads
// the full count, every member's reply is already on its way and survives
// rank 0's exit. A store-level step, not a collective: the collective
// sequence numbers that hang reports show stay those of the program.
//
// Not covered: a group made from a sub-group that rank 0 is not in (rank 0
// never sees that call), and NCCL before 2.18, whose sub-groups read their
// unique id from the store (NCCL's own connect is collective otherwise).

#include <chrono>
#include <string>
#include <vector>

#include "comm/c10d.h"

namespace shardtrain::comm {

/// The global rank whose process hosts the job's store (rendezvous.cpp).
inline constexpr int kStoreHostRank = 0;

/// Called once a group's connect has finished, by each of its members, and by
/// global rank 0 when it is not a member (it still hosts the store).
/// `key_prefix` is the group's own prefix in `store`; `members` are the
/// group's global ranks. Rank 0 waits at most `timeout` and then throws a
/// TimeoutError that says how many checked in of how many; everyone else
/// returns once the store has answered.
void check_in_after_connect(c10d::Store& store, const std::string& key_prefix, const std::vector<int>& members,
                            int my_global_rank, std::chrono::milliseconds timeout);

}  // namespace shardtrain::comm
