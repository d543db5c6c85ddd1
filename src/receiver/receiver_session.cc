#include "receiver/receiver_session.h"
#include "refit/loader.h"

#include <array>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "receiver/apply.h"
#include "refit/status_format.h"
#include "util/check.h"
#include "util/logging.h"
#include "util/thread_name.h"

namespace refit {
namespace {

/// Missing payloads named in a DeadlineExceeded message; the rest are counted. Enough to show a
/// pattern (one producer silent, one payload lost) without a megabyte-long message.
constexpr size_t kMaxNamedMissingPayloads = 8;

/// The OS name of the apply thread (Linux keeps at most 15 bytes).
constexpr const char* kApplyThreadName = "refit-apply";
constexpr const char* kDecodeThreadName = "refit-decode";

using Clock = std::chrono::steady_clock;

uint64_t MillisecondsBetween(Clock::time_point from, Clock::time_point to) {
  if (to <= from) return 0;
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(to - from).count());
}

/// How a finished transfer ended.
enum class Outcome : uint8_t { kCommitted, kAborted };

std::string_view OutcomeName(Outcome outcome) {
  return outcome == Outcome::kCommitted ? "committed" : "aborted";
}

/// The dedupe key of a payload within its transfer.
uint64_t PayloadKey(uint32_t producer_id, uint32_t payload_id) {
  return (uint64_t{producer_id} << 32) | payload_id;
}

Status CheckExpectation(const TransferExpectation& expected) {
  if (!expected.payloads_per_producer.empty() && expected.total_payloads.has_value()) {
    uint64_t sum = 0;
    for (const auto& [producer, count] : expected.payloads_per_producer) sum += count;
    if (sum != *expected.total_payloads) {
      return InvalidArgument(
          "expected total_payloads {} != {}, the sum of the per-producer payload counts",
          *expected.total_payloads, sum);
    }
  }
  return Status::OK();
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

/// A staged payload's bytes and their decode, which the decode thread may do ahead of the apply
/// (validation, checksum, decompression: the part of a payload's work that does not touch the
/// store). Shared: a thread decoding it keeps it alive when an abort empties the queue.
struct PayloadWork {
  explicit PayloadWork(ValidatedPayload staged) : payload(std::move(staged)) {}
  /// Guarded by the session's mutex: who decodes it, and whether that is done.
  enum class Decode : uint8_t { kPending, kRunning, kDone };
  Decode decode = Decode::kPending;
  /// As staged; the apply moves it to the undo log (an XOR item is undone by applying it again).
  ValidatedPayload payload;
  /// Written by the thread that set kRunning, without the lock; read once kDone.
  std::optional<Result<DecodedPayload>> decoded;
};

/// One staged payload waiting for the apply thread.
struct QueuedPayload {
  PayloadIds ids;
  std::shared_ptr<PayloadWork> work;
};

/// Everything the apply thread learns from one payload.
struct ApplyOutcome {
  Status status;
  uint64_t items = 0;
  uint64_t changed_elements = 0;
};

}  // namespace

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

namespace {
/// The undo log's options from the session's.
UndoLogOptions UndoLogOptionsOf(const ReceiverSessionOptions& options) {
  return UndoLogOptions{.anchor_undo = options.anchor_undo,
                        .spill_directory = options.anchor_undo_directory};
}
}  // namespace

struct ReceiverSession::Impl {
  /// The open transfer.
  struct Transfer {
    TransferId id;
    uint64_t base_version = 0;
    uint64_t target_version = 0;
    /// The expectation as Prepare declared it (a repeated Prepare must match it).
    TransferExpectation declared;
    /// The expectation in force: Prepare's, completed by Flush.
    TransferExpectation expected;
    /// No more payloads accepted.
    bool sealed = false;
    /// Set by Abort while it waits for the apply thread and rolls back.
    bool aborting = false;
    /// Staged payloads: PayloadKey → body checksum.
    std::unordered_map<uint64_t, std::array<uint8_t, 16>> staged;
    /// Distinct payloads staged per producer.
    std::map<uint32_t, uint64_t> staged_per_producer;
    /// The payload count of each producer whose stream end arrived (EndStream).
    std::map<uint32_t, uint32_t> ended;
    uint64_t applied = 0;
    uint64_t items = 0;
    uint64_t changed_elements = 0;
    uint64_t duplicates = 0;
    /// The first apply error; after it, queued payloads are discarded unapplied.
    Status first_error;
    /// Set by a successful Flush: the transfer is kPrepared.
    std::optional<FlushReport> report;
    /// Whether the transfer is an anchor (accepted whatever version the receiver held).
    bool anchor = false;
    /// Whether before_first_apply was called for this transfer.
    bool apply_started = false;
    /// The last Prepare, payload, apply or Flush of this transfer: its lease runs from here.
    Clock::time_point last_progress = Clock::now();
    /// Whether the warning that a prepared transfer outwaited the lease was logged.
    bool decision_wait_logged = false;
  };

  Impl(const ReceiverSessionOptions& session_options, WeightStore& session_store)
      : options(session_options),
        store(session_store),
        version(session_store.version()),
        undo(UndoLogOptionsOf(session_options)) {}

  ReceiverState StateLocked() const {
    if (!transfer) return ReceiverState::kIdle;
    return transfer->report ? ReceiverState::kPrepared : ReceiverState::kReceiving;
  }

  std::string DescribeLocked() const {
    if (!transfer) return fmt::format("the receiver is idle at version {}", version);
    std::string described = fmt::format("the receiver is {} transfer {} (version {} -> {})",
                                        ReceiverStateName(StateLocked()), transfer->id.ToHex(),
                                        transfer->base_version, transfer->target_version);
    // Say when it ends by itself, so whoever is refused knows whether waiting helps.
    const Clock::time_point now = Clock::now();
    if (std::optional<Clock::time_point> deadline = LeaseDeadlineLocked()) {
      described += fmt::format(", no progress for {} ms, its lease expires in {} ms",
                               MillisecondsBetween(transfer->last_progress, now),
                               MillisecondsBetween(now, *deadline));
    } else if (transfer->report) {
      described += fmt::format(", waiting {} ms for commit or abort",
                               MillisecondsBetween(transfer->last_progress, now));
    }
    return described;
  }

