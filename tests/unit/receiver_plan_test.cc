// Per-receiver plans: PlanCatchUps chooses each receiver's catch-up from where it stands, and a
// ProducerStream with a delta, an anchor and a folded route sends each what takes its receivers to
// the target — the folded route one payload per chunk whose items take a receiver 3 versions
// behind to the target bit-identically, with no more bytes than the 3 deltas it missed.
#include "pipeline/receiver_plan.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "codec/delta_history.h"
#include "codec/locations.h"
#include "codec/tracker.h"
#include "pipeline/producer_stream.h"
#include "refit/chunk_source.h"
#include "refit/payload.h"
#include "test_util.h"

namespace refit {
namespace {

TransferPlan Delta(uint64_t base) {
  return TransferPlan{TransferId::Random(), false, base, base + 1};
}

TEST(PlanCatchUpsTest, EachReceiverIsCaughtUpByTheCheapestSourceThatIsCorrect) {
  const std::vector<std::optional<ReceiverStanding>> standings = {
      ReceiverStanding{.version = 10, .accepts_target = true},  // At the base.
      ReceiverStanding{.version = 7, .accepts_target = true},   // 3 behind, within history.
      ReceiverStanding{.version = 3, .accepts_target = true},   // Beyond history (from 5).
      ReceiverStanding{.version = 7, .accepts_target = false},  // Cannot prepare to a target.
      ReceiverStanding{.version = 10, .needs_anchor = true},    // A mix of versions.
      ReceiverStanding{.version = 12},                          // Ahead of the base.
      std::nullopt,                                             // Not asked.
  };
  const std::vector<PlannedCatchUp> plans = PlanCatchUps(Delta(10), standings, 5);
  ASSERT_EQ(plans.size(), standings.size());
  const CatchUp want[] = {CatchUp::kDelta,  CatchUp::kFolded, CatchUp::kAnchor, CatchUp::kAnchor,
                          CatchUp::kAnchor, CatchUp::kAnchor, CatchUp::kDelta};
  for (size_t r = 0; r < plans.size(); ++r) {
    EXPECT_EQ(plans[r].how, want[r]) << "receiver " << r << ": " << plans[r].why;
  }
  EXPECT_EQ(plans[1].from_version, 7u);
  EXPECT_EQ(plans[1].lag, 3u);
  EXPECT_EQ(plans[2].lag, 7u);
  EXPECT_NE(plans[2].why.find("beyond the retained history"), std::string::npos) << plans[2].why;
  EXPECT_EQ(plans[6].from_version, 10u);

  // Without history, behind is an anchor of its own; in an anchor, everyone gets the anchor.
  EXPECT_EQ(PlanCatchUps(Delta(10), standings, std::nullopt)[1].how, CatchUp::kAnchor);
  TransferPlan anchor = Delta(10);
  anchor.anchor = true;
  for (const PlannedCatchUp& plan : PlanCatchUps(anchor, standings, 5)) {
    EXPECT_EQ(plan.how, CatchUp::kAnchor);
  }
}

// Stragglers and quorum (docs/protocol.md): a receiver behind the base — one fenced at the last
// transfer among them, which may still hold that transfer open if its Abort was lost — is
// prepared from the version it holds, folded or by an anchor of its own, in a delta transfer or an
// anchor: its open transfer is then rolled back (implied abort), never committed. Receivers at or
// ahead of the base, and those that cannot prepare to a named target, are prepared from the base.
TEST(PlanCatchUpsTest, AReceiverBehindIsPreparedFromTheVersionItHolds) {
  const std::vector<std::optional<ReceiverStanding>> standings = {
      ReceiverStanding{.version = 10, .accepts_target = true},  // At the base.
      ReceiverStanding{.version = 9, .accepts_target = true},   // Fenced last time: folded.
      ReceiverStanding{.version = 9, .accepts_target = true},   // Fenced, beyond the history.
      ReceiverStanding{.version = 9, .accepts_target = false},  // An older build.
      ReceiverStanding{.version = 12, .accepts_target = true},  // Ahead.
      std::nullopt,                                             // Not asked.
  };
  std::vector<PlannedCatchUp> plans = PlanCatchUps(Delta(10), standings, 9);
  EXPECT_EQ(plans[1].how, CatchUp::kFolded);
  plans[2] = PlanCatchUps(Delta(10), standings, std::nullopt)[2];
  EXPECT_EQ(plans[2].how, CatchUp::kAnchor);
  const uint64_t want[] = {10, 9, 9, 10, 10, 10};
  for (size_t r = 0; r < plans.size(); ++r) {
    EXPECT_EQ(plans[r].prepared_base, want[r]) << "receiver " << r << ": " << plans[r].why;
  }
  TransferPlan anchor = Delta(10);
  anchor.anchor = true;
  plans = PlanCatchUps(anchor, standings, 9);
  for (size_t r = 0; r < plans.size(); ++r) {
    EXPECT_EQ(plans[r].prepared_base, want[r]) << "anchor, receiver " << r;
  }
}

// ---- The producer side: one stream, three routes.
// ------------------------------------------------

constexpr uint64_t kElements = 3000;
constexpr int kTensors = 4;
constexpr uint64_t kChunkBytes = 2 * kElements * 2;  // Two tensors per chunk: 2 chunks.

using Model = std::vector<std::vector<uint16_t>>;

std::vector<TensorView> Views(const Model& model) {
  std::vector<TensorView> views;
  for (size_t t = 0; t < model.size(); ++t) {
    views.push_back(TensorView{"t" + std::to_string(t),
                               DType::kBFloat16,
                               {static_cast<int64_t>(kElements)},
                               std::as_bytes(std::span<const uint16_t>(model[t]))});
  }
  return views;
}

// The payloads one route received, decoded.
struct RouteSink {
  std::mutex mutex;
  std::vector<std::vector<std::byte>> payloads;
  uint64_t bytes = 0;

