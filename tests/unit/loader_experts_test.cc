// The expert loader kinds (expert_gate_up, expert_down, stacked_gate_up, stacked_down): MoE
// expert weights, per expert or stacked, into the stacks of the experts a shard holds, under
// tensor parallelism, expert parallelism (linear and round-robin placements) and both at once.
// Every shard is compared with a slice of the model made by plain loops, after deltas, anchors
// and rollbacks; the distinct pieces of a group add up to the producer's digest.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "codec/tracker.h"
#include "core/digest.h"
#include "layout_check.h"
#include "receiver/apply.h"
#include "refit/loader.h"
#include "refit/loader_layout.h"
#include "refit/payload.h"
#include "refit/weight_store.h"
#include "store_snapshot.h"
#include "test_data.h"
#include "test_util.h"

namespace refit {
namespace {

using testing::Perturb;
using testing::RandomTensor;
using testing::StoreSnapshot;
using testing::TakeSnapshot;

constexpr int64_t kExperts = 6;
constexpr int64_t kHidden = 4;
constexpr int64_t kIntermediate = 8;

// Layer 0 exports every expert's matrices (Hugging Face checkpoints, transformers < 5); layer 1
// exports the stacks (transformers ≥ 5's gate_up_proj [E, 2I, H] and down_proj [E, H, I]).
std::string Expert(int64_t e, std::string_view part) {
  return fmt::format("model.layers.0.mlp.experts.{}.{}.weight", e, part);
}
const std::string kStackedGateUp = "model.layers.1.mlp.experts.gate_up_proj";
const std::string kStackedDown = "model.layers.1.mlp.experts.down_proj";

std::vector<OwnedTensor> CanonicalModel() {
  std::vector<OwnedTensor> model;
  uint64_t seed = 1;
  for (int64_t e = 0; e < kExperts; ++e) {
    model.push_back(
        RandomTensor(Expert(e, "gate_proj"), DType::kBFloat16, {kIntermediate, kHidden}, seed++));
    model.push_back(
        RandomTensor(Expert(e, "up_proj"), DType::kBFloat16, {kIntermediate, kHidden}, seed++));
    model.push_back(
        RandomTensor(Expert(e, "down_proj"), DType::kBFloat16, {kHidden, kIntermediate}, seed++));
  }
  model.push_back(RandomTensor(kStackedGateUp, DType::kBFloat16,
                               {kExperts, 2 * kIntermediate, kHidden}, seed++));
  model.push_back(
      RandomTensor(kStackedDown, DType::kBFloat16, {kExperts, kHidden, kIntermediate}, seed++));
  return model;
}

/// One shard: its coordinates in the spec, the experts it holds slot by slot, and the TP split
/// of the expert matrices.
struct Shard {
  uint32_t tp_rank;
  uint32_t tp_size;
  std::vector<uint32_t> experts;
  uint32_t expert_tp_rank;
  uint32_t expert_tp_size;
};

struct Placement {
  std::string name;
  std::vector<Shard> shards;
};

std::vector<Placement> Placements() {
  const std::vector<uint32_t> all = {0, 1, 2, 3, 4, 5};
  return {
      // vLLM without expert parallelism: every rank holds every expert, TP-split.
      {"tp2", {{0, 2, all, 0, 2}, {1, 2, all, 1, 2}}},
      {"tp1", {{0, 1, all, 0, 1}}},
      // vLLM with expert parallelism at TP 2: the expert layers' TP is 1, experts split linearly.
      {"ep2_linear", {{0, 2, {0, 1, 2}, 0, 1}, {1, 2, {3, 4, 5}, 0, 1}}},
      // Round-robin placement (2 EP ranks) with the expert matrices split over 2 TP ranks: 4
      // shards, spec TP 4.
      {"ep2_round_robin_tp2",
       {{0, 4, {0, 2, 4}, 0, 2},
        {1, 4, {0, 2, 4}, 1, 2},
        {2, 4, {1, 3, 5}, 0, 2},
        {3, 4, {1, 3, 5}, 1, 2}}},
  };
}

LoaderSpec SpecOf(const Shard& shard) {
  const auto common = [&](LoaderRule rule) {
    rule.num_experts = kExperts;
    rule.experts = shard.experts;
    rule.expert_tp_rank = shard.expert_tp_rank;
    rule.expert_tp_size = shard.expert_tp_size;
    return rule;
  };
  return LoaderSpec{
      shard.tp_rank,
      shard.tp_size,
      {
          common({.kind = LoaderKind::kExpertGateUp,
                  .to = "model.layers.$1.mlp.experts.w13_weight",
                  .gate = R"(model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.gate_proj\.weight)",
                  .up = R"(model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.up_proj\.weight)",
                  .expert_group = 2}),
          common({.kind = LoaderKind::kExpertDown,
                  .match = R"(model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.down_proj\.weight)",
                  .to = "model.layers.$1.mlp.experts.w2_weight",
                  .expert_group = 2}),
          common({.kind = LoaderKind::kStackedGateUp,
                  .match = R"(model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj)",
                  .to = "model.layers.$1.mlp.experts.w13_weight"}),
          common({.kind = LoaderKind::kStackedDown,
                  .match = R"(model\.layers\.(\d+)\.mlp\.experts\.down_proj)",
                  .to = "model.layers.$1.mlp.experts.w2_weight"}),
      }};
}

uint16_t Bits(const OwnedTensor& t, int64_t index) {
  uint16_t bits;
  std::memcpy(&bits, t.bytes.data() + index * 2, 2);
  return bits;
}

/// The shard's local stacks, sliced from `model` by plain loops (independent of the loader):
/// w13[s, j, h] = gate of expert experts[s], row rank·I/tp + j (j < I/tp), then up; w2[s, h, i] =
/// down of that expert, column rank·I/tp + i.
std::map<std::string, OwnedTensor> SliceShard(const std::vector<OwnedTensor>& model,
                                              const Shard& shard) {
  std::map<std::string, const OwnedTensor*> by_name;
  for (const OwnedTensor& t : model) by_name[t.name] = &t;
  const int64_t slots = static_cast<int64_t>(shard.experts.size());
  const int64_t block = kIntermediate / shard.expert_tp_size;
  const int64_t first = shard.expert_tp_rank * block;
  // gate(e, row, h), up(e, row, h), down(e, h, col) of each layer's canonical form.
  const auto gate = [&](int layer, int64_t e, int64_t row, int64_t h) {
    if (layer == 0) return Bits(*by_name.at(Expert(e, "gate_proj")), row * kHidden + h);
    return Bits(*by_name.at(kStackedGateUp), (e * 2 * kIntermediate + row) * kHidden + h);
  };
  const auto up = [&](int layer, int64_t e, int64_t row, int64_t h) {
    if (layer == 0) return Bits(*by_name.at(Expert(e, "up_proj")), row * kHidden + h);
    return Bits(*by_name.at(kStackedGateUp),
                (e * 2 * kIntermediate + kIntermediate + row) * kHidden + h);
  };
  const auto down = [&](int layer, int64_t e, int64_t h, int64_t col) {
    if (layer == 0) return Bits(*by_name.at(Expert(e, "down_proj")), h * kIntermediate + col);
    return Bits(*by_name.at(kStackedDown), (e * kHidden + h) * kIntermediate + col);
  };
  std::map<std::string, OwnedTensor> out;
  for (int layer = 0; layer < 2; ++layer) {
    std::vector<uint16_t> w13;
    std::vector<uint16_t> w2;
    for (int64_t s = 0; s < slots; ++s) {
      const int64_t e = shard.experts[s];
      for (int64_t j = 0; j < block; ++j) {
        for (int64_t h = 0; h < kHidden; ++h) w13.push_back(gate(layer, e, first + j, h));
      }
      for (int64_t j = 0; j < block; ++j) {
        for (int64_t h = 0; h < kHidden; ++h) w13.push_back(up(layer, e, first + j, h));
      }
      for (int64_t h = 0; h < kHidden; ++h) {
        for (int64_t i = 0; i < block; ++i) w2.push_back(down(layer, e, h, first + i));
      }
    }
    const auto local = [](std::string name, Shape shape, const std::vector<uint16_t>& bits) {
      OwnedTensor t{std::move(name), DType::kBFloat16, std::move(shape), {}};
      t.bytes.resize(bits.size() * 2);
      std::memcpy(t.bytes.data(), bits.data(), t.bytes.size());
      return t;
    };
    const std::string prefix = fmt::format("model.layers.{}.mlp.experts.", layer);
    out.emplace(prefix + "w13_weight",
                local(prefix + "w13_weight", {slots, 2 * block, kHidden}, w13));
    out.emplace(prefix + "w2_weight", local(prefix + "w2_weight", {slots, kHidden, block}, w2));
  }
  return out;
}

/// Open transfer `id` on `tracker` for `next` and return its one payload, decoded.
std::vector<DecodedPayload> EncodeStep(internal::DeltaTracker& tracker, const TransferId& id,
                                       const std::vector<OwnedTensor>& next, bool anchor) {
  auto plan = tracker.Begin(id, anchor);
  EXPECT_TRUE(plan.ok()) << plan.status().ToString();
  std::vector<Item> items;
  for (const OwnedTensor& t : next) {
    // Two spans per tensor, not aligned to an expert or a row.
    const uint64_t numel = t.view().numel();
    for (const auto& [begin, end] : {std::pair{uint64_t{0}, numel / 3}, {numel / 3, numel}}) {
      auto encoded = tracker.Encode(id, t.view(), begin, end);
      EXPECT_TRUE(encoded.ok()) << encoded.status().ToString();
      if (!encoded.ok()) continue;
      for (Item& item : encoded->items) items.push_back(std::move(item));
    }
  }
  std::vector<ItemView> views;
  for (const Item& item : items) views.push_back(item.view());
  auto bytes = EncodePayload(PayloadIds{id, 0, 0, plan->base_version, plan->target_version}, views);
  EXPECT_TRUE(bytes.ok()) << bytes.status().ToString();
  auto decoded = DecodePayload(*bytes);
  EXPECT_TRUE(decoded.ok()) << decoded.status().ToString();
  std::vector<DecodedPayload> out;
  out.push_back(std::move(decoded).ValueOrDie());
  return out;
}

class ExpertLoaderTest : public ::testing::TestWithParam<Placement> {
 protected:
  void SetUp() override {
    model_ = CanonicalModel();
    for (const OwnedTensor& t : model_) names_.push_back(t.name);
    TrackerOptions options;
    options.op = Op::kXor;
    ASSERT_OK_AND_ASSIGN(tracker_, internal::DeltaTracker::Make(options));
    for (const OwnedTensor& t : model_) ASSERT_OK(tracker_->AdoptBaseline(t.view()));
    for (const Shard& shard : GetParam().shards) {
      auto store = WeightStore::Make();
      for (const auto& [name, t] : SliceShard(model_, shard)) {
        ASSERT_OK(testing::AddTestTensor(*store, t.view()));
      }
      ASSERT_OK_AND_ASSIGN(std::unique_ptr<Loader> loader, Loader::Make(SpecOf(shard), *store));
      ASSERT_OK(store->AttachLoader(std::move(loader)));
      stores_.push_back(std::move(store));
    }
    undo_.resize(stores_.size());
  }