  // ---- Lease. ---------------------------------------------------------------------------------

  /// Record progress of the open transfer: its lease starts again.
  void TouchLocked() {
    if (transfer) transfer->last_progress = Clock::now();
  }

  /// When the open transfer's lease expires: only while it is receiving, under a lease, and
  /// not already being aborted.
  std::optional<Clock::time_point> LeaseDeadlineLocked() const {
    if (!transfer || transfer->report || transfer->aborting) return std::nullopt;
    if (options.transfer_lease.count() == 0) return std::nullopt;
    return transfer->last_progress + options.transfer_lease;
  }

  /// When the apply thread must look at the lease next: the lease deadline, or, for a prepared
  /// transfer, when to warn once that it has outwaited a lease.
  std::optional<Clock::time_point> NextLeaseEventLocked() const {
    if (std::optional<Clock::time_point> deadline = LeaseDeadlineLocked()) return deadline;
    if (transfer && transfer->report && !transfer->decision_wait_logged &&
        options.transfer_lease.count() > 0) {
      return transfer->last_progress + options.transfer_lease;
    }
    return std::nullopt;
  }

  /// On the apply thread, with nothing queued or applying: abort a receiving transfer whose
  /// lease ran out; warn once about a prepared one that waits longer than a lease.
  void WatchLeaseLocked(std::unique_lock<std::mutex>& lock) {
    if (!transfer || applying || !queue.empty()) return;
    const Clock::time_point now = Clock::now();
    if (transfer->report) {
      if (transfer->decision_wait_logged || options.transfer_lease.count() == 0 ||
          now < transfer->last_progress + options.transfer_lease) {
        return;
      }
      transfer->decision_wait_logged = true;
      // No lease ends it: it may be committed on other receivers already.
      REFIT_LOG_WARN(
          "receiver: transfer {} (version {} -> {}) is prepared and has waited {} ms for commit "
          "or abort; it stays prepared: the next transfer based on version {} commits it, one "
          "based on version {} aborts it (or `refit abort`)",
          transfer->id.ToHex(), transfer->base_version, transfer->target_version,
          MillisecondsBetween(transfer->last_progress, now), transfer->target_version,
          transfer->base_version);
      return;
    }
    const std::optional<Clock::time_point> deadline = LeaseDeadlineLocked();
    if (!deadline || now < *deadline) return;
    const TransferId id = transfer->id;
    const Status expired = DeadlineExceeded(
        "transfer {} (version {} -> {}): its lease of {} ms expired with no prepare, payload, "
        "flush or commit for {} ms ({} payloads staged, {} applied); aborted and rolled back to "
        "version {}",
        id.ToHex(), transfer->base_version, transfer->target_version,
        options.transfer_lease.count(), MillisecondsBetween(transfer->last_progress, now),
        transfer->staged.size(), transfer->applied, version);
    REFIT_LOG_WARN("receiver: {}", expired.message());
    // Recorded before the abort: it runs after_abort without the lock, and a Prepare that
    // slips in then must find this transfer's expiry already reported, not see it afterwards.
    ++expired_leases;
    last_error = expired;
    const Status aborted = AbortOpenLocked(lock, "lease expired, aborted");
    if (!aborted.ok()) {
      // Still open (AbortOpenLocked reported the failed rollback in last_error).
      --expired_leases;
      REFIT_LOG_ERROR("receiver: transfer {}: the lease expired but the rollback failed: {}",
                      id.ToHex(), aborted.ToString());
    }
  }

  std::optional<Outcome> FinishedLocked(const TransferId& id) const {
    auto it = finished.find(id.bytes);
    if (it == finished.end()) return std::nullopt;
    return it->second;
  }

  void RememberLocked(const TransferId& id, Outcome outcome) {
    if (finished.emplace(id.bytes, outcome).second) finished_order.push_back(id.bytes);
    while (finished_order.size() > options.remembered_transfers) {
      finished.erase(finished_order.front());
      finished_order.pop_front();
    }
  }

  // Abort holds the open transfer while it rolls back; every other control call waits for it so
  // that it sees the transfer either fully open or fully finished.
  void WaitForAbortLocked(std::unique_lock<std::mutex>& lock) {
    progress.wait(lock, [this] { return !transfer || !transfer->aborting; });
  }

  void CommitLocked() {
    REFIT_DCHECK(transfer && transfer->report, "CommitLocked needs a prepared transfer");
    version = transfer->target_version;
    store.set_version(version);
    undo.Clear();
    undo_bytes = 0;
    undo_file_bytes = 0;
    if (needs_anchor && transfer->anchor) {
      REFIT_LOG_INFO("receiver: anchor {} committed: the store no longer needs an anchor",
                     transfer->id.ToHex());
      needs_anchor.reset();
    }
    RememberLocked(transfer->id, Outcome::kCommitted);
    REFIT_LOG_INFO("receiver: committed transfer {} ({} payloads): now at version {}",
                   transfer->id.ToHex(), transfer->applied, version);
    transfer.reset();
    progress.notify_all();
  }

  // ---- Stage. ---------------------------------------------------------------------------------

