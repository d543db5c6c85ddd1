#include "refit/loader.h"

#include <gtest/gtest.h>

#include <fmt/format.h>
#include <unistd.h>
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "codec/tracker.h"
#include "core/digest.h"
#include "layout_check.h"
#include "receiver/apply.h"
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

// A two-layer GQA model, small enough to slice by hand: 8 q heads, 2 kv heads of 4 rows each.
constexpr int64_t kHidden = 16;
constexpr int64_t kHeads = 8;
constexpr int64_t kKvHeads = 2;
constexpr int64_t kHeadDim = 4;
constexpr int64_t kIntermediate = 24;
/// Not a multiple of kPadTo × TP for any TP tested, so every shard group has padding rows.
constexpr int64_t kVocab = 100;
constexpr int64_t kPadTo = 8;
/// What the receiver's padding rows hold; no canonical element ever writes it.
constexpr uint16_t kPaddingBits = 0xA5C3;

const std::string kOddName = "odd tensor · ünïcode.Σ name";
const std::string kOddRowName = "blocks ✓.0.weight (odd)";

std::string Layer(int layer, std::string_view rest) {
  return fmt::format("model.layers.{}.{}", layer, rest);
}

/// The canonical (checkpoint) tensors, bf16 bit patterns.
std::vector<OwnedTensor> CanonicalModel() {
  std::vector<OwnedTensor> model;
  uint64_t seed = 1;
  const auto add = [&](const std::string& name, Shape shape) {
    model.push_back(RandomTensor(name, DType::kBFloat16, std::move(shape), seed++));
  };
  add("model.embed_tokens.weight", {kVocab, kHidden});
  for (int layer = 0; layer < 2; ++layer) {
    add(Layer(layer, "self_attn.q_proj.weight"), {kHeads * kHeadDim, kHidden});
    add(Layer(layer, "self_attn.k_proj.weight"), {kKvHeads * kHeadDim, kHidden});
    add(Layer(layer, "self_attn.v_proj.weight"), {kKvHeads * kHeadDim, kHidden});
    add(Layer(layer, "self_attn.o_proj.weight"), {kHidden, kHeads * kHeadDim});
    add(Layer(layer, "mlp.gate_proj.weight"), {kIntermediate, kHidden});
    add(Layer(layer, "mlp.up_proj.weight"), {kIntermediate, kHidden});
    add(Layer(layer, "mlp.down_proj.weight"), {kHidden, kIntermediate});
  }
  // Layer 0 has qkv biases, layer 1 has none.
  add(Layer(0, "self_attn.q_proj.bias"), {kHeads * kHeadDim});
  add(Layer(0, "self_attn.k_proj.bias"), {kKvHeads * kHeadDim});
  add(Layer(0, "self_attn.v_proj.bias"), {kKvHeads * kHeadDim});
  add(Layer(0, "input_layernorm.weight"), {kHidden});
  add(Layer(0, "mlp.experts.w"), {6, 8, 3});
  add(Layer(0, "router.weight"), {8, 2, 3});
  add("model.norm.weight", {kHidden});
  add("model.rotary_emb.inv_freq", {8});
  add("lm_head.weight", {kVocab, kHidden});
  add(kOddName, {4, 3});
  add(kOddRowName, {8, 5});
  add("model.logit_scale", {});
  return model;
}

std::string LoaderYaml(uint32_t rank, uint32_t tp) {
  return fmt::format(R"(tp_rank: {}
tp_size: {}
rules:
  - {{kind: skip, match: 'model\.rotary_emb\..*'}}
  - kind: qkv
    q: 'model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)'
    k: 'model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)'
    v: 'model\.layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)'
    to: 'model.layers.$1.self_attn.qkv_proj.$2'
    num_heads: {}
    num_kv_heads: {}
  - kind: gate_up
    gate: 'model\.layers\.(\d+)\.mlp\.gate_proj\.weight'
    up: 'model\.layers\.(\d+)\.mlp\.up_proj\.weight'
    to: 'model.layers.$1.mlp.gate_up_proj.weight'
  - {{kind: column, match: 'model\.layers\.\d+\.(self_attn\.o_proj\.weight|mlp\.down_proj\.weight|mlp\.experts\.w)'}}
  - {{kind: row, match: 'model\.layers\.\d+\.router\.weight'}}
  - {{kind: vocab, match: 'model\.embed_tokens\.weight|lm_head\.weight', vocab_size: {}, pad_to: {}}}
  - {{kind: rename, match: 'model\.layers\.(\d+)\.input_layernorm\.weight', to: 'model.layers.$1.ln_in.weight'}}
  - {{kind: row, match: 'blocks ✓\.(\d+)\.weight \(odd\)', to: 'b✓$1 w'}}
)",
                     rank, tp, kHeads, kKvHeads, kVocab, kPadTo);
}

// ---- The receiver's layout, sliced by plain loops (independent of the loader) ----------------

uint16_t At(const OwnedTensor& t, int64_t index) {
  uint16_t bits;
  std::memcpy(&bits, t.bytes.data() + index * 2, 2);
  return bits;
}

int64_t RowElements(const OwnedTensor& t) {
  int64_t n = 1;
  for (size_t d = 1; d < t.shape.size(); ++d) n *= t.shape[d];
  return n;
}

void AppendRows(const OwnedTensor& t, int64_t first, int64_t count, std::vector<uint16_t>* out) {
  const int64_t row = RowElements(t);
  for (int64_t r = first; r < first + count; ++r) {
    for (int64_t c = 0; c < row; ++c) out->push_back(At(t, r * row + c));
  }
}

OwnedTensor Local(const std::string& name, Shape shape, const std::vector<uint16_t>& bits) {
  OwnedTensor t{name, DType::kBFloat16, std::move(shape), {}};
  t.bytes.resize(bits.size() * 2);
  std::memcpy(t.bytes.data(), bits.data(), t.bytes.size());
  return t;
}

Shape WithDim(Shape shape, size_t dim, int64_t extent) {
  shape[dim] = extent;
  return shape;
}

