// Producer layouts: pieces of FSDP-, TP-, FSDP × TP-, Megatron- and data-parallel-style ranks,
// the plan of who sends which box, the tiling and overlap checks, copies that diverge, and the
// piece digests that add up to the canonical tensor's.
#include "refit/producer_layout.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "core/digest.h"
#include "test_data.h"
#include "test_util.h"

namespace refit {
namespace {

using testing::RandomTensor;

LayoutPiece Piece(std::string tensor, Shape shape, std::vector<int64_t> offset,
                  std::vector<int64_t> extent, DType dtype = DType::kBFloat16) {
  LayoutPiece piece{.tensor = tensor,
                    .dtype = dtype,
                    .shape = std::move(shape),
                    .offset = std::move(offset),
                    .extent = extent,
                    .local = tensor,
                    .local_shape = Shape(extent.begin(), extent.end()),
                    .local_offset = std::vector<int64_t>(extent.size(), 0)};
  return piece;
}

/// Row-major multi-index of flat element `i` of `shape`.
std::vector<int64_t> Unflatten(uint64_t i, const Shape& shape) {
  std::vector<int64_t> index(shape.size());
  for (size_t d = shape.size(); d > 0; --d) {
    index[d - 1] = static_cast<int64_t>(i % static_cast<uint64_t>(shape[d - 1]));
    i /= static_cast<uint64_t>(shape[d - 1]);
  }
  return index;
}

/// Fill `locals` (by local name) with the canonical elements the rank's pieces hold, by a walk
/// over every canonical element (independent of PieceDigest's row runs).
void SliceInto(const ProducerLayout& layout, const std::map<std::string, OwnedTensor>& canonical,
               std::map<std::string, OwnedTensor>* locals) {
  for (const LayoutPiece& piece : layout.pieces) {
    const OwnedTensor& full = canonical.at(piece.tensor);
    const uint32_t width = DTypeSize(full.dtype);
    auto [it, inserted] = locals->try_emplace(piece.local);
    OwnedTensor& local = it->second;
    if (inserted) {
      local = OwnedTensor{piece.local, full.dtype, piece.local_shape, {}};
      local.bytes.assign(NumElements(piece.local_shape).ValueOrDie() * width, std::byte{0x5A});
    }
    const uint64_t numel = NumElements(full.shape).ValueOrDie();
    for (uint64_t i = 0; i < numel; ++i) {
      const std::vector<int64_t> index = Unflatten(i, full.shape);
      uint64_t local_flat = 0;
      bool inside = true;
      for (size_t d = 0; d < index.size(); ++d) {
        const int64_t j = index[d] - piece.offset[d];
        if (j < 0 || j >= piece.extent[d]) inside = false;
        local_flat = local_flat * static_cast<uint64_t>(piece.local_shape[d]) +
                     static_cast<uint64_t>(piece.local_offset[d] + j);
      }
      if (!inside) continue;
      std::memcpy(local.bytes.data() + local_flat * width, full.bytes.data() + i * width, width);
    }
  }
}

class ProducerLayoutTest : public ::testing::Test {
 protected:
  /// Plan `layouts`, digest every rank's pieces from slices of random canonical tensors, and
  /// expect the copies to agree and the distinct boxes to add up to each tensor's digest.
  LayoutPlan PlanAndCheckDigests(const std::vector<ProducerLayout>& layouts) {
    auto plan = PlanLayouts(layouts);
    EXPECT_TRUE(plan.ok()) << plan.status().ToString();
    if (!plan.ok()) return {};
    std::map<std::string, OwnedTensor> canonical;
    uint64_t seed = 1;
    for (const PlannedTensor& t : plan->tensors) {
      canonical.emplace(t.name, RandomTensor(t.name, t.dtype, t.shape, seed++));
    }
    std::vector<BoxDigest> reports;
    for (uint32_t rank = 0; rank < layouts.size(); ++rank) {
      std::map<std::string, OwnedTensor> locals;
      SliceInto(layouts[rank], canonical, &locals);
      for (size_t i = 0; i < layouts[rank].pieces.size(); ++i) {
        const LayoutPiece& piece = layouts[rank].pieces[i];
        if (plan->roles[rank][i] == PieceRole::kEmpty) continue;
        reports.push_back(
            {piece.tensor, piece.offset, rank, PieceDigest(piece, locals.at(piece.local).view())});
      }
    }
    auto sums = CheckCopies(*plan, reports);
    EXPECT_TRUE(sums.ok()) << sums.status().ToString();
    if (sums.ok()) {
      EXPECT_EQ(sums->size(), canonical.size());
      for (const auto& [name, digest] : *sums) {
        EXPECT_EQ(digest, TensorDigest(canonical.at(name).view())) << "tensor '" << name << "'";
      }
    }
    return std::move(plan).ValueOrDie();
  }
};

/// torch.chunk's split of `rows` over `w` ranks: ceil(rows / w) each, the last ones short or empty.
std::vector<std::pair<int64_t, int64_t>> ChunkRows(int64_t rows, int64_t w) {
  const int64_t each = (rows + w - 1) / w;
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t r = 0; r < w; ++r) {
    const int64_t begin = std::min(rows, r * each);
    out.emplace_back(begin, std::min(rows, begin + each) - begin);
  }
  return out;
}

TEST_F(ProducerLayoutTest, FsdpRowShardsUnevenAndEmptyTileEveryTensor) {
  for (int64_t w : {2, 3, 4}) {
    SCOPED_TRACE(w);
    std::vector<ProducerLayout> layouts(w);
    for (int64_t r = 0; r < w; ++r) {
      for (const auto& [name, shape] : std::vector<std::pair<std::string, Shape>>{
               {"embed", {7, 4}}, {"tiny", {2, 3}}, {"bias", {5}}, {"one", {1}}}) {
        const auto [begin, rows] = ChunkRows(shape[0], w)[r];
        std::vector<int64_t> offset(shape.size(), 0);
        std::vector<int64_t> extent(shape.begin(), shape.end());
        offset[0] = begin;
        extent[0] = rows;
        layouts[r].pieces.push_back(Piece(name, shape, offset, extent));
      }
      // A 0-d tensor every rank holds whole: replicated, sent by rank 0.
      layouts[r].pieces.push_back(Piece("scale", {}, {}, {}, DType::kFloat32));
    }
    const LayoutPlan plan = PlanAndCheckDigests(layouts);
    ASSERT_EQ(plan.tensors.size(), 5u);
    const PlannedTensor& scale = plan.tensors[3];
    ASSERT_EQ(scale.name, "scale");
    ASSERT_EQ(scale.boxes.size(), 1u);
    EXPECT_EQ(scale.boxes[0].sender, 0u);
    EXPECT_EQ(scale.boxes[0].copies.size(), static_cast<size_t>(w - 1));
    // "one" [1] over W ranks: rank 0 holds it, the others hold empty shards.
    EXPECT_EQ(plan.roles[1][3], PieceRole::kEmpty);
    EXPECT_EQ(plan.roles[0][3], PieceRole::kSend);
    EXPECT_EQ(plan.roles[1][4], PieceRole::kCopy);
  }
}

TEST_F(ProducerLayoutTest, FsdpTimesTpMeshAndAThreeDimensionalExpertShard) {
  // A 2 × 2 mesh: dim 0 split over the FSDP axis, dim 1 over the TP axis; and an expert stack
  // [4, 6, 3] sharded on dim 1 over 2 ranks, each of which also holds a copy of the other axis.
  std::vector<ProducerLayout> layouts(4);
  for (int64_t fsdp = 0; fsdp < 2; ++fsdp) {
    for (int64_t tp = 0; tp < 2; ++tp) {
      ProducerLayout& layout = layouts[fsdp * 2 + tp];
      layout.pieces.push_back(Piece("w", {6, 8}, {fsdp * 3, tp * 4}, {3, 4}));
      layout.pieces.push_back(Piece("experts", {4, 6, 3}, {0, tp * 3, 0}, {4, 3, 3}));
    }
  }
  const LayoutPlan plan = PlanAndCheckDigests(layouts);
  const PlannedTensor& experts = plan.tensors[0];
  ASSERT_EQ(experts.name, "experts");
  ASSERT_EQ(experts.boxes.size(), 2u);
  EXPECT_EQ(experts.boxes[0].sender, 0u);
  EXPECT_EQ(experts.boxes[0].copies, (std::vector<uint32_t>{2}));
  EXPECT_EQ(experts.boxes[1].sender, 1u);
  EXPECT_EQ(plan.tensors[1].boxes.size(), 4u);
}

TEST_F(ProducerLayoutTest, AMegatronFusedQkvHoldsSeveralPiecesOfOneLocalTensor) {
  // Two query groups over TP = 2, interleaved per group: rank r's linear_qkv [8, 4] holds the q
  // rows of its group, then its k rows, then its v rows. PP = 2 stages own different layers;
  // DP = 2 copies of every rank (ranks 4–7 mirror 0–3).
  std::vector<ProducerLayout> layouts(8);
  for (int64_t dp = 0; dp < 2; ++dp) {
    for (int64_t pp = 0; pp < 2; ++pp) {
      for (int64_t tp = 0; tp < 2; ++tp) {
        ProducerLayout& layout = layouts[dp * 4 + pp * 2 + tp];
        const std::string layer = fmt::format("layers.{}.", pp);
        const std::string local = layer + "linear_qkv";
        const auto fused = [&](std::string name, Shape shape, int64_t rows, int64_t local_row) {
          LayoutPiece piece = Piece(layer + name, shape, {tp * rows, 0}, {rows, 4});
          piece.local = local;
          piece.local_shape = {8, 4};
          piece.local_offset = {local_row, 0};
          return piece;
        };
        layout.pieces.push_back(fused("q_proj", {8, 4}, 4, 0));
        layout.pieces.push_back(fused("k_proj", {4, 4}, 2, 4));
        layout.pieces.push_back(fused("v_proj", {4, 4}, 2, 6));
      }
    }
  }
  const LayoutPlan plan = PlanAndCheckDigests(layouts);
  ASSERT_EQ(plan.tensors.size(), 6u);
  for (uint32_t rank = 0; rank < 8; ++rank) {
    for (PieceRole role : plan.roles[rank]) {
      EXPECT_EQ(role, rank < 4 ? PieceRole::kSend : PieceRole::kCopy) << "rank " << rank;
    }
  }
}

TEST_F(ProducerLayoutTest, ADivergedCopyFailsByRankTensorAndBox) {
  std::vector<ProducerLayout> layouts(2);
  for (ProducerLayout& layout : layouts)
    layout.pieces.push_back(Piece("w", {4, 2}, {0, 0}, {4, 2}));
  ASSERT_OK_AND_ASSIGN(LayoutPlan plan, PlanLayouts(layouts));
  const std::vector<BoxDigest> reports = {{"w", {0, 0}, 0, 11}, {"w", {0, 0}, 1, 12}};
  EXPECT_STATUS_MSG(DataLoss, "tensor 'w' [0:4, 0:2]: rank 1's copy differs from rank 0's",
                    CheckCopies(plan, reports));
  EXPECT_STATUS_MSG(InvalidArgument, "no digest from rank 1, which holds a copy",
                    CheckCopies(plan, std::vector<BoxDigest>{{"w", {0, 0}, 0, 11}}));
  EXPECT_STATUS_MSG(InvalidArgument, "a box the plan does not have",
                    CheckCopies(plan, std::vector<BoxDigest>{{"w", {1, 0}, 0, 11}}));
}

TEST_F(ProducerLayoutTest, GapsOverlapsAndDisagreementsAreRefusedByName) {
  const auto plan_of = [](std::vector<std::vector<LayoutPiece>> ranks) {
    std::vector<ProducerLayout> layouts;
    for (auto& pieces : ranks) layouts.push_back(ProducerLayout{std::move(pieces)});
    return PlanLayouts(layouts).status();
  };
  // A rank missing: rows 4:6 are held by nobody.
  EXPECT_STATUS_MSG(
      InvalidArgument,
      "tensor 'w' [6, 2]: the ranks' pieces hold 8 of its 12 elements (element [4, 0] is held by "
      "no rank); boxes: rank 0 [0:2, 0:2], rank 1 [2:4, 0:2]",
      plan_of({{Piece("w", {6, 2}, {0, 0}, {2, 2})}, {Piece("w", {6, 2}, {2, 0}, {2, 2})}}));
  // A column gap in a 2-D split.
  EXPECT_STATUS_MSG(
      InvalidArgument, "element [0, 3] is held by no rank",
      plan_of({{Piece("w", {2, 4}, {0, 0}, {2, 3})}, {Piece("w", {2, 4}, {0, 0}, {2, 3})}}));
  EXPECT_STATUS_MSG(
      InvalidArgument,
      "tensor 'w': rank 0's box [0:4, 0:2] and rank 1's box [3:6, 0:2] overlap without coinciding",
      plan_of({{Piece("w", {6, 2}, {0, 0}, {4, 2})}, {Piece("w", {6, 2}, {3, 0}, {3, 2})}}));
  EXPECT_STATUS_MSG(InvalidArgument, "tensor 'w': rank 0 has bfloat16 [6, 2], rank 1 has float32",
                    plan_of({{Piece("w", {6, 2}, {0, 0}, {6, 2})},
                             {Piece("w", {6, 2}, {0, 0}, {6, 2}, DType::kFloat32)}}));
  EXPECT_STATUS_MSG(
      InvalidArgument, "rank 1 has bfloat16 [6, 3]",
      plan_of({{Piece("w", {6, 2}, {0, 0}, {6, 2})}, {Piece("w", {6, 3}, {0, 0}, {6, 3})}}));
  EXPECT_STATUS_MSG(
      InvalidArgument,
      "rank 1's layout: piece of tensor 'w': box [5:8, 0:2] on "
      "dimension 0 is outside the shape [6, 2]",
      plan_of({{Piece("w", {6, 2}, {0, 0}, {6, 2})}, {Piece("w", {6, 2}, {5, 0}, {3, 2})}}));
  EXPECT_STATUS_MSG(
      InvalidArgument, "pieces 'w' [0:3, 0:2] and 'w' [2:6, 0:2] of one rank overlap",
      plan_of({{Piece("w", {6, 2}, {0, 0}, {3, 2}), Piece("w", {6, 2}, {2, 0}, {4, 2})}}));
  LayoutPiece a = Piece("a", {2, 2}, {0, 0}, {2, 2});
  LayoutPiece b = Piece("b", {2, 2}, {0, 0}, {2, 2});
  a.local = b.local = "fused";
  a.local_shape = b.local_shape = {3, 2};
  b.local_offset = {1, 0};
  EXPECT_STATUS_MSG(InvalidArgument, "overlap in local tensor 'fused'", plan_of({{a, b}}));
  b.local_offset = {2, 0};
  EXPECT_STATUS_MSG(InvalidArgument,
                    "local box [2:4, 0:2] on dimension 0 is outside local tensor "
                    "'fused' of shape [3, 2]",
                    plan_of({{a, b}}));
  LayoutPiece wrong_rank = Piece("w", {6, 2}, {0}, {6});
  EXPECT_STATUS_MSG(InvalidArgument, "offset has 1 and extent 1 dimensions",
                    plan_of({{wrong_rank}}));
}

TEST(PieceDigestTest, EqualsTheDigestOfTheWholeTensorForOneWholePiece) {
  for (const Shape& shape : {Shape{}, Shape{1}, Shape{5}, Shape{3, 4}, Shape{2, 3, 4}}) {
    const OwnedTensor t = RandomTensor("t", DType::kFloat32, shape, 7);
    const LayoutPiece piece =
        Piece("t", shape, std::vector<int64_t>(shape.size(), 0),
              std::vector<int64_t>(shape.begin(), shape.end()), DType::kFloat32);
    EXPECT_EQ(PieceDigest(piece, t.view()), TensorDigest(t.view())) << ShapeToString(shape);
  }
}

}  // namespace
}  // namespace refit
