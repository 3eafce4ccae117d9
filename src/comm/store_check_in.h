#pragma once
// Keeps the job's key-value store up until every rank is done with it.
//
// The store lives in global rank 0's process (rendezvous.cpp). Connecting a
// group (Gloo's full-mesh connect) can return on rank 0 while another member
// still reads the store, and a program with nothing left to do (or an error
// on rank 0 alone) then exits and takes the store with it: the other rank
// fails its connect with "Connection reset by peer". So after connecting,
// every member but rank 0 checks in with one store request (its reply proves
// that rank no longer needs the store for the connect), and rank 0 waits for
// all of them. A store-level step, not a collective: the collective sequence
// numbers that hang reports show stay those of the program.

#include <chrono>
#include <string>
#include <vector>

#include "comm/c10d.h"

namespace shardtrain::comm {

/// Called once a group's connect has finished, by each of its members, and by
/// global rank 0 when it is not a member (it still hosts the store).
/// `key_prefix` is the group's own prefix in `store`; `members` are the
/// group's global ranks. Rank 0 waits at most `timeout` and then throws a
/// TimeoutError that names the ranks missing; everyone else returns at once.
void check_in_after_connect(c10d::Store& store, const std::string& key_prefix, const std::vector<int>& members,
                            int my_global_rank, std::chrono::milliseconds timeout);

}  // namespace shardtrain::comm
