#include "receiver/receiver_session.h"
#include "refit/loader.h"

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "receiver/apply_queue.h"
#include "receiver/transfer_ledger.h"
#include "refit/status_format.h"
#include "util/check.h"
#include "util/logging.h"
#include "util/mutex.h"
#include "util/thread_name.h"

namespace refit {

std::string_view ReceiverStateName(ReceiverState state) {
  switch (state) {
    case ReceiverState::kIdle:
      return "idle";
    case ReceiverState::kReceiving:
      return "receiving";
    case ReceiverState::kPrepared:
      return "prepared";
  }
  return "unknown";
}

namespace internal {
namespace {

using Clock = LedgerClock;

/// The OS name of the apply thread (Linux keeps at most 15 bytes).
constexpr const char* kApplyThreadName = "refit-apply";

uint64_t MillisecondsBetween(Clock::time_point from, Clock::time_point to) {
  if (to <= from) return 0;
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(to - from).count());
}

/// Check that every tensor `expected` names is one `store` holds (or, through its loader, maps
/// or skips): a prepare listing millions of made-up names must not be kept until the next
/// transfer, and a digest for a tensor the receiver cannot hold could never verify.
Status CheckDigestNamesKnown(const WeightStore& store, const TransferExpectation& expected) {
  for (const auto& [name, digest] : expected.digests) {
    const Status known =
        store.has_loader() ? store.ResolveCanonical(name).status() : store.Find(name).status();
    if (!known.ok()) {
      return NotFound(
          "expected digest of tensor '{}', which this receiver does not hold ({} "
          "tensors here): {}",
          name, store.size(), known.message());
    }
  }
  return Status::OK();
}

/// The undo log's options from the session's.
UndoLogOptions UndoLogOptionsOf(const ReceiverSessionOptions& options) {
  return UndoLogOptions{.anchor_undo = options.anchor_undo,
                        .spill_directory = options.anchor_undo_directory};
}

internal::ApplyQueueOptions ApplyQueueOptionsOf(const ReceiverSessionOptions& options) {
  return internal::ApplyQueueOptions{.decode_threads = options.decode_threads,
                                     .apply_threads = options.apply_threads,
                                     .limits = options.limits,
                                     .undo = UndoLogOptionsOf(options),
                                     .before_apply = options.before_apply};
}

internal::LedgerOptions LedgerOptionsOf(const ReceiverSessionOptions& options) {
  return internal::LedgerOptions{.remembered_transfers = options.remembered_transfers,
                                 .transfer_lease = options.transfer_lease,
                                 .preempt_after = options.preempt_after};
}

}  // namespace

// The session joins the two rooms: the ledger (what the protocol allows) and the apply queue
// (the work), under the queue's mutex, with the engine hooks run without it.
struct ReceiverSession::Impl {
  Impl(const ReceiverSessionOptions& session_options, WeightStore& session_store)
      : options(session_options),
        store(session_store),
        queue(ApplyQueueOptionsOf(session_options), session_store),
        ledger(session_store.version(), LedgerOptionsOf(session_options), session_store.lineage()),
        visible_version(session_store.version()) {}

  internal::Mutex& mutex() REFIT_RETURN_CAPABILITY(queue.mutex()) { return queue.mutex(); }

  // ---- Decisions. -----------------------------------------------------------------------------

  // Abort holds the open transfer while it rolls back; every other control call waits for it so
  // that it sees the transfer either fully open or fully finished.
  void WaitForAbortLocked(MutexLock& lock) REFIT_REQUIRES(mutex()) {
    progress.wait(lock, [this]() REFIT_REQUIRES(mutex()) {
      return ledger.open() == nullptr || !ledger.open()->aborting;
    });
  }

  /// Commit the open, prepared transfer; its undo log is dropped.
  void CommitLocked() REFIT_REQUIRES(mutex()) {
    const OpenTransfer& open = *ledger.open();
    const TransferId id = open.id;
    const uint64_t applied = open.applied;
    const bool healed = open.anchor && ledger.needs_anchor().has_value();
    ledger.Commit();
    store.set_version(ledger.version());
    store.set_lineage(ledger.lineage());
    queue.ClearUndo();
    if (healed) {
      REFIT_LOG_INFO("receiver: anchor {} committed: the store no longer needs an anchor",
                     id.ToHex());
    }
    REFIT_LOG_INFO("receiver: committed transfer {} ({} payloads): now at version {}", id.ToHex(),
                   applied, ledger.version());
    progress.notify_all();
  }

