// The receiver's transfer bookkeeping on sequences of events alone: no store, no threads, a clock
// the test moves. Each test is a protocol rule (docs/protocol.md, "The receiver's state
// machine"); the sequences the fault soak and the chaos tests found are named where they are.
#include "receiver/transfer_ledger.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/digest.h"
#include "refit/lineage.h"
#include "refit/status_format.h"
#include "test_util.h"

namespace refit::internal {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr milliseconds kLease = seconds(60);
constexpr milliseconds kPreemptAfter = seconds(5);

std::array<uint8_t, 16> Checksum(uint8_t tag) {
  std::array<uint8_t, 16> checksum{};
  checksum.fill(tag);
  return checksum;
}

class TransferLedgerTest : public ::testing::Test {
 protected:
  TransferLedgerTest()
      : ledger_(/*version=*/7, LedgerOptions{.remembered_transfers = 4,
                                             .transfer_lease = kLease,
                                             .preempt_after = kPreemptAfter}) {}

  /// A request based on `base` expecting `per_producer` payloads from each of producers 0, 1.
  static PrepareRequest Request(uint64_t base, uint32_t per_producer = 2, bool anchor = false) {
    PrepareRequest request;
    request.transfer_id = TransferId::Random();
    request.base_version = base;
    request.anchor = anchor;
    request.expected.payloads_per_producer = {{0, per_producer}, {1, per_producer}};
    return request;
  }

  static PayloadIds Ids(const PrepareRequest& request, uint32_t producer, uint32_t payload) {
    return PayloadIds{request.transfer_id, producer, payload, request.base_version,
                      TargetOf(request)};
  }

  /// Open `request` (it must classify as kOpen).
  void Open(const PrepareRequest& request) {
    ASSERT_OK_AND_ASSIGN(PrepareStep step, ledger_.ClassifyPrepare(request, now_));
    ASSERT_EQ(step, PrepareStep::kOpen);
    ledger_.Open(request, now_);
  }

  /// Stage and apply every payload `request` expects, then flush it to prepared.
  void StageApplyAndFlush(const PrepareRequest& request) {
    for (const auto& [producer, count] : request.expected.payloads_per_producer) {
      for (uint32_t payload = 0; payload < count; ++payload) {
        const PayloadIds ids = Ids(request, producer, payload);
        ASSERT_OK(ledger_.CheckStageable(ids));
        ASSERT_OK_AND_ASSIGN(bool duplicate, ledger_.CheckDuplicate(ids, Checksum(1)));
        ASSERT_FALSE(duplicate);
        ledger_.RecordStaged(ids, Checksum(1), 100, now_);
        ASSERT_TRUE(ledger_.ShouldApply(request.transfer_id));
        ledger_.StartApply();
        ledger_.RecordApplied(1, 10, now_);
      }
    }
    ASSERT_OK(ledger_.MergeExpectation({}));
    ASSERT_TRUE(ledger_.AllStaged());
    ASSERT_OK(ledger_.Seal());
    FlushReport report;
    report.transfer_id = request.transfer_id;
    report.target_version = TargetOf(request);
    ledger_.Prepared(report, now_);
    ASSERT_EQ(ledger_.state(), ReceiverState::kPrepared);
  }