/// The local tensors of rank `rank` of a TP group of `tp`.
std::map<std::string, OwnedTensor> SliceShard(const std::vector<OwnedTensor>& model, uint32_t rank,
                                              uint32_t tp) {
  std::map<std::string, const OwnedTensor*> by_name;
  for (const OwnedTensor& t : model) by_name[t.name] = &t;
  const auto get = [&](const std::string& name) -> const OwnedTensor& { return *by_name.at(name); };
  std::map<std::string, OwnedTensor> shard;
  const auto put = [&](OwnedTensor t) { shard[t.name] = std::move(t); };

  const int64_t q_heads = kHeads / tp;
  std::vector<int64_t> kv_heads;
  if (kKvHeads >= static_cast<int64_t>(tp)) {
    for (int64_t h = rank * kKvHeads / tp; h < (rank + 1) * kKvHeads / tp; ++h) {
      kv_heads.push_back(h);
    }
  } else {
    kv_heads.push_back(rank / (tp / kKvHeads));
  }
  const auto qkv = [&](int layer, const std::string& suffix) {
    std::vector<uint16_t> bits;
    for (int64_t h = rank * q_heads; h < (rank + 1) * q_heads; ++h) {
      AppendRows(get(Layer(layer, "self_attn.q_proj." + suffix)), h * kHeadDim, kHeadDim, &bits);
    }
    for (const char* part : {"k", "v"}) {
      for (int64_t h : kv_heads) {
        AppendRows(get(Layer(layer, fmt::format("self_attn.{}_proj.{}", part, suffix))),
                   h * kHeadDim, kHeadDim, &bits);
      }
    }
    const int64_t rows = (q_heads + 2 * static_cast<int64_t>(kv_heads.size())) * kHeadDim;
    put(Local(Layer(layer, "self_attn.qkv_proj." + suffix),
              suffix == "weight" ? Shape{rows, kHidden} : Shape{rows}, bits));
  };
  const auto column = [&](const OwnedTensor& t) {
    const int64_t a_extent = t.shape[0];
    const int64_t b_extent = t.shape[1];
    const int64_t block = b_extent / tp;
    int64_t inner = 1;
    for (size_t d = 2; d < t.shape.size(); ++d) inner *= t.shape[d];
    std::vector<uint16_t> bits;
    for (int64_t a = 0; a < a_extent; ++a) {
      for (int64_t b = 0; b < block; ++b) {
        for (int64_t e = 0; e < inner; ++e) {
          bits.push_back(At(t, (a * b_extent + rank * block + b) * inner + e));
        }
      }
    }
    put(Local(t.name, WithDim(t.shape, 1, block), bits));
  };
  const auto row = [&](const OwnedTensor& t, const std::string& local_name) {
    const int64_t block = t.shape[0] / tp;
    std::vector<uint16_t> bits;
    AppendRows(t, rank * block, block, &bits);
    put(Local(local_name, WithDim(t.shape, 0, block), bits));
  };
  const auto vocab = [&](const OwnedTensor& t) {
    const int64_t multiple = kPadTo * tp;
    const int64_t padded = (kVocab + multiple - 1) / multiple * multiple;
    const int64_t per_rank = padded / tp;
    std::vector<uint16_t> bits;
    for (int64_t j = 0; j < per_rank; ++j) {
      const int64_t padded_row = rank * per_rank + j;
      if (padded_row < kVocab) {
        AppendRows(t, padded_row, 1, &bits);
      } else {
        bits.insert(bits.end(), kHidden, kPaddingBits);
      }
    }
    put(Local(t.name, {per_rank, kHidden}, bits));
  };

  for (int layer = 0; layer < 2; ++layer) {
    qkv(layer, "weight");
    std::vector<uint16_t> gate_up;
    const int64_t block = kIntermediate / tp;
    AppendRows(get(Layer(layer, "mlp.gate_proj.weight")), rank * block, block, &gate_up);
    AppendRows(get(Layer(layer, "mlp.up_proj.weight")), rank * block, block, &gate_up);
    put(Local(Layer(layer, "mlp.gate_up_proj.weight"), {2 * block, kHidden}, gate_up));
    column(get(Layer(layer, "self_attn.o_proj.weight")));
    column(get(Layer(layer, "mlp.down_proj.weight")));
  }
  qkv(0, "bias");
  column(get(Layer(0, "mlp.experts.w")));
  row(get(Layer(0, "router.weight")), Layer(0, "router.weight"));
  row(get(kOddRowName), "b✓0 w");
  vocab(get("model.embed_tokens.weight"));
  vocab(get("lm_head.weight"));
  OwnedTensor ln = get(Layer(0, "input_layernorm.weight"));
  ln.name = Layer(0, "ln_in.weight");
  put(ln);
  put(get("model.norm.weight"));
  put(get(kOddName));
  put(get("model.logit_scale"));
  return shard;
}

// ---- Producer side ----------------------------------------------------------------------------

struct Step {
  TransferId id;
  std::vector<DecodedPayload> payloads;
};

/// Open a transfer on `tracker` for `next`, every tensor cut into `spans` element ranges (not
/// aligned to rows) spread over `payload_count` payloads, and decode them as a receiver would.
Step EncodeStep(internal::DeltaTracker& tracker, const std::vector<OwnedTensor>& next, bool anchor,
                uint64_t spans = 3, size_t payload_count = 4) {
  Step step;
  step.id = TransferId::Random();
  auto plan = tracker.Begin(step.id, anchor);
  EXPECT_TRUE(plan.ok()) << plan.status().ToString();
  if (!plan.ok()) return step;
  EXPECT_EQ(plan->anchor, anchor);
  std::vector<std::vector<Item>> buckets(payload_count);
  size_t chunk = 0;
  for (const OwnedTensor& t : next) {
    const uint64_t numel = t.view().numel();
    for (uint64_t s = 0; s < spans; ++s) {
      const uint64_t begin = numel * s / spans;
      const uint64_t end = numel * (s + 1) / spans;
      if (begin == end) continue;
      auto encoded = tracker.Encode(step.id, t.view(), begin, end);
      EXPECT_TRUE(encoded.ok()) << encoded.status().ToString();
      if (!encoded.ok()) continue;
      for (Item& item : encoded->items) buckets[chunk % payload_count].push_back(std::move(item));
      ++chunk;
    }
  }
  uint32_t payload_id = 0;
  for (const std::vector<Item>& bucket : buckets) {
    if (bucket.empty()) continue;
    std::vector<ItemView> views;
    for (const Item& item : bucket) views.push_back(item.view());
    auto bytes = EncodePayload(
        PayloadIds{step.id, 0, payload_id++, plan->base_version, plan->target_version}, views);
    EXPECT_TRUE(bytes.ok()) << bytes.status().ToString();
    if (!bytes.ok()) continue;
    auto decoded = DecodePayload(*bytes);
    EXPECT_TRUE(decoded.ok()) << decoded.status().ToString();
    if (decoded.ok()) step.payloads.push_back(std::move(decoded).ValueOrDie());
  }
  return step;
}

std::vector<std::string> Names(const std::vector<OwnedTensor>& model) {
  std::vector<std::string> names;
  for (const OwnedTensor& t : model) names.push_back(t.name);
  return names;
}

/// A trainer (tracker over the canonical model) and the TP group of one replica.
class ShardGroup {
 public:
  void Build(uint32_t tp, Op op, int apply_threads = 1) {
    tp_ = tp;
    apply_threads_ = apply_threads;
    model_ = CanonicalModel();
    names_ = Names(model_);
    TrackerOptions options;
    options.op = op;
    options.add_delta_dtype = DType::kFloat32;
    auto tracker = internal::DeltaTracker::Make(options);
    ASSERT_OK(tracker);
    tracker_ = std::move(tracker).ValueOrDie();
    for (const OwnedTensor& t : model_) ASSERT_OK(tracker_->AdoptBaseline(t.view()));
    for (uint32_t rank = 0; rank < tp; ++rank) {
      auto store = WeightStore::Make();
      for (const auto& [name, t] : SliceShard(model_, rank, tp))
        ASSERT_OK(testing::AddTestTensor(*store, t.view()));
      ASSERT_OK_AND_ASSIGN(LoaderSpec spec,
                           LoaderSpecFromYaml(LoaderYaml(rank, tp), "loader.yaml"));
      ASSERT_OK_AND_ASSIGN(std::unique_ptr<Loader> loader, Loader::Make(spec, *store));
      ASSERT_OK(store->AttachLoader(std::move(loader)));
      shards_.push_back(std::move(store));
    }
    undo_.resize(tp);
  }

  /// Apply every payload of `step` to every shard.
  void Apply(const Step& step) {
    for (uint32_t rank = 0; rank < tp_; ++rank) {
      for (const DecodedPayload& payload : step.payloads) {
        ASSERT_OK(
            internal::ApplyPayload(payload, *shards_[rank], &undo_[rank], nullptr, apply_threads_));
      }
    }
  }

  /// Every shard equals the slice of `model` byte for byte (padding rows included), and its
  /// incrementally kept digests equal digests recomputed from the bytes.
  void ExpectShardsHold(const std::vector<OwnedTensor>& model) {
    for (uint32_t rank = 0; rank < tp_; ++rank) {
      const WeightStore& store = *shards_[rank];
      const std::map<std::string, OwnedTensor> expected = SliceShard(model, rank, tp_);
      ASSERT_EQ(store.size(), expected.size());
      for (const auto& [name, t] : expected) {
        ASSERT_OK_AND_ASSIGN(TensorView got, store.Find(name));
        EXPECT_EQ(got.shape, t.shape) << name;
        EXPECT_TRUE(testing::StoreBytes(store, name) == t.bytes)
            << "rank " << rank << " of " << tp_ << ": local tensor '" << name << "'";
      }
      EXPECT_EQ(store.Digests(), store.RecomputeDigests()) << "rank " << rank;
      ASSERT_OK_AND_ASSIGN(auto holdings, store.Holdings(names_));
      ASSERT_OK_AND_ASSIGN(auto recomputed, store.RecomputeHoldings(names_));
      EXPECT_EQ(holdings, recomputed) << "rank " << rank;
    }
  }