  /// Run after_commit for `id` without the lock (re-locked on return), then make the committed
  /// version visible in the status: a reader of the status (wait_for_version, /v1/status) never
  /// sees a version whose bytes a hook is still moving into the engine's memory (a host mirror
  /// copied into the module, tensors handed to the engine's own loading path).
  void PublishCommitLocked(MutexLock& lock, const TransferId& id) REFIT_REQUIRES(mutex()) {
    if (options.after_commit) {
      ++commit_hooks_running;
      const uint64_t committed = ledger.version();
      lock.unlock();
      options.after_commit(id, committed);
      lock.lock();
      --commit_hooks_running;
    }
    // Only once no hook is moving bytes: another commit may have followed while this hook ran.
    if (commit_hooks_running == 0) visible_version = ledger.version();
    progress.notify_all();
  }

  /// Abort the open transfer: discard its queue, wait for the payload being applied, roll back,
  /// remember the id as aborted, and call after_abort without the lock (re-locked on return).
  /// `why` says who ended it, for the log.
  Status AbortOpenLocked(MutexLock& lock, std::string_view why) REFIT_REQUIRES(mutex()) {
    const TransferId id = ledger.open()->id;
    ledger.BeginAbort();
    const size_t discarded = queue.Clear();
    progress.notify_all();  // Wake blocked Stage and Flush callers: the transfer is ending.
    progress.wait(lock, [this]() REFIT_REQUIRES(mutex()) { return !queue.applying(); });
    // Under the lock: nothing applies and the queue is empty, so nothing else touches the store;
    // O(changes of the transfer), like applying it.
    const bool exact = queue.undo_exact();
    const uint64_t applied = ledger.open()->applied;
    Status rollback = queue.Rollback();
    if (!rollback.ok()) {
      ledger.AbortFailed(rollback.WithContext(fmt::format("abort of transfer {}", id.ToHex())));
      progress.notify_all();
      return ledger.last_error();
    }
    ledger.FinishAbort(exact);
    if (exact) {
      REFIT_LOG_INFO(
          "receiver: {} transfer {} ({} payloads applied and rolled back, {} discarded "
          "unapplied): back at version {}",
          why, id.ToHex(), applied, discarded, ledger.version());
    } else {
      REFIT_LOG_WARN("receiver: {} transfer {}: {}; only an anchor is accepted until one commits",
                     why, id.ToHex(), *ledger.needs_anchor());
    }
    progress.notify_all();
    const uint64_t held = ledger.version();
    // Weights that need an anchor must not be served: the engine stays paused (no after_abort)
    // until the anchor's after_commit.
    if (options.after_abort && exact) {
      lock.unlock();
      options.after_abort(id, held);
      lock.lock();
    }
    return Status::OK();
  }

  // ---- Control calls. -------------------------------------------------------------------------