  PayloadSender Sender() {
    return [this](uint32_t, std::span<const std::byte> payload) {
      std::lock_guard lock(mutex);
      payloads.emplace_back(payload.begin(), payload.end());
      bytes += payload.size();
      return Status::OK();
    };
  }

  // Apply every payload to `state` as a receiver does (XOR or FULL), checking its header.
  void ApplyTo(Model& state, uint64_t base, uint64_t target) {
    for (const std::vector<std::byte>& payload : payloads) {
      ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(payload));
      EXPECT_EQ(decoded.header().ids.base_version, base);
      EXPECT_EQ(decoded.header().ids.target_version, target);
      for (const ItemView& item : decoded.items()) {
        std::vector<uint16_t>& tensor = state.at(std::stoul(std::string(item.name.substr(1))));
        if (item.op == Op::kFull) {
          std::memcpy(tensor.data() + item.span_begin, item.values.data(), item.values.size());
          continue;
        }
        ASSERT_EQ(item.op, Op::kXor);
        ASSERT_OK_AND_ASSIGN(std::vector<uint64_t> locations, DecodeAllLocations(item));
        for (size_t k = 0; k < locations.size(); ++k) {
          uint16_t v = 0;
          std::memcpy(&v, item.values.data() + k * 2, 2);
          tensor[locations[k]] ^= v;
        }
      }
    }
  }
};

TEST(PerReceiverStreamTest, DeltaAnchorAndFoldedRoutesEachReachTheTargetInOneTransfer) {
  std::mt19937_64 rng(40);
  Model model(kTensors, std::vector<uint16_t>(kElements));
  for (auto& tensor : model) {
    for (uint16_t& b : tensor) b = static_cast<uint16_t>(0x3c80 + rng() % 0x100);
  }
  std::vector<Model> versions = {model};
  auto tracker = internal::DeltaTracker::Make(TrackerOptions{}).ValueOrDie();
  for (const TensorView& view : Views(model)) ASSERT_OK(tracker->AdoptBaseline(view));
  auto history = DeltaHistory::Make(DeltaHistoryOptions{}).ValueOrDie();
  ProducerStreamOptions options;
  options.chunk_bytes = kChunkBytes;
  options.encode_threads = 2;
  auto stream = ProducerStream::Make(options).ValueOrDie();
  std::bernoulli_distribution changes(0.02);
  const auto step = [&] {
    for (auto& tensor : model) {
      for (uint16_t& b : tensor) {
        if (changes(rng)) b = static_cast<uint16_t>(b ^ (1 + rng() % 3));
      }
    }
  };

  // Five delta syncs, each recorded in the history; the bytes of each delta kept.
  std::vector<uint64_t> delta_bytes;
  for (int s = 0; s < 5; ++s) {
    step();
    ASSERT_OK_AND_ASSIGN(TransferPlan plan, tracker->Begin(TransferId::Random()));
    history->Begin(plan.base_version, plan.anchor);
    RouteSink sink;
    const StreamRoute route{nullptr, sink.Sender(), nullptr};
    ASSERT_OK(stream
                  ->Run(*tracker, TensorListSource(Views(model), kChunkBytes),
                        std::span<const StreamRoute>(&route, 1), history.get())
                  .status());
    ASSERT_OK(tracker->Commit(plan.transfer_id));
    history->Commit();
    delta_bytes.push_back(sink.bytes);
    versions.push_back(model);
  }

  // Transfer 5 → 6: members at 5 get the delta, a receiver at 2 the fold of 3→…→6, a newcomer
  // at 0 an anchor of its own.
  step();
  ASSERT_OK_AND_ASSIGN(TransferPlan plan, tracker->Begin(TransferId::Random()));
  history->Begin(plan.base_version, plan.anchor);
  ASSERT_TRUE(history->CanFold(2));
  RouteSink delta, anchor, folded;
  const StreamRoute routes[] = {
      StreamRoute{nullptr, delta.Sender(), nullptr},
      StreamRoute{nullptr, anchor.Sender(), nullptr, CatchUp::kAnchor, 5},
      StreamRoute{nullptr, folded.Sender(), nullptr, CatchUp::kFolded, 2},
  };
  ASSERT_OK_AND_ASSIGN(
      StreamReport report,
      stream->Run(*tracker, TensorListSource(Views(model), kChunkBytes), routes, history.get()));
  ASSERT_EQ(report.routes.size(), 3u);
  // One folded item per tensor (each changed in every step), whatever the k deltas behind it.
  EXPECT_EQ(report.routes[2].items, static_cast<uint64_t>(kTensors));

  Model at_base = versions[5];
  delta.ApplyTo(at_base, 5, 6);
  EXPECT_TRUE(at_base == model) << "the delta takes a member at 5 to 6";
  Model newcomer(kTensors, std::vector<uint16_t>(kElements, 0xFFFF));
  anchor.ApplyTo(newcomer, 5, 6);
  EXPECT_TRUE(newcomer == model) << "the anchor takes any state to 6";
  Model laggard = versions[2];
  folded.ApplyTo(laggard, 2, 6);
  EXPECT_TRUE(laggard == model) << "the fold takes a receiver at 2 to 6";

  // The fold replaces the deltas 2→3, 3→4, 4→5 and this one, 5→6: never more than their sum.
  const uint64_t missed = delta_bytes[2] + delta_bytes[3] + delta_bytes[4] + delta.bytes;
  EXPECT_LE(folded.bytes, missed);
  EXPECT_LT(folded.bytes, anchor.bytes);
  // The members' payloads are those of a plain delta transfer.
  EXPECT_EQ(report.routes[0].wire_bytes, delta.bytes);
  ASSERT_OK(tracker->Commit(plan.transfer_id));
  history->Commit();
}

TEST(PerReceiverStreamTest, AFoldedRouteWithoutHistoryIsRefusedBeforeAnythingIsSent) {
  Model model(kTensors, std::vector<uint16_t>(kElements, 0x3c80));
  auto tracker = internal::DeltaTracker::Make(TrackerOptions{}).ValueOrDie();
  for (const TensorView& view : Views(model)) ASSERT_OK(tracker->AdoptBaseline(view));
  ProducerStreamOptions options;
  options.chunk_bytes = kChunkBytes;
  auto stream = ProducerStream::Make(options).ValueOrDie();
  ASSERT_OK_AND_ASSIGN(TransferPlan plan, tracker->Begin(TransferId::Random()));
  RouteSink folded;
  const StreamRoute route{nullptr, folded.Sender(), nullptr, CatchUp::kFolded, 0};
  EXPECT_STATUS(InvalidArgument, stream
                                     ->Run(*tracker, TensorListSource(Views(model), kChunkBytes),
                                           std::span<const StreamRoute>(&route, 1), nullptr)
                                     .status());
  EXPECT_TRUE(folded.payloads.empty());
  ASSERT_OK(tracker->Abort(plan.transfer_id));
}

}  // namespace
}  // namespace refit
