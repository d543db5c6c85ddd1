// ReceiverSession: the receiver's transactional transfer state — staging with dedupe, a bounded
// FIFO apply queue drained by one apply thread, flush with verification, commit, and abort with a
// bit-exact rollback. Transport-independent: `refit serve` feeds it from ZeroMQ and HTTP.
//
// Three rooms: the TransferLedger (transfer_ledger.h) says what the protocol allows, as pure
// state; the ApplyQueue (apply_queue.h) does the work — decode ahead, apply, undo; this session
// joins them under one lock and runs the engine hooks without it.
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
#include <utility>
#include <vector>

#include "refit/anchor_undo.h"
#include "refit/payload.h"
#include "refit/receiver_session_options.h"
#include "refit/status.h"
#include "refit/transfer.h"
#include "refit/weight_store.h"

namespace refit::internal {

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
/// A receiving transfer quiet for options.preempt_after is rolled back by a Prepare of another
/// transfer from the same base (PrepareResult::implied_abort): its coordinator died, and a
/// transfer this receiver never flushed was committed nowhere.
///
/// Thread-safety: every member function may be called concurrently from any thread. Stage and
/// TryStage are meant for many transport threads; the control calls (Prepare, Flush, Commit,
/// Abort) for the control plane. One mutex (the apply queue's) guards the ledger and the queue;
/// blocked callers (Stage on a full queue, Flush waiting for payloads, Abort waiting for the
/// payload being applied, a repeated Commit waiting for the first one's hook) wait on condition
/// variables without holding it. Payloads are decoded and applied on the session's own threads
/// without the lock, and the engine hooks run without it. No call may be in flight when the
/// session is destroyed.
///
/// The store must outlive the session, and while the session exists it is the only writer of
/// the store's bytes, digests and version. Reading the store is safe while no transfer is open,
/// or while one is kPrepared and no Commit or Abort runs concurrently.
class ReceiverSession final : public ReceiverControl, public PayloadSink {
 public:
  /// Create a session idle at store.version() and start its apply thread.
  /// Errors: InvalidArgument for apply_queue_depth or remembered_transfers outside
  /// [1, ReceiverSessionOptions::kMax…], apply_threads outside [1, kMaxApplyThreads],
  /// decode_threads outside [0, kMaxApplyThreads], a negative transfer_lease, or an
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

  // ---- PayloadSink: a transport's Listener delivers into the session itself. ----------------

  /// Stage a payload a listener received (Stage, blocking while the apply queue is full).
  Result<StageResult> Deliver(ValidatedPayload payload, std::stop_token stop) override {
    return Stage(std::move(payload), std::move(stop));
  }
  /// Record a stream end a listener received (EndStream).
  Status EndOfStream(const StreamEnd& end) override { return EndStream(end); }
  /// Whether `transfer_id` is the open transfer (prepared, not yet committed or aborted).
  bool IsTransferOpen(const TransferId& transfer_id) const override;

  /// What the store's loader holds of each named canonical tensor (ReceiverControl::Regions);
  /// empty without a loader. Resolves each name (cached by the loader); touches no weights.
  Result<HeldRegions> Regions(const std::vector<std::string>& canonical_names) override;

  /// Return a snapshot of the state and counters. Cheap (no store access). Its version is the
  /// last committed version once its after_commit hook returned: while the hook moves the bytes
  /// into the engine's memory, the version before it is reported (a reader never sees a version
  /// the engine does not hold yet).
  ReceiverStatus GetStatus() const;

 private:
  struct Impl;
  explicit ReceiverSession(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace refit::internal
