// DeltaHistory: a producer's retained deltas fold a receiver k versions behind to the open
// transfer's target, chunk by chunk, bit-identically; the bounds (versions, bytes) drop the
// oldest; whatever does not fold exactly (a non-XOR item, a broken chain, an anchor, a chunk that
// changed) clears the history rather than fold wrongly.
#include "codec/delta_history.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "codec/locations.h"
#include "codec/tracker.h"
#include "test_util.h"

namespace refit {
namespace {

constexpr uint64_t kElements = 2048;
constexpr int kChunks = 2;

std::string Name(int chunk) { return "layer." + std::to_string(chunk) + ".weight"; }

TensorView View(int chunk, const std::vector<uint16_t>& bits) {
  return TensorView{Name(chunk),
                    DType::kBFloat16,
                    {static_cast<int64_t>(kElements)},
                    std::as_bytes(std::span<const uint16_t>(bits))};
}

void ApplyXor(const ItemView& item, std::vector<uint16_t>& state) {
  ASSERT_EQ(item.op, Op::kXor);
  ASSERT_OK_AND_ASSIGN(std::vector<uint64_t> locations, DecodeAllLocations(item));
  for (size_t k = 0; k < locations.size(); ++k) {
    uint16_t v = 0;
    std::memcpy(&v, item.values.data() + k * sizeof(uint16_t), sizeof(v));
    state[locations[k]] ^= v;
  }
}

// A producer of two chunks (one tensor each) that records every transfer in a history, and the
// states of every version, so a receiver at any version can be replayed.
class Producer {
 public:
  explicit Producer(DeltaHistoryOptions options) : rng_(42) {
    history_ = DeltaHistory::Make(options).ValueOrDie();
    tracker_ = internal::DeltaTracker::Make(TrackerOptions{}).ValueOrDie();
    for (int c = 0; c < kChunks; ++c) {
      state_[c].resize(kElements);
      for (uint16_t& b : state_[c]) b = static_cast<uint16_t>(0x3c80 + rng_() % 0x100);
      EXPECT_OK(tracker_->AdoptBaseline(View(c, state_[c])));
    }
    versions_.push_back(state_);
  }

  // One step: open a transfer, record its items; `commit` false leaves it open for a fold.
  std::array<std::vector<Item>, kChunks> Step(bool commit = true, double fraction = 0.02) {
    std::bernoulli_distribution changes(fraction);
    for (int c = 0; c < kChunks; ++c) {
      for (uint16_t& b : state_[c]) {
        if (changes(rng_)) b = static_cast<uint16_t>(b ^ (1 + rng_() % 3));
      }
    }
    id_ = TransferId::Random();
    const TransferPlan plan = tracker_->Begin(id_).ValueOrDie();
    history_->Begin(plan.base_version, plan.anchor);
    std::array<std::vector<Item>, kChunks> items;
    for (int c = 0; c < kChunks; ++c) {
      const TensorView view = View(c, state_[c]);
      items[c] = tracker_->Encode(id_, view).ValueOrDie().items;
      history_->Record(c, ChunkSignature(std::span<const TensorView>(&view, 1)), items[c]);
    }
    if (commit) Commit();
    return items;
  }
  void Commit() {
    EXPECT_OK(tracker_->Commit(id_));
    history_->Commit();
    versions_.push_back(state_);
  }

  // The receiver at `from` folded to the open transfer's target: every chunk equals the state.
  void ExpectFoldReaches(uint64_t from, const std::array<std::vector<Item>, kChunks>& open) {
    for (int c = 0; c < kChunks; ++c) {
      const TensorView view = View(c, state_[c]);
      ASSERT_OK_AND_ASSIGN(
          std::vector<Item> folded,
          history_->FoldChunk(from, c, ChunkSignature(std::span<const TensorView>(&view, 1)),
                              open[c]));
      ASSERT_LE(folded.size(), 1u);
      std::vector<uint16_t> held = versions_.at(from)[c];
      for (const Item& item : folded) ApplyXor(item.view(), held);
      EXPECT_TRUE(held == state_[c]) << "chunk " << c << " folded from version " << from;
    }
  }

  DeltaHistory& history() { return *history_; }