  Result<PrepareResult> Prepare(const PrepareRequest& request) REFIT_EXCLUDES(mutex()) {
    const std::string id = request.transfer_id.ToHex();
    REFIT_RETURN_NOT_OK(
        internal::CheckExpectation(request.expected).WithContext("prepare of transfer " + id));
    if (request.base_version == UINT64_MAX) {
      return InvalidArgument("prepare of transfer {}: base version {} has no successor", id,
                             request.base_version);
    }
    if (request.target_version != 0 && request.target_version <= request.base_version) {
      return InvalidArgument(
          "prepare of transfer {}: target version {} is not above its base version {}", id,
          request.target_version, request.base_version);
    }
    REFIT_RETURN_NOT_OK(
        CheckDigestNamesKnown(store, request.expected).WithContext("prepare of transfer " + id));
    MutexLock lock(mutex());
    WaitForAbortLocked(lock);
    PrepareResult result;
    while (true) {
      REFIT_ASSIGN_OR_RETURN(PrepareStep step, ledger.ClassifyPrepare(request, Clock::now()));
      if (step == PrepareStep::kRepeat) {
        result.repeated = true;
        ledger.Touch(Clock::now());
        return result;
      }
      if (step == PrepareStep::kOpen) break;
      const TransferId old = ledger.open()->id;
      if (step == PrepareStep::kCommitOpenFirst) {
        // The coordinator only starts a transfer from T's target once every receiver prepared T
        // and it decided to commit; this receiver's Commit(T) was lost or is still in flight.
        REFIT_LOG_INFO(
            "receiver: transfer {} is based on version {}: implied commit of transfer {}", id,
            request.base_version, old.ToHex());
        result.implied_commit = old;
        CommitLocked();
        PublishCommitLocked(lock, old);
      } else {
        const bool prepared = ledger.open()->report.has_value();
        REFIT_LOG_INFO(
            "receiver: transfer {} is based on version {}: implied abort of {} transfer {}", id,
            request.base_version, prepared ? "prepared" : "quiet receiving", old.ToHex());
        REFIT_RETURN_NOT_OK(AbortOpenLocked(lock, prepared ? "implied abort of" : "preempted")
                                .WithContext(fmt::format("prepare of transfer {}", id)));
        result.implied_abort = old;
      }
      // The hooks ran without the lock: look again at whatever is open now.
      WaitForAbortLocked(lock);
    }
    ledger.Open(request, Clock::now());
    // A raised epoch fence is kept with the version, so it survives a restart (the store's
    // lineage is what a receiver node saves).
    store.set_lineage(ledger.lineage());
    if (request.anchor && request.base_version != ledger.version()) {
      REFIT_LOG_INFO("receiver: transfer {} is an anchor from version {}; this receiver holds {}",
                     id, request.base_version, ledger.version());
    }
    // Wake the apply thread: this lease may expire before whatever it sleeps for.
    ++lease_generation;
    work.notify_one();
    REFIT_LOG_DEBUG("receiver: prepared transfer {} (version {} -> {})", id, request.base_version,
                    internal::TargetOf(request));
    return result;
  }

  // Whether a payload of `bytes` may join the apply queue now: below its depth, and within its
  // byte bound unless the queue is empty (a payload larger than the bound still passes alone).
  bool HasRoomFor(uint64_t bytes) REFIT_REQUIRES(mutex()) {
    if (queue.size() >= options.apply_queue_depth) return false;
    return options.apply_queue_bytes == 0 || queue.size() == 0 ||
           queue.queued_bytes() + bytes <= options.apply_queue_bytes;
  }

  Result<StageResult> StagePayload(ValidatedPayload& payload, bool block,
                                   const std::stop_token& stop) REFIT_EXCLUDES(mutex()) {
    const PayloadHeader& header = payload.header();
    REFIT_RETURN_NOT_OK(CheckPayloadLimits(header, options.limits));
    const PayloadIds& ids = header.ids;
    MutexLock lock(mutex());
    while (true) {
      REFIT_RETURN_NOT_OK(ledger.CheckStageable(ids));
      REFIT_ASSIGN_OR_RETURN(const bool duplicate, ledger.CheckDuplicate(ids, header.checksum));
      // A sender that offers a payload of the open transfer is alive, even if it must wait.
      ledger.Touch(Clock::now());
      if (duplicate) return StageResult::kDuplicate;
      if (HasRoomFor(payload.size())) break;
      if (!block) {
        return ResourceExhausted(
            "payload {} of producer {} (transfer {}): the apply queue is full ({} payload(s) "
            "of {} bytes; depth {}, {} bytes)",
            ids.payload_id, ids.producer_id, ids.transfer_id.ToHex(), queue.size(),
            queue.queued_bytes(), options.apply_queue_depth, options.apply_queue_bytes);
      }
      // Wake on room or on any change of the transfer; the loop re-checks everything, since
      // another thread may have staged the same payload or the transfer may have ended.
      const bool woken = progress.wait(lock, stop, [&]() REFIT_REQUIRES(mutex()) {
        const OpenTransfer* open = ledger.open();
        return HasRoomFor(payload.size()) || open == nullptr || open->id != ids.transfer_id ||
               open->aborting || open->sealed || !open->first_error.ok();
      });
      if (!woken) {
        return Cancelled(
            "payload {} of producer {} (transfer {}): stop requested while waiting "
            "for room in the apply queue",
            ids.payload_id, ids.producer_id, ids.transfer_id.ToHex());
      }
    }
    ledger.RecordStaged(ids, header.checksum, payload.size(), Clock::now());
    queue.Push(ids, std::move(payload));
    work.notify_one();
    return StageResult::kAccepted;
  }