  /// Check that `ids` may be staged now; the dedupe and room checks come after.
  Status CheckStageableLocked(const PayloadIds& ids) const {
    auto context = [&] {
      return fmt::format("payload {} of producer {} (transfer {})", ids.payload_id, ids.producer_id,
                         ids.transfer_id.ToHex());
    };
    if (std::optional<Outcome> outcome = FinishedLocked(ids.transfer_id)) {
      return FailedPrecondition("{}: the transfer was already {}", context(),
                                OutcomeName(*outcome));
    }
    if (!transfer || transfer->id != ids.transfer_id) {
      return FailedPrecondition("{}: not the open transfer: {}", context(), DescribeLocked());
    }
    if (transfer->aborting)
      return FailedPrecondition("{}: the transfer is being aborted", context());
    if (transfer->sealed)
      return FailedPrecondition("{}: the transfer is already flushed", context());
    if (ids.base_version != transfer->base_version ||
        ids.target_version != transfer->target_version) {
      return FailedPrecondition("{}: moves version {} -> {} but the transfer moves {} -> {}",
                                context(), ids.base_version, ids.target_version,
                                transfer->base_version, transfer->target_version);
    }
    if (!transfer->first_error.ok()) {
      return transfer->first_error.WithContext(
          fmt::format("{}: the transfer failed earlier", context()));
    }
    if (auto ended = transfer->ended.find(ids.producer_id);
        ended != transfer->ended.end() && ids.payload_id >= ended->second) {
      return InvalidArgument("{}: unexpected: producer {} ended its stream with {} payloads",
                             context(), ids.producer_id, ended->second);
    }
    const auto& per_producer = transfer->expected.payloads_per_producer;
    if (!per_producer.empty()) {
      auto it = per_producer.find(ids.producer_id);
      const uint32_t count = it == per_producer.end() ? 0 : it->second;
      if (ids.payload_id >= count) {
        return InvalidArgument("{}: unexpected: producer {} sends {} payloads (ids 0 to n-1)",
                               context(), ids.producer_id, count);
      }
    }
    return Status::OK();
  }

  Result<StageResult> StagePayload(ValidatedPayload& payload, bool block,
                                   const std::stop_token& stop) {
    const PayloadHeader& header = payload.header();
    REFIT_RETURN_NOT_OK(CheckPayloadLimits(header, options.limits));
    const PayloadIds& ids = header.ids;
    const uint64_t key = PayloadKey(ids.producer_id, ids.payload_id);
    std::unique_lock lock(mutex);
    while (true) {
      REFIT_RETURN_NOT_OK(CheckStageableLocked(ids));
      auto staged = transfer->staged.find(key);
      if (staged != transfer->staged.end()) {
        if (staged->second != header.checksum) {
          return AlreadyExists(
              "payload {} of producer {} (transfer {}) was already staged with another checksum",
              ids.payload_id, ids.producer_id, ids.transfer_id.ToHex());
        }
        ++transfer->duplicates;
        TouchLocked();
        return StageResult::kDuplicate;
      }
      // A sender that offers a payload of the open transfer is alive, even if it must wait.
      TouchLocked();
      if (queue.size() < options.apply_queue_depth) break;
      if (!block) {
        return ResourceExhausted(
            "payload {} of producer {} (transfer {}): the apply queue is full at depth {}",
            ids.payload_id, ids.producer_id, ids.transfer_id.ToHex(), options.apply_queue_depth);
      }
      // Wake on room or on any change of the transfer; the loop re-checks everything, since
      // another thread may have staged the same payload or the transfer may have ended.
      const bool woken = progress.wait(lock, stop, [&] {
        return queue.size() < options.apply_queue_depth || !transfer ||
               transfer->id != ids.transfer_id || transfer->aborting || transfer->sealed ||
               !transfer->first_error.ok();
      });
      if (!woken) {
        return Cancelled(
            "payload {} of producer {} (transfer {}): stop requested while waiting "
            "for room in the apply queue",
            ids.payload_id, ids.producer_id, ids.transfer_id.ToHex());
      }
    }
    transfer->staged.emplace(key, header.checksum);
    ++transfer->staged_per_producer[ids.producer_id];
    ++received_payloads;
    received_bytes += payload.size();
    queue.push_back(QueuedPayload{ids, std::make_shared<PayloadWork>(std::move(payload))});
    work.notify_one();
    decode_work.notify_one();
    return StageResult::kAccepted;
  }

  // ---- Apply thread. --------------------------------------------------------------------------

  // Decode `work` unless another thread is on it, and wait until it is decoded. Called by the
  // apply thread, with the lock, for the payload it is about to apply.
  void DecodeForApplyLocked(std::unique_lock<std::mutex>& lock, PayloadWork& payload) {
    if (payload.decode == PayloadWork::Decode::kPending) {
      payload.decode = PayloadWork::Decode::kRunning;
      lock.unlock();
      payload.decoded = DecodePayload(payload.payload, options.limits);
      lock.lock();
      payload.decode = PayloadWork::Decode::kDone;
      return;
    }
    // The decode thread finishes what it started (a bounded decode), whatever stop says.
    decoded.wait(lock, [&] { return payload.decode == PayloadWork::Decode::kDone; });
  }

  ApplyOutcome ApplyOne(QueuedPayload& payload) {
    if (options.before_apply) options.before_apply(payload.ids);
    ApplyOutcome outcome;
    PayloadWork& staged = *payload.work;
    if (!staged.decoded->ok()) {
      outcome.status = staged.decoded->status();
      return outcome;
    }
    const DecodedPayload& decoded_payload = **staged.decoded;
    for (const ItemView& item : decoded_payload.items()) {
      ++outcome.items;
      outcome.changed_elements += item.count;
    }
    // The payload's bytes go to the undo log, which rolls its XOR items back by applying them
    // again: O(wire) instead of the old bits (docs/architecture.md, "Rollback").
    outcome.status =
        ApplyPayload(decoded_payload, store, &undo, &staged.payload, options.apply_threads);
    return outcome;
  }

