// Canonical boxes: the index map, digests in canonical coordinates, and trackers that each keep
// one box of a canonical tensor (DeltaTracker::Place) and together refit a whole-tensor receiver
// through the real payload encoder and ApplyPayload.
#include "codec/canonical_box.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "codec/tracker.h"
#include "core/digest.h"
#include "pipeline/bucketing.h"
#include "receiver/apply.h"
#include "refit/payload.h"
#include "refit/weight_store.h"
#include "test_data.h"
#include "test_util.h"

namespace refit {
namespace {

using testing::Perturb;
using testing::RandomTensor;

/// One box of a canonical tensor.
struct Box {
  std::vector<int64_t> offset;
  Shape extent;
};

uint64_t Volume(const Shape& extent) {
  uint64_t n = 1;
  for (int64_t e : extent) n *= static_cast<uint64_t>(e);
  return n;
}

/// The canonical flat index of local element `local` of `box`, by multi-index arithmetic.
uint64_t BruteForceMap(const Shape& shape, const Box& box, uint64_t local) {
  std::vector<int64_t> index(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    index[d] = static_cast<int64_t>(local % static_cast<uint64_t>(box.extent[d]));
    local /= static_cast<uint64_t>(box.extent[d]);
  }
  uint64_t flat = 0;
  for (size_t d = 0; d < shape.size(); ++d) {
    flat = flat * static_cast<uint64_t>(shape[d]) + static_cast<uint64_t>(box.offset[d] + index[d]);
  }
  return flat;
}

/// The elements of `box` of `tensor`, as a tensor named `name` of the box's extent.
OwnedTensor Cut(const OwnedTensor& tensor, const Box& box, const std::string& name) {
  const uint32_t width = DTypeSize(tensor.dtype);
  OwnedTensor out{name, tensor.dtype, box.extent, {}};
  out.bytes.resize(Volume(box.extent) * width);
  for (uint64_t i = 0; i < Volume(box.extent); ++i) {
    const uint64_t c = BruteForceMap(tensor.shape, box, i);
    std::copy_n(tensor.bytes.begin() + static_cast<std::ptrdiff_t>(c * width), width,
                out.bytes.begin() + static_cast<std::ptrdiff_t>(i * width));
  }
  return out;
}

/// The boxes of one dimension split like torch.chunk: ceil(n / parts) each, the last ones
/// shorter or empty.
std::vector<std::pair<int64_t, int64_t>> Chunks(int64_t n, int64_t parts) {
  const int64_t size = (n + parts - 1) / parts;
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t begin = std::min(n, p * size);
    out.emplace_back(begin, std::min(n, begin + size) - begin);
  }
  return out;
}

/// A tiling of `shape` split on dimension `dim` into `parts` (torch.chunk), then, when
/// `second_dim` ≥ 0, each part split on it into `second_parts` (a 2-D mesh).
std::vector<Box> Tiling(const Shape& shape, size_t dim, int64_t parts, int second_dim = -1,
                        int64_t second_parts = 1) {
  std::vector<Box> boxes;
  for (auto [begin, length] : Chunks(shape[dim], parts)) {
    Box box{std::vector<int64_t>(shape.size(), 0), shape};
    box.offset[dim] = begin;
    box.extent[dim] = length;
    if (second_dim < 0) {
      boxes.push_back(box);
      continue;
    }
    const auto d2 = static_cast<size_t>(second_dim);
    for (auto [begin2, length2] : Chunks(shape[d2], second_parts)) {
      Box inner = box;
      inner.offset[d2] = begin2;
      inner.extent[d2] = length2;
      boxes.push_back(inner);
    }
  }
  return boxes;
}

TEST(BoxIndexMapTest, MapsEveryElementAsMultiIndexArithmeticDoes) {
  const std::vector<std::pair<Shape, Box>> cases = {
      {{7, 10}, {{3, 0}, {2, 10}}},         // a row shard: one run
      {{7, 10}, {{0, 4}, {7, 3}}},          // a column shard: a run per row
      {{7, 10}, {{2, 5}, {4, 5}}},          // a 2-D mesh cell
      {{4, 6, 5}, {{0, 2, 0}, {4, 2, 5}}},  // a 3-D tensor sharded on dim 1: runs of 10
      {{4, 6, 5}, {{1, 2, 3}, {2, 3, 2}}},  // a box in every dimension
      {{4, 6, 5}, {{2, 0, 0}, {1, 6, 5}}},  // whole trailing dimensions
      {{3, 1, 8}, {{1, 0, 0}, {2, 1, 8}}},  // a dimension of size 1
      {{}, {{}, {}}},                       // a 0-d tensor
      {{5}, {{2}, {3}}},                    // 1-d
  };
  for (const auto& [shape, box] : cases) {
    ASSERT_OK_AND_ASSIGN(BoxIndexMap map,
                         BoxIndexMap::Make(CanonicalBox{"w", shape, box.offset}, box.extent));
    ASSERT_EQ(map.numel(), Volume(box.extent)) << ShapeToString(shape);
    std::vector<uint64_t> all;
    for (uint64_t i = 0; i < map.numel(); ++i) {
      EXPECT_EQ(map.Map(i), BruteForceMap(shape, box, i))
          << ShapeToString(shape) << " box extent " << ShapeToString(box.extent) << " at " << i;
      all.push_back(i);
    }
    map.MapSorted(all);
    for (uint64_t i = 0; i < map.numel(); ++i) EXPECT_EQ(all[i], BruteForceMap(shape, box, i));
    // Runs are contiguous on both sides and as long as possible.
    for (uint64_t r = 0; r < map.runs(); ++r) {
      for (uint64_t k = 1; k < map.run_elements(); ++k) {
        EXPECT_EQ(map.Map(r * map.run_elements() + k), map.RunStart(r) + k);
      }
      if (r + 1 < map.runs()) {
        EXPECT_NE(map.RunStart(r + 1), map.RunStart(r) + map.run_elements()) << "runs not merged";
      }
    }
  }
}

TEST(BoxIndexMapTest, ARowShardIsOneRunAndAColumnShardARunPerRow) {
  ASSERT_OK_AND_ASSIGN(BoxIndexMap rows, BoxIndexMap::Make({"w", {7, 10}, {3, 0}}, {2, 10}));
  EXPECT_TRUE(rows.contiguous());
  EXPECT_EQ(rows.start(), 30u);
  ASSERT_OK_AND_ASSIGN(BoxIndexMap columns, BoxIndexMap::Make({"w", {7, 10}, {0, 4}}, {7, 3}));
  EXPECT_FALSE(columns.contiguous());
  EXPECT_EQ(columns.runs(), 7u);
  EXPECT_EQ(columns.run_elements(), 3u);
  ASSERT_OK_AND_ASSIGN(BoxIndexMap empty, BoxIndexMap::Make({"w", {7, 10}, {7, 0}}, {0, 10}));
  EXPECT_EQ(empty.numel(), 0u);
  EXPECT_EQ(empty.runs(), 0u);
}

TEST(BoxIndexMapTest, ABoxOutsideItsTensorIsRefusedByName) {
  EXPECT_STATUS_MSG(InvalidArgument, "'w' of shape [7, 10] on dimension 1",
                    BoxIndexMap::Make({"w", {7, 10}, {0, 8}}, {7, 3}).status());
  EXPECT_STATUS_MSG(InvalidArgument, "dimension 0",
                    BoxIndexMap::Make({"w", {7, 10}, {-1, 0}}, {1, 10}).status());
  EXPECT_STATUS_MSG(InvalidArgument, "rank 2",
                    BoxIndexMap::Make({"w", {7, 10}, {0}}, {7, 10}).status());
  EXPECT_STATUS_MSG(InvalidArgument, "rank 2",
                    BoxIndexMap::Make({"w", {7, 10}, {0, 0}}, {7}).status());
}

TEST(BoxIndexMapTest, TheDigestsOfATilingAddUpToTheTensorDigest) {
  const OwnedTensor tensor = RandomTensor("w", DType::kBFloat16, {9, 6, 5}, 7);
  const uint64_t whole = TensorDigest(tensor.view());
  for (const std::vector<Box>& tiling :
       {Tiling(tensor.shape, 0, 4), Tiling(tensor.shape, 1, 4), Tiling(tensor.shape, 2, 3),
        Tiling(tensor.shape, 0, 2, 1, 4), Tiling(tensor.shape, 0, 16)}) {
    uint64_t sum = 0;
    for (const Box& box : tiling) {
      ASSERT_OK_AND_ASSIGN(BoxIndexMap map,
                           BoxIndexMap::Make({"w", tensor.shape, box.offset}, box.extent));
      const OwnedTensor local = Cut(tensor, box, "local");
      sum += map.Digest(local.bytes, 2, 0, map.numel());
      // Any split of the local range gives the same sum.
      if (map.numel() > 3) {
        EXPECT_EQ(map.Digest(local.bytes, 2, 0, map.numel()),
                  map.Digest(local.bytes, 2, 0, 3) + map.Digest(local.bytes, 2, 3, map.numel()));
      }
    }
    EXPECT_EQ(sum, whole);
  }
}

// ---------------------------------------------------------------------------------------------
// Trackers over boxes → one whole-tensor receiver

/// W trackers, tracker r holding box r of every canonical tensor under the local name
/// "rank<r>/<tensor>": what W sharded trainer ranks hold.
class ShardedProducers {
 public:
  ShardedProducers(std::vector<std::pair<OwnedTensor, std::vector<Box>>> tilings,
                   TrackerOptions options)
      : tilings_(std::move(tilings)) {
    size_t ranks = 0;
    for (const auto& [tensor, boxes] : tilings_) ranks = std::max(ranks, boxes.size());
    for (size_t r = 0; r < ranks; ++r) {
      auto tracker = internal::DeltaTracker::Make(options);
      EXPECT_TRUE(tracker.ok());
      trackers_.push_back(std::move(tracker).ValueOrDie());
      for (const auto& [tensor, boxes] : tilings_) {
        if (r >= boxes.size()) continue;
        EXPECT_OK(trackers_[r]->Place(LocalName(r, tensor.name),
                                      {tensor.name, tensor.shape, boxes[r].offset},
                                      boxes[r].extent));
      }
    }
  }