  Status EndStream(const StreamEnd& end) REFIT_EXCLUDES(mutex()) {
    MutexLock lock(mutex());
    return ledger.EndStream(end, Clock::now());
  }

  /// Seal, verify and prepare. Precondition: every expected payload is staged and applied.
  Result<FlushReport> FinishFlushLocked() REFIT_REQUIRES(mutex()) {
    REFIT_RETURN_NOT_OK(ledger.Seal());
    const OpenTransfer& open = *ledger.open();
    const TransferExpectation& expected = open.expected;
    const std::string id = open.id.ToHex();
    // Device tensors: what was applied is made visible to the weights' readers (the engine's
    // stream) before the flush reports it.
    if (store.has_device_tensors()) {
      Status synced = store.SynchronizeDevices();
      if (!synced.ok()) return synced.WithContext(fmt::format("flush of transfer {}", id));
    }
    FlushReport report;
    report.transfer_id = open.id;
    report.target_version = open.target_version;
    report.payloads = open.applied;
    report.items = open.items;
    report.changed_elements = open.changed_elements;
    report.duplicates = open.duplicates;
    // Safe under the lock: the transfer is sealed and drained, so nothing applies.
    report.digests = store.Digests();
    if (store.has_loader()) {
      // A store in its own layout (e.g. one tensor-parallel shard) cannot check canonical
      // digests alone: it reports what it holds of each expected tensor, in canonical
      // coordinates, and the coordinator verifies the whole replica.
      std::vector<std::string> names;
      names.reserve(expected.digests.size());
      for (const auto& [name, digest] : expected.digests) names.push_back(name);
      Result<std::map<std::string, CanonicalHolding>> holdings = store.Holdings(names);
      if (!holdings.ok()) {
        return holdings.status().WithContext(fmt::format("flush of transfer {}", id));
      }
      report.holdings = *std::move(holdings);
      return PreparedLocked(std::move(report));
    }
    for (const auto& [name, digest] : expected.digests) {
      auto it = report.digests.find(name);
      if (it == report.digests.end()) {
        return NotFound("flush of transfer {}: expected tensor '{}' is not in the store", id, name);
      }
      if (it->second != digest) {
        return DataLoss(
            "flush of transfer {}: tensor '{}' has state digest {:#018x} but the producers "
            "expect {:#018x}",
            id, name, it->second, digest);
      }
    }
    return PreparedLocked(std::move(report));
  }

  /// Move the open transfer to prepared with `report`; from now on it waits for a decision.
  FlushReport PreparedLocked(FlushReport report) REFIT_REQUIRES(mutex()) {
    ledger.Prepared(report, Clock::now());
    ++lease_generation;
    work.notify_one();
    progress.notify_all();
    return report;
  }

  Result<FlushReport> Flush(const TransferId& id, const FlushOptions& options_given)
      REFIT_EXCLUDES(mutex()) {
    const auto deadline = Clock::now() + options_given.timeout;
    MutexLock lock(mutex());
    WaitForAbortLocked(lock);
    if (!ledger.IsOpen(id)) {
      return FailedPrecondition("flush of transfer {}: not the open transfer: {}", id.ToHex(),
                                ledger.Describe(Clock::now()));
    }
    auto finish = [&](Status status) REFIT_REQUIRES(mutex()) {
      ledger.set_last_error(status);
      return status;
    };
    ledger.Touch(Clock::now());
    if (!ledger.open()->report) {
      Status merged = CheckDigestNamesKnown(store, options_given.expected).WithContext("flush");
      if (merged.ok()) merged = ledger.MergeExpectation(options_given.expected);
      if (!merged.ok()) return finish(merged);
      const bool ready = progress.wait_until(lock, deadline, [&]() REFIT_REQUIRES(mutex()) {
        const OpenTransfer* open = ledger.open();
        return open == nullptr || open->id != id || open->aborting || !open->first_error.ok() ||
               open->report || (ledger.AllStaged() && queue.drained());
      });
      const OpenTransfer* open = ledger.open();
      if (open == nullptr || open->id != id || open->aborting) {
        return Cancelled("flush of transfer {}: the transfer was aborted while flushing",
                         id.ToHex());
      }
      if (!open->first_error.ok()) {
        return open->first_error.WithContext(fmt::format("flush of transfer {}", id.ToHex()));
      }
      if (!ready) {
        return finish(DeadlineExceeded("flush of transfer {} timed out after {} ms: {}", id.ToHex(),
                                       options_given.timeout.count(), ledger.DescribeMissing()));
      }
      // A concurrent Flush may have finished it while this one waited.
      if (!open->report) {
        Result<FlushReport> report = FinishFlushLocked();
        if (!report.ok()) return finish(report.status());
        return report;
      }
    }
    // Repeated Flush: the same report, unless it now expects something else.
    if (ledger.ExpectationDiffers(options_given.expected)) {
      return InvalidArgument("flush of transfer {}: already flushed with a different expectation",
                             id.ToHex());
    }
    return *ledger.open()->report;
  }