  // A decode thread: decode the first queued payload nobody has started, so that the next
  // payloads are decoded while the apply thread applies this one. Nothing it does touches the
  // store; a payload it decodes is applied (or dropped by an abort) by the apply thread.
  void RunDecodeAhead(const std::stop_token& stop) {
    internal::NameCurrentThread(kDecodeThreadName);
    std::unique_lock lock(mutex);
    while (!stop.stop_requested()) {
      std::shared_ptr<PayloadWork> next;
      // At most decode_threads queued payloads decoded (or being decoded) ahead of the apply:
      // each holds its decompressed body until it is applied.
      const auto pending = [&] {
        size_t ahead = 0;
        for (const QueuedPayload& queued : queue) {
          if (queued.work->decode != PayloadWork::Decode::kPending) {
            if (++ahead == static_cast<size_t>(options.decode_threads)) return false;
            continue;
          }
          next = queued.work;
          return true;
        }
        return false;
      };
      if (!decode_work.wait(lock, stop, pending)) break;
      next->decode = PayloadWork::Decode::kRunning;
      lock.unlock();
      next->decoded = DecodePayload(next->payload, options.limits);
      lock.lock();
      next->decode = PayloadWork::Decode::kDone;
      decoded.notify_all();
    }
  }

  void RunApply(const std::stop_token& stop) {
    internal::NameCurrentThread(kApplyThreadName);
    std::unique_lock lock(mutex);
    // The apply thread also keeps the lease: it is the one that knows the receiver itself has
    // nothing left to do, and an abort it starts never waits for a payload being applied.
    while (!stop.stop_requested()) {
      if (queue.empty()) {
        WatchLeaseLocked(lock);
        if (!queue.empty()) continue;
        const uint64_t generation = lease_generation;
        const auto woken = [this, generation] {
          return !queue.empty() || lease_generation != generation;
        };
        if (const std::optional<Clock::time_point> wake = NextLeaseEventLocked()) {
          work.wait_until(lock, stop, *wake, woken);
        } else {
          work.wait(lock, stop, woken);
        }
        continue;
      }
      QueuedPayload payload = std::move(queue.front());
      queue.pop_front();
      decode_work.notify_one();  // Room to decode the next one ahead.
      // Every queued payload belongs to the open transfer: Abort empties the queue before the
      // transfer ends, and only the open transfer's payloads are staged.
      REFIT_DCHECK(transfer && transfer->id == payload.ids.transfer_id,
                   "a queued payload outlived its transfer");
      progress.notify_all();                      // Room in the queue.
      if (!transfer->first_error.ok()) continue;  // Nothing applies after the first error.
      applying = true;
      // Decoded by the decode thread while the previous payload applied, or now (the lock is
      // let go meanwhile: an abort may have begun, and then this payload is not applied).
      DecodeForApplyLocked(lock, *payload.work);
      if (transfer->aborting) {
        applying = false;
        progress.notify_all();
        continue;
      }
      const bool first_apply = !std::exchange(transfer->apply_started, true);
      lock.unlock();
      // Abort waits for `applying` to clear, so the transfer is still open during the hook.
      if (first_apply && options.before_first_apply)
        options.before_first_apply(payload.ids.transfer_id);
      ApplyOutcome outcome = ApplyOne(payload);
      // O(records) but records grow by one per item, so this stays small next to the apply.
      const uint64_t bytes = undo.bytes();
      const uint64_t file_bytes = undo.spilled_bytes();
      lock.lock();
      applying = false;
      undo_bytes = bytes;
      undo_file_bytes = file_bytes;
      TouchLocked();
      if (outcome.status.ok()) {
        ++transfer->applied;
        transfer->items += outcome.items;
        transfer->changed_elements += outcome.changed_elements;
      } else {
        transfer->first_error = outcome.status;
        last_error = outcome.status;
        REFIT_LOG_WARN("receiver: transfer {}: apply failed: {}", transfer->id.ToHex(),
                       outcome.status.ToString());
      }
      progress.notify_all();
    }
  }

  // ---- Flush. ---------------------------------------------------------------------------------

  /// Whether every expected payload is staged. Precondition: a payload count is declared.
  bool AllStagedLocked() const {
    const TransferExpectation& expected = transfer->expected;
    if (!expected.payloads_per_producer.empty()) {
      // Stage refuses ids outside the counts, so per-producer counts identify the payloads.
      for (const auto& [producer, count] : expected.payloads_per_producer) {
        auto it = transfer->staged_per_producer.find(producer);
        if ((it == transfer->staged_per_producer.end() ? 0 : it->second) < count) return false;
      }
      return true;
    }
    return transfer->staged.size() >= *expected.total_payloads;
  }

  bool DrainedLocked() const { return queue.empty() && !applying; }

  std::string DescribeMissingLocked() const {
    const TransferExpectation& expected = transfer->expected;
    const uint64_t staged = transfer->staged.size();
    if (expected.payloads_per_producer.empty()) {
      return fmt::format("{} of {} expected payloads staged, {} applied", staged,
                         *expected.total_payloads, transfer->applied);
    }
    std::string named;
    uint64_t missing = 0;
    uint64_t wanted = 0;
    for (const auto& [producer, count] : expected.payloads_per_producer) {
      wanted += count;
      for (uint32_t id = 0; id < count; ++id) {
        if (transfer->staged.contains(PayloadKey(producer, id))) continue;
        if (++missing <= kMaxNamedMissingPayloads) {
          named += fmt::format("{}producer {} payload {}", named.empty() ? "" : ", ", producer, id);
        }
      }
    }
    if (missing == 0) {
      return fmt::format("all {} expected payloads staged, {} applied", wanted, transfer->applied);
    }
    if (missing > kMaxNamedMissingPayloads) {
      named += fmt::format(" and {} more", missing - kMaxNamedMissingPayloads);
    }
    return fmt::format("{} of {} expected payloads missing ({}); {} applied", missing, wanted,
                       named, transfer->applied);
  }

