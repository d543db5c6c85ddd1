// ReceiverSession: the receiver's transactional transfer state — staging with dedupe, a bounded
// FIFO apply queue drained by one apply thread, flush with verification, commit, and abort with a
// bit-exact rollback. Transport-independent: `refit serve` feeds it from ZeroMQ and HTTP.
//
// Lifecycle of one transfer T (base version v, target v + 1):
//
//   kIdle (at v) ──Prepare(T)──▶ kReceiving ──Flush(T)──▶ kPrepared ──Commit(T)──▶ kIdle (at v+1)
//                                    │                        │
//                                    └──────Abort(T)──────────┴──────────────────▶ kIdle (at v)
//
// Stage(payload) is accepted only in kReceiving for T, before T is sealed. ACK (Stage OK) means
// *staged*: the payload is queued, not yet applied. Only a successful Flush means *applied and
// verified*. Every payload applied in T is recorded in an UndoLog, so Abort restores version v
// bit-exactly without a reload, and a retry (with a new transfer id) starts from a clean base.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <vector>

#include "refit/anchor_undo.h"
#include "refit/payload.h"
#include "refit/status.h"
#include "refit/transfer.h"
#include "refit/weight_store.h"

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
};

/// Options of ReceiverSession::Make.
struct ReceiverSessionOptions {
  /// Payloads staged but not yet applied. Stage blocks (TryStage fails) while this many wait, so
  /// receiver memory stays bounded by depth × payload size. Upstream allows 32 batches of 8
  /// outstanding because each batch costs an RPC round trip; applying in process needs only
  /// enough queued work that the apply thread never waits for the next payload.
  size_t apply_queue_depth = 8;
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
};

/// The receiver's transactional transfer state over one WeightStore.
///
/// What each call does by state (T = the open transfer, U = any other id):
/// - Any Prepare that is not an anchor, while the store needs an anchor (an aborted transfer's
///   FULL items could not be undone, AnchorUndo::kNone): FailedPrecondition naming why.
/// - Prepare(T): kIdle → opens T if its base is the store's version. kReceiving/kPrepared with T
///   open and the same request → OK, repeated.
/// - Prepare(U): kIdle → opens U. kPrepared with U based on T's target → commits T (implied
///   commit), then opens U. kPrepared with U based on T's base → rolls T back (implied abort),
///   then opens U. Otherwise FailedPrecondition (kReceiving: T still holds its lease).
/// - Stage: only in kReceiving, for T's payloads, before T is sealed; FailedPrecondition
///   otherwise.
/// - Flush(T): kReceiving → waits, seals, verifies → kPrepared. kPrepared → the same report
///   again. kIdle, or U → FailedPrecondition.
/// - Commit(T): kPrepared → kIdle at the target version. kIdle with T already committed → OK.
///   Otherwise FailedPrecondition.
/// - Abort(T): kReceiving/kPrepared → rolls back → kIdle at the base version. kIdle → OK unless
///   T was committed. Abort(U) while T is open → FailedPrecondition.
///
/// A transfer that is kReceiving and makes no progress within options.transfer_lease is aborted
/// as Abort(T) does, by the session's apply thread: logged as a warning naming T, counted in
/// ReceiverStatus::expired_leases, and reported as last_error (DeadlineExceeded).
///
/// Finished transfer ids (committed or aborted) are remembered (remembered_transfers): their
/// payloads and a new Prepare with their id are refused, because replaying an XOR delta reverts it.
///
/// Thread-safety: every member function may be called concurrently from any thread. Stage and
/// TryStage are meant for many transport threads; the control calls (Prepare, Flush, Commit,
/// Abort) for the control plane. One mutex guards the state; blocked callers (Stage on a full
/// queue, Flush waiting for payloads, Abort waiting for the payload being applied) wait on
/// condition variables without holding it. Payloads are decoded and applied on the session's own
/// apply thread without the lock. No call may be in flight when the session is destroyed.
///
/// The store must outlive the session, and while the session exists it is the only writer of
/// the store's bytes, digests and version. Reading the store is safe while no transfer is open,
/// or while one is kPrepared and no Commit or Abort runs concurrently.
class ReceiverSession final : public ReceiverControl {
 public:
  /// Bounds on Options::apply_queue_depth and remembered_transfers: far above any sensible
  /// value, low enough that a mistyped one (e.g. a byte count) is reported.
  static constexpr size_t kMaxApplyQueueDepth = size_t{1} << 16;
  static constexpr size_t kMaxRememberedTransfers = size_t{1} << 20;
  static constexpr int kMaxApplyThreads = 256;

  /// Create a session idle at store.version() and start its apply thread.
  /// Errors: InvalidArgument for apply_queue_depth or remembered_transfers outside
  /// [1, kMax…], apply_threads outside [1, kMaxApplyThreads], decode_threads outside
  /// [0, kMaxApplyThreads], a negative transfer_lease, or an
  /// anchor_undo_directory that is not a writable
  /// directory (kFile); ResourceExhausted when the OS refuses the thread.
  static Result<std::unique_ptr<ReceiverSession>> Make(const ReceiverSessionOptions& options,
                                                       WeightStore& store);

  /// Stop the apply thread (after the payload it is applying) and discard queued payloads. If a
  /// transfer is still open, roll it back, so the store is left bit-exactly at its version.
  ~ReceiverSession();
  ReceiverSession(const ReceiverSession&) = delete;
  ReceiverSession& operator=(const ReceiverSession&) = delete;