  Status Commit(const TransferId& id) REFIT_EXCLUDES(mutex()) {
    MutexLock lock(mutex());
    WaitForAbortLocked(lock);
    if (ledger.IsOpen(id)) {
      if (!ledger.open()->report) {
        return FailedPrecondition("commit of transfer {}: it is not flushed yet: {}", id.ToHex(),
                                  ledger.Describe(Clock::now()));
      }
      CommitLocked();
      PublishCommitLocked(lock, id);
      return Status::OK();
    }
    const std::optional<Outcome> outcome = ledger.Finished(id);
    if (outcome == Outcome::kCommitted) {
      // A repeated (or implied, then late) Commit returns once the version is visible, as the
      // first one does: its caller may report the version to whoever reads the weights.
      progress.wait(lock, [this]() REFIT_REQUIRES(mutex()) { return commit_hooks_running == 0; });
      return Status::OK();
    }
    if (outcome == Outcome::kAborted) {
      return FailedPrecondition("commit of transfer {}: it was aborted", id.ToHex());
    }
    return FailedPrecondition("commit of transfer {}: unknown transfer: {}", id.ToHex(),
                              ledger.Describe(Clock::now()));
  }

  Status Abort(const TransferId& id) REFIT_EXCLUDES(mutex()) {
    MutexLock lock(mutex());
    WaitForAbortLocked(lock);
    if (!ledger.IsOpen(id)) {
      const std::optional<Outcome> outcome = ledger.Finished(id);
      if (outcome == Outcome::kAborted) return Status::OK();
      if (outcome == Outcome::kCommitted) {
        return FailedPrecondition("abort of transfer {}: it was already committed", id.ToHex());
      }
      if (ledger.open() != nullptr) {
        return FailedPrecondition("abort of transfer {}: not the open transfer: {}", id.ToHex(),
                                  ledger.Describe(Clock::now()));
      }
      ledger.RecordAbortOfUnprepared(id);
      REFIT_LOG_INFO("receiver: aborted transfer {} before it was prepared here", id.ToHex());
      return Status::OK();
    }
    return AbortOpenLocked(lock, "aborted");
  }

  // ---- The apply thread. ----------------------------------------------------------------------

  /// On the apply thread, with nothing queued or applying: abort a receiving transfer whose
  /// lease ran out; warn once about a prepared one that waits longer than a lease.
  void WatchLeaseLocked(MutexLock& lock) REFIT_REQUIRES(mutex()) {
    const OpenTransfer* open = ledger.open();
    if (open == nullptr || !queue.drained()) return;
    const Clock::time_point now = Clock::now();
    if (open->report) {
      if (!ledger.TakeDecisionWaitWarning(now)) return;
      // No lease ends it: it may be committed on other receivers already.
      REFIT_LOG_WARN(
          "receiver: transfer {} (version {} -> {}) is prepared and has waited {} ms for commit "
          "or abort; it stays prepared: the next transfer based on version {} commits it, one "
          "based on version {} aborts it (or `refit abort`)",
          open->id.ToHex(), open->base_version, open->target_version,
          MillisecondsBetween(open->last_progress, now), open->target_version, open->base_version);
      return;
    }
    const std::optional<Clock::time_point> deadline = ledger.LeaseDeadline();
    if (!deadline || now < *deadline) return;
    const TransferId id = open->id;
    const Status expired = ledger.LeaseExpiredError(now);
    REFIT_LOG_WARN("receiver: {}", expired.message());
    // Recorded before the abort: it runs after_abort without the lock, and a Prepare that
    // slips in then must find this transfer's expiry already reported, not see it afterwards.
    ledger.CountExpiredLease(+1);
    ledger.set_last_error(expired);
    const Status aborted = AbortOpenLocked(lock, "lease expired, aborted");
    if (!aborted.ok()) {
      // Still open (AbortOpenLocked reported the failed rollback in last_error).
      ledger.CountExpiredLease(-1);
      REFIT_LOG_ERROR("receiver: transfer {}: the lease expired but the rollback failed: {}",
                      id.ToHex(), aborted.ToString());
    }
  }

