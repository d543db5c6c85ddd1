#include "receiver/transfer_ledger.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "core/digest.h"
#include "refit/status_format.h"
#include "util/check.h"

namespace refit::internal {
namespace {

/// Missing payloads named in a DeadlineExceeded message; the rest are counted. Enough to show a
/// pattern (one producer silent, one payload lost) without a megabyte-long message.
constexpr size_t kMaxNamedMissingPayloads = 8;

/// The dedupe key of a payload within its transfer.
uint64_t PayloadKey(uint32_t producer_id, uint32_t payload_id) {
  return (uint64_t{producer_id} << 32) | payload_id;
}

uint32_t ProducerOf(uint64_t key) { return static_cast<uint32_t>(key >> 32); }
uint32_t PayloadOf(uint64_t key) { return static_cast<uint32_t>(key); }

uint64_t MillisecondsBetween(LedgerClock::time_point from, LedgerClock::time_point to) {
  if (to <= from) return 0;
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(to - from).count());
}

// A transfer's lineage for errors: "run 'r' epoch e", or that it states none.
std::string DescribeStated(const TransferLineage& lineage) {
  if (lineage.run_id.empty()) return "no lineage";
  return fmt::format("run '{}' epoch {}", lineage.run_id, lineage.epoch);
}

std::string FingerprintHex(uint64_t fingerprint) { return fmt::format("{:016x}", fingerprint); }

}  // namespace

uint64_t TargetOf(const PrepareRequest& request) {
  return request.target_version != 0 ? request.target_version : request.base_version + 1;
}

