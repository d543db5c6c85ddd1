// TransferLedger: the receiver's bookkeeping of transfers as pure state — which transfer is open,
// what it expects, what was staged, which streams ended, what was applied, how it was decided,
// and which transfers are finished. No threads, no locks, no weights: ReceiverSession holds it
// under its mutex and joins it with the apply queue (apply_queue.h), which does the work.
//
// Every rule of the transfer protocol a receiver enforces lives here (docs/protocol.md, "The
// receiver's state machine"): version fencing, implied commit and implied abort, dedupe by
// payload ids, per-producer payload counts, stream ends, the leases. Being pure, it is tested on
// sequences of events alone (tests/unit/transfer_ledger_test.cc).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>

#include "refit/payload.h"
#include "refit/receiver_session_options.h"
#include "refit/status.h"
#include "refit/transfer.h"

namespace refit::internal {

using LedgerClock = std::chrono::steady_clock;

/// How a finished transfer ended.
enum class Outcome : uint8_t { kCommitted, kAborted };

std::string_view OutcomeName(Outcome outcome);

/// What a Prepare has to do before its transfer opens.
enum class PrepareStep : uint8_t {
  /// The open transfer's own request again: nothing changes.
  kRepeat,
  /// Open the transfer now.
  kOpen,
  /// The open transfer is prepared and the request is based on its target: the coordinator
  /// decided to commit it, and this receiver's Commit was lost or is in flight. Commit it, then
  /// classify the request again.
  kCommitOpenFirst,
  /// The request is based on the open transfer's base under a new id, and the open transfer is
  /// prepared (its coordinator gave up on it or died), or still receiving and quiet for
  /// preempt_after (its coordinator died before its flush; it cannot have committed anywhere,
  /// since a commit needs this receiver's flush). Roll it back, then classify the request again.
  kAbortOpenFirst,
};

/// The ledger's options: the session's, less what only the threads need.
struct LedgerOptions {
  /// Finished transfer ids kept (ReceiverSessionOptions::remembered_transfers).
  size_t remembered_transfers = 1024;
  /// ReceiverSessionOptions::transfer_lease; zero: no lease.
  std::chrono::milliseconds transfer_lease{std::chrono::minutes(5)};
  /// ReceiverSessionOptions::preempt_after; zero: a receiving transfer is never preempted.
  std::chrono::milliseconds preempt_after{std::chrono::seconds(5)};
};

/// The open transfer, as the ledger keeps it.
struct OpenTransfer {
  TransferId id;
  uint64_t base_version = 0;
  uint64_t target_version = 0;
  /// The expectation as Prepare declared it (a repeated Prepare must match it).
  TransferExpectation declared;
  /// The expectation in force: Prepare's, completed by Flush.
  TransferExpectation expected;
  /// No more payloads accepted.
  bool sealed = false;
  /// Set while it is being rolled back.
  bool aborting = false;
  /// Staged payloads: (producer << 32 | payload) → body checksum.
  std::unordered_map<uint64_t, std::array<uint8_t, 16>> staged;
  /// Distinct payloads staged per producer.
  std::map<uint32_t, uint64_t> staged_per_producer;
  /// The payload count of each producer whose stream end arrived.
  std::map<uint32_t, uint32_t> ended;
  uint64_t applied = 0;
  uint64_t items = 0;
  uint64_t changed_elements = 0;
  uint64_t duplicates = 0;
  /// The first apply error; after it, queued payloads are discarded unapplied.
  Status first_error;
  /// Set by a successful Flush: the transfer is prepared.
  std::optional<FlushReport> report;
  /// Whether the transfer is an anchor (accepted whatever version the receiver held).
  bool anchor = false;
  /// The lineage its Prepare stated; committed with it.
  TransferLineage lineage;
  /// Whether the first payload started to apply (before_first_apply was called).
  bool apply_started = false;
  /// The last Prepare, payload, apply, stream end or Flush: its lease runs from here.
  LedgerClock::time_point last_progress;
  /// Whether the warning that a prepared transfer outwaited the lease was logged.
  bool decision_wait_logged = false;
};

/// The receiver's transfer bookkeeping.
///
/// Thread-safety: none; the owner serializes every call (ReceiverSession holds its mutex).
/// Complexity: every call is O(1) or O(payloads of the open transfer), never O(model).
/// Check an expectation's own consistency (the per-producer counts add up to the total).
Status CheckExpectation(const TransferExpectation& expected);

/// The version `request` takes the receiver to: its named target, or base_version + 1. A receiver
/// caught up by folded deltas is prepared from its own version to the fleet's target, several
/// versions on (docs/protocol.md, "Per-receiver plans").
uint64_t TargetOf(const PrepareRequest& request);

class TransferLedger {
 public:
  /// A ledger at committed `version`, holding `lineage` (what the store was loaded with).
  TransferLedger(uint64_t version, const LedgerOptions& options, HeldLineage lineage = {});