  void RunApply(const std::stop_token& stop) REFIT_EXCLUDES(mutex()) {
    internal::NameCurrentThread(kApplyThreadName);
    MutexLock lock(mutex());
    // The apply thread also keeps the lease: it is the one that knows the receiver itself has
    // nothing left to do, and an abort it starts never waits for a payload being applied.
    while (!stop.stop_requested()) {
      std::optional<QueuedPayload> payload = queue.Pop();
      if (!payload) {
        WatchLeaseLocked(lock);
        if (!queue.empty()) continue;
        const uint64_t generation = lease_generation;
        const auto woken = [this, generation]() REFIT_REQUIRES(mutex()) {
          return !queue.empty() || lease_generation != generation;
        };
        if (const std::optional<Clock::time_point> wake = ledger.NextLeaseEvent()) {
          work.wait_until(lock, stop, *wake, woken);
        } else {
          work.wait(lock, stop, woken);
        }
        continue;
      }
      progress.notify_all();  // Room in the queue.
      // Every queued payload belongs to the open transfer (an abort empties the queue before the
      // transfer ends); nothing applies after the transfer's first error.
      if (!ledger.ShouldApply(payload->ids.transfer_id)) continue;
      queue.BeginApply();
      // Decoded by a decode thread while the previous payload applied, or now (the lock is let
      // go meanwhile: an abort may have begun, and then this payload is not applied).
      queue.DecodeForApply(lock, *payload->work);
      if (!ledger.ShouldApply(payload->ids.transfer_id)) {
        queue.EndApply();
        progress.notify_all();
        continue;
      }
      const bool first_apply = ledger.StartApply();
      lock.unlock();
      // Abort waits for the apply to end, so the transfer is still open during the hook.
      if (first_apply && options.before_first_apply) {
        options.before_first_apply(payload->ids.transfer_id);
      }
      ApplyOutcome outcome = queue.Apply(*payload);
      lock.lock();
      queue.EndApply();
      if (outcome.status.ok()) {
        ledger.RecordApplied(outcome.items, outcome.changed_elements, Clock::now());
      } else {
        ledger.RecordApplyFailed(outcome.status, Clock::now());
        REFIT_LOG_WARN("receiver: transfer {}: apply failed: {}", payload->ids.transfer_id.ToHex(),
                       outcome.status.ToString());
      }
      progress.notify_all();
    }
  }

  ReceiverStatus GetStatus() REFIT_EXCLUDES(mutex()) {
    MutexLock lock(mutex());
    ReceiverStatus status;
    status.state = ledger.state();
    status.version = visible_version;
    // The ledger opens a transfer to the target its prepare names (folded catch-ups).
    status.accepts_target_version = true;
    status.lineage = ledger.lineage();
    status.last_error = ledger.last_error();
    status.undo_bytes = queue.undo_bytes();
    status.undo_file_bytes = queue.undo_file_bytes();
    status.expired_leases = ledger.expired_leases();
    status.received_payloads = ledger.received_payloads();
    status.received_bytes = ledger.received_bytes();
    const BoundaryTraffic device = store.device_traffic();
    status.device_to_bytes = device.to_device_bytes;
    status.device_from_bytes = device.from_device_bytes;
    status.needs_anchor = ledger.needs_anchor().has_value();
    if (ledger.needs_anchor()) status.needs_anchor_reason = *ledger.needs_anchor();
    if (std::optional<Clock::time_point> deadline = ledger.LeaseDeadline()) {
      status.lease_remaining_ms = MillisecondsBetween(Clock::now(), *deadline);
    }
    if (const OpenTransfer* open = ledger.open()) {
      status.transfer_id = open->id;
      status.base_version = open->base_version;
      status.target_version = open->target_version;
      status.sealed = open->sealed;
      status.staged_payloads = open->staged.size();
      status.applied_payloads = open->applied;
      status.queued_payloads = queue.size();
      status.duplicate_payloads = open->duplicates;
    }
    return status;
  }

