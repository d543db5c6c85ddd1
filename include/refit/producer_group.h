// ProducerGroup: the W ranks of one trainer job (torchrun, Megatron, Ray, mpirun), as the
// Publishers of those ranks exchange the small messages of a Sync — the plan, stream reports,
// per-tensor digests and the decision. Two collectives, nothing more: rank 0 broadcasts to every
// rank, and every rank's message is gathered at rank 0 (docs/architecture.md, "One sync, step by
// step").
//
//   rank 0 ──Broadcast──▶ ranks 1 … W−1        ranks 0 … W−1 ──Gather──▶ rank 0
//
// Implementations: in-process (threads of one process; tests), TCP (rank 0 listens, the others
// connect and authenticate with the fleet's api key), MPI (non-blocking broadcast and gather on a
// communicator, when the build finds MPI; refit/mpi_producer_group.h), and from Python the
// trainer's torch.distributed group.
//
// Failure model. Every call takes a deadline. A rank that vanishes (its process died, its
// connection closed) or misses the deadline makes the collective fail on the ranks that wait for
// it — Unavailable or DeadlineExceeded naming the rank — and the link to it is dropped, so a late
// or stale message of an abandoned collective can never be taken for the next one's. The ranks
// still reachable stay usable: a Broadcast after a failed Gather reaches them (and reports the
// ranks it could not reach), which is how rank 0 tells the survivors to abort. A rank whose
// process restarted joins again under its rank number, and takes part from the next collective
// on.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "refit/status.h"

namespace refit {

/// The clock of every group deadline.
using GroupClock = std::chrono::steady_clock;

/// One rank's endpoint of a producer group.
///
/// Collectives are called by every rank in the same order (SPMD), one at a time per rank. Each
/// endpoint numbers its calls (its k-th collective is round k, whether it succeeded or not), and
/// implementations use that number to tell a late message of an abandoned round from the current
/// one's, so a rank that failed a collective is back in step at the next.
///
/// Thread-safety: one collective at a time per object; rank() and world_size() may be called
/// from any thread.
class ProducerGroup {
 public:
  virtual ~ProducerGroup() = default;

  /// This rank, in [0, world_size()).
  virtual uint32_t rank() const = 0;
  /// The number of ranks W (≥ 1).
  virtual uint32_t world_size() const = 0;

  /// Rank 0: send `message` to every other rank and return it. Other ranks: `message` is
  /// ignored; return rank 0's message. Messages are opaque bytes of any length up to the
  /// implementation's limit.
  /// Errors: Unavailable naming each rank that could not be reached (rank 0: those ranks get
  /// nothing and their links are dropped, the others got the message; other ranks: rank 0 is
  /// gone), DeadlineExceeded when `deadline` passes first, ResourceExhausted for a message over
  /// the limit, PermissionDenied for a peer that failed authentication, FailedPrecondition on a
  /// rank that missed whole rounds (it is in step again from its next call) or on a group that
  /// can no longer be used (MPI, after a deadline).
  virtual Result<std::string> Broadcast(std::string message, GroupClock::time_point deadline) = 0;

  /// Every rank: contribute `message`. Rank 0: return the W messages in rank order (its own
  /// first). Other ranks: return an empty vector once the message is sent.
  /// Errors: as Broadcast; on rank 0 the error names every rank whose message did not arrive.
  virtual Result<std::vector<std::string>> Gather(std::string message,
                                                  GroupClock::time_point deadline) = 0;
};

/// Make the W in-process ranks of one group, for threads of one process (tests, a single-process
/// trainer with W producer streams). Destroying one rank's object makes the collectives of the
/// others fail with Unavailable naming it ("rank 2 of 4 left the group"), as a dead process
/// would; a message it contributed before is still delivered. Messages have no size limit, and
/// rank 0's Broadcast never waits (it posts for each live rank).
/// Errors: InvalidArgument for world_size 0.
Result<std::vector<std::unique_ptr<ProducerGroup>>> MakeInProcessGroup(uint32_t world_size);

/// Options of MakeTcpGroup.
struct TcpGroupOptions {
  /// Rank 0 listens on this host:port, the other ranks connect to it (tcp://HOST:PORT or
  /// HOST:PORT). Port 0 on rank 0 picks a free port (TcpGroupPort tells it; tests only).
  std::string address;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  /// The shared secret every rank must prove it holds (HMAC challenge at connect; the key itself
  /// never crosses the wire). Empty: no authentication (rank 0 logs a warning).
  std::string api_key;
  /// The largest message accepted (ResourceExhausted beyond it): plans and reports are small,
  /// the per-tensor digests of a model with a million tensors are about 64 MiB. A sender refuses
  /// its own oversized message and tells the waiting side, so both fail at once; a receiver with
  /// a smaller limit refuses the frame by its header and drops the link.
  uint64_t max_message_bytes = uint64_t{256} << 20;
  /// How long Make waits: the ranks ≥ 1 for their first connection to rank 0 (retrying while
  /// rank 0 is not up yet), and rank 0 for its port (at most bind_timeout of it). Later
  /// reconnections happen inside the collectives, within their deadlines.
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(60)};
  /// How long rank 0 retries a port that is in use (a restarted rank 0 whose predecessor is still
  /// exiting), within connect_timeout. A port that another process keeps is reported then, naming
  /// it, rather than after the whole connect_timeout: a wrong or taken --group port fails fast.
  std::chrono::milliseconds bind_timeout{std::chrono::seconds(3)};
};

/// Make this rank's endpoint of a TCP group. Rank 0 binds and accepts the others in the
/// background on a thread named "refit-group" (a rank that reconnects replaces its old link);
/// ranks 1 … W−1 connect to rank 0 and prove the api key (HMAC-SHA256 over a fresh challenge).
///
/// Failures, in the terms of the failure model: rank 0's Broadcast waits until the deadline for
/// ranks that are not connected and writes to all links at once; its Gather reads all links at
/// once, fails a rank whose connection closes at once, and waits until the deadline for a rank
/// that is not connected (it may be reconnecting). A rank ≥ 1 whose link was dropped reconnects
/// at the start of its next collective; any I/O failure drops the link and fails the call
/// (Unavailable "rank 0 at HOST:PORT is gone: …"). A restarted rank's Make takes over rank 0's
/// round numbering, so it takes part from rank 0's current (or, between collectives, next)
/// collective on.
///
/// Thread-safety: as ProducerGroup; the accept thread is internal.
/// While a collective on rank 0 waits for ranks that are not connected, it logs which ones, at
/// info after a few seconds and then periodically, at warn once the wait is long.
///
/// Errors: InvalidArgument (a malformed address, rank ≥ world_size, port 0 on a rank ≥ 1, a rank
/// or world size rank 0 does not accept), Unavailable (rank 0 cannot bind: "port 7001 is in use",
/// within bind_timeout; a rank cannot reach rank 0 within connect_timeout), PermissionDenied
/// ("rank 0 at HOST:PORT refused this rank's api key").
Result<std::unique_ptr<ProducerGroup>> MakeTcpGroup(const TcpGroupOptions& options);

/// The port a TCP group's rank 0 listens on (the ephemeral one when the address gave port 0), or
/// 0 for any other group (a TCP group's ranks ≥ 1, an in-process or MPI group).
uint16_t TcpGroupPort(const ProducerGroup& group);

}  // namespace refit