  // ---- State. ----------------------------------------------------------------------------------

  /// The committed version (what fences the next transfer).
  uint64_t version() const { return version_; }
  /// The lineage of the committed version, with the highest epoch of its run seen.
  const HeldLineage& lineage() const { return lineage_; }
  ReceiverState state() const;
  /// The open transfer, or null.
  const OpenTransfer* open() const { return open_ ? &*open_ : nullptr; }
  /// Whether `id` is the open transfer.
  bool IsOpen(const TransferId& id) const { return open_ && open_->id == id; }
  /// How `id` ended, if it is remembered as finished.
  std::optional<Outcome> Finished(const TransferId& id) const;
  /// One sentence on the state, for errors: idle at a version, or the open transfer and its lease.
  std::string Describe(LedgerClock::time_point now) const;

  // ---- Prepare. --------------------------------------------------------------------------------

  /// What `request` needs (see PrepareStep). Errors: FailedPrecondition naming the state — the id
  /// finished already, is open with another request, another transfer is receiving, the open
  /// prepared transfer is based on neither the request's base nor its target, the receiver needs
  /// an anchor and this is a delta, or the delta's base is not the receiver's version — or
  /// naming both lineages (docs/protocol.md "Lineage and fencing"): a delta of another run, an
  /// anchor of another run that would reuse a version number held, an epoch below the one seen
  /// (a zombie trainer), a delta whose base fingerprint is not the one held at that version, a
  /// request stating no lineage to a receiver that holds one, or an implied commit or abort of
  /// the open transfer asked by another lineage.
  Result<PrepareStep> ClassifyPrepare(const PrepareRequest& request,
                                      LedgerClock::time_point now) const;
  /// Open `request`'s transfer; a higher epoch of the run held raises the fence at once.
  /// Precondition: ClassifyPrepare said kOpen.
  void Open(const PrepareRequest& request, LedgerClock::time_point now);
  /// Record progress of the open transfer: its lease starts again.
  void Touch(LedgerClock::time_point now);

  // ---- Stage. ----------------------------------------------------------------------------------

  /// Check that a payload with `ids` may be staged now (open, not sealed or aborting, versions and
  /// counts agree, no earlier failure).
  Status CheckStageable(const PayloadIds& ids) const;
  /// Whether a payload with `ids` and `checksum` was staged already (a duplicate, counted); an
  /// AlreadyExists error if it was staged with another checksum. Precondition: CheckStageable.
  Result<bool> CheckDuplicate(const PayloadIds& ids, const std::array<uint8_t, 16>& checksum);
  /// Record a payload staged. Precondition: CheckStageable and not a duplicate.
  void RecordStaged(const PayloadIds& ids, const std::array<uint8_t, 16>& checksum, uint64_t bytes,
                    LedgerClock::time_point now);
  /// Record that producer `end.producer_id` ended its stream (ReceiverSession::EndStream).
  Status EndStream(const StreamEnd& end, LedgerClock::time_point now);

  // ---- Apply. ----------------------------------------------------------------------------------

  /// Whether a queued payload of `id` is still to be applied: its transfer is open, not aborting
  /// and has not failed.
  bool ShouldApply(const TransferId& id) const;
  /// Mark that a payload of the open transfer starts to apply; true for the transfer's first.
  bool StartApply();
  /// Record one payload applied, or its failure (the transfer's first error, also last_error).
  void RecordApplied(uint64_t items, uint64_t changed_elements, LedgerClock::time_point now);
  void RecordApplyFailed(const Status& error, LedgerClock::time_point now);

  // ---- Flush. ----------------------------------------------------------------------------------