  /// Per canonical tensor, copies of one piece agree across shards and the distinct pieces sum
  /// to the producer's digest. Returns how many shards hold each (tensor, piece id).
  std::map<std::pair<std::string, std::string>, int> ExpectGroupDigests(
      const std::map<std::string, uint64_t>& producer) {
    std::vector<std::map<std::string, CanonicalHolding>> holdings;
    for (const auto& store : shards_) {
      auto h = store->Holdings(names_);
      EXPECT_TRUE(h.ok()) << h.status().ToString();
      if (!h.ok()) return {};
      holdings.push_back(std::move(h).ValueOrDie());
    }
    std::map<std::pair<std::string, std::string>, int> copies;
    for (const std::string& name : names_) {
      if (name == "model.rotary_emb.inv_freq") {
        for (const auto& h : holdings) EXPECT_TRUE(h.at(name).skipped) << name;
        continue;
      }
      std::map<std::string, uint64_t> distinct;
      for (const auto& h : holdings) {
        EXPECT_FALSE(h.at(name).skipped) << name;
        for (const auto& [id, digest] : h.at(name).pieces) {
          const auto [it, inserted] = distinct.emplace(id, digest);
          EXPECT_EQ(it->second, digest) << "copies of '" << name << "' " << id << " disagree";
          ++copies[{name, id}];
        }
      }
      uint64_t sum = 0;
      for (const auto& [id, digest] : distinct) sum += digest;
      EXPECT_EQ(sum, producer.at(name)) << "'" << name << "' over " << tp_ << " shards";
    }
    return copies;
  }

  struct GroupSnapshot {
    std::vector<StoreSnapshot> stores;
    std::vector<std::map<std::string, CanonicalHolding>> holdings;
    friend bool operator==(const GroupSnapshot&, const GroupSnapshot&) = default;
  };
  GroupSnapshot Snapshot() const {
    GroupSnapshot snapshot;
    for (const auto& store : shards_) {
      snapshot.stores.push_back(TakeSnapshot(*store));
      auto h = store->Holdings(names_);
      EXPECT_TRUE(h.ok()) << h.status().ToString();
      if (h.ok()) snapshot.holdings.push_back(*h);
    }
    return snapshot;
  }

  uint32_t tp_ = 1;
  // ApplyPayload's threads: a delta's items that write distinct local tensors apply at once.
  int apply_threads_ = 1;
  std::vector<OwnedTensor> model_;
  std::vector<std::string> names_;
  std::unique_ptr<internal::DeltaTracker> tracker_;
  std::vector<std::unique_ptr<WeightStore>> shards_;
  std::vector<internal::UndoLog> undo_;
};

std::vector<OwnedTensor> PerturbModel(const std::vector<OwnedTensor>& model, double density,
                                      uint64_t seed) {
  std::vector<OwnedTensor> next;
  for (size_t t = 0; t < model.size(); ++t) next.push_back(Perturb(model[t], density, seed + t));
  return next;
}

class LoaderGroupTest : public ::testing::TestWithParam<std::tuple<uint32_t, Op, int>> {
 protected:
  void SetUp() override {
    const auto [tp, op, threads] = GetParam();
    ASSERT_NO_FATAL_FAILURE(group_.Build(tp, op, threads));
  }
  ShardGroup group_;
};

TEST_P(LoaderGroupTest, DeltasAndAnchorsReachEveryShardExactly) {
  std::vector<OwnedTensor> current = group_.model_;
  group_.ExpectShardsHold(current);
  group_.ExpectGroupDigests(group_.tracker_->Digests());
  // delta, anchor (FULL spans not aligned to rows), delta.
  const std::vector<std::pair<double, bool>> plan = {{0.08, false}, {0.6, true}, {0.02, false}};
  for (size_t s = 0; s < plan.size(); ++s) {
    const auto [density, anchor] = plan[s];
    SCOPED_TRACE(fmt::format("step {} ({})", s, anchor ? "anchor" : "delta"));
    current = PerturbModel(current, density, 1000 * (s + 1));
    const Step step = EncodeStep(*group_.tracker_, current, anchor);
    ASSERT_FALSE(step.payloads.empty());
    ASSERT_NO_FATAL_FAILURE(group_.Apply(step));
    group_.ExpectShardsHold(current);
    group_.ExpectGroupDigests(group_.tracker_->PendingDigests());
    ASSERT_OK(group_.tracker_->Commit(step.id));
    for (internal::UndoLog& undo : group_.undo_) undo.Clear();
  }
}

TEST_P(LoaderGroupTest, ReplicatedPiecesAreReportedOnceByIdAndAgree) {
  const auto copies = group_.ExpectGroupDigests(group_.tracker_->Digests());
  const uint32_t tp = group_.tp_;
  // Unsharded tensors: every shard holds the same whole piece.
  EXPECT_EQ(copies.at({"model.norm.weight", "rows 0:16 cols 0:1"}), static_cast<int>(tp));
  EXPECT_EQ(copies.at({kOddName, "rows 0:4 cols 0:3"}), static_cast<int>(tp));
  EXPECT_EQ(copies.at({"model.logit_scale", "rows 0:1 cols 0:1"}), static_cast<int>(tp));
  // kv heads: 2 heads over TP ranks; with TP = 4 each head (4 rows) sits on 2 ranks.
  for (const std::string& name :
       {Layer(0, "self_attn.k_proj.weight"), Layer(1, "self_attn.v_proj.weight")}) {
    const int per_head = tp > kKvHeads ? static_cast<int>(tp / kKvHeads) : 1;
    if (tp <= kKvHeads) {
      // Each rank holds kKvHeads / TP heads of its own.
      const int64_t rows = kKvHeads / tp * kHeadDim;
      for (uint32_t r = 0; r < tp; ++r) {
        EXPECT_EQ(copies.at({name, fmt::format("rows {}:{} cols 0:16", r * rows, (r + 1) * rows)}),
                  1);
      }
    } else {
      EXPECT_EQ(copies.at({name, "rows 0:4 cols 0:16"}), per_head);
      EXPECT_EQ(copies.at({name, "rows 4:8 cols 0:16"}), per_head);
    }
  }
}

TEST_P(LoaderGroupTest, RollbackRestoresBytesAndHoldingsExactly) {
  const ShardGroup::GroupSnapshot before = group_.Snapshot();
  for (bool anchor : {false, true}) {
    SCOPED_TRACE(anchor ? "anchor" : "delta");
    const Step step = EncodeStep(*group_.tracker_, PerturbModel(group_.model_, 0.3, 77), anchor);
    ASSERT_NO_FATAL_FAILURE(group_.Apply(step));
    EXPECT_NE(group_.Snapshot(), before);
    for (uint32_t rank = 0; rank < group_.tp_; ++rank) {
      ASSERT_OK(group_.undo_[rank].Rollback(*group_.shards_[rank]));
    }
    EXPECT_EQ(group_.Snapshot(), before);
    ASSERT_OK(group_.tracker_->Abort(step.id));
  }
}

