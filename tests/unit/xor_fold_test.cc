// XOR folding: the deltas a tracker emitted over k steps, folded into one item, take the first
// state to the last bit-identically — the same bits as applying the k items one by one — with no
// more locations than their sum and the digest the states' digests say.
#include "codec/xor_fold.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "codec/locations.h"
#include "codec/tracker.h"
#include "core/digest.h"
#include "test_util.h"

namespace refit {
namespace {

constexpr uint64_t kElements = 4096;

TensorView View(const std::vector<uint16_t>& bits) {
  return TensorView{"w",
                    DType::kBFloat16,
                    {static_cast<int64_t>(kElements)},
                    std::as_bytes(std::span<const uint16_t>(bits))};
}

// dst ^= v at every location of `item`: what a receiver does with an XOR item.
void ApplyXor(const ItemView& item, std::vector<uint16_t>& state) {
  ASSERT_OK_AND_ASSIGN(std::vector<uint64_t> locations, DecodeAllLocations(item));
  ASSERT_EQ(item.values.size(), locations.size() * sizeof(uint16_t));
  for (size_t k = 0; k < locations.size(); ++k) {
    uint16_t v = 0;
    std::memcpy(&v, item.values.data() + k * sizeof(uint16_t), sizeof(v));
    state[locations[k]] ^= v;
  }
}

// `steps` optimizer steps of a bf16 tensor, each moving `fraction` of its elements by a few ulps
// (some elements move back, so folding cancels them), with the XOR item a tracker emits for each.
struct Steps {
  std::vector<std::vector<uint16_t>> states;  // states[0] … states[steps]
  std::vector<Item> deltas;                   // deltas[k]: states[k] → states[k + 1]
};

Steps MakeSteps(uint64_t seed, int steps, double fraction) {
  std::mt19937_64 rng(seed);
  Steps out;
  std::vector<uint16_t> state(kElements);
  for (uint16_t& b : state) b = static_cast<uint16_t>(0x3c80 + rng() % 0x100);
  out.states.push_back(state);
  TrackerOptions options;
  auto tracker = internal::DeltaTracker::Make(options).ValueOrDie();
  EXPECT_OK(tracker->AdoptBaseline(View(state)));
  std::bernoulli_distribution changes(fraction);
  for (int s = 0; s < steps; ++s) {
    for (uint64_t i = 0; i < kElements; ++i) {
      // Low elements flip their lowest bit every step: they come back every other step.
      if (i < 64 || changes(rng))
        state[i] = static_cast<uint16_t>(state[i] ^ (1 + (i < 64 ? 0 : rng() % 3)));
    }
    const TransferId id = TransferId::Random();
    EXPECT_OK(tracker->Begin(id).status());
    Result<internal::EncodeResult> encoded = tracker->Encode(id, View(state));
    EXPECT_OK(encoded.status());
    EXPECT_EQ(encoded->items.size(), 1u);
    out.deltas.push_back(encoded->items.front());
    EXPECT_OK(tracker->Commit(id));
    out.states.push_back(state);
  }
  return out;
}

TEST(XorFoldTest, TheFoldOfThreeDeltasIsBitIdenticalToApplyingThemOneByOne) {
  const Steps steps = MakeSteps(7, 3, 0.02);
  std::vector<ItemView> views;
  uint64_t summed_locations = 0;
  uint64_t summed_bytes = 0;
  for (const Item& delta : steps.deltas) {
    views.push_back(delta.view());
    summed_locations += delta.count;
    summed_bytes += delta.locations.size() + delta.values.size();
  }
  ASSERT_OK_AND_ASSIGN(std::optional<Item> folded, FoldXorItems(views));
  ASSERT_TRUE(folded.has_value());

  std::vector<uint16_t> one_by_one = steps.states[0];
  for (const Item& delta : steps.deltas) ApplyXor(delta.view(), one_by_one);
  std::vector<uint16_t> at_once = steps.states[0];
  ApplyXor(folded->view(), at_once);
  EXPECT_TRUE(one_by_one == steps.states[3]);
  EXPECT_TRUE(at_once == steps.states[3]) << "the folded delta does not reach the last state";

  // Never larger than the three: the 64 elements that flipped back and forth cancel.
  EXPECT_LT(folded->count, summed_locations);
  EXPECT_LE(folded->locations.size() + folded->values.size(), summed_bytes);
  // Its digest is the change of the tensor's state digest from the first state to the last.
  EXPECT_EQ(TensorDigest(View(steps.states[0])) + folded->digest,
            TensorDigest(View(steps.states[3])));
}

TEST(XorFoldTest, OrderDoesNotMatterAndASingleItemFoldsToItself) {
  const Steps steps = MakeSteps(11, 4, 0.05);
  std::vector<ItemView> forward, backward;
  for (const Item& delta : steps.deltas) forward.push_back(delta.view());
  backward.assign(forward.rbegin(), forward.rend());
  ASSERT_OK_AND_ASSIGN(std::optional<Item> a, FoldXorItems(forward));
  ASSERT_OK_AND_ASSIGN(std::optional<Item> b, FoldXorItems(backward));
  ASSERT_TRUE(a.has_value() && b.has_value());
  EXPECT_EQ(a->locations, b->locations);
  EXPECT_EQ(a->values, b->values);
  EXPECT_EQ(a->digest, b->digest);

  const ItemView only = steps.deltas[1].view();
  ASSERT_OK_AND_ASSIGN(std::optional<Item> same, FoldXorItems(std::span<const ItemView>(&only, 1)));
  ASSERT_TRUE(same.has_value());
  EXPECT_EQ(same->count, steps.deltas[1].count);
  EXPECT_EQ(same->values, steps.deltas[1].values);
  EXPECT_EQ(same->digest, steps.deltas[1].digest);
}

TEST(XorFoldTest, ADeltaAndItsUndoCancelCompletely) {
  const Steps steps = MakeSteps(3, 1, 0.1);
  const ItemView twice[] = {steps.deltas[0].view(), steps.deltas[0].view()};
  ASSERT_OK_AND_ASSIGN(std::optional<Item> folded, FoldXorItems(twice));
  EXPECT_FALSE(folded.has_value()) << "d ^ d changes nothing";
}

TEST(XorFoldTest, ItemsOfAnotherOpOrTensorAreRefusedByName) {
  const Steps steps = MakeSteps(5, 2, 0.05);
  Item overwrite = steps.deltas[1];
  overwrite.op = Op::kOverwrite;
  const ItemView mixed_op[] = {steps.deltas[0].view(), overwrite.view()};
  EXPECT_STATUS(InvalidArgument, FoldXorItems(mixed_op).status());

  Item other = steps.deltas[1];
  other.name = "other";
  const ItemView mixed_tensor[] = {steps.deltas[0].view(), other.view()};
  const Status refused = FoldXorItems(mixed_tensor).status();
  EXPECT_STATUS(InvalidArgument, refused);
  EXPECT_NE(refused.message().find("'other'"), std::string_view::npos) << refused.ToString();
}

}  // namespace
}  // namespace refit