  /// Roll back a transfer still open at shutdown. The apply thread is gone.
  void RollBackAtShutdown() REFIT_EXCLUDES(mutex()) {
    MutexLock lock(mutex());
    const OpenTransfer* open = ledger.open();
    if (open == nullptr) return;
    const std::string id = open->id.ToHex();
    queue.Clear();
    const bool exact = queue.undo_exact();
    Status rollback = queue.Rollback();
    if (rollback.ok() && !exact) {
      REFIT_LOG_ERROR(
          "receiver: transfer {} was still open at shutdown and applied FULL spans anchor_undo "
          "'none' cannot undo: the store is a mix of versions and needs an anchor",
          id);
    } else if (rollback.ok()) {
      REFIT_LOG_WARN("receiver: transfer {} was still open at shutdown; rolled back to version {}",
                     id, ledger.version());
    } else {
      REFIT_LOG_ERROR(
          "receiver: transfer {} was still open at shutdown and its rollback failed: {}", id,
          rollback.ToString());
    }
  }

  /// Stop and join the apply and decode threads (any may not have started). A decode thread
  /// finishes a decode it started; the apply thread a payload it applies.
  void StopThreads() {
    apply_thread.request_stop();
    if (apply_thread.joinable()) apply_thread.join();
    queue.Stop();
  }