// An anchor's old bits spilled to a file undo it as exactly as in memory; kept nowhere, the
// rollback leaves the anchor's bits and digests (local and piece) that match them, for the anchor
// that must follow.
TEST_P(LoaderGroupTest, AnAnchorIsUndoneFromItsSpillFileOrLeftSelfConsistentWhenNotKept) {
  const ShardGroup::GroupSnapshot before = group_.Snapshot();
  for (AnchorUndo policy : {AnchorUndo::kFile, AnchorUndo::kNone}) {
    SCOPED_TRACE(AnchorUndoName(policy));
    for (internal::UndoLog& undo : group_.undo_)
      undo = internal::UndoLog(internal::UndoLogOptions{.anchor_undo = policy});
    const std::vector<OwnedTensor> next = PerturbModel(group_.model_, 0.3, 91);
    const Step step = EncodeStep(*group_.tracker_, next, /*anchor=*/true);
    ASSERT_NO_FATAL_FAILURE(group_.Apply(step));
    for (uint32_t rank = 0; rank < group_.tp_; ++rank) {
      internal::UndoLog& undo = group_.undo_[rank];
      EXPECT_EQ(undo.exact(), policy == AnchorUndo::kFile);
      EXPECT_EQ(undo.spilled_bytes() > 0, policy == AnchorUndo::kFile);
      EXPECT_EQ(undo.bytes(), 0u) << "an anchor's old bits stay out of memory";
      ASSERT_OK(undo.Rollback(*group_.shards_[rank]));
    }
    if (policy == AnchorUndo::kFile) {
      EXPECT_EQ(group_.Snapshot(), before);
    } else {
      // Every element was overwritten by the anchor and kept: the shards hold `next`, and their
      // digests were recomputed (ExpectShardsHold compares them with the bytes).
      group_.ExpectShardsHold(next);
      for (uint32_t rank = 0; rank < group_.tp_; ++rank) {
        EXPECT_TRUE(group_.undo_[rank].exact()) << "Rollback clears the log";
      }
    }
    ASSERT_OK(group_.tracker_->Abort(step.id));
    if (policy == AnchorUndo::kNone) {
      // Put the base back, as the next anchor would, for the loop's next policy.
      for (internal::UndoLog& undo : group_.undo_) undo = internal::UndoLog();
      const Step heal = EncodeStep(*group_.tracker_, group_.model_, /*anchor=*/true);
      ASSERT_NO_FATAL_FAILURE(group_.Apply(heal));
      ASSERT_OK(group_.tracker_->Abort(heal.id));
      for (internal::UndoLog& undo : group_.undo_) undo.Clear();
      EXPECT_EQ(group_.Snapshot(), before);
    }
  }
}

// One apply thread, and three: a delta's items that write distinct local tensors apply at once,
// with the same bits, digests, holdings and rollback.
INSTANTIATE_TEST_SUITE_P(TpOpsAndThreads, LoaderGroupTest,
                         ::testing::Combine(::testing::Values(1u, 2u, 4u),
                                            ::testing::Values(Op::kXor, Op::kOverwrite, Op::kAdd),
                                            ::testing::Values(1, 3)),
                         [](const auto& param_info) {
                           return fmt::format("TP{}_{}_{}Threads", std::get<0>(param_info.param),
                                              OpName(std::get<1>(param_info.param)),
                                              std::get<2>(param_info.param));
                         });

// ---- Layouts resolved by hand -----------------------------------------------------------------

TEST(LoaderLayoutTest, ResolvesTheGeometryOfEveryKind) {
  const std::vector<OwnedTensor> model = CanonicalModel();
  auto store = WeightStore::Make();
  for (const auto& [name, t] : SliceShard(model, 1, 4)) {
    ASSERT_OK(testing::AddTestTensor(*store, t.view()));
  }
  ASSERT_OK_AND_ASSIGN(LoaderSpec spec, LoaderSpecFromYaml(LoaderYaml(1, 4), "loader.yaml"));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Loader> loader, Loader::Make(spec, *store));

  struct Expected {
    std::string canonical;
    Shape shape;
    std::string local;
    std::string id;
    uint64_t local_row_offset;
    uint64_t local_row_length;
  };
  // Rank 1 of 4: q heads 2..3 (rows 8:16), kv head 0 (replicated on ranks 0 and 1), local qkv
  // rows [q 0:8 | k 8:12 | v 12:16]; gate/up rows 6:12; o_proj cols 8:16 of 32; experts [6, 8, 3]
  // holds dim-1 block 2:4, i.e. cols 6:12 of 24; vocab padded to 128, rows 32:64.
  const std::vector<Expected> expected = {
      {Layer(0, "self_attn.q_proj.weight"),
       {32, 16},
       Layer(0, "self_attn.qkv_proj.weight"),
       "rows 8:16 cols 0:16",
       0,
       16},
      {Layer(0, "self_attn.k_proj.weight"),
       {8, 16},
       Layer(0, "self_attn.qkv_proj.weight"),
       "rows 0:4 cols 0:16",
       8,
       16},
      {Layer(0, "self_attn.v_proj.bias"),
       {8},
       Layer(0, "self_attn.qkv_proj.bias"),
       "rows 0:4 cols 0:1",
       12,
       1},
      {Layer(1, "mlp.up_proj.weight"),
       {24, 16},
       Layer(1, "mlp.gate_up_proj.weight"),
       "rows 6:12 cols 0:16",
       6,
       16},
      {Layer(1, "self_attn.o_proj.weight"),
       {16, 32},
       Layer(1, "self_attn.o_proj.weight"),
       "rows 0:16 cols 8:16",
       0,
       8},
      {Layer(0, "mlp.experts.w"), {6, 8, 3}, Layer(0, "mlp.experts.w"), "rows 0:6 cols 6:12", 0, 6},
      {Layer(0, "router.weight"), {8, 2, 3}, Layer(0, "router.weight"), "rows 2:4 cols 0:6", 0, 6},
      {"lm_head.weight", {100, 16}, "lm_head.weight", "rows 32:64 cols 0:16", 0, 16},
      {Layer(0, "input_layernorm.weight"),
       {16},
       Layer(0, "ln_in.weight"),
       "rows 0:16 cols 0:1",
       0,
       1},
      {kOddRowName, {8, 5}, "b✓0 w", "rows 2:4 cols 0:5", 0, 5},
      {kOddName, {4, 3}, kOddName, "rows 0:4 cols 0:3", 0, 3},
      {"model.logit_scale", {}, "model.logit_scale", "rows 0:1 cols 0:1", 0, 1},
  };
  for (const Expected& e : expected) {
    SCOPED_TRACE(e.canonical);
    ASSERT_OK_AND_ASSIGN(const CanonicalLayout* layout, loader->Resolve(e.canonical));
    EXPECT_FALSE(layout->skipped);
    EXPECT_EQ(layout->dtype, DType::kBFloat16);
    EXPECT_EQ(layout->shape, e.shape);
    ASSERT_EQ(layout->pieces.size(), 1u);
    EXPECT_EQ(layout->pieces[0].local_tensor, e.local);
    EXPECT_EQ(layout->pieces[0].id, e.id);
    EXPECT_EQ(layout->pieces[0].local_row_offset, e.local_row_offset);
    EXPECT_EQ(layout->pieces[0].local_row_length, e.local_row_length);
    // Cached: the same layout object.
    ASSERT_OK_AND_ASSIGN(const CanonicalLayout* again, loader->Resolve(e.canonical));
    EXPECT_EQ(again, layout);
  }
  ASSERT_OK_AND_ASSIGN(const CanonicalLayout* skipped,
                       loader->Resolve("model.rotary_emb.inv_freq"));
  EXPECT_TRUE(skipped->skipped);
  EXPECT_EQ(PieceId(0, 64, 0, 4096), "rows 0:64 cols 0:4096");
}

TEST(LoaderLayoutTest, AVocabShardPastTheVocabularyHoldsNoPiece) {
  // V = 10, pad_to 8, TP 4: Vp = 32, 8 rows per rank; ranks 2 and 3 hold only padding.
  auto store = WeightStore::Make();
  ASSERT_OK(store->AddCopy(RandomTensor("embed", DType::kBFloat16, {8, 4}, 1).view()));
  LoaderSpec spec{
      3,
      4,
      {LoaderRule{.kind = LoaderKind::kVocab, .match = "embed", .vocab_size = 10, .pad_to = 8}}};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Loader> loader, Loader::Make(spec, *store));
  ASSERT_OK_AND_ASSIGN(const CanonicalLayout* layout, loader->Resolve("embed"));
  EXPECT_EQ(layout->shape, (Shape{10, 4}));
  EXPECT_TRUE(layout->pieces.empty());
  ASSERT_OK(store->AttachLoader(std::move(loader)));
  const std::vector<std::string> names = {"embed"};
  ASSERT_OK_AND_ASSIGN(auto holdings, store->Holdings(names));
  EXPECT_EQ(holdings.at("embed"), CanonicalHolding{});
}