  void Apply(const std::vector<DecodedPayload>& payloads) {
    for (size_t s = 0; s < stores_.size(); ++s) {
      for (const DecodedPayload& payload : payloads) {
        ASSERT_OK(internal::ApplyPayload(payload, *stores_[s], &undo_[s]));
      }
    }
  }

  /// Every shard holds its slice of `model` byte for byte, with consistent digests, and the
  /// distinct pieces of the group add up to each canonical tensor's digest.
  void ExpectGroupHolds(const std::vector<OwnedTensor>& model) {
    std::map<std::string, std::map<std::string, uint64_t>> distinct;
    for (size_t s = 0; s < stores_.size(); ++s) {
      const WeightStore& store = *stores_[s];
      for (const auto& [name, t] : SliceShard(model, GetParam().shards[s])) {
        EXPECT_TRUE(testing::StoreBytes(store, name) == t.bytes)
            << "shard " << s << ": local tensor '" << name << "'";
      }
      EXPECT_EQ(store.Digests(), store.RecomputeDigests()) << "shard " << s;
      ASSERT_OK_AND_ASSIGN(auto holdings, store.Holdings(names_));
      ASSERT_OK_AND_ASSIGN(auto recomputed, store.RecomputeHoldings(names_));
      EXPECT_EQ(holdings, recomputed) << "shard " << s;
      for (const auto& [name, holding] : holdings) {
        for (const auto& [id, digest] : holding.pieces) {
          const auto [it, inserted] = distinct[name].emplace(id, digest);
          EXPECT_EQ(it->second, digest) << "copies of '" << name << "' " << id << " disagree";
        }
      }
    }
    for (const OwnedTensor& t : model) {
      uint64_t sum = 0;
      for (const auto& [id, digest] : distinct[t.name]) sum += digest;
      EXPECT_EQ(sum, TensorDigest(t.view())) << "'" << t.name << "'";
    }
  }