 private:
  std::mt19937_64 rng_;
  std::unique_ptr<DeltaHistory> history_;
  std::unique_ptr<internal::DeltaTracker> tracker_;
  TransferId id_;
  std::array<std::vector<uint16_t>, kChunks> state_;
  std::vector<std::array<std::vector<uint16_t>, kChunks>> versions_;
};

TEST(DeltaHistoryTest, AReceiverUpToMaxVersionsBehindIsFoldedToTheTargetChunkByChunk) {
  DeltaHistoryOptions options;
  options.max_versions = 4;
  Producer producer(options);
  for (int s = 0; s < 6; ++s) producer.Step();
  // Versions 0 … 6 committed; the open transfer 6 → 7. Four deltas kept: 2→3 … 5→6.
  const auto open = producer.Step(/*commit=*/false);
  EXPECT_EQ(producer.history().retained_versions(), 4u);
  EXPECT_EQ(producer.history().oldest_version(), 2u);
  for (uint64_t from = 2; from < 6; ++from) {
    EXPECT_TRUE(producer.history().CanFold(from)) << from;
    producer.ExpectFoldReaches(from, open);
  }
  EXPECT_FALSE(producer.history().CanFold(1)) << "beyond the retained history: an anchor";
  EXPECT_FALSE(producer.history().CanFold(6)) << "at the base: the delta itself";
  EXPECT_STATUS(FailedPrecondition, producer.history().FoldChunk(1, 0, 0, open[0]).status());
}

TEST(DeltaHistoryTest, TheByteBoundDropsTheOldestDeltas) {
  DeltaHistoryOptions options;
  options.max_versions = 100;
  Producer probe(options);
  probe.Step();
  const uint64_t one = probe.history().retained_bytes();
  ASSERT_GT(one, 0u);
  options.max_bytes = one * 5 / 2;  // Room for about two deltas of this size.
  Producer producer(options);
  for (int s = 0; s < 6; ++s) producer.Step();
  EXPECT_LE(producer.history().retained_bytes(), options.max_bytes);
  EXPECT_GE(producer.history().retained_versions(), 1u);
  EXPECT_LE(producer.history().retained_versions(), 3u);
  const auto open = producer.Step(/*commit=*/false);
  producer.ExpectFoldReaches(*producer.history().oldest_version(), open);
}

TEST(DeltaHistoryTest, AnAnchorABrokenChainOrANonXorItemClearsTheHistory) {
  Producer producer(DeltaHistoryOptions{});
  for (int s = 0; s < 3; ++s) producer.Step();
  ASSERT_EQ(producer.history().retained_versions(), 3u);

  DeltaHistory& history = producer.history();
  history.Begin(3, /*anchor=*/true);
  EXPECT_EQ(history.retained_versions(), 0u) << "an anchor";
  history.Abort();

  Producer chained(DeltaHistoryOptions{});
  for (int s = 0; s < 3; ++s) chained.Step();
  chained.history().Begin(7, /*anchor=*/false);  // A restarted producer at another version.
  EXPECT_EQ(chained.history().retained_versions(), 0u) << "a base the history does not reach";
  chained.history().Abort();

  Producer mixed(DeltaHistoryOptions{});
  for (int s = 0; s < 2; ++s) mixed.Step();
  mixed.history().Begin(2, false);
  Item overwrite;
  overwrite.name = Name(0);
  overwrite.op = Op::kOverwrite;
  mixed.history().Record(0, 1, std::span<const Item>(&overwrite, 1));
  mixed.history().Commit();
  EXPECT_EQ(mixed.history().retained_versions(), 0u) << "an OVERWRITE delta does not fold";
}

TEST(DeltaHistoryTest, AChunkThatChangedShapeIsRefusedNotFoldedWrongly) {
  Producer producer(DeltaHistoryOptions{});
  for (int s = 0; s < 3; ++s) producer.Step();
  const auto open = producer.Step(/*commit=*/false);
  const Status refused = producer.history().FoldChunk(1, 0, /*signature=*/12345, open[0]).status();
  EXPECT_STATUS(FailedPrecondition, refused);
  EXPECT_NE(refused.message().find("chunk 0"), std::string_view::npos) << refused.ToString();
  producer.Commit();
  producer.history().Begin(4, false);
  EXPECT_EQ(producer.history().retained_versions(), 0u);
}

}  // namespace
}  // namespace refit
