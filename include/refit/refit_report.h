// What one transfer did across the fleet (RefitReport, in Publisher::Sync's SyncReport): the plan,
// each producer's StreamReport, each receiver's outcome, the routes by holdings and the phase
// times. The coordinator that drives a transfer is internal (src/pipeline/coordinator.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "refit/status.h"
#include "refit/stream_options.h"
#include "refit/transfer.h"

namespace refit {

/// The cut of items one class of receivers holds (src/codec/routing.h): opaque to users.
class ItemRoute;

/// How a receiver was brought to a transfer's target (docs/protocol.md "Per-receiver plans").
/// Receivers at the transfer's base get the delta; one behind it, new, or needing an anchor is
/// caught up in the same transfer by the cheapest source the coordinator can prove correct,
/// without changing what the others receive.
enum class CatchUp : uint8_t {
  /// The fleet's delta: the receiver held the base version.
  kDelta,
  /// One folded XOR payload per chunk from the version it held (the producers' retained deltas
  /// and this transfer's, composed exactly).
  kFolded,
  /// A peer replica that holds the target streamed its state.
  kPeer,
  /// Replayed the object store's chain before the transfer (s3://).
  kChain,
  /// An anchor (every element FULL) for this receiver alone, or for everyone when the transfer
  /// is an anchor.
  kAnchor,
};

/// Return "delta", "folded", "peer", "chain" or "anchor".
std::string_view CatchUpName(CatchUp how);

/// One class of the receivers of a transfer: the receivers that hold the same elements (every
/// TP rank-k shard of every replica; every unsharded receiver), which get the same payloads
/// (routing by holdings, src/codec/routing.h). A transfer that is not routed has one route: every
/// receiver, every item whole.
struct TransferRoute {
  /// Indices into the coordinator's receivers, in the coordinator's order: the relay tree order.
  std::vector<size_t> receivers;
  /// Their data endpoints, in the same order; empty for the unrouted route (the channel's
  /// default: the whole fleet).
  std::vector<std::string> endpoints;
  /// What they hold; null: everything.
  std::shared_ptr<const ItemRoute> items;
  /// What the route carries: the transfer's own items (kDelta; FULL ones in an anchor), FULL
  /// items of every owned element for receivers caught up by an anchor of their own (kAnchor),
  /// or the fold of the retained deltas from `from_version` (kFolded).
  CatchUp content = CatchUp::kDelta;
  /// The version its receivers hold: the transfer's base, except for kFolded.
  uint64_t from_version = 0;
};

/// What one receiver reported.
struct ReceiverOutcome {
  std::string name;
  FlushReport flush;
  /// The transfer this receiver committed implicitly at Prepare, if any.
  std::optional<TransferId> implied_commit;
  /// OK, or why its Commit failed after the decision (it stays prepared and commits implicitly
  /// at the next transfer's Prepare).
  Status commit_status;
  /// The prepared transfer this receiver rolled back at Prepare because this transfer comes
  /// from its base (its coordinator never decided it), if any. (Last, with an initializer.)
  std::optional<TransferId> implied_abort = std::nullopt;
  /// The route (class of receivers holding the same elements) it was sent, an index into
  /// RefitReport::routes.
  size_t route = 0;
  /// The version it held before the transfer (as its status said; the base when not asked),
  /// how many versions that was behind the base, and how it was caught up.
  uint64_t held_version = 0;
  uint64_t lag = 0;
  CatchUp caught_up_by = CatchUp::kDelta;
  /// The bytes the producers sent into its route (each payload reaches each receiver of the
  /// route once): what this receiver received in the transfer.
  uint64_t wire_bytes = 0;
  /// Under a quorum commit policy (refit/commit_policy.h): the transfer committed elsewhere
  /// while this receiver (its replica) did not flush, so it was fenced: aborted, rolled back to
  /// held_version, and caught up at the next transfer by a plan of its own (docs/protocol.md
  /// "Stragglers and quorum"). `fenced_because`: its flush's (or its replica's) failure;
  /// `fence_abort_status`: OK, or why the Abort failed (the next transfer's prepare from the
  /// version it holds then rolls it back; it never commits this transfer).
  bool fenced = false;
  Status fenced_because = {};
  Status fence_abort_status = {};
};

/// What one successful Refit did.
struct RefitReport {
  TransferPlan plan;
  /// Per producer, in producer order.
  std::vector<StreamReport> producers;
  /// Per receiver, in receiver order.
  std::vector<ReceiverOutcome> receivers;
  /// The routes the transfer took (one unless routed by holdings), with what each producer sent
  /// along each in producers[p].routes.
  std::vector<TransferRoute> routes;
  /// The receivers fenced under a quorum commit policy (ReceiverOutcome::fenced), by name: they
  /// do not hold the target version.
  std::vector<std::string> fenced;
  /// The replicas of the fleet, and those that flushed and verified (all of them unless some
  /// receivers were fenced).
  uint64_t replicas = 0;
  uint64_t flushed_replicas = 0;
  /// The state digest of every canonical tensor after the transfer, as the producers declared it.
  std::map<std::string, uint64_t> digests;
  /// Sums over producers.
  uint64_t payloads = 0;
  uint64_t wire_bytes = 0;
  uint64_t changed_elements = 0;
  uint64_t total_elements = 0;
  /// Wall time of each phase and of the whole transfer, in seconds.
  double prepare_s = 0;
  double stream_s = 0;
  double flush_s = 0;
  double commit_s = 0;
  double total_s = 0;
};

}  // namespace refit