std::string_view OutcomeName(Outcome outcome) {
  return outcome == Outcome::kCommitted ? "committed" : "aborted";
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

TransferLedger::TransferLedger(uint64_t version, const LedgerOptions& options, HeldLineage lineage)
    : options_(options), version_(version), lineage_(std::move(lineage)) {}

ReceiverState TransferLedger::state() const {
  if (!open_) return ReceiverState::kIdle;
  return open_->report ? ReceiverState::kPrepared : ReceiverState::kReceiving;
}

std::optional<Outcome> TransferLedger::Finished(const TransferId& id) const {
  auto it = finished_.find(id.bytes);
  if (it == finished_.end()) return std::nullopt;
  return it->second;
}

std::string TransferLedger::Describe(LedgerClock::time_point now) const {
  if (!open_) return fmt::format("the receiver is idle at version {}", version_);
  std::string described =
      fmt::format("the receiver is {} transfer {} (version {} -> {})", ReceiverStateName(state()),
                  open_->id.ToHex(), open_->base_version, open_->target_version);
  // Say when it ends by itself, so whoever is refused knows whether waiting helps.
  if (std::optional<LedgerClock::time_point> deadline = LeaseDeadline()) {
    described += fmt::format(", no progress for {} ms, its lease expires in {} ms",
                             MillisecondsBetween(open_->last_progress, now),
                             MillisecondsBetween(now, *deadline));
  } else if (open_->report) {
    described += fmt::format(", waiting {} ms for commit or abort",
                             MillisecondsBetween(open_->last_progress, now));
  }
  return described;
}

// ---- Prepare. -----------------------------------------------------------------------------------

Result<PrepareStep> TransferLedger::ClassifyPrepare(const PrepareRequest& request,
                                                    LedgerClock::time_point now) const {
  const std::string id = request.transfer_id.ToHex();
  if (open_ && open_->id == request.transfer_id) {
    if (request.base_version != open_->base_version || request.anchor != open_->anchor ||
        TargetOf(request) != open_->target_version || request.expected != open_->declared ||
        request.lineage != open_->lineage) {
      return FailedPrecondition(
          "prepare of transfer {}: already open with base version {} and a different request", id,
          open_->base_version);
    }
    return PrepareStep::kRepeat;
  }
  if (std::optional<Outcome> outcome = Finished(request.transfer_id)) {
    return FailedPrecondition(
        "prepare of transfer {}: it was already {}; a retried transfer needs a new id", id,
        OutcomeName(*outcome));
  }
  if (open_ && open_->report) {
    // The coordinator only starts a transfer from T's target once every receiver prepared T and
    // it decided to commit.
    if (request.base_version == open_->target_version) {
      REFIT_RETURN_NOT_OK(CheckImpliedDecision(request, "commit"));
      return PrepareStep::kCommitOpenFirst;
    }
    // A new transfer from T's base under a new id: T's coordinator gave up on T (or died) and
    // never committed it anywhere, or the new coordinator would have seen a receiver at T's
    // target and based the transfer on it (docs/protocol.md, "implied abort").
    if (request.base_version == open_->base_version) {
      REFIT_RETURN_NOT_OK(CheckImpliedDecision(request, "abort"));
      REFIT_RETURN_NOT_OK(CheckLineage(request));
      return PrepareStep::kAbortOpenFirst;
    }
    return FailedPrecondition(
        "prepare of transfer {} (based on version {}): {}; a transfer based on version {} "
        "commits it, one based on version {} aborts it, version {} is neither",
        id, request.base_version, Describe(now), open_->target_version, open_->base_version,
        request.base_version);
  }
  if (open_) {
    const LedgerClock::duration quiet = now - open_->last_progress;
    if (!open_->aborting && request.base_version == open_->base_version &&
        options_.preempt_after.count() > 0 && quiet >= options_.preempt_after) {
      REFIT_RETURN_NOT_OK(CheckImpliedDecision(request, "abort"));
      REFIT_RETURN_NOT_OK(CheckLineage(request));
      return PrepareStep::kAbortOpenFirst;
    }
    return FailedPrecondition(
        "prepare of transfer {}: {}: wait for it, abort it, or prepare from version {} once it "
        "has been quiet for {} ms",
        id, Describe(now), open_->base_version, options_.preempt_after.count());
  }
  if (needs_anchor_ && !request.anchor) {
    return FailedPrecondition(
        "prepare of transfer {}: the receiver needs an anchor and refuses a delta: {}; an anchor "
        "(FULL) transfer heals it, and a Publisher sends one when a receiver's status says "
        "needs_anchor",
        id, *needs_anchor_);
  }
  REFIT_RETURN_NOT_OK(CheckLineage(request));
  if (request.base_version != version_ && !request.anchor) {
    return FailedPrecondition(
        "prepare of transfer {}: it is based on version {} but the receiver is at version {}", id,
        request.base_version, version_);
  }
  return PrepareStep::kOpen;
}

Status TransferLedger::CheckLineage(const PrepareRequest& request) const {
  // A receiver that holds no lineage (a checkpoint loaded without one, and nothing committed
  // since that stated one) accepts any: it has nothing to tell two trainers apart by, and the
  // flush's digest check still verifies the state a delta reaches.
  if (lineage_.run_id.empty()) return Status::OK();
  const TransferLineage& from = request.lineage;
  const uint64_t target = TargetOf(request);
  const std::string id = request.transfer_id.ToHex();
  const std::string held =
      fmt::format("the receiver holds version {} of {} (fingerprint {})", version_,
                  DescribeLineage(lineage_), FingerprintHex(lineage_.fingerprint));
  if (from.run_id.empty()) {
    return FailedPrecondition(
        "prepare of transfer {} (version {} -> {}): it states no lineage (a coordinator older "
        "than lineages, or one given no run id), but {}; give the trainer a run id "
        "(PublisherOptions::run_id with resume, or a new one, which anchors above version {})",
        id, request.base_version, target, held, version_);
  }
  const std::string stated = DescribeStated(from);
  if (from.run_id != lineage_.run_id) {
    if (!request.anchor) {
      return FailedPrecondition(
          "prepare of transfer {}: a delta of {} (version {} -> {}) refused: {}; another run "
          "replaces a receiver's lineage only by an anchor to a version above {}",
          id, stated, request.base_version, target, held, version_);
    }
    if (target <= version_) {
      return FailedPrecondition(
          "prepare of transfer {}: an anchor of {} to version {} would reuse version {} with "
          "other contents: {}; a new lineage anchors at a version above {}",
          id, stated, target, target, held, version_);
    }
    return Status::OK();
  }
  if (from.epoch < lineage_.epoch) {
    return FailedPrecondition(
        "prepare of transfer {}: {} (version {} -> {}) is fenced: {}, and epoch {} of that run "
        "was seen, so a trainer of an older epoch (a zombie, superseded by one that resumed the "
        "run) may not publish",
        id, stated, request.base_version, target, held, lineage_.epoch);
  }
  if (!request.anchor) {
    if (request.base_version == version_ && from.base_fingerprint != 0 &&
        lineage_.fingerprint != 0 && from.base_fingerprint != lineage_.fingerprint) {
      return FailedPrecondition(
          "prepare of transfer {}: a delta of {} based on version {} with fingerprint {} "
          "refused: {}, so it would reuse version {} with other contents (the trainer adopted "
          "another checkpoint under that version number: `refit push --base FILE`, "
          "Publisher::AdoptBaseline)",
          id, stated, request.base_version, FingerprintHex(from.base_fingerprint), held, target);
    }
  } else if (target <= version_ && from.epoch > lineage_.epoch) {
    // The same trainer (same epoch) may anchor its own versions again (a receiver that needs an
    // anchor); a resumed one may not rewrite versions its predecessor published.
    return FailedPrecondition(
        "prepare of transfer {}: an anchor of {} to version {} would reuse version {} with "
        "other contents: {}, published by epoch {}; a resumed trainer continues from the "
        "version the fleet holds, or starts a new run",
        id, stated, target, target, held, lineage_.epoch);
  }
  return Status::OK();
}

Status TransferLedger::CheckImpliedDecision(const PrepareRequest& request,
                                            std::string_view decision) const {
  const TransferLineage& open = open_->lineage;
  const TransferLineage& from = request.lineage;
  if (from.run_id == open.run_id && from.epoch >= open.epoch) return Status::OK();
  return FailedPrecondition(
      "prepare of transfer {} ({}, version {} -> {}) refused: transfer {} of {} (version {} -> "
      "{}) is {} here, and only its own lineage may {} it implicitly",
      request.transfer_id.ToHex(), DescribeStated(from), request.base_version, TargetOf(request),
      open_->id.ToHex(), DescribeStated(open), open_->base_version, open_->target_version,
      ReceiverStateName(state()), decision);
}

void TransferLedger::Open(const PrepareRequest& request, LedgerClock::time_point now) {
  REFIT_DCHECK(!open_, "Open needs an idle ledger");
  OpenTransfer& transfer = open_.emplace();
  transfer.id = request.transfer_id;
  transfer.base_version = request.base_version;
  transfer.target_version = TargetOf(request);
  transfer.anchor = request.anchor;
  transfer.lineage = request.lineage;
  // The fence rises when the resumed trainer's first Prepare is accepted, not at its commit:
  // from then on the zombie is refused even if this transfer aborts.
  if (!request.lineage.run_id.empty() && request.lineage.run_id == lineage_.run_id) {
    lineage_.epoch = std::max(lineage_.epoch, request.lineage.epoch);
  }
  transfer.declared = request.expected;
  transfer.expected = request.expected;
  transfer.last_progress = now;
  last_error_ = Status::OK();
}

void TransferLedger::Touch(LedgerClock::time_point now) {
  if (open_) open_->last_progress = now;
}

// ---- Stage. -------------------------------------------------------------------------------------

Status TransferLedger::CheckStageable(const PayloadIds& ids) const {
  auto context = [&] {
    return fmt::format("payload {} of producer {} (transfer {})", ids.payload_id, ids.producer_id,
                       ids.transfer_id.ToHex());
  };
  if (std::optional<Outcome> outcome = Finished(ids.transfer_id)) {
    return FailedPrecondition("{}: the transfer was already {}", context(), OutcomeName(*outcome));
  }
  if (!open_ || open_->id != ids.transfer_id) {
    return FailedPrecondition("{}: not the open transfer: {}", context(),
                              Describe(LedgerClock::now()));
  }
  if (open_->aborting) return FailedPrecondition("{}: the transfer is being aborted", context());
  if (open_->sealed) return FailedPrecondition("{}: the transfer is already flushed", context());
  if (ids.base_version != open_->base_version || ids.target_version != open_->target_version) {
    return FailedPrecondition("{}: moves version {} -> {} but the transfer moves {} -> {}",
                              context(), ids.base_version, ids.target_version, open_->base_version,
                              open_->target_version);
  }
  if (!open_->first_error.ok()) {
    return open_->first_error.WithContext(
        fmt::format("{}: the transfer failed earlier", context()));
  }
  if (auto ended = open_->ended.find(ids.producer_id);
      ended != open_->ended.end() && ids.payload_id >= ended->second) {
    return InvalidArgument("{}: unexpected: producer {} ended its stream with {} payloads",
                           context(), ids.producer_id, ended->second);
  }
  const auto& per_producer = open_->expected.payloads_per_producer;
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

Result<bool> TransferLedger::CheckDuplicate(const PayloadIds& ids,
                                            const std::array<uint8_t, 16>& checksum) {
  REFIT_DCHECK(open_ && open_->id == ids.transfer_id, "CheckDuplicate needs the open transfer");
  auto staged = open_->staged.find(PayloadKey(ids.producer_id, ids.payload_id));
  if (staged == open_->staged.end()) return false;
  if (staged->second != checksum) {
    return AlreadyExists(
        "payload {} of producer {} (transfer {}) was already staged with another checksum",
        ids.payload_id, ids.producer_id, ids.transfer_id.ToHex());
  }
  ++open_->duplicates;
  return true;
}

void TransferLedger::RecordStaged(const PayloadIds& ids, const std::array<uint8_t, 16>& checksum,
                                  uint64_t bytes, LedgerClock::time_point now) {
  REFIT_DCHECK(open_ && open_->id == ids.transfer_id, "RecordStaged needs the open transfer");
  open_->staged.emplace(PayloadKey(ids.producer_id, ids.payload_id), checksum);
  ++open_->staged_per_producer[ids.producer_id];
  open_->last_progress = now;
  ++received_payloads_;
  received_bytes_ += bytes;
}

Status TransferLedger::CheckStreamEnds(const TransferExpectation& expectation,
                                       std::string_view by) const {
  if (expectation.payloads_per_producer.empty()) return Status::OK();
  for (const auto& [producer, payloads] : open_->ended) {
    auto it = expectation.payloads_per_producer.find(producer);
    const uint32_t expected = it == expectation.payloads_per_producer.end() ? 0 : it->second;
    if (expected != payloads) {
      return InvalidArgument(
          "transfer {}: producer {} ended its stream with {} payloads, but {} expects {}",
          open_->id.ToHex(), producer, payloads, by, expected);
    }
  }
  return Status::OK();
}

Status TransferLedger::EndStream(const StreamEnd& end, LedgerClock::time_point now) {
  if (!open_ || open_->id != end.transfer_id) {
    if (Finished(end.transfer_id).has_value()) return Status::OK();  // A late or repeated end.
    return FailedPrecondition(
        "stream end of producer {} for transfer {}: not the open transfer: {}", end.producer_id,
        end.transfer_id.ToHex(), Describe(now));
  }
  const std::string id = open_->id.ToHex();
  if (auto earlier = open_->ended.find(end.producer_id); earlier != open_->ended.end()) {
    if (earlier->second == end.payloads) return Status::OK();  // A repeated end.
    return InvalidArgument(
        "transfer {}: producer {} ended its stream with {} payloads, and earlier with {}", id,
        end.producer_id, end.payloads, earlier->second);
  }
  // O(staged payloads), once per producer and transfer.
  for (const auto& [key, checksum] : open_->staged) {
    if (ProducerOf(key) == end.producer_id && PayloadOf(key) >= end.payloads) {
      return InvalidArgument(
          "transfer {}: producer {} ended its stream with {} payloads, but its payload {} was "
          "staged",
          id, end.producer_id, end.payloads, PayloadOf(key));
    }
  }
  open_->ended.emplace(end.producer_id, end.payloads);
  if (Status agreed = CheckStreamEnds(open_->expected, "the transfer's payload count");
      !agreed.ok()) {
    open_->ended.erase(end.producer_id);
    return agreed;
  }
  open_->last_progress = now;
  return Status::OK();
}

// ---- Apply. -------------------------------------------------------------------------------------

bool TransferLedger::ShouldApply(const TransferId& id) const {
  return open_ && open_->id == id && !open_->aborting && open_->first_error.ok();
}

bool TransferLedger::StartApply() {
  REFIT_DCHECK(open_, "StartApply needs an open transfer");
  return !std::exchange(open_->apply_started, true);
}

void TransferLedger::RecordApplied(uint64_t items, uint64_t changed_elements,
                                   LedgerClock::time_point now) {
  REFIT_DCHECK(open_, "RecordApplied needs an open transfer");
  ++open_->applied;
  open_->items += items;
  open_->changed_elements += changed_elements;
  open_->last_progress = now;
}

void TransferLedger::RecordApplyFailed(const Status& error, LedgerClock::time_point now) {
  REFIT_DCHECK(open_, "RecordApplyFailed needs an open transfer");
  open_->first_error = error;
  open_->last_progress = now;
  last_error_ = error;
}

// ---- Flush. -------------------------------------------------------------------------------------

Status TransferLedger::MergeExpectation(const TransferExpectation& given) {
  REFIT_DCHECK(open_, "MergeExpectation needs an open transfer");
  REFIT_RETURN_NOT_OK(CheckExpectation(given).WithContext("flush"));
  TransferExpectation& expected = open_->expected;
  if (given.has_payload_count()) {
    if (expected.has_payload_count() &&
        (given.payloads_per_producer != expected.payloads_per_producer ||
         given.total_payloads != expected.total_payloads)) {
      return InvalidArgument(
          "flush of transfer {}: payload count differs from the one declared before",
          open_->id.ToHex());
    }
    // With per-producer counts declared only now, payloads staged before must fit them.
    if (!given.payloads_per_producer.empty()) {
      for (const auto& [key, checksum] : open_->staged) {
        auto it = given.payloads_per_producer.find(ProducerOf(key));
        if (it == given.payloads_per_producer.end() || PayloadOf(key) >= it->second) {
          return InvalidArgument(
              "flush of transfer {}: payload {} of producer {} was staged but is not expected",
              open_->id.ToHex(), PayloadOf(key), ProducerOf(key));
        }
      }
    }
    REFIT_RETURN_NOT_OK(CheckStreamEnds(given, "the flush"));
    expected.payloads_per_producer = given.payloads_per_producer;
    expected.total_payloads = given.total_payloads;
  }
  if (!given.digests.empty()) {
    if (!expected.digests.empty() && given.digests != expected.digests) {
      return InvalidArgument(
          "flush of transfer {}: expected digests differ from the ones declared before",
          open_->id.ToHex());
    }
    expected.digests = given.digests;
  }
  if (!expected.has_payload_count()) {
    return FailedPrecondition(
        "flush of transfer {}: no expected payload count was declared at Prepare or Flush",
        open_->id.ToHex());
  }
  return Status::OK();
}

bool TransferLedger::AllStaged() const {
  const TransferExpectation& expected = open_->expected;
  if (!expected.payloads_per_producer.empty()) {
    // Stage refuses ids outside the counts, so per-producer counts identify the payloads.
    for (const auto& [producer, count] : expected.payloads_per_producer) {
      auto it = open_->staged_per_producer.find(producer);
      if ((it == open_->staged_per_producer.end() ? 0 : it->second) < count) return false;
    }
    return true;
  }
  return open_->staged.size() >= *expected.total_payloads;
}

std::string TransferLedger::DescribeMissing() const {
  const TransferExpectation& expected = open_->expected;
  const uint64_t staged = open_->staged.size();
  if (expected.payloads_per_producer.empty()) {
    return fmt::format("{} of {} expected payloads staged, {} applied", staged,
                       *expected.total_payloads, open_->applied);
  }
  std::string named;
  uint64_t missing = 0;
  uint64_t wanted = 0;
  for (const auto& [producer, count] : expected.payloads_per_producer) {
    wanted += count;
    for (uint32_t id = 0; id < count; ++id) {
      if (open_->staged.contains(PayloadKey(producer, id))) continue;
      if (++missing <= kMaxNamedMissingPayloads) {
        named += fmt::format("{}producer {} payload {}", named.empty() ? "" : ", ", producer, id);
      }
    }
  }
  if (missing == 0) {
    return fmt::format("all {} expected payloads staged, {} applied", wanted, open_->applied);
  }
  if (missing > kMaxNamedMissingPayloads) {
    named += fmt::format(" and {} more", missing - kMaxNamedMissingPayloads);
  }
  return fmt::format("{} of {} expected payloads missing ({}); {} applied", missing, wanted, named,
                     open_->applied);
}

Status TransferLedger::Seal() {
  open_->sealed = true;
  const TransferExpectation& expected = open_->expected;
  if (expected.payloads_per_producer.empty() && open_->staged.size() > *expected.total_payloads) {
    return InvalidArgument("flush of transfer {}: {} payloads staged but {} expected",
                           open_->id.ToHex(), open_->staged.size(), *expected.total_payloads);
  }
  return Status::OK();
}

void TransferLedger::Prepared(FlushReport report, LedgerClock::time_point now) {
  open_->report = std::move(report);
  open_->last_progress = now;
}

bool TransferLedger::ExpectationDiffers(const TransferExpectation& given) const {
  const TransferExpectation& expected = open_->expected;
  return (given.has_payload_count() &&
          (given.payloads_per_producer != expected.payloads_per_producer ||
           given.total_payloads != expected.total_payloads)) ||
         (!given.digests.empty() && given.digests != expected.digests);
}

// ---- Decide. ------------------------------------------------------------------------------------

void TransferLedger::Commit() {
  REFIT_DCHECK(open_ && open_->report, "Commit needs a prepared transfer");
  version_ = open_->target_version;
  const TransferLineage& committed = open_->lineage;
  if (committed.run_id != lineage_.run_id) {
    lineage_.run_id = committed.run_id;
    lineage_.epoch = committed.epoch;
  } else {
    lineage_.epoch = std::max(lineage_.epoch, committed.epoch);
  }
  // The digests Flush declared are the producers' canonical state at the target, which this
  // receiver verified (or its replica was verified as a whole) before the transfer was decided.
  lineage_.fingerprint =
      open_->expected.digests.empty() ? 0 : StateFingerprint(open_->expected.digests);
  if (needs_anchor_ && open_->anchor) needs_anchor_.reset();
  Remember(open_->id, Outcome::kCommitted);
  open_.reset();
}

void TransferLedger::BeginAbort() {
  REFIT_DCHECK(open_ && !open_->aborting, "BeginAbort needs an open transfer");
  open_->aborting = true;
}

void TransferLedger::AbortFailed(const Status& error) {
  REFIT_DCHECK(open_ && open_->aborting, "AbortFailed needs a transfer being aborted");
  open_->aborting = false;
  last_error_ = error;
}

void TransferLedger::FinishAbort(bool exact) {
  REFIT_DCHECK(open_ && open_->aborting, "FinishAbort needs a transfer being aborted");
  if (!exact) {
    needs_anchor_ = fmt::format(
        "transfer {} (version {} -> {}) was aborted after {} payloads had overwritten FULL "
        "spans whose old bits anchor_undo 'none' does not keep: the weights are a mix of "
        "versions",
        open_->id.ToHex(), open_->base_version, open_->target_version, open_->applied);
  }
  Remember(open_->id, Outcome::kAborted);
  open_.reset();
}

void TransferLedger::RecordAbortOfUnprepared(const TransferId& id) {
  Remember(id, Outcome::kAborted);
}

void TransferLedger::Remember(const TransferId& id, Outcome outcome) {
  if (finished_.emplace(id.bytes, outcome).second) finished_order_.push_back(id.bytes);
  while (finished_order_.size() > options_.remembered_transfers) {
    finished_.erase(finished_order_.front());
    finished_order_.pop_front();
  }
}

// ---- Leases. ------------------------------------------------------------------------------------

std::optional<LedgerClock::time_point> TransferLedger::LeaseDeadline() const {
  if (!open_ || open_->report || open_->aborting) return std::nullopt;
  if (options_.transfer_lease.count() == 0) return std::nullopt;
  return open_->last_progress + options_.transfer_lease;
}

std::optional<LedgerClock::time_point> TransferLedger::NextLeaseEvent() const {
  if (std::optional<LedgerClock::time_point> deadline = LeaseDeadline()) return deadline;
  if (open_ && open_->report && !open_->decision_wait_logged &&
      options_.transfer_lease.count() > 0) {
    return open_->last_progress + options_.transfer_lease;
  }
  return std::nullopt;
}

bool TransferLedger::TakeDecisionWaitWarning(LedgerClock::time_point now) {
  if (!open_ || !open_->report || open_->decision_wait_logged ||
      options_.transfer_lease.count() == 0 ||
      now < open_->last_progress + options_.transfer_lease) {
    return false;
  }
  open_->decision_wait_logged = true;
  return true;
}

Status TransferLedger::LeaseExpiredError(LedgerClock::time_point now) const {
  REFIT_DCHECK(open_, "LeaseExpiredError needs an open transfer");
  return DeadlineExceeded(
      "transfer {} (version {} -> {}): its lease of {} ms expired with no prepare, payload, "
      "flush or commit for {} ms ({} payloads staged, {} applied); aborted and rolled back to "
      "version {}",
      open_->id.ToHex(), open_->base_version, open_->target_version,
      options_.transfer_lease.count(), MillisecondsBetween(open_->last_progress, now),
      open_->staged.size(), open_->applied, version_);
}

}  // namespace refit::internal