TEST(LoaderLayoutTest, ResolveIsSafeFromManyThreads) {
  const std::vector<OwnedTensor> model = CanonicalModel();
  auto store = WeightStore::Make();
  for (const auto& [name, t] : SliceShard(model, 0, 2)) {
    ASSERT_OK(testing::AddTestTensor(*store, t.view()));
  }
  ASSERT_OK_AND_ASSIGN(LoaderSpec spec, LoaderSpecFromYaml(LoaderYaml(0, 2), "loader.yaml"));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Loader> loader, Loader::Make(spec, *store));
  const std::vector<std::string> names = Names(model);
  std::vector<std::vector<const CanonicalLayout*>> seen(4);
  {
    std::vector<std::jthread> threads;
    for (size_t t = 0; t < seen.size(); ++t) {
      threads.emplace_back([&, t] {
        for (const std::string& name : names) {
          auto layout = loader->Resolve(name);
          seen[t].push_back(layout.ok() ? *layout : nullptr);
        }
      });
    }
  }
  for (size_t t = 1; t < seen.size(); ++t) EXPECT_EQ(seen[t], seen[0]);
  for (const CanonicalLayout* layout : seen[0]) EXPECT_NE(layout, nullptr);
}

// ---- Refusals ---------------------------------------------------------------------------------

Item OverwriteItem(std::string name, Shape shape, DType dtype = DType::kBFloat16) {
  Item item;
  item.name = std::move(name);
  item.dtype = item.value_dtype = dtype;
  item.shape = std::move(shape);
  item.op = Op::kOverwrite;
  item.span_end = 4;
  item.count = 1;
  item.location_encoding = LocationEncoding::kGap16;
  item.locations = {0, 0};
  item.values.resize(DTypeSize(dtype));
  return item;
}

class LoaderRefusalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(group_.Build(2, Op::kXor));
    next_ = PerturbModel(group_.model_, 0.3, 5);
  }

  /// One payload: the XOR deltas of q_proj (layer 0) and model.norm (their FULL items for an
  /// anchor; with `corrupt_norm`, the norm's first value flipped), then `extra`.
  DecodedPayload MakePayload(std::vector<Item> extra, bool anchor = false,
                             bool corrupt_norm = false) {
    const TransferId id = TransferId::Random();
    auto plan = group_.tracker_->Begin(id, anchor);
    EXPECT_TRUE(plan.ok());
    std::vector<Item> items;
    for (const OwnedTensor& t : next_) {
      if (t.name != Layer(0, "self_attn.q_proj.weight") && t.name != "model.norm.weight") continue;
      auto encoded = group_.tracker_->Encode(id, t.view());
      EXPECT_TRUE(encoded.ok()) << encoded.status().ToString();
      for (Item& item : encoded->items) items.push_back(std::move(item));
    }
    EXPECT_TRUE(group_.tracker_->Abort(id).ok());
    for (Item& item : items) {
      if (corrupt_norm && item.name == "model.norm.weight") item.values[0] ^= std::byte{0x01};
    }
    for (Item& item : extra) items.push_back(std::move(item));
    std::vector<ItemView> views;
    for (const Item& item : items) views.push_back(item.view());
    auto bytes =
        EncodePayload(PayloadIds{id, 1, 4, plan->base_version, plan->target_version}, views);
    EXPECT_TRUE(bytes.ok()) << bytes.status().ToString();
    auto decoded = DecodePayload(*bytes);
    EXPECT_TRUE(decoded.ok()) << decoded.status().ToString();
    return std::move(decoded).ValueOrDie();
  }

  WeightStore& rank0() { return *group_.shards_[0]; }

  ShardGroup group_;
  std::vector<OwnedTensor> next_;
};

TEST_F(LoaderRefusalTest, UnknownTensorIsNotFoundAndNothingIsApplied) {
  const StoreSnapshot before = TakeSnapshot(rank0());
  const DecodedPayload payload = MakePayload({OverwriteItem("model.missing", {4})});
  internal::UndoLog undo;
  EXPECT_STATUS_MSG(NotFound,
                    "tensor 'model.missing' is neither in the receiver's store nor mapped",
                    internal::ApplyPayload(payload, rank0(), &undo));
  EXPECT_EQ(TakeSnapshot(rank0()), before);
  EXPECT_EQ(undo.records(), 0u);
}

TEST_F(LoaderRefusalTest, WrongCanonicalShapeOrDtypeNamesBoth) {
  const StoreSnapshot before = TakeSnapshot(rank0());
  internal::UndoLog undo;
  {
    const DecodedPayload payload =
        MakePayload({OverwriteItem(Layer(1, "self_attn.k_proj.weight"), {9, 16})});
    const Status status = internal::ApplyPayload(payload, rank0(), &undo);
    EXPECT_STATUS_MSG(InvalidArgument, "[9, 16]", status);
    EXPECT_STATUS_MSG(InvalidArgument, "[8, 16]", status);
    EXPECT_STATUS_MSG(InvalidArgument, "self_attn.k_proj.weight", status);
  }
  {
    const DecodedPayload payload =
        MakePayload({OverwriteItem(Layer(1, "mlp.up_proj.weight"), {24, 16}, DType::kFloat16)});
    const Status status = internal::ApplyPayload(payload, rank0(), &undo);
    EXPECT_STATUS_MSG(InvalidArgument, "is float16 [24, 16] in the payload", status);
    EXPECT_STATUS_MSG(InvalidArgument, "bfloat16 [24, 16] in the receiver's loader", status);
  }
  EXPECT_EQ(TakeSnapshot(rank0()), before);
  EXPECT_EQ(undo.records(), 0u);
}

TEST_F(LoaderRefusalTest, SkippedTensorsAreIgnored) {
  const StoreSnapshot before = TakeSnapshot(rank0());
  // Wrong shape too: a receiver that does not hold a tensor has no opinion about it.
  const DecodedPayload payload = MakePayload({OverwriteItem("model.rotary_emb.inv_freq", {5})});
  internal::UndoLog undo;
  ASSERT_OK(internal::ApplyPayload(payload, rank0(), &undo));
  EXPECT_NE(TakeSnapshot(rank0()), before);
  ASSERT_OK(undo.Rollback(rank0()));
  EXPECT_EQ(TakeSnapshot(rank0()), before);
}

TEST_F(LoaderRefusalTest, AWholeTensorNotAtBaseIsDetectedAndThePayloadUndone) {
  const DecodedPayload payload = MakePayload({});
  const std::vector<std::string> names = Names(group_.model_);
  // Diverge the receiver's norm (held whole, so the producer's item digest applies) at an element
  // the payload changes; q_proj, applied first, is sharded and cannot be checked alone.
  const auto next_norm = std::find_if(next_.begin(), next_.end(), [](const OwnedTensor& t) {
    return t.name == "model.norm.weight";
  });
  ASSERT_NE(next_norm, next_.end());
  const std::vector<std::byte> norm_bytes = testing::StoreBytes(rank0(), "model.norm.weight");
  size_t changed = 0;
  while (norm_bytes[changed] == next_norm->bytes[changed]) ++changed;
  ASSERT_OK(testing::FlipByte(rank0(), "model.norm.weight", changed));
  ASSERT_OK(
      rank0().SetDigest("model.norm.weight", rank0().RecomputeDigests().at("model.norm.weight")));
  ASSERT_OK_AND_ASSIGN(auto recomputed, rank0().RecomputeHoldings(names));
  ASSERT_OK(rank0().SetPieceDigest("model.norm.weight", 0,
                                   recomputed.at("model.norm.weight").pieces.begin()->second));
  const StoreSnapshot diverged = TakeSnapshot(rank0());
  ASSERT_OK_AND_ASSIGN(auto holdings_before, rank0().Holdings(names));
  EXPECT_EQ(holdings_before, recomputed);
  // With three threads q_proj (into the fused qkv_proj) and the norm apply at once; the norm's
  // failed check still undoes both.
  for (const int threads : {1, 3}) {
    SCOPED_TRACE(fmt::format("{} apply threads", threads));
    internal::UndoLog undo;
    EXPECT_STATUS_MSG(DataLoss, "differs from the producer's base",
                      internal::ApplyPayload(payload, rank0(), &undo, nullptr, threads));
    EXPECT_EQ(TakeSnapshot(rank0()), diverged);
    ASSERT_OK_AND_ASSIGN(auto holdings_after, rank0().Holdings(names));
    EXPECT_EQ(holdings_after, holdings_before);
    EXPECT_EQ(undo.records(), 0u);
  }
}