  std::vector<OwnedTensor> model_;
  std::vector<std::string> names_;
  std::unique_ptr<internal::DeltaTracker> tracker_;
  std::vector<std::unique_ptr<WeightStore>> stores_;
  std::vector<internal::UndoLog> undo_;
};

TEST_P(ExpertLoaderTest, DeltasAnchorsAndRollbacksReachEveryStackExactly) {
  ASSERT_NO_FATAL_FAILURE(ExpectGroupHolds(model_));
  std::vector<OwnedTensor> next;
  for (size_t t = 0; t < model_.size(); ++t) next.push_back(Perturb(model_[t], 0.3, 100 + t));
  std::vector<StoreSnapshot> before;
  for (const auto& store : stores_) before.push_back(TakeSnapshot(*store));

  // A delta (XOR items), then an anchor (FULL items) of the same step, each rolled back.
  for (const bool anchor : {false, true}) {
    SCOPED_TRACE(anchor ? "anchor" : "delta");
    const TransferId id = TransferId::Random();
    ASSERT_NO_FATAL_FAILURE(Apply(EncodeStep(*tracker_, id, next, anchor)));
    ASSERT_NO_FATAL_FAILURE(ExpectGroupHolds(next));
    for (size_t s = 0; s < stores_.size(); ++s) {
      ASSERT_OK(undo_[s].Rollback(*stores_[s]));
      EXPECT_EQ(TakeSnapshot(*stores_[s]), before[s]) << "shard " << s;
      undo_[s].Clear();
    }
    ASSERT_OK(tracker_->Abort(id));
  }
}

INSTANTIATE_TEST_SUITE_P(Placements, ExpertLoaderTest, ::testing::ValuesIn(Placements()),
                         [](const auto& param_info) { return param_info.param.name; });

// A trainer rank holding expert stacks (expert parallelism, TP-split matrices, or both) states
// them with the same rules: each 2-D expert matrix's pieces view the stack as [slots·rows, cols],
// the stacked tensors' pieces are 3-D boxes, and the ranks' layouts tile every expert.
TEST_P(ExpertLoaderTest, ATrainerRankStatesItsStacksWithTheSameRules) {
  std::map<std::string, const OwnedTensor*> canonical;
  std::vector<std::string> names;
  for (const OwnedTensor& t : model_) {
    canonical[t.name] = &t;
    names.push_back(t.name);
  }
  std::vector<ProducerLayout> layouts;
  for (const Shard& shard : GetParam().shards) {
    const std::map<std::string, OwnedTensor> stacks = SliceShard(model_, shard);
    std::vector<TensorView> views;
    std::map<std::string, const OwnedTensor*> locals;
    for (const auto& [name, t] : stacks) {
      views.push_back(t.view());
      locals[name] = &t;
    }
    ASSERT_OK_AND_ASSIGN(ProducerLayout layout,
                         ProducerLayoutFromLoader(SpecOf(shard), views, names));
    testing::ExpectPiecesReadTheirBoxes(layout, canonical, locals,
                                        fmt::format("shard {}", layouts.size()));
    layouts.push_back(std::move(layout));
  }
  ASSERT_OK_AND_ASSIGN(LayoutPlan plan, PlanLayouts(layouts));
  EXPECT_EQ(plan.tensors.size(), model_.size());
}

// ---- Layouts and refusals ----------------------------------------------------------------------

std::unique_ptr<WeightStore> StoreWith(Shape w13, Shape w2) {
  auto store = WeightStore::Make();
  OwnedTensor a{"w13", DType::kBFloat16, w13, {}};
  a.bytes.assign(NumElements(w13).ValueOrDie() * 2, std::byte{0});
  OwnedTensor b{"w2", DType::kBFloat16, w2, {}};
  b.bytes.assign(NumElements(w2).ValueOrDie() * 2, std::byte{0});
  EXPECT_TRUE(store->AddCopy(a.view()).ok());
  EXPECT_TRUE(store->AddCopy(b.view()).ok());
  return store;
}

TEST(ExpertLayoutTest, StacksOfConsecutiveExpertsMergeIntoOnePiece) {
  // TP 1, every expert: each stacked tensor is one piece over the whole tensor (so a receiver
  // checks its item digests alone); with TP 2 each expert's gate and up are separate pieces.
  for (uint32_t tp : {1u, 2u}) {
    SCOPED_TRACE(tp);
    auto store = StoreWith({kExperts, 2 * kIntermediate / tp, kHidden},
                           {kExperts, kHidden, kIntermediate / tp});
    ASSERT_OK_AND_ASSIGN(
        std::unique_ptr<Loader> loader,
        Loader::Make(LoaderSpec{tp - 1,
                                tp,
                                {{.kind = LoaderKind::kStackedGateUp, .match = "gu", .to = "w13"},
                                 {.kind = LoaderKind::kStackedDown, .match = "d", .to = "w2"}}},
                     *store));
    ASSERT_OK_AND_ASSIGN(const CanonicalLayout* gate_up, loader->Resolve("gu"));
    EXPECT_EQ(gate_up->shape, (Shape{kExperts, 2 * kIntermediate, kHidden}));
    EXPECT_EQ(gate_up->rows, uint64_t{kExperts * 2 * kIntermediate});
    EXPECT_EQ(gate_up->cols, uint64_t{kHidden});
    EXPECT_EQ(gate_up->pieces.size(), tp == 1 ? 1u : 2u * kExperts);
    EXPECT_EQ(gate_up->held_whole(), tp == 1);
    ASSERT_OK_AND_ASSIGN(const CanonicalLayout* down, loader->Resolve("d"));
    EXPECT_EQ(down->shape, (Shape{kExperts, kHidden, kIntermediate}));
    EXPECT_EQ(down->rows, uint64_t{kExperts * kHidden});
    ASSERT_EQ(down->pieces.size(), 1u);
    EXPECT_EQ(down->pieces[0].id,
              PieceId(0, kExperts * kHidden, (tp - 1) * kIntermediate / tp, kIntermediate));
  }
}

TEST(ExpertLayoutTest, AnExpertTheShardDoesNotHoldHasNoPiece) {
  auto store = StoreWith({2, 2 * kIntermediate, kHidden}, {2, kHidden, kIntermediate});
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Loader> loader,
                       Loader::Make(LoaderSpec{0,
                                               1,
                                               {{.kind = LoaderKind::kExpertDown,
                                                 .match = R"(e(\d+)\.down)",
                                                 .to = "w2",
                                                 .expert_group = 1,
                                                 .num_experts = kExperts,
                                                 .experts = {4, 1}}}},
                                    *store));
  ASSERT_OK_AND_ASSIGN(const CanonicalLayout* held, loader->Resolve("e1.down"));
  ASSERT_EQ(held->pieces.size(), 1u);
  EXPECT_EQ(held->pieces[0].local_row_offset, uint64_t{kHidden});  // slot 1
  ASSERT_OK_AND_ASSIGN(const CanonicalLayout* other, loader->Resolve("e3.down"));
  EXPECT_FALSE(other->skipped);
  EXPECT_TRUE(other->pieces.empty());
  EXPECT_EQ(other->shape, (Shape{kHidden, kIntermediate}));
  EXPECT_STATUS_MSG(InvalidArgument, "expert 6 is not below 6", loader->Resolve("e6.down"));
}

TEST(ExpertLayoutTest, ShapesThatDoNotFitTheRuleNameBoth) {
  const LoaderRule gate_up{.kind = LoaderKind::kExpertGateUp,
                           .to = "w13",
                           .gate = R"(e(\d+)\.gate)",
                           .up = R"(e(\d+)\.up)",
                           .expert_group = 1};
  {
    auto store = StoreWith({kExperts, 2 * kIntermediate + 1, kHidden}, {kExperts, kHidden, 1});
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Loader> loader,
                         Loader::Make(LoaderSpec{0, 1, {gate_up}}, *store));
    const Status status = loader->Resolve("e0.gate").status();
    EXPECT_STATUS_MSG(InvalidArgument, "tensor 'e0.gate' → local tensor 'w13'", status);
    EXPECT_STATUS_MSG(InvalidArgument, "odd number of rows", status);
  }
  {
    auto store = StoreWith({2 * kIntermediate, kHidden}, {kExperts, kHidden, 1});
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Loader> loader,
                         Loader::Make(LoaderSpec{0, 1, {gate_up}}, *store));
    EXPECT_STATUS_MSG(InvalidArgument, "is not a stack", loader->Resolve("e0.up"));
  }
  {
    LoaderRule listed = gate_up;
    listed.experts = {0, 1, 2};
    auto store = StoreWith({2, 2 * kIntermediate, kHidden}, {2, kHidden, 1});
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Loader> loader,
                         Loader::Make(LoaderSpec{0, 1, {listed}}, *store));
    EXPECT_STATUS_MSG(InvalidArgument, "holds 2 experts, but the rule lists 3",
                      loader->Resolve("e0.up"));
  }
}

