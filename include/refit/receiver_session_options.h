// A receiver's transfer session, as its users configure and observe it: the options (apply queue,
// payload limits, engine hooks, anchor undo, threads, lease) and its status snapshot. Options of
// ReceiverNodeOptions::session; the session itself is internal (src/receiver/receiver_session.h).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "refit/anchor_undo.h"
#include "refit/lineage.h"
#include "refit/payload.h"
#include "refit/status.h"
#include "refit/transfer.h"

namespace refit {

/// The state of a ReceiverSession.
enum class ReceiverState : uint8_t {
  /// No open transfer; the store holds the committed version.
  kIdle,
  /// A transfer is prepared: payloads are staged and applied, not yet verified.
  kReceiving,
  /// The transfer is flushed: every expected payload is applied and verified; it awaits Commit
  /// (or Abort). The transfer is sealed: no more payloads are accepted.
  kPrepared,
};

/// Return "idle", "receiving" or "prepared".
std::string_view ReceiverStateName(ReceiverState state);

/// A consistent snapshot of the session (GetStatus).
struct ReceiverStatus {
  ReceiverState state = ReceiverState::kIdle;
  /// The committed version the store holds.
  uint64_t version = 0;
  /// The open transfer (kReceiving or kPrepared) and its versions.
  std::optional<TransferId> transfer_id;
  uint64_t base_version = 0;
  uint64_t target_version = 0;
  /// Whether the open transfer refuses new payloads (Flush got past waiting for them).
  bool sealed = false;
  /// Payloads of the open transfer: distinct ones staged, applied, waiting in the queue, and
  /// duplicates ACKed.
  uint64_t staged_payloads = 0;
  uint64_t applied_payloads = 0;
  uint64_t queued_payloads = 0;
  uint64_t duplicate_payloads = 0;
  /// The error that failed the open (or, once idle, the last) transfer: the first apply error,
  /// or a failed Flush or Abort. OK otherwise. Cleared by the next Prepare.
  Status last_error;
  /// Bytes held by the undo log of the open transfer.
  uint64_t undo_bytes = 0;
  /// While the open transfer is receiving under a lease (ReceiverSessionOptions::transfer_lease):
  /// the milliseconds left before it is aborted for lack of progress. Unset otherwise (idle,
  /// prepared, or no lease).
  std::optional<uint64_t> lease_remaining_ms;
  /// Transfers this session aborted and rolled back because their lease expired, since it was
  /// made. The last one is named by last_error (DeadlineExceeded) until the next Prepare.
  uint64_t expired_leases = 0;
  /// The store holds a mix of versions that no rollback can undo: a transfer that applied FULL
  /// items under AnchorUndo::kNone was aborted. Only an anchor is accepted until one commits;
  /// `needs_anchor_reason` names the transfer.
  bool needs_anchor = false;
  std::string needs_anchor_reason{};
  /// Bytes of old bits the open transfer's undo log spilled to its file (AnchorUndo::kFile).
  uint64_t undo_file_bytes = 0;
  /// Distinct payloads staged since the session was made (duplicates not counted), and their
  /// bytes as received: what this receiver was sent, e.g. a TP shard's cut under routing by
  /// holdings (docs/protocol.md).
  uint64_t received_payloads = 0;
  uint64_t received_bytes = 0;
  /// Bytes that crossed the boundary of the store's device tensors since it was made, each way
  /// (refit/tensor_memory.h): positions and new bits to the device, old bits and read ranges
  /// from it. Both 0 for a store in host memory.
  uint64_t device_to_bytes = 0;
  uint64_t device_from_bytes = 0;
  /// The session prepares a transfer to the target its PrepareRequest names
  /// (PrepareRequest::target_version), so folded deltas can catch it up from a version behind
  /// the fleet's base; false: only to base_version + 1, and a coordinator sends it an anchor of
  /// its own instead (docs/protocol.md "Per-receiver plans").
  bool accepts_target_version = false;
  /// The lineage of the committed version: its run, the highest epoch of that run seen (the
  /// fence), and its state fingerprint (docs/protocol.md "Lineage and fencing"). (Last, with an
  /// initializer.)
  HeldLineage lineage = {};
};

/// Options of ReceiverSession::Make.
struct ReceiverSessionOptions {
  /// Payloads staged but not yet applied. Stage blocks (TryStage fails) while this many wait, so
  /// receiver memory stays bounded by depth × payload size. Upstream allows 32 batches of 8
  /// outstanding because each batch costs an RPC round trip; applying in process needs only
  /// enough queued work that the apply thread never waits for the next payload.
  size_t apply_queue_depth = 8;
  /// The bytes of the payloads staged but not yet applied: Stage also waits while the queue holds
  /// this many (a queue that is empty takes any payload, so one larger than this still passes).
  /// The depth bounds a delta's many small payloads; this bounds an anchor's, which are each up
  /// to a bucket (8 MiB by default): what is queued sits on top of the model (a 1 GiB model's
  /// receiver peaked at 1.08–1.09 × it during a raw anchor, docs/benchmark-results.md). Four
  /// default buckets keep the next payload ready while one applies. 0: no bound but the depth.
  uint64_t apply_queue_bytes = uint64_t{32} << 20;
  /// Limits for decoding untrusted payloads (Stage checks the header against them too).
  PayloadLimits limits;
  /// How many finished (committed or aborted) transfer ids to remember, so that a late payload
  /// or a replayed Prepare of a finished transfer is refused instead of re-applied. Oldest are
  /// forgotten first; 1024 ids cost under 100 KiB and cover far more transfers than can be in
  /// flight.
  size_t remembered_transfers = 1024;
  /// A hook for tracing and tests: called on the apply thread, without the session lock, before
  /// each payload is applied (it may have been decoded already). It must not call into the
  /// session.
  std::function<void(const PayloadIds&)> before_apply;