// An anchor through the loader: q_proj (into the fused qkv_proj) and the norm are copied at once
// on three threads; a FULL span of the norm (held whole, so its digest is checked) that does not
// match its digest fails the payload, and both tensors are put back from the log, in memory or
// in the spill file.
TEST_F(LoaderRefusalTest, AnAnchorWithACorruptSpanIsUndoneWhateverTheThreads) {
  const DecodedPayload good = MakePayload({}, /*anchor=*/true);
  const DecodedPayload corrupt = MakePayload({}, /*anchor=*/true, /*corrupt_norm=*/true);
  ASSERT_EQ(corrupt.items().size(), 2u);
  for (const ItemView& item : corrupt.items()) ASSERT_EQ(item.op, Op::kFull) << item.name;
  const StoreSnapshot before = TakeSnapshot(rank0());
  for (const AnchorUndo policy : {AnchorUndo::kMemory, AnchorUndo::kFile}) {
    for (const int threads : {1, 3}) {
      SCOPED_TRACE(fmt::format("{}, {} apply threads", AnchorUndoName(policy), threads));
      internal::UndoLog undo(internal::UndoLogOptions{.anchor_undo = policy});
      EXPECT_STATUS_MSG(DataLoss, "'model.norm.weight': span digest after apply",
                        internal::ApplyPayload(corrupt, rank0(), &undo, nullptr, threads));
      EXPECT_EQ(TakeSnapshot(rank0()), before);
      EXPECT_EQ(undo.records(), 0u);
      // The intact anchor applies, and is undone exactly.
      ASSERT_OK(internal::ApplyPayload(good, rank0(), &undo, nullptr, threads));
      EXPECT_NE(TakeSnapshot(rank0()), before);
      ASSERT_OK(undo.Rollback(rank0()));
      EXPECT_EQ(TakeSnapshot(rank0()), before);
    }
  }
}

// ---- Resolve errors ---------------------------------------------------------------------------

TEST(LoaderResolveTest, MissingLocalTensorsAndShapesThatDoNotDivideNameBoth) {
  auto store = WeightStore::Make();
  ASSERT_OK(store->AddCopy(RandomTensor("fused.qkv", DType::kBFloat16, {17, 4}, 1).view()));
  ASSERT_OK(store->AddCopy(RandomTensor("embed", DType::kBFloat16, {50, 4}, 2).view()));
  ASSERT_OK(store->AddCopy(RandomTensor("scalar", DType::kBFloat16, {}, 3).view()));
  LoaderSpec spec{0, 2, {}};
  spec.rules.push_back(
      LoaderRule{.kind = LoaderKind::kRow, .match = "w\\.(\\d+)", .to = "w$1.local"});
  spec.rules.push_back(LoaderRule{.kind = LoaderKind::kQkv,
                                  .to = "fused.qkv",
                                  .q = "q",
                                  .k = "k",
                                  .v = "v",
                                  .num_heads = 4,
                                  .num_kv_heads = 2});
  spec.rules.push_back(LoaderRule{.kind = LoaderKind::kVocab, .match = "embed", .vocab_size = 100});
  spec.rules.push_back(LoaderRule{.kind = LoaderKind::kColumn, .match = "scalar"});
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Loader> loader, Loader::Make(spec, *store));
  {
    const Status status = loader->Resolve("w.3").status();
    EXPECT_STATUS_MSG(NotFound, "tensor 'w.3'", status);
    EXPECT_STATUS_MSG(NotFound, "local tensor 'w3.local'", status);
  }
  {
    const Status status = loader->Resolve("k").status();
    EXPECT_STATUS_MSG(InvalidArgument, "tensor 'k'", status);
    EXPECT_STATUS_MSG(InvalidArgument, "'fused.qkv'", status);
    EXPECT_STATUS_MSG(InvalidArgument, "[17, 4]", status);
  }
  EXPECT_STATUS_MSG(InvalidArgument, "vocab_size 100", loader->Resolve("embed"));
  EXPECT_STATUS_MSG(InvalidArgument, "fewer than 2 dimensions", loader->Resolve("scalar"));
  EXPECT_STATUS_MSG(NotFound, "tensor 'nope' is neither in the receiver's store nor mapped",
                    loader->Resolve("nope"));
}

TEST(LoaderResolveTest, MakeRefusesSpecsThatCannotWork) {
  auto store = WeightStore::Make();
  EXPECT_STATUS_MSG(InvalidArgument, "tp_rank 2", Loader::Make(LoaderSpec{2, 2, {}}, *store));
  const auto make_one = [&](LoaderRule rule, uint32_t tp) {
    return Loader::Make(
               LoaderSpec{
                   0, tp, {LoaderRule{.kind = LoaderKind::kSkip, .match = "x"}, std::move(rule)}},
               *store)
        .status();
  };
  EXPECT_STATUS_MSG(InvalidArgument, "loader rule 1 (qkv): num_kv_heads",
                    make_one(LoaderRule{.kind = LoaderKind::kQkv,
                                        .to = "t",
                                        .q = "q",
                                        .k = "k",
                                        .v = "v",
                                        .num_heads = 12,
                                        .num_kv_heads = 3},
                             2));
  EXPECT_STATUS_MSG(InvalidArgument, "loader rule 1 (qkv): num_heads",
                    make_one(LoaderRule{.kind = LoaderKind::kQkv,
                                        .to = "t",
                                        .q = "q",
                                        .k = "k",
                                        .v = "v",
                                        .num_heads = 6,
                                        .num_kv_heads = 2},
                             4));
  EXPECT_STATUS_MSG(InvalidArgument, "loader rule 1 (row): match",
                    make_one(LoaderRule{.kind = LoaderKind::kRow, .match = "(unclosed"}, 2));
  EXPECT_STATUS_MSG(InvalidArgument, "loader rule 1 (gate_up): to",
                    make_one(LoaderRule{.kind = LoaderKind::kGateUp, .gate = "g", .up = "u"}, 2));
}

// ---- Store integration without or with a loader ----------------------------------------------

TEST(LoaderStoreTest, HoldingsWithoutALoaderAreOneWholePiece) {
  auto store = WeightStore::Make();
  const OwnedTensor w = RandomTensor("w", DType::kFloat32, {10}, 1);
  ASSERT_OK(store->AddCopy(w.view()));
  const std::vector<std::string> names = {"w"};
  ASSERT_OK_AND_ASSIGN(auto holdings, store->Holdings(names));
  EXPECT_EQ(holdings.at("w"), (CanonicalHolding{false, {{"", TensorDigest(w.view())}}}));
  const std::vector<std::string> missing = {"w", "v"};
  EXPECT_STATUS_MSG(NotFound, "'v'", store->Holdings(missing));
  EXPECT_FALSE(store->has_loader());
  EXPECT_EQ(store->loader(), nullptr);
}

