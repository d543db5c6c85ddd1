// The transfer vocabulary: the types every layer that takes part in a transfer shares — the
// coordinator's requests and a receiver's reports (prepare, flush, commit, abort), the interface a
// receiver is driven through (ReceiverControl), where a transport delivers received payloads
// (PayloadSink) and sends a producer's (PayloadChannel), and how a transport learns each
// transfer's outcome (TransferObserver). It sits low, beside the payload format, so that pipeline,
// receiver, transport, control and node speak it without linking one another for a type.
//
//   coordinator ──PrepareRequest / FlushOptions──▶ ReceiverControl (ReceiverSession, ControlClient)
//               ◀──PrepareResult / FlushReport────
//   ProducerStream ──PayloadSender──▶ PayloadChannel (TransportSender) ══▶ Listener ──▶ PayloadSink
#pragma once

#include <chrono>
#include <compare>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <vector>

#include "refit/lineage.h"
#include "refit/payload.h"
#include "refit/status.h"

namespace refit {

/// The plan of an open transfer.
struct TransferPlan {
  TransferId transfer_id;
  bool anchor = false;
  uint64_t base_version = 0;
  uint64_t target_version = 0;
};

/// What one transfer must deliver. The coordinator may declare it at Prepare, or only at Flush
/// (payload counts and digests are known once every producer has streamed), or at both if the two
/// agree.
struct TransferExpectation {
  /// Payloads per producer id: producer p sends payload ids 0 … n_p − 1 (upstream numbering).
  /// Producers not listed send none. With these counts the session rejects unexpected payload
  /// ids at Stage and names each missing payload when Flush times out.
  std::map<uint32_t, uint32_t> payloads_per_producer;
  /// The total number of payloads over all producers, for coordinators that only know the sum.
  /// If payloads_per_producer is set too, this must equal its sum.
  std::optional<uint64_t> total_payloads;
  /// The per-tensor state digests the store must hold after the transfer (the producers'
  /// DeltaTracker::PendingDigests, merged). Empty: Flush does not compare digests.
  std::map<std::string, uint64_t> digests;

  /// Whether a payload count is declared (an empty transfer declares total_payloads = 0).
  bool has_payload_count() const {
    return !payloads_per_producer.empty() || total_payloads.has_value();
  }

  friend bool operator==(const TransferExpectation&, const TransferExpectation&) = default;
};

/// The relay tree one transfer's payloads take through a set of receivers (transports with
/// fan_out_tree, docs/protocol.md "Relay trees"), named by the coordinator in each receiver's
/// Prepare, so that receivers need no static peers list: every member's data endpoint in tree
/// order (the sender's SenderContext::endpoints), and the position of the receiver told. A
/// producer's root is endpoints[producer_id % n]; every relay forwards to its binary-heap
/// children below that root.
struct RelayTree {
  std::vector<std::string> endpoints;
  uint32_t position = 0;