  const ReceiverSessionOptions options;
  WeightStore& store;
  /// The work room; its mutex guards everything below.
  ApplyQueue queue;
  /// The protocol room.
  TransferLedger ledger REFIT_GUARDED_BY(mutex());
  /// The apply thread waits here for queued payloads or a lease event; condition_variable_any so
  /// that the wait also ends on the thread's stop_token.
  internal::CondVar work;
  /// Everything else waits here for progress: room in the queue, a payload applied, a transfer
  /// flushed or ended, a commit hook done.
  internal::CondVar progress;
  /// The version the status reports: the ledger's once no after_commit hook is still moving its
  /// bytes into the engine's memory.
  uint64_t visible_version REFIT_GUARDED_BY(mutex()) = 0;
  /// after_commit hooks running without the lock.
  uint32_t commit_hooks_running REFIT_GUARDED_BY(mutex()) = 0;
  /// Bumped whenever a new lease event may come sooner than the apply thread's wake-up (a
  /// transfer opened or prepared), so that it wakes and looks again.
  uint64_t lease_generation REFIT_GUARDED_BY(mutex()) = 0;
  /// Declared last: it starts after every member it uses is constructed, and stops first.
  std::jthread apply_thread;
};

ReceiverSession::ReceiverSession(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<ReceiverSession>> ReceiverSession::Make(
    const ReceiverSessionOptions& options, WeightStore& store) {
  if (options.apply_queue_depth == 0 ||
      options.apply_queue_depth > ReceiverSessionOptions::kMaxApplyQueueDepth) {
    return InvalidArgument("receiver session: apply_queue_depth {} is outside [1, {}]",
                           options.apply_queue_depth, ReceiverSessionOptions::kMaxApplyQueueDepth);
  }
  if (options.remembered_transfers == 0 ||
      options.remembered_transfers > ReceiverSessionOptions::kMaxRememberedTransfers) {
    return InvalidArgument("receiver session: remembered_transfers {} is outside [1, {}]",
                           options.remembered_transfers,
                           ReceiverSessionOptions::kMaxRememberedTransfers);
  }
  if (options.apply_threads < 1 ||
      options.apply_threads > ReceiverSessionOptions::kMaxApplyThreads) {
    return InvalidArgument("receiver session: apply_threads {} is outside [1, {}]",
                           options.apply_threads, ReceiverSessionOptions::kMaxApplyThreads);
  }
  if (options.decode_threads < 0 ||
      options.decode_threads > ReceiverSessionOptions::kMaxApplyThreads) {
    return InvalidArgument("receiver session: decode_threads {} is outside [0, {}]",
                           options.decode_threads, ReceiverSessionOptions::kMaxApplyThreads);
  }
  if (options.transfer_lease.count() < 0) {
    return InvalidArgument("receiver session: transfer_lease {} ms is negative (0: no lease)",
                           options.transfer_lease.count());
  }
  if (options.preempt_after.count() < 0) {
    return InvalidArgument(
        "receiver session: preempt_after {} ms is negative (0: never preempt a receiving "
        "transfer)",
        options.preempt_after.count());
  }
  REFIT_RETURN_NOT_OK(UndoLog::Validate(UndoLogOptionsOf(options)).WithContext("receiver session"));
  auto impl = std::make_unique<Impl>(options, store);
  REFIT_RETURN_NOT_OK(impl->queue.Start().WithContext("receiver session"));
  // std::jthread reports an OS refusal (EAGAIN: thread or memory limit) only by throwing; turn it
  // into a Status so no exception leaves the library.
  try {
    impl->apply_thread =
        std::jthread([raw = impl.get()](const std::stop_token& stop) { raw->RunApply(stop); });
  } catch (const std::system_error& error) {
    impl->StopThreads();
    return ResourceExhausted("receiver session: cannot start the apply thread: {}", error.what());
  }
  // Not make_unique: the constructor is private.
  return std::unique_ptr<ReceiverSession>(new ReceiverSession(std::move(impl)));
}

ReceiverSession::~ReceiverSession() {
  impl_->StopThreads();
  // The threads are gone, so nothing else touches the store or the undo log.
  impl_->RollBackAtShutdown();
}

Result<PrepareResult> ReceiverSession::Prepare(const PrepareRequest& request) {
  return impl_->Prepare(request);
}

Result<StageResult> ReceiverSession::Stage(ValidatedPayload payload, std::stop_token stop) {
  return impl_->StagePayload(payload, /*block=*/true, stop);
}

Result<StageResult> ReceiverSession::Stage(std::vector<std::byte> payload, std::stop_token stop) {
  REFIT_ASSIGN_OR_RETURN(ValidatedPayload validated,
                         ValidatePayload(std::move(payload), impl_->options.limits));
  return impl_->StagePayload(validated, /*block=*/true, stop);
}

Result<StageResult> ReceiverSession::TryStage(ValidatedPayload& payload) {
  return impl_->StagePayload(payload, /*block=*/false, std::stop_token());
}

Status ReceiverSession::EndStream(const StreamEnd& end) { return impl_->EndStream(end); }

bool ReceiverSession::IsTransferOpen(const TransferId& transfer_id) const {
  MutexLock lock(impl_->mutex());
  return impl_->ledger.IsOpen(transfer_id);
}

std::map<uint32_t, uint32_t> ReceiverSession::DeclaredPayloads(const TransferId& id) const {
  MutexLock lock(impl_->mutex());
  if (!impl_->ledger.IsOpen(id)) return {};
  return impl_->ledger.open()->ended;
}

Result<FlushReport> ReceiverSession::Flush(const TransferId& id, const FlushOptions& options) {
  return impl_->Flush(id, options);
}

Status ReceiverSession::Commit(const TransferId& id) { return impl_->Commit(id); }

Status ReceiverSession::Abort(const TransferId& id) { return impl_->Abort(id); }

Result<HeldRegions> ReceiverSession::Regions(const std::vector<std::string>& canonical_names) {
  if (canonical_names.size() > kMaxRegionTensors) {
    return InvalidArgument("regions: {} tensor names, more than the {} one call may ask about",
                           canonical_names.size(), kMaxRegionTensors);
  }
  HeldRegions regions;
  const Loader* loader = impl_->store.loader();
  if (loader == nullptr) return regions;  // No loader: every tensor is held whole.
  for (const std::string& name : canonical_names) {
    // A tensor the loader cannot resolve is sent whole, so that its apply fails as it always did.
    Result<const CanonicalLayout*> layout = loader->Resolve(name);
    if (!layout.ok() || (*layout)->held_whole()) continue;
    HeldRegion& region = regions[name];
    region.skipped = (*layout)->skipped;
    if (region.skipped) continue;
    region.cols = (*layout)->cols;
    for (const CanonicalPiece& piece : (*layout)->pieces) {
      region.rects.push_back({piece.row_begin, piece.row_end, piece.col_begin, piece.col_end});
    }
  }
  return regions;
}

ReceiverStatus ReceiverSession::GetStatus() const { return impl_->GetStatus(); }

}  // namespace internal
}  // namespace refit