TEST(LoaderStoreTest, AttachLoaderChecksItsStore) {
  auto store = WeightStore::Make();
  auto other = WeightStore::Make();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Loader> foreign, Loader::Make(LoaderSpec{}, *other));
  EXPECT_STATUS(InvalidArgument, store->AttachLoader(std::move(foreign)));
  EXPECT_STATUS(InvalidArgument, store->AttachLoader(nullptr));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Loader> first, Loader::Make(LoaderSpec{}, *store));
  const Loader* attached = first.get();
  ASSERT_OK(store->AttachLoader(std::move(first)));
  EXPECT_TRUE(store->has_loader());
  EXPECT_EQ(store->loader(), attached);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Loader> second, Loader::Make(LoaderSpec{}, *store));
  EXPECT_STATUS(FailedPrecondition, store->AttachLoader(std::move(second)));
}

// ---- YAML -------------------------------------------------------------------------------------

TEST(LoaderYamlTest, ParsesEveryKindAndItsParameters) {
  ASSERT_OK_AND_ASSIGN(LoaderSpec spec, LoaderSpecFromYaml(LoaderYaml(3, 4), "loader.yaml"));
  EXPECT_EQ(spec.tp_rank, 3u);
  EXPECT_EQ(spec.tp_size, 4u);
  ASSERT_EQ(spec.rules.size(), 8u);
  EXPECT_EQ(spec.rules[0].kind, LoaderKind::kSkip);
  EXPECT_EQ(spec.rules[1].kind, LoaderKind::kQkv);
  EXPECT_EQ(spec.rules[1].q, "model\\.layers\\.(\\d+)\\.self_attn\\.q_proj\\.(weight|bias)");
  EXPECT_EQ(spec.rules[1].to, "model.layers.$1.self_attn.qkv_proj.$2");
  EXPECT_EQ(spec.rules[1].num_heads, 8u);
  EXPECT_EQ(spec.rules[1].num_kv_heads, 2u);
  EXPECT_EQ(spec.rules[2].kind, LoaderKind::kGateUp);
  EXPECT_EQ(spec.rules[3].kind, LoaderKind::kColumn);
  EXPECT_EQ(spec.rules[4].kind, LoaderKind::kRow);
  EXPECT_EQ(spec.rules[5].kind, LoaderKind::kVocab);
  EXPECT_EQ(spec.rules[5].vocab_size, 100u);
  EXPECT_EQ(spec.rules[5].pad_to, 8u);
  EXPECT_EQ(spec.rules[6].kind, LoaderKind::kRename);
  EXPECT_EQ(spec.rules[7].to, "b✓$1 w");
  ASSERT_OK_AND_ASSIGN(LoaderSpec empty, LoaderSpecFromYaml("", "empty.yaml"));
  EXPECT_EQ(empty.tp_size, 1u);
  EXPECT_TRUE(empty.rules.empty());
}

TEST(LoaderYamlTest, ErrorsNameTheFileTheRuleAndTheKey) {
  const std::string rule0 = "tp_size: 2\nrules:\n  - {kind: skip, match: 'a'}\n";
  struct Case {
    std::string yaml;
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {rule0 + "  - {kind: row, match: 'b', bogus: 1}\n", {"rules[1].bogus", "unknown key"}},
      {rule0 + "  - {kind: row, match: 'b', num_heads: 8}\n",
       {"rules[1].num_heads", "does not apply to a row rule"}},
      {rule0 + "  - {kind: skip, match: 'b', to: 'c'}\n",
       {"rules[1].to", "does not apply to a skip rule"}},
      {rule0 + "  - {kind: qkv, q: a, k: b, v: c, to: t, num_heads: eight, num_kv_heads: 2}\n",
       {"rules[1].num_heads", "'eight'"}},
      {rule0 + "  - {kind: vocab, match: e, vocab_size: -5}\n", {"rules[1].vocab_size", "'-5'"}},
      {rule0 + "  - {kind: diagonal, match: 'b'}\n", {"rules[1].kind", "'diagonal'"}},
      {rule0 + "  - {match: 'b'}\n", {"rules[1].kind", "missing"}},
      {rule0 + "  - {kind: row, match: '(unclosed'}\n", {"rules[1].match", "regular expression"}},
      // libstdc++'s std::regex overflows a long on these (UBSan; loader_yaml_fuzz found it).
      {rule0 + "  - {kind: row, match: '(a)\\11111111111'}\n",
       {"rules[1].match", "more than 9 digits at offset 4"}},
      {rule0 + "  - {kind: row, match: 'a{12345678901}'}\n",
       {"rules[1].match", "more than 9 digits"}},
      {rule0 + "  - {kind: rename, match: 'b'}\n", {"rules[1].to"}},
      {rule0 + "  - {kind: row, match: 'b', match: 'c'}\n", {"rules[1].match", "duplicate"}},
      {rule0 + "  - {kind: row, match: [b]}\n", {"rules[1].match", "scalar"}},
      {rule0 + "  - just text\n", {"rules[1]", "mapping"}},
      {"rules:\n  - {kind: skip, match: 'a'}\n  - {kind: qkv, q: a, k: b, v: c, to: t, "
       "num_heads: 8, num_kv_heads: 2}\ntp_size: 3\n",
       {"rules[1].num_heads", "tp_size 3"}},
      {"tp_size: 2\ntp_rank: 2\n", {"tp_rank", "not below tp_size 2"}},
      {"tp_ranks: 1\n", {"tp_ranks", "unknown key"}},
      {"tp_size: 0\n", {"tp_size", "outside"}},
      {"rules: {kind: row}\n", {"rules", "sequence"}},
      {"- 1\n- 2\n", {"mapping"}},
      {"rules: [ {kind: row\n", {"YAML syntax error"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.yaml);
    const Status status = LoaderSpecFromYaml(c.yaml, "conf/loader.yaml").status();
    EXPECT_STATUS_MSG(InvalidArgument, "conf/loader.yaml", status);
    for (const std::string& part : c.expected) EXPECT_STATUS_MSG(InvalidArgument, part, status);
  }
  // Positions are 1-based line:column of the key.
  EXPECT_STATUS_MSG(InvalidArgument, "conf/loader.yaml:4:29: rules[1].bogus",
                    LoaderSpecFromYaml(cases[0].yaml, "conf/loader.yaml"));
}

TEST(LoaderYamlTest, ReadsAFile) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / fmt::format("refit_loader_test_{}", ::getpid());
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "loader.yaml").string();
  {
    std::ofstream out(path);
    out << LoaderYaml(1, 2);
  }
  ASSERT_OK_AND_ASSIGN(LoaderSpec spec, LoaderSpecFromYamlFile(path));
  EXPECT_EQ(spec.tp_rank, 1u);
  EXPECT_EQ(spec.rules.size(), 8u);
  {
    std::ofstream out(path);
    out << "tp_size: 2\nrules:\n  - {kind: row, match: 'b', bogus: 1}\n";
  }
  EXPECT_STATUS_MSG(InvalidArgument, path + ":3:", LoaderSpecFromYamlFile(path));
  EXPECT_STATUS_MSG(NotFound, "missing.yaml",
                    LoaderSpecFromYamlFile((dir / "missing.yaml").string()));
  std::filesystem::remove_all(dir);
}

// ---- Producer layouts from the same vocabulary ------------------------------------------------

std::vector<TensorView> Views(const std::map<std::string, OwnedTensor>& tensors) {
  std::vector<TensorView> views;
  for (const auto& [name, t] : tensors) views.push_back(t.view());
  return views;
}

std::map<std::string, const OwnedTensor*> ByName(const std::vector<OwnedTensor>& tensors) {
  std::map<std::string, const OwnedTensor*> out;
  for (const OwnedTensor& t : tensors) out[t.name] = &t;
  return out;
}

std::map<std::string, const OwnedTensor*> ByName(
    const std::map<std::string, OwnedTensor>& tensors) {
  std::map<std::string, const OwnedTensor*> out;
  for (const auto& [name, t] : tensors) out[name] = &t;
  return out;
}