  /// Engine hooks (docs/architecture.md, "Layers": node/), for a receiver whose store is the memory
  /// an inference engine serves from. None may call into the session; each runs without the session
  /// lock. Called on the apply thread before the first payload of a transfer is applied: from then
  /// on until the transfer commits or aborts the weights are a mix of two versions, so an engine
  /// pauses generation here. A transfer that applies nothing (an empty delta) never calls it.
  std::function<void(const TransferId&)> before_first_apply;
  /// Called once a transfer committed (also an implied commit), with the version now held.
  std::function<void(const TransferId&, uint64_t version)> after_commit;
  /// Called once an open transfer was aborted and rolled back, with the version held again. Not
  /// called when the abort leaves the store needing an anchor (anchor_undo kNone): its weights
  /// are then a mix of versions, so an engine stays paused until the anchor's after_commit.
  std::function<void(const TransferId&, uint64_t version)> after_abort;

  /// What the undo log keeps of the bits an anchor's FULL items overwrite (AnchorUndo): the
  /// receiver's memory during a FULL (about 2× the model with kMemory, 1× with kFile or kNone)
  /// against what an aborted anchor leaves (the base restored, or a receiver that needs the
  /// next anchor). docs/configuration.md has the trade-off.
  AnchorUndo anchor_undo = AnchorUndo::kMemory;
  /// kFile: where the undo log's spill file is made (unlinked at once); empty: $TMPDIR or /tmp.
  std::string anchor_undo_directory{};
  /// Threads that apply one payload, one tensor per thread at a time (ApplyPayload): an
  /// anchor's FULL items, whose apply hashes every element, which one core does slower than it
  /// copies; and a delta payload's items, whose locations are decoded and values applied and
  /// hashed per element, a large XOR item in slices of its own; through a loader, a delta
  /// payload's items, grouped by the local tensors they write. Payloads are still applied one at a
  /// time, in arrival order. 1 to kMaxApplyThreads.
  int apply_threads = 4;
  /// Threads that decode (validate, checksum, decompress, parse) queued payloads ahead of the
  /// apply, each the first queued payload nobody has started, at most this many payloads ahead:
  /// the decode of the next payloads overlaps the apply of this one, and several payloads
  /// decode at once (a FULL's decompression is the slowest receiver stage on one thread). Costs
  /// up to this many decompressed payload bodies of memory; the results are the same whatever
  /// the number (payloads still apply one at a time, in arrival order). 0: the apply thread
  /// decodes each payload itself, as a one-core receiver would. 0 to kMaxApplyThreads.
  int decode_threads = 2;

  /// The transfer lease: a transfer that is receiving (prepared here, not yet flushed) and makes
  /// no progress for this long is aborted and rolled back by the session itself, so a producer
  /// that died (kill -9 after Prepare, mid-stream) cannot wedge the receiver. Progress is any
  /// Prepare, payload (staged, duplicate or refused for room), applied payload, Flush or Commit
  /// of that transfer; the lease never runs out while staged payloads wait to be applied. A
  /// prepared transfer has no lease: it is decided by its coordinator and may already be
  /// committed elsewhere, so only a decision ends it (Commit, Abort, or the next transfer's
  /// Prepare: implied commit or implied abort, docs/protocol.md). The lease must exceed the
  /// longest quiet gap of a live transfer: a producer comparing chunks that did not change sends
  /// nothing for a while. Five minutes covers a scan of terabytes at memory bandwidth and is short
  /// next to a training step of an RL job that waits for its weights. Zero: no lease (a transfer
  /// stays open until it is aborted).
  std::chrono::milliseconds transfer_lease{std::chrono::minutes(5)};
  /// A receiving transfer (prepared here, not yet flushed) that has made no progress for this
  /// long is rolled back when a Prepare of another transfer from the same base arrives: its
  /// coordinator died or was replaced (a preempted trainer restarted), and a transfer this
  /// receiver has not flushed cannot have committed anywhere, since a commit needs every
  /// receiver's flush (docs/protocol.md, "Preemption"). The new coordinator gets in at once
  /// instead of after the lease. Zero: never preempt (only the lease or an Abort ends it).
  std::chrono::milliseconds preempt_after{std::chrono::seconds(5)};

  /// Bounds on apply_queue_depth, remembered_transfers and the thread counts: far above any
  /// sensible value, low enough that a mistyped one (e.g. a byte count) is reported.
  static constexpr size_t kMaxApplyQueueDepth = size_t{1} << 16;
  static constexpr size_t kMaxRememberedTransfers = size_t{1} << 20;
  static constexpr int kMaxApplyThreads = 256;
};

}  // namespace refit