  /// Combine the expectation given to Flush with the one in force (store-independent checks).
  Status MergeExpectation(const TransferExpectation& given);
  /// Whether every expected payload is staged. Precondition: a payload count is declared.
  bool AllStaged() const;
  /// Which expected payloads are missing, for a DeadlineExceeded.
  std::string DescribeMissing() const;
  /// Seal the open transfer (later payloads are refused); InvalidArgument if more payloads were
  /// staged than a total count expects.
  Status Seal();
  /// Move the open transfer to prepared with `report`.
  void Prepared(FlushReport report, LedgerClock::time_point now);
  /// Whether `given` asks a prepared transfer for something else than it was flushed with.
  bool ExpectationDiffers(const TransferExpectation& given) const;

  // ---- Decide. ---------------------------------------------------------------------------------

  /// Commit the open, prepared transfer: the version becomes its target, the lineage its
  /// lineage with the fingerprint of the digests its Flush declared, an anchor clears
  /// needs_anchor, the id is remembered as committed. Precondition: prepared.
  void Commit();
  /// Mark the open transfer as being rolled back (its payloads are refused, waiters wake).
  void BeginAbort();
  /// The rollback failed: the transfer stays open, `error` becomes last_error.
  void AbortFailed(const Status& error);
  /// The rollback is done: the id is remembered as aborted. `exact` false: FULL spans could not
  /// be undone, and only an anchor is accepted until one commits.
  void FinishAbort(bool exact);
  /// Remember `id` as aborted though it never opened here (a coordinator aborts everywhere).
  void RecordAbortOfUnprepared(const TransferId& id);

  // ---- Leases. ---------------------------------------------------------------------------------

  /// When the open transfer's lease expires: only while it is receiving, under a lease, and not
  /// being aborted.
  std::optional<LedgerClock::time_point> LeaseDeadline() const;
  /// When to look at the lease next: its deadline, or for a prepared transfer when to warn once.
  std::optional<LedgerClock::time_point> NextLeaseEvent() const;
  /// Whether a prepared transfer has waited a lease for its decision and was not warned about
  /// yet; marks it warned.
  bool TakeDecisionWaitWarning(LedgerClock::time_point now);
  /// The DeadlineExceeded to report when the open transfer's lease expired at `now`.
  Status LeaseExpiredError(LedgerClock::time_point now) const;
  /// Count a lease expiry (ReceiverStatus::expired_leases), or take it back when the rollback
  /// failed.
  void CountExpiredLease(int delta) { expired_leases_ += delta; }

  // ---- What the status reports. ----------------------------------------------------------------

  const Status& last_error() const { return last_error_; }
  void set_last_error(Status error) { last_error_ = std::move(error); }
  const std::optional<std::string>& needs_anchor() const { return needs_anchor_; }
  void set_needs_anchor(std::string why) { needs_anchor_ = std::move(why); }
  uint64_t expired_leases() const { return expired_leases_; }
  uint64_t received_payloads() const { return received_payloads_; }
  uint64_t received_bytes() const { return received_bytes_; }

 private:
  /// Check that the per-producer counts of `expectation` (declared by `by`) agree with every
  /// stream end recorded: a producer absent from them is expected to send nothing.
  Status CheckStreamEnds(const TransferExpectation& expectation, std::string_view by) const;
  /// The lineage rules against the committed version and lineage (ClassifyPrepare).
  Status CheckLineage(const PrepareRequest& request) const;
  /// Whether `request` may commit or abort the open transfer implicitly: the same run, an epoch
  /// not below the open transfer's.
  Status CheckImpliedDecision(const PrepareRequest& request, std::string_view decision) const;
  void Remember(const TransferId& id, Outcome outcome);

  LedgerOptions options_;
  uint64_t version_;
  HeldLineage lineage_;
  std::optional<OpenTransfer> open_;
  std::optional<std::string> needs_anchor_;
  Status last_error_;
  uint64_t expired_leases_ = 0;
  uint64_t received_payloads_ = 0;
  uint64_t received_bytes_ = 0;
  /// Finished transfers, and their ids oldest first (for forgetting).
  std::map<std::array<uint8_t, 16>, Outcome> finished_;
  std::deque<std::array<uint8_t, 16>> finished_order_;
};

}  // namespace refit::internal