  friend bool operator==(const RelayTree&, const RelayTree&) = default;
};

/// The argument of Prepare.
struct PrepareRequest {
  TransferId transfer_id;
  /// The version the transfer starts from; it must equal the receiver's committed version
  /// (version fencing). The target is base_version + 1.
  uint64_t base_version = 0;
  TransferExpectation expected;
  /// The transfer is an anchor: every element of every tensor is sent in FULL, so it does not
  /// depend on what the receiver holds, and an idle receiver at any version accepts it. A
  /// receiver that restarted from an older checkpoint, or fell behind, rejoins this way.
  /// (With an initializer, so that `PrepareRequest{id, base, expected}` stays valid.)
  bool anchor = false;
  /// The relay tree this transfer's payloads take through this receiver (transports with
  /// fan_out_tree), named by the coordinator; nullopt: the receiver's static peers list, if any.
  std::optional<RelayTree> relay_tree = std::nullopt;
  /// The version the transfer takes this receiver to; 0: base_version + 1. A receiver caught up
  /// by folded deltas (docs/protocol.md "Per-receiver plans") is prepared with its own version
  /// as the base and the fleet's target, several versions on. Only a receiver whose status says
  /// accepts_target_version is sent one; the coordinator checks the target its flush reports.
  uint64_t target_version = 0;
  /// The trainer run, epoch and base fingerprint the transfer comes from (docs/protocol.md
  /// "Lineage and fencing"); a receiver refuses another lineage's delta, a zombie epoch, and a
  /// version number it holds under other contents. Default: none stated.
  TransferLineage lineage = {};
};

/// What Prepare did.
struct PrepareResult {
  /// True when the transfer was already open with the same request (a retried control call).
  bool repeated = false;
  /// The transfer committed implicitly because this one is based on its target version
  /// (docs/protocol.md, "implied commit": a lost Commit message cannot wedge the receiver).
  std::optional<TransferId> implied_commit;
  /// The prepared transfer that was rolled back because this one comes from its base version
  /// under a new id (docs/protocol.md, "implied abort": its coordinator gave up on it before
  /// any receiver committed it). (Last, with an initializer, for aggregate initializers.)
  std::optional<TransferId> implied_abort = std::nullopt;
};

/// How a payload was staged. Either way the sender gets an ACK.
enum class StageResult : uint8_t {
  /// Queued for apply.
  kAccepted,
  /// Already staged in this transfer with the same checksum: not queued again. (An XOR payload
  /// applied twice would revert its changes, so dedupe is what makes sender retries safe.)
  kDuplicate,
};

/// Options of Flush.
struct FlushOptions {
  /// How long to wait for the expected payloads to be staged and applied.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  /// Expectations declared now (see TransferExpectation); fields left empty keep Prepare's.
  TransferExpectation expected;
};

/// What a receiver holds of one canonical tensor, for the coordinator's check of a replica
/// (docs/architecture.md: digests stay in canonical coordinates). A receiver whose store maps
/// canonical tensors onto its own layout (a loader, e.g. one tensor-parallel shard) holds
/// *pieces*: rectangles of the canonical tensor, each with the partial state digest
/// Σ h(canonical index, bits) over its elements. Two shards that hold the same rectangle (a
/// replicated GQA kv head, an unsharded norm) report the same piece id; the distinct pieces of a
/// replica add up (mod 2^64) to the producer's digest of the whole tensor.
struct CanonicalHolding {
  /// The receiver's loader skips this tensor: it holds none of it.
  bool skipped = false;
  /// Piece id (a deterministic description of the rectangle) → partial digest.
  std::map<std::string, uint64_t> pieces;

  friend bool operator==(const CanonicalHolding&, const CanonicalHolding&) = default;
};

/// One rectangle of a canonical tensor's 2-D view (CanonicalLayout: element i is row i / cols,
/// column i % cols): rows [row_begin, row_end) × columns [col_begin, col_end).
struct HeldRect {
  uint64_t row_begin = 0;
  uint64_t row_end = 0;
  uint64_t col_begin = 0;
  uint64_t col_end = 0;

  friend bool operator==(const HeldRect&, const HeldRect&) = default;
  friend auto operator<=>(const HeldRect&, const HeldRect&) = default;
};

/// Which elements of one canonical tensor a receiver holds, for routing (docs/protocol.md
/// "Routing by holdings"): rectangles of the tensor's 2-D view with `cols` columns, or none at
/// all (`skipped`: its loader skips the tensor). Unlike CanonicalHolding it carries no digest:
/// it is what a receiver can hold, asked before a transfer streams.
struct HeldRegion {
  bool skipped = false;
  uint64_t cols = 0;
  std::vector<HeldRect> rects;

  friend bool operator==(const HeldRegion&, const HeldRegion&) = default;
  friend auto operator<=>(const HeldRegion&, const HeldRegion&) = default;
};

/// What a receiver holds, per canonical tensor name; a tensor the map does not name is held
/// whole (a receiver without a loader answers an empty map).
using HeldRegions = std::map<std::string, HeldRegion>;

/// Where a receiver sits in the fleet: the replica (one whole copy of the model) it belongs to,
/// and its shard of that replica's group (e.g. its tensor-parallel rank). Reported by the control
/// plane, so that a coordinator verifies each replica as a whole.
struct ReplicaPlace {
  /// Empty: the receiver is a replica of its own (shards = 1).
  std::string replica;
  uint32_t shard = 0;
  uint32_t shards = 1;

  friend bool operator==(const ReplicaPlace&, const ReplicaPlace&) = default;
};

/// Where a receiver's data plane sits in its static relay tree (transports with fan_out_tree):
/// its index in the peers list it was given, and that list's length (1 without peers: a tree of
/// its own). Reported by the control plane, for operators; a transfer whose Prepare names its
/// RelayTree takes that tree instead.
struct RelayPlace {
  uint32_t index = 0;
  uint32_t relays = 1;