// A trainer rank holding the receiver's layout (the same slicer) states it as the same loader
// spec: every piece reads its canonical box from the local tensors, and the ranks' layouts tile
// the model (skip rules aside), with replicated kv heads and norms planned as copies.
TEST(ProducerLayoutFromLoaderTest, ARankInAReceiverLayoutReadsItsBoxesAndTheRanksTileTheModel) {
  const std::vector<OwnedTensor> model = CanonicalModel();
  for (uint32_t tp : {1u, 2u, 4u}) {
    std::vector<ProducerLayout> layouts;
    for (uint32_t rank = 0; rank < tp; ++rank) {
      const std::map<std::string, OwnedTensor> shard = SliceShard(model, rank, tp);
      ASSERT_OK_AND_ASSIGN(LoaderSpec spec, LoaderSpecFromYaml(LoaderYaml(rank, tp), "l.yaml"));
      ASSERT_OK_AND_ASSIGN(ProducerLayout layout,
                           ProducerLayoutFromLoader(spec, Views(shard), Names(model)));
      const std::string where = fmt::format("TP {} rank {}", tp, rank);
      testing::ExpectPiecesReadTheirBoxes(layout, ByName(model), ByName(shard), where);
      for (const LayoutPiece& piece : layout.pieces) {
        EXPECT_NE(piece.tensor, "model.rotary_emb.inv_freq") << "a skipped tensor has a piece";
      }
      layouts.push_back(std::move(layout));
    }
    ASSERT_OK_AND_ASSIGN(LayoutPlan plan, PlanLayouts(layouts));
    EXPECT_EQ(plan.tensors.size(), model.size() - 1) << "TP " << tp;
    // With 2 kv heads on 4 ranks, ranks 0 and 1 hold kv head 0: one sends, the other copies.
    if (tp == 4) {
      bool copies = false;
      for (const PlannedTensor& t : plan.tensors) {
        if (t.name == Layer(0, "self_attn.k_proj.weight")) {
          for (const PlannedBox& box : t.boxes) copies |= box.copies == std::vector<uint32_t>{1};
        }
      }
      EXPECT_TRUE(copies) << "the replicated kv head is not planned as a copy";
    }
  }
}

/// Megatron-Core's linear_qkv of `layer`, rank `rank` of `tp`, sliced by plain loops: each of
/// the rank's query groups as [its q heads | its k head | its v head].
OwnedTensor MegatronQkv(const std::vector<OwnedTensor>& model, int layer, const std::string& suffix,
                        uint32_t rank, uint32_t tp) {
  const auto by_name = ByName(model);
  const int64_t groups = kKvHeads / tp;
  const int64_t q_per_group = kHeads / kKvHeads;
  std::vector<uint16_t> bits;
  for (int64_t g = rank * groups; g < (rank + 1) * groups; ++g) {
    AppendRows(*by_name.at(Layer(layer, "self_attn.q_proj." + suffix)), g * q_per_group * kHeadDim,
               q_per_group * kHeadDim, &bits);
    AppendRows(*by_name.at(Layer(layer, "self_attn.k_proj." + suffix)), g * kHeadDim, kHeadDim,
               &bits);
    AppendRows(*by_name.at(Layer(layer, "self_attn.v_proj." + suffix)), g * kHeadDim, kHeadDim,
               &bits);
  }
  const int64_t rows = groups * (q_per_group + 2) * kHeadDim;
  return Local(fmt::format("decoder.layers.{}.self_attention.linear_qkv.{}", layer, suffix),
               suffix == "weight" ? Shape{rows, kHidden} : Shape{rows}, bits);
}

LoaderSpec MegatronQkvSpec(uint32_t rank, uint32_t tp) {
  return LoaderSpec{rank,
                    tp,
                    {LoaderRule{.kind = LoaderKind::kQkvInterleaved,
                                .to = "decoder.layers.$1.self_attention.linear_qkv.$2",
                                .q = R"(model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias))",
                                .k = R"(model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias))",
                                .v = R"(model\.layers\.(\d+)\.self_attn\.v_proj\.(weight|bias))",
                                .num_heads = kHeads,
                                .num_kv_heads = kKvHeads}}};
}

TEST(ProducerLayoutFromLoaderTest, MegatronInterleavedQkvIsOnePiecePerQueryGroupAndTilesQKAndV) {
  const std::vector<OwnedTensor> model = CanonicalModel();
  std::vector<std::string> names;
  for (const char* part : {"q", "k", "v"}) {
    names.push_back(Layer(0, fmt::format("self_attn.{}_proj.weight", part)));
    names.push_back(Layer(0, fmt::format("self_attn.{}_proj.bias", part)));
    names.push_back(Layer(1, fmt::format("self_attn.{}_proj.weight", part)));
  }
  for (uint32_t tp : {1u, 2u}) {
    std::vector<ProducerLayout> layouts;
    for (uint32_t rank = 0; rank < tp; ++rank) {
      std::map<std::string, OwnedTensor> shard;
      for (OwnedTensor t :
           {MegatronQkv(model, 0, "weight", rank, tp), MegatronQkv(model, 0, "bias", rank, tp),
            MegatronQkv(model, 1, "weight", rank, tp)}) {
        shard[t.name] = std::move(t);
      }
      ASSERT_OK_AND_ASSIGN(
          ProducerLayout layout,
          ProducerLayoutFromLoader(MegatronQkvSpec(rank, tp), Views(shard), names));
      // Per tensor one piece per query group the rank holds.
      EXPECT_EQ(layout.pieces.size(), names.size() * (kKvHeads / tp));
      testing::ExpectPiecesReadTheirBoxes(layout, ByName(model), ByName(shard),
                                          fmt::format("TP {} rank {}", tp, rank));
      layouts.push_back(std::move(layout));
    }
    ASSERT_OK_AND_ASSIGN(LayoutPlan plan, PlanLayouts(layouts));
    EXPECT_EQ(plan.tensors.size(), names.size());
  }
  // Megatron-Core splits whole query groups: 2 groups cannot go to 4 ranks.
  const std::unique_ptr<WeightStore> store = WeightStore::Make();
  EXPECT_STATUS_MSG(InvalidArgument, "qkv_interleaved",
                    Loader::Make(MegatronQkvSpec(0, 4), *store));
  EXPECT_STATUS_MSG(InvalidArgument, "whole query groups",
                    Loader::Make(MegatronQkvSpec(0, 4), *store));
}

TEST(ProducerLayoutFromLoaderTest, ALocalNoNameMapsOntoOrANameNoLocalHoldsIsNamed) {
  const std::vector<OwnedTensor> model = CanonicalModel();
  const std::map<std::string, OwnedTensor> shard = SliceShard(model, 0, 2);
  ASSERT_OK_AND_ASSIGN(LoaderSpec spec, LoaderSpecFromYaml(LoaderYaml(0, 2), "l.yaml"));
  // Without lm_head's name, its local tensor holds no piece.
  std::vector<std::string> names = Names(model);
  std::erase(names, "lm_head.weight");
  const Status missing = ProducerLayoutFromLoader(spec, Views(shard), names).status();
  EXPECT_STATUS_MSG(InvalidArgument, "local tensor 'lm_head.weight'", missing);
  EXPECT_STATUS_MSG(InvalidArgument, "holds no piece", missing);
  // A name the rank does not hold.
  names = Names(model);
  names.push_back("model.layers.7.mlp.gate_proj.weight");
  EXPECT_STATUS_MSG(NotFound, "model.layers.7.mlp.gate_proj.weight",
                    ProducerLayoutFromLoader(spec, Views(shard), names));
  EXPECT_STATUS_MSG(NotFound, "the rank's local tensors",
                    ProducerLayoutFromLoader(spec, Views(shard), names));
  // A name twice.
  names = Names(model);
  names.push_back(names.front());
  EXPECT_STATUS_MSG(InvalidArgument, "named twice",
                    ProducerLayoutFromLoader(spec, Views(shard), names));
}

}  // namespace
}  // namespace refit