  /// Open a transfer (see the table). A repeat of the open transfer's request is OK and changes
  /// nothing. In kPrepared, a request based on the open transfer's target commits it first
  /// (PrepareResult::implied_commit); one based on its base version rolls it back first
  /// (PrepareResult::implied_abort).
  /// Errors: InvalidArgument (inconsistent expectation; base version at the maximum);
  /// FailedPrecondition (base_version is not the receiver's version; another transfer is
  /// receiving, or prepared and the request is based on neither its base nor its target; the id
  /// is open with a different request; the id belongs to a finished transfer); NotFound if the
  /// rollback of an implied abort cannot find a tensor (the old transfer then stays open).
  Result<PrepareResult> Prepare(const PrepareRequest& request) override;

  /// Stage one payload of the open transfer, its header validated by the listener that received
  /// it (ValidatePayload), taking ownership; block while the apply queue is full. The header's
  /// sizes are checked against options.limits (CheckPayloadLimits) and its ids against the open
  /// transfer; the header is not parsed again. The checksum and the body are checked on the
  /// decode threads, and their errors surface at the next Stage and at Flush.
  /// Errors (each one a NACK):
  /// - ResourceExhausted: a declared size over options.limits;
  /// - FailedPrecondition: no open transfer, another transfer id (including finished ones),
  ///   base/target versions that differ from the transfer's, the transfer is sealed ("already
  ///   flushed") or being aborted;
  /// - InvalidArgument: a payload id outside the declared per-producer counts;
  /// - AlreadyExists: the same (transfer, producer, payload) ids were staged with another
  ///   checksum. (Not DataLoss: nothing says which copy is corrupt — ids were reused or one copy
  ///   was damaged — and neither is applied twice; the transfer should be aborted and retried.)
  /// - the first apply error of the transfer, once one happened (its own code, e.g. DataLoss);
  /// - Cancelled when `stop` is requested while waiting for room.
  Result<StageResult> Stage(ValidatedPayload payload, std::stop_token stop = {});
  /// As above for bytes nothing has validated yet (a payload read from a file, an HTTP upload):
  /// validated here under options.limits. Errors: as ValidatePayloadHeader; as above.
  Result<StageResult> Stage(std::vector<std::byte> payload, std::stop_token stop = {});

  /// As Stage, but never block: when the apply queue is full, return ResourceExhausted (a
  /// retryable NACK) and leave `payload` untouched. `payload` is moved from only when the result
  /// is kAccepted.
  Result<StageResult> TryStage(ValidatedPayload& payload);

  /// Record that producer `end.producer_id` ended its stream of the open transfer with
  /// `end.payloads` payloads (ids 0 … payloads − 1), as a transport reports it. The session keeps
  /// these counts (one place for a transfer's payload counts) and holds every other account of the
  /// same stream to them: a payload of that producer with a higher id is refused at Stage, and a
  /// Flush whose per-producer count for it differs fails, instead of waiting for payloads the
  /// producer says it never sent. A stream end of a finished transfer is ignored (a late or
  /// repeated one). Errors: FailedPrecondition (the transfer is neither open nor finished);
  /// InvalidArgument naming the transfer, the producer and both counts (another end of the same
  /// stream, the payload count declared at Prepare or Flush, or a payload staged beyond it).
  Status EndStream(const StreamEnd& end);
  /// The payload count each producer's stream end declared for the open transfer `id`: empty when
  /// none did or `id` is not open.
  std::map<uint32_t, uint32_t> DeclaredPayloads(const TransferId& id) const;

  /// Wait up to options.timeout until every expected payload of transfer `id` is staged and
  /// applied, then seal the transfer (later payloads: FailedPrecondition "already flushed"),
  /// compare the expected digests with the store's, and move to kPrepared. A timed-out Flush
  /// does not seal, so missing payloads may still arrive and Flush be called again. Repeating a
  /// successful Flush returns the same report. On any error the transfer stays open (kReceiving)
  /// for the coordinator to Abort.
  /// Errors: FailedPrecondition (`id` is not the open transfer; no payload count declared at
  /// Prepare or here); InvalidArgument (an expectation that contradicts Prepare's; a payload
  /// staged that the count does not expect); DeadlineExceeded naming the missing payloads; the
  /// first apply error (e.g. DataLoss for a corrupt payload); NotFound / DataLoss naming the
  /// first expected tensor that the store lacks / whose digest differs; Cancelled when the
  /// transfer is aborted while waiting.
  Result<FlushReport> Flush(const TransferId& id, const FlushOptions& options = {}) override;

  /// Commit prepared transfer `id`: the store's version becomes its target and the undo log is
  /// dropped. Committing an already committed id is OK (idempotent).
  /// Errors: FailedPrecondition naming the state (`id` not flushed yet, aborted, unknown, or not
  /// the open transfer).
  Status Commit(const TransferId& id) override;

  /// Abort transfer `id`: discard queued payloads, wait for the one being applied, and roll the
  /// store back to the base version bit-exactly (bytes and digests). Aborting an already aborted
  /// id is OK. Aborting an id this receiver never prepared while idle is OK too (a coordinator
  /// aborts everywhere, including where Prepare never arrived) and records the id as finished,
  /// so its late payloads and a late Prepare are refused.
  /// Errors: FailedPrecondition (`id` is committed, or another transfer is open); NotFound if the
  /// rollback cannot find a tensor (the transfer then stays open).
  Status Abort(const TransferId& id) override;

  /// What the store's loader holds of each named canonical tensor (ReceiverControl::Regions);
  /// empty without a loader. Resolves each name (cached by the loader); touches no weights.
  Result<HeldRegions> Regions(const std::vector<std::string>& canonical_names) override;

  /// Return a snapshot of the state and counters. Cheap (no store access).
  ReceiverStatus GetStatus() const;

 private:
  struct Impl;
  explicit ReceiverSession(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace refit