  static std::string LocalName(size_t rank, const std::string& tensor) {
    return fmt::format("rank{}/{}", rank, tensor);
  }

  /// One transfer of `model` (the canonical tensors now, in the order of the tilings) from every
  /// rank into `store`; return the canonical digests the ranks expect, summed over their boxes.
  std::map<std::string, uint64_t> Refit(const std::vector<OwnedTensor>& model, bool anchor,
                                        WeightStore& store, uint64_t step) {
    std::map<std::string, uint64_t> expected;
    const TransferId id = TransferId::Random();
    for (size_t r = 0; r < trackers_.size(); ++r) {
      internal::DeltaTracker& tracker = *trackers_[r];
      const TransferPlan plan{id, anchor, step, step + 1};
      EXPECT_OK(tracker.BeginPlanned(plan).status());
      std::vector<Item> items;
      for (size_t t = 0; t < model.size(); ++t) {
        const std::vector<Box>& boxes = tilings_[t].second;
        if (r >= boxes.size()) continue;
        const OwnedTensor local = Cut(model[t], boxes[r], LocalName(r, model[t].name));
        auto encoded = tracker.Encode(id, local.view());
        EXPECT_TRUE(encoded.ok()) << encoded.status().ToString();
        for (Item& item : encoded->items) {
          EXPECT_EQ(item.name, model[t].name);
          EXPECT_EQ(item.shape, model[t].shape);
          items.push_back(std::move(item));
        }
      }
      const PayloadIds ids{id, static_cast<uint32_t>(r), 0, step, step + 1};
      auto payloads = PackPayloads(ids, items, /*bucket_bytes=*/256);
      EXPECT_TRUE(payloads.ok()) << payloads.status().ToString();
      for (const auto& bytes : *payloads) {
        auto decoded = DecodePayload(bytes);
        EXPECT_TRUE(decoded.ok()) << decoded.status().ToString();
        internal::UndoLog undo;
        EXPECT_OK(internal::ApplyPayload(*decoded, store, &undo));
      }
      for (const auto& [local, digest] : tracker.PendingDigests()) {
        expected[tracker.PlacementOf(local)->tensor] += digest;
      }
      EXPECT_OK(tracker.Commit(id));
    }
    return expected;
  }