TEST(ExpertLayoutTest, MakeRefusesExpertRulesThatCannotWork) {
  auto store = WeightStore::Make();
  const auto make = [&](LoaderRule rule) {
    return Loader::Make(LoaderSpec{0, 2, {std::move(rule)}}, *store).status();
  };
  EXPECT_STATUS_MSG(InvalidArgument, "loader rule 0 (expert_down): expert_group",
                    make({.kind = LoaderKind::kExpertDown, .match = R"(e(\d+))", .to = "w2"}));
  EXPECT_STATUS_MSG(
      InvalidArgument, "capture group 2 does not exist",
      make({.kind = LoaderKind::kExpertDown, .match = R"(e(\d+))", .to = "w2", .expert_group = 2}));
  EXPECT_STATUS_MSG(InvalidArgument, "expert 3 is listed twice",
                    make({.kind = LoaderKind::kStackedDown,
                          .match = "d",
                          .to = "w2",
                          .num_experts = 8,
                          .experts = {3, 1, 3}}));
  EXPECT_STATUS_MSG(InvalidArgument, "expert 8 is not below num_experts 8",
                    make({.kind = LoaderKind::kStackedDown,
                          .match = "d",
                          .to = "w2",
                          .num_experts = 8,
                          .experts = {8}}));
  EXPECT_STATUS_MSG(
      InvalidArgument, "needs num_experts",
      make({.kind = LoaderKind::kStackedGateUp, .match = "d", .to = "w13", .experts = {0}}));
  EXPECT_STATUS_MSG(InvalidArgument, "expert_tp_rank: 2 is not below expert_tp_size 2",
                    make({.kind = LoaderKind::kStackedDown,
                          .match = "d",
                          .to = "w2",
                          .expert_tp_rank = 2,
                          .expert_tp_size = 2}));
  EXPECT_STATUS_MSG(InvalidArgument, "loader rule 0 (stacked_down): to",
                    make({.kind = LoaderKind::kStackedDown, .match = "d"}));
}