  /// Check that the per-producer counts of `expectation` (declared by `by`) agree with every
  /// stream end recorded: a producer absent from them is expected to send nothing.
  Status CheckStreamEndsLocked(const TransferExpectation& expectation, std::string_view by) const {
    if (expectation.payloads_per_producer.empty()) return Status::OK();
    for (const auto& [producer, payloads] : transfer->ended) {
      auto it = expectation.payloads_per_producer.find(producer);
      const uint32_t expected = it == expectation.payloads_per_producer.end() ? 0 : it->second;
      if (expected != payloads) {
        return InvalidArgument(
            "transfer {}: producer {} ended its stream with {} payloads, but {} expects {}",
            transfer->id.ToHex(), producer, payloads, by, expected);
      }
    }
    return Status::OK();
  }

  Status EndStream(const StreamEnd& end) {
    std::lock_guard lock(mutex);
    if (!transfer || transfer->id != end.transfer_id) {
      if (FinishedLocked(end.transfer_id).has_value()) return Status::OK();
      return FailedPrecondition(
          "stream end of producer {} for transfer {}: not the open transfer: {}", end.producer_id,
          end.transfer_id.ToHex(), DescribeLocked());
    }
    const std::string id = transfer->id.ToHex();
    if (auto earlier = transfer->ended.find(end.producer_id); earlier != transfer->ended.end()) {
      if (earlier->second == end.payloads) return Status::OK();  // A repeated end.
      return InvalidArgument(
          "transfer {}: producer {} ended its stream with {} payloads, and earlier with {}", id,
          end.producer_id, end.payloads, earlier->second);
    }
    // O(staged payloads), once per producer and transfer.
    for (const auto& [key, checksum] : transfer->staged) {
      const auto producer = static_cast<uint32_t>(key >> 32);
      const auto payload = static_cast<uint32_t>(key);
      if (producer == end.producer_id && payload >= end.payloads) {
        return InvalidArgument(
            "transfer {}: producer {} ended its stream with {} payloads, but its payload {} was "
            "staged",
            id, end.producer_id, end.payloads, payload);
      }
    }
    transfer->ended.emplace(end.producer_id, end.payloads);
    if (Status agreed = CheckStreamEndsLocked(transfer->expected, "the transfer's payload count");
        !agreed.ok()) {
      transfer->ended.erase(end.producer_id);
      return agreed;
    }
    TouchLocked();
    return Status::OK();
  }

  /// Combine the expectation given to Flush with the one in force.
  Status MergeExpectationLocked(const TransferExpectation& given) {
    REFIT_RETURN_NOT_OK(CheckExpectation(given).WithContext("flush"));
    REFIT_RETURN_NOT_OK(CheckDigestNamesKnown(store, given).WithContext("flush"));
    TransferExpectation& expected = transfer->expected;
    if (given.has_payload_count()) {
      if (expected.has_payload_count() &&
          (given.payloads_per_producer != expected.payloads_per_producer ||
           given.total_payloads != expected.total_payloads)) {
        return InvalidArgument(
            "flush of transfer {}: payload count differs from the one declared before",
            transfer->id.ToHex());
      }
      // With per-producer counts declared only now, payloads staged before must fit them.
      for (const auto& [key, checksum] : transfer->staged) {
        const auto producer = static_cast<uint32_t>(key >> 32);
        const auto payload = static_cast<uint32_t>(key);
        if (given.payloads_per_producer.empty()) break;
        auto it = given.payloads_per_producer.find(producer);
        if (it == given.payloads_per_producer.end() || payload >= it->second) {
          return InvalidArgument(
              "flush of transfer {}: payload {} of producer {} was staged but is not expected",
              transfer->id.ToHex(), payload, producer);
        }
      }
      REFIT_RETURN_NOT_OK(CheckStreamEndsLocked(given, "the flush"));
      expected.payloads_per_producer = given.payloads_per_producer;
      expected.total_payloads = given.total_payloads;
    }
    if (!given.digests.empty()) {
      if (!expected.digests.empty() && given.digests != expected.digests) {
        return InvalidArgument(
            "flush of transfer {}: expected digests differ from the ones declared before",
            transfer->id.ToHex());
      }
      expected.digests = given.digests;
    }
    if (!expected.has_payload_count()) {
      return FailedPrecondition(
          "flush of transfer {}: no expected payload count was declared at Prepare or Flush",
          transfer->id.ToHex());
    }
    return Status::OK();
  }