  TransferLedger ledger_;
  LedgerClock::time_point now_ = LedgerClock::now();
};

TEST_F(TransferLedgerTest, ADeltaOpensOnlyFromTheReceiversVersion) {
  EXPECT_STATUS_MSG(FailedPrecondition, "based on version 6 but the receiver is at version 7",
                    ledger_.ClassifyPrepare(Request(6), now_));
  EXPECT_STATUS(FailedPrecondition, ledger_.ClassifyPrepare(Request(8), now_));
  // An anchor opens from any base.
  ASSERT_OK_AND_ASSIGN(PrepareStep step, ledger_.ClassifyPrepare(Request(3, 2, true), now_));
  EXPECT_EQ(step, PrepareStep::kOpen);
  Open(Request(7));
  EXPECT_EQ(ledger_.state(), ReceiverState::kReceiving);
}

TEST_F(TransferLedgerTest, ARepeatedPrepareIsARepeatAndAChangedOneIsRefused) {
  const PrepareRequest request = Request(7);
  Open(request);
  ASSERT_OK_AND_ASSIGN(PrepareStep step, ledger_.ClassifyPrepare(request, now_));
  EXPECT_EQ(step, PrepareStep::kRepeat);
  PrepareRequest changed = request;
  changed.expected.payloads_per_producer[1] = 9;
  EXPECT_STATUS_MSG(FailedPrecondition, "already open", ledger_.ClassifyPrepare(changed, now_));
}

TEST_F(TransferLedgerTest, CommitMovesTheVersionAndFinishedIdsAreRefused) {
  const PrepareRequest request = Request(7);
  Open(request);
  StageApplyAndFlush(request);
  ledger_.Commit();
  EXPECT_EQ(ledger_.version(), 8u);
  EXPECT_EQ(ledger_.state(), ReceiverState::kIdle);
  EXPECT_EQ(ledger_.Finished(request.transfer_id), Outcome::kCommitted);
  // A replayed Prepare or a late payload of the committed transfer: an XOR replayed reverts.
  EXPECT_STATUS_MSG(FailedPrecondition, "already committed",
                    ledger_.ClassifyPrepare(request, now_));
  EXPECT_STATUS_MSG(FailedPrecondition, "already committed",
                    ledger_.CheckStageable(Ids(request, 0, 0)));
}

TEST_F(TransferLedgerTest, APrepareFromTheTargetOfAPreparedTransferCommitsItFirst) {
  const PrepareRequest first = Request(7);
  Open(first);
  StageApplyAndFlush(first);
  ASSERT_OK_AND_ASSIGN(PrepareStep step, ledger_.ClassifyPrepare(Request(8), now_));
  EXPECT_EQ(step, PrepareStep::kCommitOpenFirst);
}

TEST_F(TransferLedgerTest, APrepareFromTheBaseOfAPreparedTransferAbortsItFirst) {
  const PrepareRequest first = Request(7);
  Open(first);
  StageApplyAndFlush(first);
  ASSERT_OK_AND_ASSIGN(PrepareStep step, ledger_.ClassifyPrepare(Request(7), now_));
  EXPECT_EQ(step, PrepareStep::kAbortOpenFirst);
  // From neither its base nor its target: refused, naming both.
  EXPECT_STATUS_MSG(FailedPrecondition, "based on version 8 commits it",
                    ledger_.ClassifyPrepare(Request(9), now_));
}

// The chaos test's "kill -9 after prepare": the next coordinator's prepare was refused for the
// whole lease (300 s by default).
TEST_F(TransferLedgerTest, AQuietReceivingTransferIsPreemptedByAPrepareFromItsBase) {
  const PrepareRequest abandoned = Request(7);
  Open(abandoned);
  // While it is live (progress within preempt_after) the new one is refused, naming the rule.
  now_ += kPreemptAfter - milliseconds(1);
  EXPECT_STATUS_MSG(FailedPrecondition, "once it has been quiet for 5000 ms",
                    ledger_.ClassifyPrepare(Request(7), now_));
  // A payload keeps it live.
  ledger_.RecordStaged(Ids(abandoned, 0, 0), Checksum(1), 100, now_);
  now_ += kPreemptAfter - milliseconds(1);
  EXPECT_STATUS(FailedPrecondition, ledger_.ClassifyPrepare(Request(7), now_));
  now_ += milliseconds(1);
  ASSERT_OK_AND_ASSIGN(PrepareStep step, ledger_.ClassifyPrepare(Request(7), now_));
  EXPECT_EQ(step, PrepareStep::kAbortOpenFirst);
  // Only from its base: a prepare from anywhere else says nothing about it.
  EXPECT_STATUS(FailedPrecondition, ledger_.ClassifyPrepare(Request(8), now_));
}

TEST_F(TransferLedgerTest, PreemptionCanBeTurnedOff) {
  TransferLedger ledger(7, LedgerOptions{.transfer_lease = kLease, .preempt_after = {}});
  const PrepareRequest abandoned = Request(7);
  ledger.Open(abandoned, now_);
  EXPECT_STATUS(FailedPrecondition, ledger.ClassifyPrepare(Request(7), now_ + seconds(3600)));
}

// A receiver caught up by folded deltas is prepared from its own version to the fleet's target,
// several versions on; its payloads carry that step, and a later transfer from that target
// commits it implicitly as any other.
TEST_F(TransferLedgerTest, APrepareMayNameATargetSeveralVersionsOn) {
  PrepareRequest folded = Request(7);
  folded.target_version = 10;
  Open(folded);
  EXPECT_EQ(ledger_.open()->target_version, 10u);
  PayloadIds ids = Ids(folded, 0, 0);
  ASSERT_EQ(ids.target_version, 10u);
  ASSERT_OK(ledger_.CheckStageable(ids));
  ids.target_version = 8;  // A payload of a one-step delta does not belong to it.
  EXPECT_STATUS_MSG(FailedPrecondition, "moves version 7 -> 8 but the transfer moves 7 -> 10",
                    ledger_.CheckStageable(ids));
  // The same id with another target is another request.
  PrepareRequest other_target = folded;
  other_target.target_version = 9;
  EXPECT_STATUS_MSG(FailedPrecondition, "already open",
                    ledger_.ClassifyPrepare(other_target, now_));
  ASSERT_OK_AND_ASSIGN(PrepareStep step, ledger_.ClassifyPrepare(folded, now_));
  EXPECT_EQ(step, PrepareStep::kRepeat);
  StageApplyAndFlush(folded);
  ASSERT_OK_AND_ASSIGN(step, ledger_.ClassifyPrepare(Request(10), now_));
  EXPECT_EQ(step, PrepareStep::kCommitOpenFirst);
  ledger_.Commit();
  EXPECT_EQ(ledger_.version(), 10u);
}

// Stragglers and quorum (docs/protocol.md): a receiver fenced from transfer T (7 → 8) while the
// fleet committed it lost its Abort, so T is still open here — prepared (its flush finished after
// the coordinator gave up on it) or receiving. The next transfer is based on 8, and the
// coordinator prepares the fenced receiver from the version it holds, 7, to the target 9: folded,
// or an anchor of its own. Either way T is rolled back first (implied abort), never committed,
// and the receiver reports 7 until the catch-up commits 9.
TEST_F(TransferLedgerTest, AFencedReceiverThatLostItsAbortRollsBackAtItsCatchUp) {
  for (const bool anchor : {false, true}) {
    SCOPED_TRACE(anchor ? "an anchor of its own" : "folded");
    TransferLedger ledger(7,
                          LedgerOptions{.transfer_lease = kLease, .preempt_after = kPreemptAfter});
    const PrepareRequest fenced = Request(7);
    ASSERT_OK_AND_ASSIGN(PrepareStep step, ledger.ClassifyPrepare(fenced, now_));
    ASSERT_EQ(step, PrepareStep::kOpen);
    ledger.Open(fenced, now_);
    for (const auto& [producer, count] : fenced.expected.payloads_per_producer) {
      for (uint32_t payload = 0; payload < count; ++payload) {
        const PayloadIds ids = Ids(fenced, producer, payload);
        ASSERT_OK(ledger.CheckStageable(ids));
        ledger.RecordStaged(ids, Checksum(1), 100, now_);
        ledger.StartApply();
        ledger.RecordApplied(1, 10, now_);
      }
    }
    ASSERT_OK(ledger.MergeExpectation({}));
    ASSERT_OK(ledger.Seal());
    FlushReport report;
    report.transfer_id = fenced.transfer_id;
    report.target_version = 8;
    ledger.Prepared(report, now_);
    // It still reports the version it held: the status a coordinator plans from.
    EXPECT_EQ(ledger.version(), 7u);

    PrepareRequest catch_up = Request(7, 2, anchor);
    catch_up.target_version = 9;
    ASSERT_OK_AND_ASSIGN(step, ledger.ClassifyPrepare(catch_up, now_));
    EXPECT_EQ(step, PrepareStep::kAbortOpenFirst) << "implied abort, never an implied commit";
    ledger.BeginAbort();
    ledger.FinishAbort(/*exact=*/true);
    EXPECT_EQ(ledger.Finished(fenced.transfer_id), Outcome::kAborted);
    EXPECT_EQ(ledger.version(), 7u);
    // A late payload of T is refused; the catch-up then opens from 7 to 9.
    EXPECT_STATUS_MSG(FailedPrecondition, "already aborted",
                      ledger.CheckStageable(Ids(fenced, 0, 0)));
    ASSERT_OK_AND_ASSIGN(step, ledger.ClassifyPrepare(catch_up, now_));
    ASSERT_EQ(step, PrepareStep::kOpen);
    ledger.Open(catch_up, now_);
    EXPECT_EQ(ledger.open()->base_version, 7u);
    EXPECT_EQ(ledger.open()->target_version, 9u);
  }
  // What prepares from the fleet's version would do instead — commit T unverified — is exactly
  // what the coordinator avoids by preparing a receiver behind from the version it holds.
  const PrepareRequest fenced = Request(7);
  Open(fenced);
  StageApplyAndFlush(fenced);
  ASSERT_OK_AND_ASSIGN(PrepareStep step, ledger_.ClassifyPrepare(Request(8, 2, true), now_));
  EXPECT_EQ(step, PrepareStep::kCommitOpenFirst);
}

// A fenced receiver whose Abort was lost while T was still receiving (stalled before its flush):
// its catch-up's prepare from the version it holds preempts T once T has been quiet, and is
// refused while T is live, naming T; a prepare from the fleet's version never touches T.
TEST_F(TransferLedgerTest, AFencedReceiverStillReceivingIsPreemptedByItsCatchUp) {
  const PrepareRequest fenced = Request(7);
  Open(fenced);
  PrepareRequest catch_up = Request(7);
  catch_up.target_version = 9;
  EXPECT_STATUS_MSG(FailedPrecondition, fenced.transfer_id.ToHex(),
                    ledger_.ClassifyPrepare(catch_up, now_));
  EXPECT_STATUS(FailedPrecondition, ledger_.ClassifyPrepare(Request(8, 2, true), now_ + kLease));
  now_ += kPreemptAfter;
  ASSERT_OK_AND_ASSIGN(PrepareStep step, ledger_.ClassifyPrepare(catch_up, now_));
  EXPECT_EQ(step, PrepareStep::kAbortOpenFirst);
}

TEST_F(TransferLedgerTest, DuplicatesAreCountedAndConflictsRefused) {
  const PrepareRequest request = Request(7);
  Open(request);
  const PayloadIds ids = Ids(request, 1, 0);
  ASSERT_OK_AND_ASSIGN(bool duplicate, ledger_.CheckDuplicate(ids, Checksum(1)));
  ASSERT_FALSE(duplicate);
  ledger_.RecordStaged(ids, Checksum(1), 100, now_);
  ASSERT_OK_AND_ASSIGN(duplicate, ledger_.CheckDuplicate(ids, Checksum(1)));
  EXPECT_TRUE(duplicate);
  EXPECT_EQ(ledger_.open()->duplicates, 1u);
  EXPECT_STATUS_MSG(AlreadyExists, "another checksum", ledger_.CheckDuplicate(ids, Checksum(2)));
  EXPECT_EQ(ledger_.received_payloads(), 1u);
  EXPECT_EQ(ledger_.received_bytes(), 100u);
}

TEST_F(TransferLedgerTest, PayloadsOutsideTheCountsOrVersionsAreRefused) {
  const PrepareRequest request = Request(7);
  Open(request);
  EXPECT_STATUS_MSG(InvalidArgument, "producer 0 sends 2 payloads",
                    ledger_.CheckStageable(Ids(request, 0, 2)));
  EXPECT_STATUS_MSG(InvalidArgument, "producer 5 sends 0 payloads",
                    ledger_.CheckStageable(Ids(request, 5, 0)));
  PayloadIds moved = Ids(request, 0, 0);
  moved.target_version = 9;
  EXPECT_STATUS_MSG(FailedPrecondition, "moves version 7 -> 9", ledger_.CheckStageable(moved));
  PayloadIds other = Ids(request, 0, 0);
  other.transfer_id = TransferId::Random();
  EXPECT_STATUS_MSG(FailedPrecondition, "not the open transfer", ledger_.CheckStageable(other));
}

// A stream end, the payloads staged and the expected counts are three accounts of one stream:
// one that contradicts another is refused at once, instead of a flush waiting for payloads the
// producer says it never sent.
TEST_F(TransferLedgerTest, StreamEndsAreHeldToEveryOtherAccountOfTheStream) {
  const PrepareRequest request = Request(7, 3);
  Open(request);
  ledger_.RecordStaged(Ids(request, 0, 2), Checksum(1), 100, now_);
  EXPECT_STATUS_MSG(InvalidArgument, "its payload 2 was staged",
                    ledger_.EndStream(StreamEnd{request.transfer_id, 0, 2}, now_));
  EXPECT_STATUS_MSG(InvalidArgument, "the transfer's payload count expects 3",
                    ledger_.EndStream(StreamEnd{request.transfer_id, 1, 2}, now_));
  ASSERT_OK(ledger_.EndStream(StreamEnd{request.transfer_id, 1, 3}, now_));
  ASSERT_OK(ledger_.EndStream(StreamEnd{request.transfer_id, 1, 3}, now_));  // Repeated.
  EXPECT_STATUS_MSG(InvalidArgument, "and earlier with 3",
                    ledger_.EndStream(StreamEnd{request.transfer_id, 1, 4}, now_));
  // A stream end of a transfer never seen is refused; of a finished one, ignored.
  EXPECT_STATUS(FailedPrecondition, ledger_.EndStream(StreamEnd{TransferId::Random(), 0, 1}, now_));
}

TEST_F(TransferLedgerTest, TheFirstApplyErrorFailsTheTransferAndStopsTheRest) {
  const PrepareRequest request = Request(7);
  Open(request);
  ledger_.RecordStaged(Ids(request, 0, 0), Checksum(1), 100, now_);
  EXPECT_TRUE(ledger_.StartApply());
  EXPECT_FALSE(ledger_.StartApply());  // Only the first one pauses the engine.
  ledger_.RecordApplyFailed(DataLoss("checksum"), now_);
  EXPECT_FALSE(ledger_.ShouldApply(request.transfer_id));
  EXPECT_STATUS_MSG(DataLoss, "the transfer failed earlier",
                    ledger_.CheckStageable(Ids(request, 0, 1)));
  EXPECT_STATUS(DataLoss, ledger_.last_error());
}

TEST_F(TransferLedgerTest, AnAbortThatLeavesFullSpansNeedsAnAnchorUntilOneCommits) {
  const PrepareRequest request = Request(7);
  Open(request);
  ledger_.BeginAbort();
  EXPECT_STATUS_MSG(FailedPrecondition, "being aborted",
                    ledger_.CheckStageable(Ids(request, 0, 0)));
  ledger_.FinishAbort(/*exact=*/false);
  EXPECT_EQ(ledger_.Finished(request.transfer_id), Outcome::kAborted);
  ASSERT_TRUE(ledger_.needs_anchor().has_value());
  EXPECT_STATUS_MSG(FailedPrecondition, "needs an anchor",
                    ledger_.ClassifyPrepare(Request(7), now_));
  const PrepareRequest anchor = Request(7, 1, /*anchor=*/true);
  Open(anchor);
  StageApplyAndFlush(anchor);
  ledger_.Commit();
  EXPECT_FALSE(ledger_.needs_anchor().has_value());
  EXPECT_EQ(ledger_.version(), 8u);
}

TEST_F(TransferLedgerTest, AFailedRollbackKeepsTheTransferOpen) {
  const PrepareRequest request = Request(7);
  Open(request);
  ledger_.BeginAbort();
  ledger_.AbortFailed(NotFound("tensor vanished"));
  ASSERT_TRUE(ledger_.IsOpen(request.transfer_id));
  EXPECT_FALSE(ledger_.open()->aborting);
  EXPECT_STATUS(NotFound, ledger_.last_error());
}

TEST_F(TransferLedgerTest, TheLeaseRunsOnlyWhileReceivingAndRestartsWithProgress) {
  const PrepareRequest request = Request(7);
  Open(request);
  ASSERT_EQ(ledger_.LeaseDeadline(), now_ + kLease);
  now_ += seconds(10);
  ledger_.RecordStaged(Ids(request, 0, 0), Checksum(1), 100, now_);
  EXPECT_EQ(ledger_.LeaseDeadline(), now_ + kLease);
  EXPECT_NE(
      std::string(ledger_.LeaseExpiredError(now_ + kLease).message()).find("lease of 60000 ms"),
      std::string::npos);
  // Prepared: no lease, one warning after a lease's wait.
  const PrepareRequest prepared = Request(7);
  TransferLedger ledger(7, LedgerOptions{.transfer_lease = kLease});
  ledger.Open(prepared, now_);
  FlushReport report;
  ledger.Prepared(report, now_);
  EXPECT_FALSE(ledger.LeaseDeadline().has_value());
  EXPECT_EQ(ledger.NextLeaseEvent(), now_ + kLease);
  EXPECT_FALSE(ledger.TakeDecisionWaitWarning(now_ + kLease - milliseconds(1)));
  EXPECT_TRUE(ledger.TakeDecisionWaitWarning(now_ + kLease));
  EXPECT_FALSE(ledger.TakeDecisionWaitWarning(now_ + kLease * 2));
  EXPECT_FALSE(ledger.NextLeaseEvent().has_value());
}

TEST_F(TransferLedgerTest, OnlyTheNewestFinishedIdsAreRemembered) {
  const TransferId lost = TransferId::Random();
  ledger_.RecordAbortOfUnprepared(lost);
  EXPECT_EQ(ledger_.Finished(lost), Outcome::kAborted);
  for (int i = 0; i < 4; ++i) ledger_.RecordAbortOfUnprepared(TransferId::Random());
  EXPECT_FALSE(ledger_.Finished(lost).has_value());
}

TEST_F(TransferLedgerTest, ExpectationsMayComeAtFlushButMustAgree) {
  PrepareRequest request = Request(7);
  request.expected = {};
  Open(request);
  ledger_.RecordStaged(Ids(request, 3, 0), Checksum(1), 100, now_);
  TransferExpectation counts;
  counts.payloads_per_producer = {{0, 1}};
  EXPECT_STATUS_MSG(InvalidArgument, "payload 0 of producer 3 was staged but is not expected",
                    ledger_.MergeExpectation(counts));
  EXPECT_STATUS_MSG(FailedPrecondition, "no expected payload count", ledger_.MergeExpectation({}));
  counts.payloads_per_producer = {{3, 1}};
  ASSERT_OK(ledger_.MergeExpectation(counts));
  EXPECT_TRUE(ledger_.AllStaged());
  counts.payloads_per_producer = {{3, 2}};
  EXPECT_STATUS_MSG(InvalidArgument, "payload count differs", ledger_.MergeExpectation(counts));
}

// Random sequences of events against a model of the rules: whatever happens, at most one
// transfer is open, the version moves only by a commit of a transfer based on it (or an anchor),
// a committed id never opens again, and the ledger's answers match the model's.
TEST_F(TransferLedgerTest, RandomSequencesKeepTheInvariants) {
  std::mt19937_64 random(20261205);
  for (int trial = 0; trial < 200; ++trial) {
    TransferLedger ledger(0, LedgerOptions{.remembered_transfers = 64,
                                           .transfer_lease = kLease,
                                           .preempt_after = kPreemptAfter});
    LedgerClock::time_point now = LedgerClock::now();
    std::vector<PrepareRequest> seen;
    std::vector<TransferId> committed;
    uint64_t model_version = 0;
    for (int event = 0; event < 60; ++event) {
      now += milliseconds(random() % 3000);
      const OpenTransfer* open = ledger.open();
      switch (random() % 6) {
        case 0: {  // A prepare from a nearby version, or a replay of an old one.
          PrepareRequest request = !seen.empty() && random() % 4 == 0
                                       ? seen[random() % seen.size()]
                                       : Request(model_version + (random() % 3) - 1, 1);
          if (request.base_version == UINT64_MAX) break;
          Result<PrepareStep> step = ledger.ClassifyPrepare(request, now);
          for (const TransferId& id : committed) {
            if (id == request.transfer_id) {
              ASSERT_FALSE(step.ok() && *step == PrepareStep::kOpen) << "a committed id reopened";
            }
          }
          if (!step.ok()) break;
          if (*step == PrepareStep::kOpen) {
            ASSERT_EQ(open, nullptr);
            ASSERT_TRUE(request.anchor || request.base_version == model_version);
            ledger.Open(request, now);
            seen.push_back(request);
          } else if (*step == PrepareStep::kCommitOpenFirst) {
            ASSERT_NE(open, nullptr);
            ASSERT_TRUE(open->report.has_value());
            committed.push_back(open->id);
            ledger.Commit();
            model_version = ledger.version();
          } else if (*step == PrepareStep::kAbortOpenFirst) {
            ASSERT_NE(open, nullptr);
            ASSERT_TRUE(open->report.has_value() || now - open->last_progress >= kPreemptAfter);
            ledger.BeginAbort();
            ledger.FinishAbort(true);
          }
          break;
        }
        case 1:
        case 2: {  // A payload of the open transfer.
          if (open == nullptr) break;
          const PayloadIds ids{open->id, static_cast<uint32_t>(random() % 2), 0, open->base_version,
                               open->target_version};
          if (!ledger.CheckStageable(ids).ok()) break;
          Result<bool> duplicate = ledger.CheckDuplicate(ids, Checksum(1));
          ASSERT_OK(duplicate.status());
          if (!*duplicate) ledger.RecordStaged(ids, Checksum(1), 10, now);
          break;
        }
        case 3: {  // A flush once everything is staged.
          if (open == nullptr || open->report || !ledger.MergeExpectation({}).ok()) break;
          if (!ledger.AllStaged()) break;
          ASSERT_OK(ledger.Seal());
          FlushReport report;
          report.transfer_id = open->id;
          ledger.Prepared(report, now);
          break;
        }
        case 4: {  // A commit of a prepared transfer.
          if (open == nullptr || !open->report) break;
          committed.push_back(open->id);
          ledger.Commit();
          model_version = ledger.version();
          break;
        }
        case 5: {  // An abort, or the lease.
          if (open == nullptr) break;
          const std::optional<LedgerClock::time_point> deadline = ledger.LeaseDeadline();
          if (random() % 2 == 0 || (deadline && now >= *deadline)) {
            ledger.BeginAbort();
            ledger.FinishAbort(true);
          }
          break;
        }
      }
      ASSERT_EQ(ledger.version(), model_version);
      if (ledger.open() != nullptr) {
        ASSERT_TRUE(ledger.open()->anchor || ledger.open()->base_version == model_version);
      }
    }
  }
}

// ---- Lineage and fencing (docs/protocol.md "Lineage and fencing"). -----------------------------

/// A request of `run` at `epoch` with state `digests` at its target (they fix the fingerprint the
/// receiver holds once it commits).
PrepareRequest LineageRequest(uint64_t base, std::string run, uint64_t epoch, bool anchor = false,
                              uint64_t state = 1, uint64_t base_fingerprint = 0) {
  PrepareRequest request;
  request.transfer_id = TransferId::Random();
  request.base_version = base;
  request.anchor = anchor;
  request.expected.payloads_per_producer = {{0, 1}};
  request.expected.digests = {{"w", state}};
  request.lineage = TransferLineage{std::move(run), epoch, base_fingerprint};
  return request;
}

class LedgerLineageTest : public TransferLedgerTest {
 protected:
  /// Open, stage, flush and commit `request`.
  void Commit(const PrepareRequest& request) {
    Open(request);
    StageApplyAndFlush(request);
    ledger_.Commit();
  }
};

TEST_F(LedgerLineageTest, AReceiverWithoutLineageAdoptsTheRunOfItsFirstCommit) {
  EXPECT_TRUE(ledger_.lineage().run_id.empty());
  Commit(LineageRequest(7, "run-a", 0, false, /*state=*/11));
  EXPECT_EQ(ledger_.version(), 8u);
  EXPECT_EQ(ledger_.lineage().run_id, "run-a");
  EXPECT_EQ(ledger_.lineage().epoch, 0u);
  EXPECT_EQ(ledger_.lineage().fingerprint, StateFingerprint({{"w", 11}}));
}

TEST_F(LedgerLineageTest, ADeltaOfAnotherRunIsRefusedNamingBothRuns) {
  Commit(LineageRequest(7, "run-a", 2));
  const Result<PrepareStep> refused = ledger_.ClassifyPrepare(LineageRequest(8, "run-b", 0), now_);
  EXPECT_STATUS_MSG(FailedPrecondition, "a delta of run 'run-b' epoch 0", refused);
  EXPECT_STATUS_MSG(FailedPrecondition, "holds version 8 of run 'run-a' epoch 2", refused);
  EXPECT_EQ(ledger_.state(), ReceiverState::kIdle);
}

TEST_F(LedgerLineageTest, AnotherRunAnchorsOnlyAboveTheVersionHeld) {
  Commit(LineageRequest(7, "run-a", 0));  // At 8.
  // To version 8 or below: it would reuse a version number this receiver holds.
  EXPECT_STATUS_MSG(FailedPrecondition, "would reuse version 8 with other contents",
                    ledger_.ClassifyPrepare(LineageRequest(7, "run-b", 0, true), now_));
  EXPECT_STATUS_MSG(FailedPrecondition, "would reuse version 4",
                    ledger_.ClassifyPrepare(LineageRequest(3, "run-b", 0, true), now_));
  // Above it: a new lineage, which the receiver then holds.
  Commit(LineageRequest(8, "run-b", 0, true, /*state=*/5));
  EXPECT_EQ(ledger_.version(), 9u);
  EXPECT_EQ(ledger_.lineage().run_id, "run-b");
  EXPECT_EQ(ledger_.lineage().fingerprint, StateFingerprint({{"w", 5}}));
  // And the old run's deltas are now another run's.
  EXPECT_STATUS_MSG(FailedPrecondition, "a delta of run 'run-a'",
                    ledger_.ClassifyPrepare(LineageRequest(9, "run-a", 0), now_));
}

TEST_F(LedgerLineageTest, AResumedEpochFencesTheZombieFromItsFirstPrepare) {
  Commit(LineageRequest(7, "run-a", 0));  // At 8, epoch 0.
  // The resumed trainer (epoch 1) prepares; its transfer aborts.
  const PrepareRequest resumed = LineageRequest(8, "run-a", 1);
  Open(resumed);
  EXPECT_EQ(ledger_.lineage().epoch, 1u);
  ledger_.BeginAbort();
  ledger_.FinishAbort(/*exact=*/true);
  // The zombie of epoch 0 is refused even so, and nothing opens.
  const Result<PrepareStep> zombie = ledger_.ClassifyPrepare(LineageRequest(8, "run-a", 0), now_);
  EXPECT_STATUS_MSG(FailedPrecondition, "run 'run-a' epoch 0 (version 8 -> 9) is fenced", zombie);
  EXPECT_STATUS_MSG(FailedPrecondition, "epoch 1 of that run was seen", zombie);
  EXPECT_EQ(ledger_.state(), ReceiverState::kIdle);
  // The resumed epoch continues with deltas.
  Commit(LineageRequest(8, "run-a", 1));
  EXPECT_EQ(ledger_.version(), 9u);
  EXPECT_EQ(ledger_.lineage().epoch, 1u);
}

TEST_F(LedgerLineageTest, AZombieCannotAbortTheResumedTrainersOpenTransferImplicitly) {
  Commit(LineageRequest(7, "run-a", 0));
  const PrepareRequest resumed = LineageRequest(8, "run-a", 1);
  Open(resumed);
  StageApplyAndFlush(resumed);
  // The zombie's delta from the same base would be an implied abort; it is refused instead.
  EXPECT_STATUS_MSG(FailedPrecondition, "only its own lineage may abort it",
                    ledger_.ClassifyPrepare(LineageRequest(8, "run-a", 0), now_));
  // Another run basing a transfer on the prepared target may not commit it either.
  EXPECT_STATUS_MSG(FailedPrecondition, "only its own lineage may commit it",
                    ledger_.ClassifyPrepare(LineageRequest(9, "run-b", 0, true), now_));
  EXPECT_EQ(ledger_.state(), ReceiverState::kPrepared);
  // Its own next transfer commits it implicitly.
  ASSERT_OK_AND_ASSIGN(PrepareStep step,
                       ledger_.ClassifyPrepare(LineageRequest(9, "run-a", 1), now_));
  EXPECT_EQ(step, PrepareStep::kCommitOpenFirst);
}

TEST_F(LedgerLineageTest, ADeltaFromAnotherStateUnderTheSameVersionIsRefused) {
  Commit(LineageRequest(7, "run-a", 0, false, /*state=*/21));  // At 8.
  const uint64_t held = StateFingerprint({{"w", 21}});
  const uint64_t other = StateFingerprint({{"w", 22}});
  const Result<PrepareStep> refused =
      ledger_.ClassifyPrepare(LineageRequest(8, "run-a", 1, false, 1, other), now_);
  EXPECT_STATUS_MSG(FailedPrecondition, "would reuse version 9 with other contents", refused);
  EXPECT_STATUS_MSG(FailedPrecondition, fmt::format("fingerprint {:016x}", other), refused);
  EXPECT_STATUS_MSG(FailedPrecondition, fmt::format("fingerprint {:016x}", held), refused);
  // The same base state, or one not stated, opens.
  ASSERT_OK_AND_ASSIGN(PrepareStep same, ledger_.ClassifyPrepare(
                                             LineageRequest(8, "run-a", 1, false, 1, held), now_));
  EXPECT_EQ(same, PrepareStep::kOpen);
  ASSERT_OK_AND_ASSIGN(PrepareStep unstated,
                       ledger_.ClassifyPrepare(LineageRequest(8, "run-a", 1), now_));
  EXPECT_EQ(unstated, PrepareStep::kOpen);
}

TEST_F(LedgerLineageTest, AResumedTrainerMayNotRewriteVersionsByAnAnchor) {
  Commit(LineageRequest(7, "run-a", 0));  // At 8.
  EXPECT_STATUS_MSG(FailedPrecondition, "published by epoch 0",
                    ledger_.ClassifyPrepare(LineageRequest(5, "run-a", 1, true), now_));
  // The trainer of the epoch that published them may anchor them again (a receiver that needs an
  // anchor), and the resumed one may anchor above them.
  ASSERT_OK_AND_ASSIGN(PrepareStep same,
                       ledger_.ClassifyPrepare(LineageRequest(7, "run-a", 0, true), now_));
  EXPECT_EQ(same, PrepareStep::kOpen);
  ASSERT_OK_AND_ASSIGN(PrepareStep above,
                       ledger_.ClassifyPrepare(LineageRequest(8, "run-a", 1, true), now_));
  EXPECT_EQ(above, PrepareStep::kOpen);
}

TEST_F(LedgerLineageTest, ARequestWithoutLineageIsRefusedOnlyByAReceiverThatHoldsOne) {
  // No lineage on either side: today's protocol.
  ASSERT_OK_AND_ASSIGN(PrepareStep step, ledger_.ClassifyPrepare(Request(7), now_));
  EXPECT_EQ(step, PrepareStep::kOpen);
  Commit(LineageRequest(7, "run-a", 3));
  EXPECT_STATUS_MSG(FailedPrecondition, "states no lineage",
                    ledger_.ClassifyPrepare(Request(8), now_));
}

TEST_F(LedgerLineageTest, ALineageLoadedWithTheStoreIsEnforcedFromTheStart) {
  TransferLedger restarted(/*version=*/12, LedgerOptions{}, HeldLineage{"run-a", 4, 99});
  EXPECT_STATUS_MSG(FailedPrecondition, "is fenced",
                    restarted.ClassifyPrepare(LineageRequest(12, "run-a", 3), now_));
  EXPECT_STATUS_MSG(FailedPrecondition, "would reuse version 13 with other contents",
                    restarted.ClassifyPrepare(LineageRequest(12, "run-a", 4, false, 1, 98), now_));
  ASSERT_OK_AND_ASSIGN(PrepareStep step, restarted.ClassifyPrepare(
                                             LineageRequest(12, "run-a", 4, false, 1, 99), now_));
  EXPECT_EQ(step, PrepareStep::kOpen);
}

TEST(LineageMetadataTest, RoundTripsAndRefusesGarbageByName) {
  const HeldLineage lineage{"run-a", 3, 0x0123456789abcdefULL};
  ASSERT_OK_AND_ASSIGN(HeldLineage read, LineageFromMetadata(LineageMetadata(lineage)));
  EXPECT_EQ(read, lineage);
  ASSERT_OK_AND_ASSIGN(HeldLineage none, LineageFromMetadata({}));
  EXPECT_EQ(none, HeldLineage{});
  EXPECT_STATUS_MSG(InvalidArgument, "'refit.epoch': 'x3' is not an epoch",
                    LineageFromMetadata({{"refit.run_id", "a"}, {"refit.epoch", "x3"}}));
  EXPECT_STATUS_MSG(InvalidArgument, "'refit.fingerprint'",
                    LineageFromMetadata({{"refit.fingerprint", "zz"}}));
}

}  // namespace
}  // namespace refit::internal