  friend bool operator==(const RelayPlace&, const RelayPlace&) = default;
};

/// The result of a successful Flush.
struct FlushReport {
  TransferId transfer_id;
  uint64_t target_version = 0;
  /// Payloads applied (duplicates excluded), their items, and the elements those items changed
  /// (the location count of each item; the span length of a FULL item).
  uint64_t payloads = 0;
  uint64_t items = 0;
  uint64_t changed_elements = 0;
  /// Payloads ACKed as duplicates.
  uint64_t duplicates = 0;
  /// The store's per-tensor state digests after the transfer, for the coordinator to compare
  /// across receivers and with the producers. Keyed by the store's own tensor names: canonical
  /// ones unless the store has a loader.
  std::map<std::string, uint64_t> digests;
  /// For a store with a loader: what it holds of each expected canonical tensor (empty without a
  /// loader, where `digests` are canonical). The coordinator verifies a shard group by these.
  std::map<std::string, CanonicalHolding> holdings;

  friend bool operator==(const FlushReport&, const FlushReport&) = default;
};

/// One receiver's transfer control as a coordinator drives it — Prepare → Flush → Commit, or
/// Abort — whether the receiver lives in this process (ReceiverSession) or behind its HTTP
/// control plane (ControlClient). Every call is idempotent for the same transfer id (see the
/// table of ReceiverSession), so a coordinator may repeat any of them after a lost reply.
/// Implementations accept concurrent calls from any thread.
class ReceiverControl {
 public:
  virtual ~ReceiverControl() = default;

  virtual Result<PrepareResult> Prepare(const PrepareRequest& request) = 0;
  virtual Result<FlushReport> Flush(const TransferId& id, const FlushOptions& options) = 0;
  virtual Status Commit(const TransferId& id) = 0;
  virtual Status Abort(const TransferId& id) = 0;
  /// Abort `id` on this receiver because the transfer committed on a quorum of the fleet
  /// without it (docs/protocol.md "Stragglers and quorum"): rolled back as by Abort, and told
  /// that the fleet now holds `fleet_version`, so that it reports itself behind, fenced, not
  /// ready to serve, until it has caught up. Default: Abort (a receiver without readiness).
  virtual Status Fence(const TransferId& id, uint64_t fleet_version) {
    (void)fleet_version;
    return Abort(id);
  }
  /// Which elements of each named canonical tensor this receiver holds (its loader's layouts);
  /// tensors it holds whole, or cannot resolve, are left out (payloads carry them whole, and an
  /// unresolvable one then fails where it always did, at apply). Asked by a coordinator that
  /// routes payloads by holdings, before Prepare. Errors: InvalidArgument (more than
  /// kMaxRegionTensors names), and those of the control link. A receiver
  /// older than routing by holdings is answered for as holding everything whole (it is sent
  /// every item, which is always correct: a loader keeps its part).
  virtual Result<HeldRegions> Regions(const std::vector<std::string>& canonical_names) = 0;
  /// Make every call that starts after this one end by `deadline` at the latest, retries
  /// included (DeadlineExceeded past it), whatever the implementation's own timeouts; nullopt
  /// lifts the limit. A coordinator sets its transfer's deadline here, so that no call of the
  /// transfer outlives it (its aborts by a small margin). The default ignores it: a receiver in
  /// the same process answers at once.
  virtual void SetCallDeadline(std::optional<std::chrono::steady_clock::time_point> /*deadline*/) {}
};

/// The most canonical tensor names one ReceiverControl::Regions call may ask about.
inline constexpr size_t kMaxRegionTensors = size_t{1} << 20;

/// The end of one producer's stream, as Finish announced it.
struct StreamEnd {
  TransferId transfer_id;
  uint32_t producer_id = 0;
  /// The producer sent payload ids 0 … payloads − 1.
  uint32_t payloads = 0;

  friend bool operator==(const StreamEnd&, const StreamEnd&) = default;
};

/// Where a listener puts what it receives.
///
/// Thread-safety: implementations must accept concurrent calls from any thread (a listener may
/// deliver on several threads, and an in-process sender delivers on its own threads).
class PayloadSink {
 public:
  virtual ~PayloadSink() = default;