  /// Seal, verify and prepare. Precondition: every expected payload is staged and applied.
  Result<FlushReport> FinishFlushLocked() {
    const TransferExpectation& expected = transfer->expected;
    const std::string id = transfer->id.ToHex();
    transfer->sealed = true;
    if (expected.payloads_per_producer.empty() &&
        transfer->staged.size() > *expected.total_payloads) {
      return InvalidArgument("flush of transfer {}: {} payloads staged but {} expected", id,
                             transfer->staged.size(), *expected.total_payloads);
    }
    // Device tensors: what was applied is made visible to the weights' readers (the engine's
    // stream) before the flush reports it.
    if (store.has_device_tensors()) {
      Status synced = store.SynchronizeDevices();
      if (!synced.ok()) return synced.WithContext(fmt::format("flush of transfer {}", id));
    }
    FlushReport report;
    report.transfer_id = transfer->id;
    report.target_version = transfer->target_version;
    report.payloads = transfer->applied;
    report.items = transfer->items;
    report.changed_elements = transfer->changed_elements;
    report.duplicates = transfer->duplicates;
    // Safe under the lock: the transfer is sealed and drained, so the apply thread is idle.
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

  /// Move the open transfer to kPrepared with `report`; from now on it waits for a decision.
  FlushReport PreparedLocked(FlushReport report) {
    transfer->report = report;
    TouchLocked();
    ++lease_generation;
    work.notify_one();
    progress.notify_all();
    return report;
  }

  Result<FlushReport> Flush(const TransferId& id, const FlushOptions& options_given) {
    const auto deadline = std::chrono::steady_clock::now() + options_given.timeout;
    std::unique_lock lock(mutex);
    WaitForAbortLocked(lock);
    if (!transfer || transfer->id != id) {
      return FailedPrecondition("flush of transfer {}: not the open transfer: {}", id.ToHex(),
                                DescribeLocked());
    }
    auto finish = [&](Status status) {
      last_error = status;
      return status;
    };
    TouchLocked();
    if (!transfer->report) {
      Status merged = MergeExpectationLocked(options_given.expected);
      if (!merged.ok()) return finish(merged);
      const bool ready = progress.wait_until(lock, deadline, [&] {
        return !transfer || transfer->id != id || transfer->aborting ||
               !transfer->first_error.ok() || transfer->report ||
               (AllStagedLocked() && DrainedLocked());
      });
      if (!transfer || transfer->id != id || transfer->aborting) {
        return Cancelled("flush of transfer {}: the transfer was aborted while flushing",
                         id.ToHex());
      }
      if (!transfer->first_error.ok()) {
        return transfer->first_error.WithContext(fmt::format("flush of transfer {}", id.ToHex()));
      }
      if (!ready) {
        return finish(DeadlineExceeded("flush of transfer {} timed out after {} ms: {}", id.ToHex(),
                                       options_given.timeout.count(), DescribeMissingLocked()));
      }
      // A concurrent Flush may have finished it while this one waited.
      if (!transfer->report) {
        Result<FlushReport> report = FinishFlushLocked();
        if (!report.ok()) return finish(report.status());
        return report;
      }
    }
    // Repeated Flush: the same report, unless it now expects something else.
    const TransferExpectation& given = options_given.expected;
    const TransferExpectation& expected = transfer->expected;
    if ((given.has_payload_count() &&
         (given.payloads_per_producer != expected.payloads_per_producer ||
          given.total_payloads != expected.total_payloads)) ||
        (!given.digests.empty() && given.digests != expected.digests)) {
      return InvalidArgument("flush of transfer {}: already flushed with a different expectation",
                             id.ToHex());
    }
    return *transfer->report;
  }

  // ---- Abort. ---------------------------------------------------------------------------------

  Status Abort(const TransferId& id) {
    std::unique_lock lock(mutex);
    WaitForAbortLocked(lock);
    if (!transfer || transfer->id != id) {
      const std::optional<Outcome> outcome = FinishedLocked(id);
      if (outcome == Outcome::kAborted) return Status::OK();
      if (outcome == Outcome::kCommitted) {
        return FailedPrecondition("abort of transfer {}: it was already committed", id.ToHex());
      }
      if (transfer) {
        return FailedPrecondition("abort of transfer {}: not the open transfer: {}", id.ToHex(),
                                  DescribeLocked());
      }
      RememberLocked(id, Outcome::kAborted);
      REFIT_LOG_INFO("receiver: aborted transfer {} before it was prepared here", id.ToHex());
      return Status::OK();
    }
    return AbortOpenLocked(lock, "aborted");
  }

  /// Abort the open transfer: discard its queue, wait for the payload being applied, roll back,
  /// remember the id as aborted, and call after_abort without the lock (re-locked on return).
  /// `why` says who ended it, for the log.
  Status AbortOpenLocked(std::unique_lock<std::mutex>& lock, std::string_view why) {
    REFIT_DCHECK(transfer && !transfer->aborting, "AbortOpenLocked needs an open transfer");
    const TransferId id = transfer->id;
    transfer->aborting = true;
    const uint64_t discarded = queue.size();
    queue.clear();
    progress.notify_all();  // Wake blocked Stage and Flush callers: the transfer is ending.
    progress.wait(lock, [this] { return !applying; });
    // Under the lock: the apply thread is idle and the queue empty, so nothing else touches the
    // store; O(changes of the transfer), like applying it.
    const bool exact = undo.exact();
    Status rollback = undo.Rollback(store);
    undo_bytes = undo.bytes();
    undo_file_bytes = undo.spilled_bytes();
    if (!rollback.ok()) {
      transfer->aborting = false;
      last_error = rollback.WithContext(fmt::format("abort of transfer {}", id.ToHex()));
      progress.notify_all();
      return last_error;
    }
    if (exact) {
      REFIT_LOG_INFO(
          "receiver: {} transfer {} ({} payloads applied and rolled back, {} discarded "
          "unapplied): back at version {}",
          why, id.ToHex(), transfer->applied, discarded, version);
    } else {
      needs_anchor = fmt::format(
          "transfer {} (version {} -> {}) was aborted after {} payloads had overwritten FULL "
          "spans whose old bits anchor_undo 'none' does not keep: the weights are a mix of "
          "versions",
          id.ToHex(), transfer->base_version, transfer->target_version, transfer->applied);
      REFIT_LOG_WARN("receiver: {} transfer {}: {}; only an anchor is accepted until one commits",
                     why, id.ToHex(), *needs_anchor);
    }
    RememberLocked(id, Outcome::kAborted);
    transfer.reset();
    progress.notify_all();
    const uint64_t held = version;
    // Weights that need an anchor must not be served: the engine stays paused (no after_abort)
    // until the anchor's after_commit.
    if (options.after_abort && exact) {
      lock.unlock();
      options.after_abort(id, held);
      lock.lock();
    }
    return Status::OK();
  }

  const ReceiverSessionOptions options;
  WeightStore& store;

  mutable std::mutex mutex;
  /// The apply thread waits here for queued payloads; condition_variable_any so that the wait
  /// also ends on the thread's stop_token.
  std::condition_variable_any work;
  /// Everything else waits here for progress: room in the queue, a payload applied, a transfer
  /// flushed or ended.
  std::condition_variable_any progress;
  /// The decode thread waits here for a payload to decode ahead; the apply thread waits on
  /// `decoded` for the decode thread to finish the payload it needs.
  std::condition_variable_any decode_work;
  std::condition_variable_any decoded;

  /// The committed version (mirrors store.version(), readable without touching the store).
  uint64_t version = 0;
  std::optional<Transfer> transfer;
  std::deque<QueuedPayload> queue;
  /// True while the apply thread works on a payload without the lock.
  bool applying = false;
  /// Transfers aborted because their lease expired (ReceiverStatus::expired_leases).
  uint64_t expired_leases = 0;
  // Distinct payloads staged, and their bytes, since the session was made.
  uint64_t received_payloads = 0;
  uint64_t received_bytes = 0;
  /// Bumped whenever a new lease event may come sooner than the apply thread's wake-up (a
  /// transfer opened or prepared), so that it wakes and looks again.
  uint64_t lease_generation = 0;
  /// Written by the apply thread without the lock while `applying`; by Commit and Abort only
  /// when the apply thread is idle.
  UndoLog undo;
  uint64_t undo_bytes = 0;
  uint64_t undo_file_bytes = 0;
  /// Why the store needs an anchor (ReceiverStatus::needs_anchor); unset while it does not.
  std::optional<std::string> needs_anchor;
  Status last_error;
  /// Finished transfers, and their ids oldest first (for forgetting).
  std::map<std::array<uint8_t, 16>, Outcome> finished;
  std::deque<std::array<uint8_t, 16>> finished_order;

  /// Stop and join the apply and decode threads (any may not have started). A decode thread
  /// finishes a decode it started; the apply thread a payload it applies.
  void StopThreads() {
    apply_thread.request_stop();
    for (std::jthread& thread : decode_threads) thread.request_stop();
    if (apply_thread.joinable()) apply_thread.join();
    for (std::jthread& thread : decode_threads) {
      if (thread.joinable()) thread.join();
    }
  }

  /// Declared last: they start after every member they use is constructed, and stop first.
  std::jthread apply_thread;
  std::vector<std::jthread> decode_threads;
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
  REFIT_RETURN_NOT_OK(UndoLog::Validate(UndoLogOptionsOf(options)).WithContext("receiver session"));
  auto impl = std::make_unique<Impl>(options, store);
  // std::jthread reports an OS refusal (EAGAIN: thread or memory limit) only by throwing; turn it
  // into a Status so no exception leaves the library.
  try {
    impl->apply_thread =
        std::jthread([raw = impl.get()](const std::stop_token& stop) { raw->RunApply(stop); });
    for (int t = 0; t < options.decode_threads; ++t) {
      impl->decode_threads.emplace_back(
          [raw = impl.get()](const std::stop_token& stop) { raw->RunDecodeAhead(stop); });
    }
  } catch (const std::system_error& error) {
    impl->StopThreads();
    return ResourceExhausted("receiver session: cannot start the apply and decode threads: {}",
                             error.what());
  }
  // Not make_unique: the constructor is private.
  return std::unique_ptr<ReceiverSession>(new ReceiverSession(std::move(impl)));
}

ReceiverSession::~ReceiverSession() {
  impl_->StopThreads();
  // The apply thread is gone, so nothing else touches the store or the undo log.
  std::lock_guard lock(impl_->mutex);
  if (!impl_->transfer) return;
  const std::string id = impl_->transfer->id.ToHex();
  const bool exact = impl_->undo.exact();
  Status rollback = impl_->undo.Rollback(impl_->store);
  if (rollback.ok() && !exact) {
    REFIT_LOG_ERROR(
        "receiver: transfer {} was still open at shutdown and applied FULL spans anchor_undo "
        "'none' cannot undo: the store is a mix of versions and needs an anchor",
        id);
  } else if (rollback.ok()) {
    REFIT_LOG_WARN("receiver: transfer {} was still open at shutdown; rolled back to version {}",
                   id, impl_->version);
  } else {
    REFIT_LOG_ERROR("receiver: transfer {} was still open at shutdown and its rollback failed: {}",
                    id, rollback.ToString());
  }
}

Result<PrepareResult> ReceiverSession::Prepare(const PrepareRequest& request) {
  const std::string id = request.transfer_id.ToHex();
  REFIT_RETURN_NOT_OK(CheckExpectation(request.expected).WithContext("prepare of transfer " + id));
  if (request.base_version == UINT64_MAX) {
    return InvalidArgument("prepare of transfer {}: base version {} has no successor", id,
                           request.base_version);
  }
  Impl& s = *impl_;
  REFIT_RETURN_NOT_OK(
      CheckDigestNamesKnown(s.store, request.expected).WithContext("prepare of transfer " + id));
  std::unique_lock lock(s.mutex);
  s.WaitForAbortLocked(lock);
  PrepareResult result;
  if (s.transfer && s.transfer->id == request.transfer_id) {
    if (request.base_version != s.transfer->base_version || request.anchor != s.transfer->anchor ||
        request.expected != s.transfer->declared) {
      return FailedPrecondition(
          "prepare of transfer {}: already open with base version {} and a different request", id,
          s.transfer->base_version);
    }
    result.repeated = true;
    s.TouchLocked();
    return result;
  }
  if (std::optional<Outcome> outcome = s.FinishedLocked(request.transfer_id)) {
    return FailedPrecondition(
        "prepare of transfer {}: it was already {}; a retried transfer needs a new id", id,
        OutcomeName(*outcome));
  }
  if (s.transfer && s.transfer->report && request.base_version == s.transfer->target_version) {
    // The coordinator only starts a transfer from T's target once every receiver prepared T and
    // it decided to commit; this receiver's Commit(T) was lost or is still in flight.
    result.implied_commit = s.transfer->id;
    REFIT_LOG_INFO("receiver: transfer {} is based on version {}: implied commit of transfer {}",
                   id, request.base_version, s.transfer->id.ToHex());
    s.CommitLocked();
    if (s.options.after_commit) {
      // Without the lock, like every hook; the new transfer is opened afresh below.
      lock.unlock();
      s.options.after_commit(*result.implied_commit, request.base_version);
      lock.lock();
      s.WaitForAbortLocked(lock);
    }
  }
  if (s.transfer && s.transfer->report && request.base_version == s.transfer->base_version) {
    // A new transfer from T's base under a new id: T's coordinator gave up on T (or died) and
    // never committed it anywhere, or the new coordinator would have seen a receiver at T's
    // target and based the transfer on it (docs/protocol.md, "implied abort").
    const TransferId old = s.transfer->id;
    REFIT_LOG_INFO("receiver: transfer {} is based on version {}: implied abort of transfer {}", id,
                   request.base_version, old.ToHex());
    REFIT_RETURN_NOT_OK(s.AbortOpenLocked(lock, "implied abort of")
                            .WithContext(fmt::format("prepare of transfer {}", id)));
    result.implied_abort = old;
    s.WaitForAbortLocked(lock);
  }
  if (s.transfer && s.transfer->report) {
    return FailedPrecondition(
        "prepare of transfer {} (based on version {}): {}; a transfer based on version {} "
        "commits it, one based on version {} aborts it, version {} is neither",
        id, request.base_version, s.DescribeLocked(), s.transfer->target_version,
        s.transfer->base_version, request.base_version);
  }
  if (s.transfer) {
    return FailedPrecondition("prepare of transfer {}: {}: wait for it or abort it", id,
                              s.DescribeLocked());
  }
  if (s.needs_anchor && !request.anchor) {
    return FailedPrecondition(
        "prepare of transfer {}: the receiver needs an anchor and refuses a delta: {}; an anchor "
        "(FULL) transfer heals it, and a Publisher sends one when a receiver's status says "
        "needs_anchor",
        id, *s.needs_anchor);
  }
  if (request.base_version != s.version && !request.anchor) {
    return FailedPrecondition(
        "prepare of transfer {}: it is based on version {} but the receiver is at version {}", id,
        request.base_version, s.version);
  }
  s.transfer = Impl::Transfer{};
  Impl::Transfer& transfer = *s.transfer;
  transfer.id = request.transfer_id;
  transfer.base_version = request.base_version;
  transfer.target_version = request.base_version + 1;
  transfer.anchor = request.anchor;
  if (request.anchor && request.base_version != s.version) {
    REFIT_LOG_INFO("receiver: transfer {} is an anchor from version {}; this receiver holds {}", id,
                   request.base_version, s.version);
  }
  transfer.declared = request.expected;
  transfer.expected = request.expected;
  s.last_error = Status::OK();
  s.undo_bytes = 0;
  s.undo_file_bytes = 0;
  // Wake the apply thread: this lease may expire before whatever it sleeps for.
  ++s.lease_generation;
  s.work.notify_one();
  REFIT_LOG_DEBUG("receiver: prepared transfer {} (version {} -> {})", id, transfer.base_version,
                  transfer.target_version);
  return result;
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

std::map<uint32_t, uint32_t> ReceiverSession::DeclaredPayloads(const TransferId& id) const {
  std::lock_guard lock(impl_->mutex);
  if (!impl_->transfer || impl_->transfer->id != id) return {};
  return impl_->transfer->ended;
}

Result<FlushReport> ReceiverSession::Flush(const TransferId& id, const FlushOptions& options) {
  return impl_->Flush(id, options);
}

Status ReceiverSession::Commit(const TransferId& id) {
  Impl& s = *impl_;
  std::unique_lock lock(s.mutex);
  s.WaitForAbortLocked(lock);
  if (s.transfer && s.transfer->id == id) {
    if (!s.transfer->report) {
      return FailedPrecondition("commit of transfer {}: it is not flushed yet: {}", id.ToHex(),
                                s.DescribeLocked());
    }
    s.CommitLocked();
    const uint64_t version = s.version;
    lock.unlock();
    if (s.options.after_commit) s.options.after_commit(id, version);
    return Status::OK();
  }
  const std::optional<Outcome> outcome = s.FinishedLocked(id);
  if (outcome == Outcome::kCommitted) return Status::OK();
  if (outcome == Outcome::kAborted) {
    return FailedPrecondition("commit of transfer {}: it was aborted", id.ToHex());
  }
  return FailedPrecondition("commit of transfer {}: unknown transfer: {}", id.ToHex(),
                            s.DescribeLocked());
}

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

ReceiverStatus ReceiverSession::GetStatus() const {
  const Impl& s = *impl_;
  std::lock_guard lock(s.mutex);
  ReceiverStatus status;
  status.state = s.StateLocked();
  status.version = s.version;
  status.last_error = s.last_error;
  status.undo_bytes = s.undo_bytes;
  status.expired_leases = s.expired_leases;
  status.received_payloads = s.received_payloads;
  status.received_bytes = s.received_bytes;
  const BoundaryTraffic device = s.store.device_traffic();
  status.device_to_bytes = device.to_device_bytes;
  status.device_from_bytes = device.from_device_bytes;
  status.undo_file_bytes = s.undo_file_bytes;
  status.needs_anchor = s.needs_anchor.has_value();
  if (s.needs_anchor) status.needs_anchor_reason = *s.needs_anchor;
  if (std::optional<Clock::time_point> deadline = s.LeaseDeadlineLocked()) {
    status.lease_remaining_ms = MillisecondsBetween(Clock::now(), *deadline);
  }
  if (s.transfer) {
    status.transfer_id = s.transfer->id;
    status.base_version = s.transfer->base_version;
    status.target_version = s.transfer->target_version;
    status.sealed = s.transfer->sealed;
    status.staged_payloads = s.transfer->staged.size();
    status.applied_payloads = s.transfer->applied;
    status.queued_payloads = s.queue.size();
    status.duplicate_payloads = s.transfer->duplicates;
  }
  return status;
}

}  // namespace refit