TEST(ExpertLayoutTest, YamlReadsTheExpertKeys) {
  ASSERT_OK_AND_ASSIGN(LoaderSpec spec, LoaderSpecFromYaml(R"(tp_rank: 1
tp_size: 2
rules:
  - kind: expert_gate_up
    gate: 'layers\.(\d+)\.experts\.(\d+)\.gate_proj\.weight'
    up: 'layers\.(\d+)\.experts\.(\d+)\.up_proj\.weight'
    to: 'layers.$1.experts.w13_weight'
    expert_group: 2
    num_experts: 8
    experts: [4, 5, 6, 7]
    expert_tp_rank: 0
    expert_tp_size: 1
  - {kind: stacked_down, match: 'd', to: 'w2'}
)",
                                                           "moe.yaml"));
  ASSERT_EQ(spec.rules.size(), 2u);
  EXPECT_EQ(spec.rules[0].kind, LoaderKind::kExpertGateUp);
  EXPECT_EQ(spec.rules[0].expert_group, 2u);
  EXPECT_EQ(spec.rules[0].num_experts, 8u);
  EXPECT_EQ(spec.rules[0].experts, (std::vector<uint32_t>{4, 5, 6, 7}));
  EXPECT_EQ(spec.rules[0].expert_tp_size, 1u);
  EXPECT_EQ(spec.rules[1].kind, LoaderKind::kStackedDown);
  EXPECT_STATUS_MSG(InvalidArgument, "moe.yaml:2:56: rules[0].experts[1]",
                    LoaderSpecFromYaml("rules:\n  - {kind: stacked_down, match: d, to: w, "
                                       "experts: [1, x]}\n",
                                       "moe.yaml"));
  EXPECT_STATUS_MSG(InvalidArgument, "rules[0].expert_group: does not apply to a stacked_down",
                    LoaderSpecFromYaml("rules:\n  - {kind: stacked_down, match: d, to: w, "
                                       "expert_group: 1}\n",
                                       "moe.yaml"));
  EXPECT_STATUS_MSG(InvalidArgument, "rules[0].experts: expected a sequence",
                    LoaderSpecFromYaml("rules:\n  - {kind: stacked_down, match: d, to: w, "
                                       "experts: 3}\n",
                                       "moe.yaml"));
}

}  // namespace
}  // namespace refit