  internal::DeltaTracker& tracker(size_t r) { return *trackers_[r]; }
  size_t ranks() const { return trackers_.size(); }

 private:
  std::vector<std::pair<OwnedTensor, std::vector<Box>>> tilings_;
  std::vector<std::unique_ptr<internal::DeltaTracker>> trackers_;
};

class TrackerBoxTest : public ::testing::TestWithParam<Op> {};

TEST_P(TrackerBoxTest, RanksHoldingBoxesRefitAWholeReceiverBitExactly) {
  // Every kind of box at once: uneven row shards, a tensor with fewer rows than ranks (empty
  // boxes), column shards, a 2 × 2 mesh, a 3-D tensor sharded on dim 1, a 0-d and a 1-element
  // tensor.
  const OwnedTensor rows = RandomTensor("layers.0.w", DType::kBFloat16, {7, 10}, 1);
  const OwnedTensor few = RandomTensor("layers.0.b", DType::kFloat32, {3}, 2);
  const OwnedTensor columns = RandomTensor("layers.0.o_proj", DType::kBFloat16, {6, 9}, 3);
  const OwnedTensor mesh = RandomTensor("embed", DType::kFloat16, {9, 7}, 4);
  const OwnedTensor experts = RandomTensor("experts.w13", DType::kBFloat16, {3, 8, 5}, 5);
  const OwnedTensor scalar = RandomTensor("scale", DType::kFloat32, {}, 6);
  const OwnedTensor single = RandomTensor("one", DType::kFloat32, {1}, 7);
  std::vector<std::pair<OwnedTensor, std::vector<Box>>> tilings = {
      {rows, Tiling(rows.shape, 0, 4)},       {few, Tiling(few.shape, 0, 4)},
      {columns, Tiling(columns.shape, 1, 4)}, {mesh, Tiling(mesh.shape, 0, 2, 1, 2)},
      {experts, Tiling(experts.shape, 1, 4)}, {scalar, {Box{{}, {}}}},
      {single, Tiling(single.shape, 0, 4)}};
  TrackerOptions options;
  options.op = GetParam();
  ShardedProducers producers(tilings, options);
  ASSERT_EQ(producers.ranks(), 4u);

  std::vector<OwnedTensor> model;
  for (const auto& [tensor, boxes] : tilings) model.push_back(tensor);
  std::unique_ptr<WeightStore> store = WeightStore::Make();
  for (OwnedTensor t : model) {
    std::fill(t.bytes.begin(), t.bytes.end(), std::byte{0});
    ASSERT_OK(store->AddCopy(t.view()));
  }
  for (uint64_t step = 0; step < 4; ++step) {
    if (step > 0) {
      for (size_t t = 0; t < model.size(); ++t) model[t] = Perturb(model[t], 0.3, 100 * step + t);
    }
    const std::map<std::string, uint64_t> expected =
        producers.Refit(model, /*anchor=*/step == 0, *store, step);
    for (const OwnedTensor& t : model) {
      ASSERT_OK_AND_ASSIGN(MutableTensorView held, store->Find(t.name));
      EXPECT_TRUE(std::equal(held.bytes.begin(), held.bytes.end(), t.bytes.begin(), t.bytes.end()))
          << t.name << " after step " << step;
      EXPECT_EQ(expected.at(t.name), TensorDigest(t.view())) << t.name << " after step " << step;
    }
    EXPECT_EQ(store->Digests(), store->RecomputeDigests());
  }
  // Each rank's baseline is its boxes, not the model.
  for (size_t r = 0; r < producers.ranks(); ++r) {
    uint64_t box_bytes = 0;
    for (const auto& [tensor, boxes] : tilings) {
      if (r < boxes.size()) box_bytes += Volume(boxes[r].extent) * DTypeSize(tensor.dtype);
    }
    EXPECT_EQ(producers.tracker(r).baseline_bytes(), box_bytes) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(EveryDeltaOp, TrackerBoxTest,
                         ::testing::Values(Op::kXor, Op::kOverwrite, Op::kAdd),
                         [](const auto& op) { return std::string(OpName(op.param)); });

TEST(TrackerBoxTest, AColumnShardAnchorsAsOneFullItemPerRowAndDeltasAsOneItem) {
  const OwnedTensor tensor = RandomTensor("w", DType::kBFloat16, {5, 8}, 11);
  auto tracker = internal::DeltaTracker::Make({}).ValueOrDie();
  const Box box{{0, 2}, {5, 3}};
  ASSERT_OK(tracker->Place("local", {"w", tensor.shape, box.offset}, box.extent));
  ASSERT_OK_AND_ASSIGN(TransferPlan anchor, tracker->Begin(TransferId::Random()));
  ASSERT_OK_AND_ASSIGN(internal::EncodeResult full,
                       tracker->Encode(anchor.transfer_id, Cut(tensor, box, "local").view()));
  ASSERT_EQ(full.items.size(), 5u);
  for (size_t row = 0; row < 5; ++row) {
    EXPECT_EQ(full.items[row].op, Op::kFull);
    EXPECT_EQ(full.items[row].span_begin, row * 8 + 2);
    EXPECT_EQ(full.items[row].span_end, row * 8 + 5);
  }
  ASSERT_OK(tracker->Commit(anchor.transfer_id));
  ASSERT_OK_AND_ASSIGN(TransferPlan delta, tracker->Begin(TransferId::Random()));
  const OwnedTensor next = Perturb(tensor, 0.5, 12);
  ASSERT_OK_AND_ASSIGN(internal::EncodeResult changes,
                       tracker->Encode(delta.transfer_id, Cut(next, box, "local").view()));
  ASSERT_EQ(changes.items.size(), 1u);
  EXPECT_EQ(changes.items[0].name, "w");
  EXPECT_GE(changes.items[0].span_begin, 2u);
  EXPECT_LE(changes.items[0].span_end, 4u * 8 + 5);
}

TEST(TrackerBoxTest, ALocalTensorOfAnotherShapeThanItsBoxIsRefused) {
  auto tracker = internal::DeltaTracker::Make({}).ValueOrDie();
  ASSERT_OK(tracker->Place("local", {"w", {6, 4}, {3, 0}}, {3, 4}));
  const OwnedTensor wrong = RandomTensor("local", DType::kFloat32, {4, 4}, 1);
  EXPECT_STATUS_MSG(InvalidArgument, "extent [3, 4] of canonical tensor 'w'",
                    tracker->AdoptBaseline(wrong.view()));
  ASSERT_OK_AND_ASSIGN(TransferPlan plan, tracker->Begin(TransferId::Random()));
  EXPECT_STATUS_MSG(InvalidArgument, "has shape [4, 4]",
                    tracker->Encode(plan.transfer_id, wrong.view()).status());
  EXPECT_STATUS_MSG(FailedPrecondition, "is open",
                    tracker->Place("local", {"w", {6, 4}, {0, 0}}, {3, 4}));
  ASSERT_OK(tracker->Abort(plan.transfer_id));
  EXPECT_STATUS_MSG(InvalidArgument, "on dimension 0",
                    tracker->Place("local", {"w", {6, 4}, {4, 0}}, {3, 4}));
}

TEST(TrackerBoxTest, MovingATensorToAnotherBoxDropsItsBaselineAndAnchors) {
  auto tracker = internal::DeltaTracker::Make({}).ValueOrDie();
  ASSERT_OK(tracker->Place("local", {"w", {6, 4}, {0, 0}}, {3, 4}));
  const OwnedTensor local = RandomTensor("local", DType::kFloat32, {3, 4}, 1);
  ASSERT_OK(tracker->AdoptBaseline(local.view()));
  EXPECT_FALSE(tracker->NextIsAnchor());
  // The same box again changes nothing.
  ASSERT_OK(tracker->Place("local", {"w", {6, 4}, {0, 0}}, {3, 4}));
  EXPECT_FALSE(tracker->NextIsAnchor());
  EXPECT_EQ(tracker->baseline_bytes(), 48u);
  // The other half of the rows: the baseline held other elements.
  ASSERT_OK(tracker->Place("local", {"w", {6, 4}, {3, 0}}, {3, 4}));
  EXPECT_TRUE(tracker->NextIsAnchor());
  EXPECT_EQ(tracker->baseline_bytes(), 0u);
  EXPECT_EQ(tracker->PlacementOf("local")->offset, (std::vector<int64_t>{3, 0}));
  EXPECT_FALSE(tracker->PlacementOf("other").has_value());
}

}  // namespace
}  // namespace refit