  /// Take one received payload, its header validated by the listener (ValidatePayload, under
  /// the listener's limits) and its body untrusted still. Return how it was staged; an error is
  /// the receiver's refusal (a NACK) and leaves the payload with the transport (a file stays in
  /// the drop). May block (a full apply queue); must return Cancelled soon after `stop` is
  /// requested.
  virtual Result<StageResult> Deliver(ValidatedPayload payload, std::stop_token stop) = 0;

  /// Learn that a producer's stream ended. A listener calls this only after delivering every
  /// payload of that stream it received. The default ignores it.
  /// Errors: InvalidArgument when it contradicts an earlier end of the same stream.
  virtual Status EndOfStream(const StreamEnd& end);

  /// Return whether the receiver has transfer `transfer_id` open (prepared, and neither committed
  /// nor aborted). A relay asks before it takes a stream end: the coordinator prepares every
  /// receiver before any producer streams, so a stream end of a transfer that is not open is a
  /// coordinator bug or a forgery, and the relay refuses it instead of sealing that stream.
  /// (EndOfStream itself does not ask: a file drop may deliver a stream end after the transfer
  /// committed.) The default, for sinks without a session, says yes.
  virtual bool IsTransferOpen(const TransferId& /*transfer_id*/) const { return true; }
};

/// Send one finished payload. Called concurrently from ProducerStreamOptions::send_threads
/// threads; the bytes are valid only during the call. A non-OK result fails the stream.
using PayloadSender =
    std::function<Status(uint32_t payload_id, std::span<const std::byte> payload)>;

/// Release a sender thread's resources (sockets, keys, clients). Called exactly once on every
/// sender thread that was started, on that thread, after its last send, on success and failure.
using SenderCleanup = std::function<void()>;

/// Where one producer's payloads of one transfer go: the producer side of a transport, as the
/// Coordinator drives it. TransportSender (transport.h) is the implementation for every
/// registered transport; tests may implement it in process.
///
/// Lifecycle: Send any number of times, concurrently; CleanupThread once on each sending thread
/// after its last Send; then, when the stream succeeded, Finish once with the payload count.
class PayloadChannel {
 public:
  virtual ~PayloadChannel() = default;

  /// Send payload `payload_id` (bytes borrowed for the call). Sending the same payload again is
  /// safe: receivers deduplicate it.
  virtual Status Send(uint32_t payload_id, std::span<const std::byte> payload) = 0;
  /// Release the calling thread's per-thread resources (sockets, clients).
  virtual void CleanupThread() {}
  /// Mark the end of the stream: payload ids 0 … payloads − 1 were sent.
  virtual Status Finish(uint64_t payloads) = 0;

  /// Return Send as the callback of ProducerStream::Run. This channel must outlive the callback.
  PayloadSender AsPayloadSender();
  /// Return CleanupThread as the cleanup callback of ProducerStream::Run. This channel must
  /// outlive the callback.
  SenderCleanup AsSenderCleanup();
};

/// Told what becomes of each transfer, by the coordinator that ran it: for a transport that keeps
/// state beyond delivering payloads (an object store publishing committed versions to a chain a
/// late receiver can replay, or deleting the objects of an aborted transfer).
///
/// Thread-safety: called from the thread that runs Coordinator::Refit, never concurrently.
class TransferObserver {
 public:
  virtual ~TransferObserver() = default;

  /// Whether the next transfer, from `base_version`, must be an anchor (FULL): e.g. the chain a
  /// late receiver replays does not hold `base_version`, so a delta from it would be useless.
  virtual bool NeedsAnchor(uint64_t /*base_version*/) { return false; }

  /// Transfer `plan` committed on every receiver and tracker; `digests` are the fleet's state
  /// digests at plan.target_version. Called after every channel of the transfer is destroyed.
  /// An error is logged and does not undo the transfer: the fleet holds the new version.
  virtual Status TransferCommitted(const TransferPlan& /*plan*/,
                                   const std::map<std::string, uint64_t>& /*digests*/) {
    return Status::OK();
  }

  /// Transfer `id` was aborted everywhere. Called after every channel of it is destroyed.
  virtual void TransferAborted(const TransferId& /*id*/) {}
};

}  // namespace refit
