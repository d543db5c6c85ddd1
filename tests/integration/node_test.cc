// ReceiverNode and Publisher embedded in one process, over real loopback sockets (zmq:// data
// plane, HTTP control planes): receivers over caller-registered buffers (zero-copy), the engine
// hooks, W publisher ranks as threads, and tensor-parallel shard groups whose every shard must
// equal the slice of the trainer's canonical tensor, computed here independently of the loader.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/ranges.h>

#include "loopback.h"
#include "refit/loader.h"
#include "refit/loader_layout.h"
#include "refit/producer_group.h"
#include "refit/producer_layout.h"
#include "refit/publisher.h"
#include "refit/receiver_node.h"
#include "test_util.h"

namespace refit {
namespace {

// A small Llama-like layer: hidden 32, 8 attention heads of 4, 2 kv heads (GQA), MLP 64,
// vocabulary 100 (not a multiple of the padded per-rank block).
constexpr uint64_t kHidden = 32;
constexpr uint64_t kHeads = 8;
constexpr uint64_t kKvHeads = 2;
constexpr uint64_t kHeadDim = kHidden / kHeads;
constexpr uint64_t kMlp = 64;
constexpr uint64_t kVocab = 100;
constexpr uint64_t kPadTo = 8;

// A canonical bf16 tensor as the trainer holds it (bit patterns).
struct Canonical {
  std::string name;
  uint64_t rows = 0;
  uint64_t cols = 0;
  std::vector<uint16_t> bits;

  TensorView view() const {
    Shape shape = cols == 1 ? Shape{static_cast<int64_t>(rows)}
                            : Shape{static_cast<int64_t>(rows), static_cast<int64_t>(cols)};
    return TensorView{name, DType::kBFloat16, shape,
                      std::as_bytes(std::span<const uint16_t>(bits))};
  }
  uint16_t at(uint64_t r, uint64_t c) const { return bits[r * cols + c]; }
};

std::vector<Canonical> MakeModel(uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto tensor = [&](std::string name, uint64_t rows, uint64_t cols) {
    Canonical t{std::move(name), rows, cols, std::vector<uint16_t>(rows * cols)};
    // bf16 weights around ±0.02: sign, exponent 0x79–0x7a, random mantissa.
    for (uint16_t& b : t.bits) {
      b = static_cast<uint16_t>(((rng() & 1) << 15) | (0x3c80 + (rng() % 0x100)));
    }
    return t;
  };
  return {tensor("model.embed_tokens.weight", kVocab, kHidden),
          tensor("model.layers.0.input_layernorm.weight", kHidden, 1),
          tensor("model.layers.0.self_attn.q_proj.weight", kHeads * kHeadDim, kHidden),
          tensor("model.layers.0.self_attn.k_proj.weight", kKvHeads * kHeadDim, kHidden),
          tensor("model.layers.0.self_attn.v_proj.weight", kKvHeads * kHeadDim, kHidden),
          tensor("model.layers.0.self_attn.o_proj.weight", kHidden, kHidden),
          tensor("model.layers.0.mlp.gate_proj.weight", kMlp, kHidden),
          tensor("model.layers.0.mlp.up_proj.weight", kMlp, kHidden),
          tensor("model.layers.0.mlp.down_proj.weight", kHidden, kMlp),
          tensor("lm_head.weight", kVocab, kHidden)};
}

// One optimizer step as bf16 sees it: a few percent of elements move by one ulp.
void Step(std::vector<Canonical>& model, std::mt19937_64& rng, double fraction) {
  std::bernoulli_distribution changes(fraction);
  for (Canonical& t : model) {
    for (uint16_t& b : t.bits) {
      if (changes(rng)) b = static_cast<uint16_t>(b ^ 1);
    }
  }
}

std::vector<TensorView> Views(const std::vector<Canonical>& model) {
  std::vector<TensorView> views;
  for (const Canonical& t : model) views.push_back(t.view());
  return views;
}

template <typename Model>
auto& Find(Model& model, std::string_view name) {
  for (auto& t : model) {
    if (t.name == name) return t;
  }
  ADD_FAILURE() << "no tensor " << name;
  return model.front();
}

// ---- The reference slicing: what TP rank r of `tp` must hold, by plain loops. ----------------

std::vector<uint16_t> Rows(const Canonical& t, uint64_t begin, uint64_t end) {
  std::vector<uint16_t> out;
  for (uint64_t r = begin; r < end; ++r) {
    for (uint64_t c = 0; c < t.cols; ++c) out.push_back(t.at(r, c));
  }
  return out;
}

std::vector<uint16_t> Columns(const Canonical& t, uint64_t begin, uint64_t end) {
  std::vector<uint16_t> out;
  for (uint64_t r = 0; r < t.rows; ++r) {
    for (uint64_t c = begin; c < end; ++c) out.push_back(t.at(r, c));
  }
  return out;
}

void Append(std::vector<uint16_t>& to, const std::vector<uint16_t>& from) {
  to.insert(to.end(), from.begin(), from.end());
}

// Local tensors of rank r: name → (rows, cols, bits).
struct Local {
  uint64_t rows = 0;
  uint64_t cols = 0;
  std::vector<uint16_t> bits;
};

uint64_t PaddedVocab(uint64_t tp) {
  const uint64_t multiple = kPadTo * tp;
  return (kVocab + multiple - 1) / multiple * multiple;
}

std::map<std::string, Local> ShardOf(const std::vector<Canonical>& model, uint64_t r, uint64_t tp) {
  std::map<std::string, Local> local;
  const std::string attn = "model.layers.0.self_attn.";
  const std::string mlp = "model.layers.0.mlp.";
  // Fused qkv: this rank's q heads, then its kv head(s) of k and of v.
  const uint64_t q_heads = kHeads / tp;
  const uint64_t kv_heads = kKvHeads >= tp ? kKvHeads / tp : 1;
  const uint64_t kv_first = kKvHeads >= tp ? r * kv_heads : r / (tp / kKvHeads);
  Local& qkv = local[attn + "qkv_proj.weight"];
  Append(qkv.bits, Rows(Find(model, attn + "q_proj.weight"), r * q_heads * kHeadDim,
                        (r + 1) * q_heads * kHeadDim));
  for (const char* part : {"k_proj.weight", "v_proj.weight"}) {
    Append(qkv.bits,
           Rows(Find(model, attn + part), kv_first * kHeadDim, (kv_first + kv_heads) * kHeadDim));
  }
  qkv.cols = kHidden;
  qkv.rows = qkv.bits.size() / kHidden;
  Local& gate_up = local[mlp + "gate_up_proj.weight"];
  for (const char* part : {"gate_proj.weight", "up_proj.weight"}) {
    Append(gate_up.bits, Rows(Find(model, mlp + part), r * kMlp / tp, (r + 1) * kMlp / tp));
  }
  gate_up.cols = kHidden;
  gate_up.rows = 2 * kMlp / tp;
  local[attn + "o_proj.weight"] = {
      kHidden, kHidden / tp,
      Columns(Find(model, attn + "o_proj.weight"), r * kHidden / tp, (r + 1) * kHidden / tp)};
  local[mlp + "down_proj.weight"] = {
      kHidden, kMlp / tp,
      Columns(Find(model, mlp + "down_proj.weight"), r * kMlp / tp, (r + 1) * kMlp / tp)};
  // Vocabulary-parallel, padded: rows past the vocabulary are padding, left as the engine set
  // them (0xFFFF here, so a write into them shows).
  const uint64_t block = PaddedVocab(tp) / tp;
  for (const char* name : {"model.embed_tokens.weight", "lm_head.weight"}) {
    Local& shard = local[name];
    shard.rows = block;
    shard.cols = kHidden;
    shard.bits.assign(block * kHidden, 0xFFFF);
    const Canonical& t = Find(model, name);
    for (uint64_t row = r * block; row < std::min((r + 1) * block, kVocab); ++row) {
      for (uint64_t c = 0; c < kHidden; ++c)
        shard.bits[(row - r * block) * kHidden + c] = t.at(row, c);
    }
  }
  const Canonical& norm = Find(model, "model.layers.0.input_layernorm.weight");
  local[norm.name] = {kHidden, 1, norm.bits};
  return local;
}

LoaderSpec TpLoader(uint32_t rank, uint32_t tp) {
  LoaderSpec spec;
  spec.tp_rank = rank;
  spec.tp_size = tp;
  const std::string layer = R"(model\.layers\.(\d+)\.)";
  spec.rules = {
      {.kind = LoaderKind::kQkv,
       .to = "model.layers.$1.self_attn.qkv_proj.weight",
       .q = layer + R"(self_attn\.q_proj\.weight)",
       .k = layer + R"(self_attn\.k_proj\.weight)",
       .v = layer + R"(self_attn\.v_proj\.weight)",
       .num_heads = kHeads,
       .num_kv_heads = kKvHeads},
      {.kind = LoaderKind::kGateUp,
       .to = "model.layers.$1.mlp.gate_up_proj.weight",
       .gate = layer + R"(mlp\.gate_proj\.weight)",
       .up = layer + R"(mlp\.up_proj\.weight)"},
      {.kind = LoaderKind::kColumn,
       .match = layer + R"((self_attn\.o_proj|mlp\.down_proj)\.weight)"},
      {.kind = LoaderKind::kVocab,
       .match = R"(model\.embed_tokens\.weight|lm_head\.weight)",
       .vocab_size = kVocab,
       .pad_to = kPadTo},
  };
  return spec;
}

// A receiver embedded in this process, over buffers it owns the way an engine owns its
// parameters.
struct EmbeddedReceiver {
  std::map<std::string, Local> buffers;
  std::unique_ptr<ReceiverNode> node;
  std::vector<std::string> hooks;
  std::mutex hooks_mutex;
};

std::unique_ptr<EmbeddedReceiver> StartReceiver(std::map<std::string, Local> buffers,
                                                std::optional<LoaderSpec> loader,
                                                std::string replica, const std::string& endpoint,
                                                const std::vector<std::string>& peers) {
  auto receiver = std::make_unique<EmbeddedReceiver>();
  receiver->buffers = std::move(buffers);
  ReceiverNodeOptions options;
  options.loader = std::move(loader);
  options.place.replica = std::move(replica);
  options.transport_uri = "zmq://?timeout_ms=10000";
  options.data_endpoint = endpoint;
  options.peers = peers;
  EmbeddedReceiver* raw = receiver.get();
  auto record = [raw](std::string event) {
    std::lock_guard lock(raw->hooks_mutex);
    raw->hooks.push_back(std::move(event));
  };
  options.session.before_first_apply = [record](const TransferId&) { record("pause"); };
  options.session.after_commit = [record](const TransferId&, uint64_t version) {
    record("commit " + std::to_string(version));
  };
  options.session.after_abort = [record](const TransferId&, uint64_t version) {
    record("abort " + std::to_string(version));
  };
  Result<std::unique_ptr<ReceiverNode>> node = ReceiverNode::Make(options);
  EXPECT_TRUE(node.ok()) << node.status().ToString();
  receiver->node = std::move(node).ValueOrDie();
  for (auto& [name, local] : receiver->buffers) {
    Shape shape = local.cols == 1
                      ? Shape{static_cast<int64_t>(local.rows)}
                      : Shape{static_cast<int64_t>(local.rows), static_cast<int64_t>(local.cols)};
    EXPECT_OK(receiver->node->RegisterTensor(MutableTensorView{
        name, DType::kBFloat16, shape, std::as_writable_bytes(std::span<uint16_t>(local.bits))}));
  }
  EXPECT_OK(receiver->node->Start());
  return receiver;
}

std::map<std::string, Local> Unsharded(const std::vector<Canonical>& model) {
  std::map<std::string, Local> local;
  for (const Canonical& t : model) local[t.name] = {t.rows, t.cols, t.bits};
  return local;
}

// Sync on every rank at once (SPMD); return rank 0's result.
Result<SyncReport> SyncAll(std::vector<std::unique_ptr<Publisher>>& ranks,
                           const std::vector<Canonical>& model, bool anchor = false) {
  std::vector<Result<SyncReport>> results(ranks.size(), Status(StatusCode::kInternal, "unset"));
  {
    std::vector<std::jthread> threads;
    for (size_t p = 1; p < ranks.size(); ++p) {
      threads.emplace_back([&, p] { results[p] = ranks[p]->Sync(Views(model), anchor); });
    }
    results[0] = ranks[0]->Sync(Views(model), anchor);
  }
  return std::move(results[0]);
}

std::vector<std::unique_ptr<Publisher>> MakeRanks(uint32_t world,
                                                  const std::vector<EmbeddedReceiver*>& fleet,
                                                  uint64_t chunk_bytes) {
  PublisherOptions options;
  options.transport_uri = "zmq://?timeout_ms=10000";
  options.stream.chunk_bytes = chunk_bytes;
  options.stream.encode_threads = 2;
  options.stream.serialize_threads = 1;
  options.stream.send_threads = 2;
  options.transfer_timeout = std::chrono::seconds(60);
  for (EmbeddedReceiver* receiver : fleet) {
    options.receivers.push_back(
        {receiver->node->control_url(), receiver->node->producer_endpoint()});
  }
  Result<std::vector<std::unique_ptr<ProducerGroup>>> groups = MakeInProcessGroup(world);
  EXPECT_TRUE(groups.ok()) << groups.status().ToString();
  std::vector<std::unique_ptr<Publisher>> ranks;
  for (std::unique_ptr<ProducerGroup>& group : *groups) {
    Result<std::unique_ptr<Publisher>> made = Publisher::Make(options, std::move(group));
    EXPECT_TRUE(made.ok()) << made.status().ToString();
    ranks.push_back(std::move(made).ValueOrDie());
  }
  return ranks;
}

void ExpectHolds(const EmbeddedReceiver& receiver, const std::map<std::string, Local>& want,
                 const std::string& who) {
  for (const auto& [name, local] : want) {
    const Local& held = receiver.buffers.at(name);
    ASSERT_EQ(held.bits.size(), local.bits.size()) << who << " " << name;
    EXPECT_TRUE(held.bits == local.bits) << who << ": tensor '" << name << "' differs";
  }
}

TEST(ReceiverNodeTest, AppliesIntoCallerRegisteredBuffersAndCallsTheEngineHooks) {
  std::vector<Canonical> model = MakeModel(1);
  const std::string endpoint = testing::FreeLoopbackEndpoint();
  std::unique_ptr<EmbeddedReceiver> receiver =
      StartReceiver(Unsharded(model), std::nullopt, "", endpoint, {endpoint});
  // The addresses the engine registered: refit must write there and nowhere else.
  std::map<std::string, const void*> addresses;
  for (const auto& [name, local] : receiver->buffers) addresses[name] = local.bits.data();
  for (const TensorView& held : receiver->node->store().tensors()) {
    EXPECT_EQ(static_cast<const void*>(held.bytes.data()), addresses.at(held.name))
        << "the store holds a copy of '" << held.name << "'";
  }
  std::vector<std::unique_ptr<Publisher>> ranks = MakeRanks(1, {receiver.get()}, 4096);
  ASSERT_OK(ranks[0]->AdoptBaseline(Views(model), 0));
  std::mt19937_64 rng(7);
  for (int step = 1; step <= 3; ++step) {
    Step(model, rng, 0.03);
    ASSERT_OK_AND_ASSIGN(SyncReport report, SyncAll(ranks, model));
    EXPECT_FALSE(report.transfer.plan.anchor);
    EXPECT_EQ(report.transfer.plan.target_version, static_cast<uint64_t>(step));
    ExpectHolds(*receiver, Unsharded(model), "receiver");
  }
  for (const auto& [name, local] : receiver->buffers) {
    EXPECT_EQ(static_cast<const void*>(local.bits.data()), addresses.at(name));
  }
  std::lock_guard lock(receiver->hooks_mutex);
  EXPECT_EQ(receiver->hooks, (std::vector<std::string>{"pause", "commit 1", "pause", "commit 2",
                                                       "pause", "commit 3"}));
}

// Issue 26, finding 4: the payload limit defaults to what producers send for this model, not
// 4 GiB: twice the larger of the bucket and the largest canonical tensor, at least 256 MiB.
TEST(ReceiverNodeTest, ThePayloadLimitDefaultsToWhatProducersSendForTheModel) {
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  std::vector<std::byte> big(40 * kMiB);
  std::vector<std::byte> small(4 * kMiB);
  const auto make_store = [&] {
    std::unique_ptr<WeightStore> store = WeightStore::Make();
    EXPECT_OK(store->AddExternal(
        MutableTensorView{"lm_head.weight", DType::kBFloat16, {20 * kMiB}, big}));
    EXPECT_OK(store->AddExternal(
        MutableTensorView{"layers.0.mlp.experts.w13", DType::kBFloat16, {2 * kMiB}, small}));
    return store;
  };
  std::unique_ptr<WeightStore> store = make_store();
  // A small model: the floor.
  EXPECT_EQ(DefaultMaxPayloadBytes(*store, kDefaultBucketBytes), kMinDefaultMaxPayloadBytes);
  // A bucket of 512 MiB: two buckets' worth.
  EXPECT_EQ(DefaultMaxPayloadBytes(*store, 512 * kMiB), 1024 * kMiB);
  // A TP = 8 shard of a 320 MiB canonical head, with experts 2 of 16 per stack: the largest
  // local tensor scaled by 8 × 8.
  LoaderSpec spec{.tp_rank = 0,
                  .tp_size = 8,
                  .rules = {{.kind = LoaderKind::kRow, .match = "lm_head\\.weight"},
                            {.kind = LoaderKind::kStackedGateUp,
                             .match = "layers\\.0\\.mlp\\.experts\\.gate_up_proj",
                             .to = "layers.0.mlp.experts.w13",
                             .num_experts = 16,
                             .experts = {0, 1}}}};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Loader> loader, Loader::Make(spec, *store));
  ASSERT_OK(store->AttachLoader(std::move(loader)));
  EXPECT_EQ(DefaultMaxPayloadBytes(*store, kDefaultBucketBytes), 2 * 40 * kMiB * 8 * 8);

  // The node takes the default at Start, and an explicit limit when one is given.
  for (const std::optional<uint64_t> given : {std::optional<uint64_t>(), std::optional(kMiB)}) {
    ReceiverNodeOptions options;
    options.data_endpoint = testing::FreeLoopbackEndpoint();
    options.max_payload_bytes = given;
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ReceiverNode> node, ReceiverNode::Make(options));
    for (const TensorView& tensor : make_store()->tensors()) {
      ASSERT_OK(node->RegisterTensor(
          MutableTensorView{tensor.name, tensor.dtype, tensor.shape,
                            std::span<std::byte>(tensor.name == "lm_head.weight" ? big : small)}));
    }
    ASSERT_OK(node->Start());
    EXPECT_EQ(node->max_payload_bytes(), given.value_or(kMinDefaultMaxPayloadBytes));
    EXPECT_EQ(node->options().session.limits.max_body_bytes, node->max_payload_bytes());
    EXPECT_EQ(node->options().control.max_request_bytes, node->max_payload_bytes());
  }
}

TEST(PublisherTest, AGroupMessageWithAWronglyTypedFieldIsRefusedNotACrash) {
  // Rank 0 is a bare group endpoint speaking malformed messages; rank 1 a real Publisher.
  ASSERT_OK_AND_ASSIGN(std::vector<std::unique_ptr<ProducerGroup>> groups, MakeInProcessGroup(2));
  std::unique_ptr<ProducerGroup> leader = std::move(groups[0]);
  PublisherOptions options;
  options.transfer_timeout = std::chrono::seconds(20);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Publisher> follower,
                       Publisher::Make(options, std::move(groups[1])));
  std::vector<Canonical> model = MakeModel(3);
  for (const std::string bad : {R"({"protocol":"1"})", R"({"protocol":1,"op":5})",
                                R"({"protocol":1,"op":"begin","endpoints":[1]})",
                                R"({"protocol":1,"op":"stream","report":{"payloads":-1}})"}) {
    Result<SyncReport> synced = Status(StatusCode::kInternal, "not run");
    std::thread rank1([&] { synced = follower->Sync(Views(model)); });
    const auto deadline = GroupClock::now() + std::chrono::seconds(20);
    ASSERT_OK(leader->Broadcast(bad, deadline).status());
    // The follower explains its refusal in the gather rank 0 now waits for.
    ASSERT_OK_AND_ASSIGN(std::vector<std::string> replies, leader->Gather("{}", deadline));
    rank1.join();
    EXPECT_NE(replies[1].find("InvalidArgument"), std::string::npos) << bad << ": " << replies[1];
    EXPECT_STATUS_MSG(InvalidArgument, "field", synced);
  }
}

TEST(PublisherTest, MoreRanksThanChunksTakePartAndVote) {
  std::vector<Canonical> model = MakeModel(2);
  const std::string endpoint = testing::FreeLoopbackEndpoint();
  std::unique_ptr<EmbeddedReceiver> receiver =
      StartReceiver(Unsharded(model), std::nullopt, "", endpoint, {endpoint});
  // One chunk holds the whole model: ranks 1 … 7 own nothing.
  std::vector<std::unique_ptr<Publisher>> ranks = MakeRanks(8, {receiver.get()}, 64 << 20);
  for (std::unique_ptr<Publisher>& rank : ranks) {
    ASSERT_OK(rank->AdoptBaseline(Views(model),
                                  rank->rank() == 0 ? std::optional<uint64_t>(0) : std::nullopt));
  }
  std::mt19937_64 rng(8);
  for (int step = 1; step <= 2; ++step) {
    Step(model, rng, 0.05);
    ASSERT_OK_AND_ASSIGN(SyncReport report, SyncAll(ranks, model));
    EXPECT_FALSE(report.transfer.plan.anchor) << "a rank that owns nothing forced an anchor";
    EXPECT_EQ(report.transfer.producers.size(), 8u);
    ExpectHolds(*receiver, Unsharded(model), "receiver");
  }
  for (const std::unique_ptr<Publisher>& rank : ranks) EXPECT_EQ(rank->version(), 2u);
}

class ShardGroupTest : public ::testing::TestWithParam<uint32_t> {};

TEST_P(ShardGroupTest, EveryShardEqualsTheSliceAndACorruptShardAbortsTheTransfer) {
  const uint32_t tp = GetParam();
  std::vector<Canonical> model = MakeModel(3);
  // One TP group and one unsharded replica in the same relay tree.
  // Chosen together, so that no two receivers get the same port (ports chosen one at a time can
  // repeat once each is released).
  const std::vector<std::string> endpoints = testing::FreeLoopbackEndpoints(tp + 1);
  std::vector<std::unique_ptr<EmbeddedReceiver>> fleet;
  for (uint32_t r = 0; r < tp; ++r) {
    fleet.push_back(
        StartReceiver(ShardOf(model, r, tp), TpLoader(r, tp), "tp-group", endpoints[r], endpoints));
  }
  fleet.push_back(StartReceiver(Unsharded(model), std::nullopt, "", endpoints[tp], endpoints));
  std::vector<EmbeddedReceiver*> receivers;
  for (auto& receiver : fleet) receivers.push_back(receiver.get());
  // Two ranks with small chunks, so that both own tensors.
  std::vector<std::unique_ptr<Publisher>> ranks = MakeRanks(2, receivers, 4096);
  for (std::unique_ptr<Publisher>& rank : ranks) {
    ASSERT_OK(rank->AdoptBaseline(Views(model),
                                  rank->rank() == 0 ? std::optional<uint64_t>(0) : std::nullopt));
  }
  auto expect_fleet_holds = [&](const std::string& when) {
    for (uint32_t r = 0; r < tp; ++r) {
      ExpectHolds(*fleet[r], ShardOf(model, r, tp), when + ", shard " + std::to_string(r));
    }
    ExpectHolds(*fleet[tp], Unsharded(model), when + ", unsharded");
  };
  std::mt19937_64 rng(9);
  for (int step = 1; step <= 3; ++step) {
    Step(model, rng, 0.03);
    ASSERT_OK_AND_ASSIGN(SyncReport report, SyncAll(ranks, model, /*anchor=*/step == 2));
    EXPECT_EQ(report.transfer.plan.anchor, step == 2);
    expect_fleet_holds("step " + std::to_string(step));
  }

  // Corrupt one element of shard 1's fused qkv behind refit's back — one the next step
  // changes — and the replica digest catches it at flush: everyone rolls back.
  const std::vector<Canonical> base = model;
  Step(model, rng, 0.03);
  Canonical& k = Find(model, "model.layers.0.self_attn.k_proj.weight");
  const Canonical& k_base = Find(base, k.name);
  uint64_t changed = 0;
  while (k.bits[changed] == k_base.bits[changed]) ++changed;
  // Shard 1 holds kv head 0 (TP 4: ranks 0, 1) or heads 0 … (TP 2: rank 1 holds head 1).
  const uint64_t kv_first = kKvHeads >= tp ? 1 * (kKvHeads / tp) : 1 / (tp / kKvHeads);
  const uint64_t kv_heads = kKvHeads >= tp ? kKvHeads / tp : 1;
  const uint64_t row = changed / kHidden;
  if (row < kv_first * kHeadDim || row >= (kv_first + kv_heads) * kHeadDim) {
    // The changed element is not held by shard 1: make it one that is.
    changed = kv_first * kHeadDim * kHidden;
    k.bits[changed] = static_cast<uint16_t>(k_base.bits[changed] ^ 1);
  }
  Local& qkv = fleet[1]->buffers.at("model.layers.0.self_attn.qkv_proj.weight");
  const uint64_t local_index =
      (kHeads / tp) * kHeadDim * kHidden + (changed - kv_first * kHeadDim * kHidden);
  const uint16_t good = qkv.bits[local_index];
  qkv.bits[local_index] = static_cast<uint16_t>(good ^ 0x0100);
  Result<SyncReport> failed = SyncAll(ranks, model);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kDataLoss) << failed.status().ToString();
  EXPECT_NE(failed.status().message().find("replica 'tp-group'"), std::string::npos)
      << failed.status().ToString();
  // Everyone is back at the base: the shards equal the base slices (the corrupted element
  // still corrupted, as the engine left it), the unsharded replica the base model.
  for (const std::unique_ptr<EmbeddedReceiver>& receiver : fleet) {
    EXPECT_EQ(receiver->node->status().version, 3u);
  }
  qkv.bits[local_index] = good;
  for (uint32_t r = 0; r < tp; ++r) {
    ExpectHolds(*fleet[r], ShardOf(base, r, tp), "after the abort, shard " + std::to_string(r));
  }
  ExpectHolds(*fleet[tp], Unsharded(base), "after the abort, unsharded");
  // With the shard repaired, the same step commits.
  ASSERT_OK_AND_ASSIGN(SyncReport retried, SyncAll(ranks, model));
  EXPECT_EQ(retried.transfer.plan.target_version, 4u);
  expect_fleet_holds("the retried step");
  std::lock_guard lock(fleet[1]->hooks_mutex);
  EXPECT_EQ(fleet[1]->hooks.back(), "commit 4");
  EXPECT_EQ(fleet[1]->hooks[fleet[1]->hooks.size() - 2], "pause");
  EXPECT_EQ(fleet[1]->hooks[fleet[1]->hooks.size() - 3], "abort 3");
}

INSTANTIATE_TEST_SUITE_P(TensorParallel, ShardGroupTest, ::testing::Values(2u, 4u),
                         [](const auto& param_info) {
                           return "TP" + std::to_string(param_info.param);
                         });

// Routing by holdings: two replicas of TP = 4 and an unsharded receiver, refitted by two
// publisher ranks. From the first Sync on (a Sync of a tensor list names its tensors) the
// receivers form five classes — TP rank k of both replicas, and the unsharded one — and every
// shard receives only its class's payloads: a quarter-sized cut of the delta, not all of it.
TEST(RoutedShardClassesTest, EachShardReceivesOnlyItsCutAndEveryElementMatchesAfterEveryStep) {
  constexpr uint32_t kTp = 4;
  std::vector<Canonical> model = MakeModel(11);
  const std::vector<std::string> endpoints = testing::FreeLoopbackEndpoints(2 * kTp + 1);
  std::vector<std::unique_ptr<EmbeddedReceiver>> fleet;
  // Started in an order unlike the classes', with no peers list: the trees are named per
  // transfer.
  for (uint32_t replica = 0; replica < 2; ++replica) {
    for (uint32_t r = 0; r < kTp; ++r) {
      fleet.push_back(StartReceiver(ShardOf(model, r, kTp), TpLoader(r, kTp),
                                    fmt::format("tp-{}", replica), endpoints[replica * kTp + r],
                                    {}));
    }
  }
  fleet.push_back(StartReceiver(Unsharded(model), std::nullopt, "", endpoints[2 * kTp], {}));
  std::vector<EmbeddedReceiver*> receivers;
  for (auto& receiver : fleet) receivers.push_back(receiver.get());
  std::vector<std::unique_ptr<Publisher>> ranks = MakeRanks(2, receivers, 4096);
  for (std::unique_ptr<Publisher>& rank : ranks) {
    ASSERT_OK(rank->AdoptBaseline(Views(model),
                                  rank->rank() == 0 ? std::optional<uint64_t>(0) : std::nullopt));
  }
  auto expect_fleet_holds = [&](const std::vector<Canonical>& want, const std::string& when) {
    for (uint32_t replica = 0; replica < 2; ++replica) {
      for (uint32_t r = 0; r < kTp; ++r) {
        // Whole local buffers: the vocabulary padding (0xFFFF) must be untouched too.
        ExpectHolds(*fleet[replica * kTp + r], ShardOf(want, r, kTp),
                    fmt::format("{}, replica {} shard {}", when, replica, r));
      }
    }
    ExpectHolds(*fleet[2 * kTp], Unsharded(want), when + ", unsharded");
  };
  std::mt19937_64 rng(13);
  std::vector<uint64_t> received(fleet.size(), 0);
  for (int step = 1; step <= 4; ++step) {
    Step(model, rng, 0.05);
    ASSERT_OK_AND_ASSIGN(SyncReport report, SyncAll(ranks, model, /*anchor=*/step == 3));
    expect_fleet_holds(model, fmt::format("step {}", step));
    const RefitReport& transfer = report.transfer;
    ASSERT_EQ(transfer.routes.size(), kTp + 1) << "step " << step;
    // Rank k of both replicas share a route; the unsharded receiver has its own.
    for (uint32_t r = 0; r < kTp; ++r) {
      EXPECT_EQ(transfer.receivers[r].route, transfer.receivers[kTp + r].route);
    }
    std::set<size_t> distinct;
    for (const ReceiverOutcome& outcome : transfer.receivers) distinct.insert(outcome.route);
    EXPECT_EQ(distinct.size(), kTp + 1);
    // Each receiver applied exactly its route's payloads: what every rank sent that route.
    std::vector<uint64_t> route_bytes(transfer.routes.size(), 0);
    std::vector<uint64_t> route_payloads(transfer.routes.size(), 0);
    for (const StreamReport& producer : transfer.producers) {
      ASSERT_EQ(producer.routes.size(), transfer.routes.size());
      for (size_t k = 0; k < producer.routes.size(); ++k) {
        // Location and value bytes: on a model this small, the fixed bytes of payload and item
        // headers would hide the ratio (a benchmark measures wire bytes on a real size).
        route_bytes[k] += producer.routes[k].item_bytes;
        route_payloads[k] += producer.routes[k].payloads;
      }
    }
    const size_t whole = transfer.receivers[2 * kTp].route;
    for (size_t r = 0; r < fleet.size(); ++r) {
      // The receiver's own counters: it was sent exactly its route's payloads, whether from a
      // producer or forwarded by the other member of its class.
      const ReceiverOutcome& outcome = transfer.receivers[r];
      const ReceiverStatus status = fleet[r]->node->status();
      uint64_t route_wire = 0;
      for (const StreamReport& producer : transfer.producers) {
        route_wire += producer.routes[outcome.route].wire_bytes;
      }
      EXPECT_EQ(status.received_bytes - received[r], route_wire) << outcome.name;
      received[r] = status.received_bytes;
    }
    for (const ReceiverOutcome& outcome : transfer.receivers) {
      EXPECT_EQ(outcome.flush.payloads, route_payloads[outcome.route]) << outcome.name;
      if (outcome.route == whole) continue;
      EXPECT_LT(outcome.flush.changed_elements,
                transfer.receivers[2 * kTp].flush.changed_elements / 2)
          << outcome.name;
      const double ratio =
          static_cast<double>(route_bytes[outcome.route]) / static_cast<double>(route_bytes[whole]);
      // About 1/4: the kv heads (2 for TP = 4) and the norm are held by two and four shards.
      EXPECT_LT(ratio, 0.4) << outcome.name << " step " << step;
    }
  }

  // One corrupted element on one shard (replica 1, TP rank 2), in a row the next step changes:
  // its replica's digest catches it at flush, and every receiver rolls back.
  const std::vector<Canonical> base = model;
  Step(model, rng, 0.05);
  Canonical& o = Find(model, "model.layers.0.self_attn.o_proj.weight");
  // Rank 2 holds columns 16:24 of o_proj; make sure the step changes (row 0, column 17).
  o.bits[17] = static_cast<uint16_t>(Find(base, o.name).bits[17] ^ 1);
  Local& shard_o = fleet[kTp + 2]->buffers.at("model.layers.0.self_attn.o_proj.weight");
  const uint16_t good = shard_o.bits[1];
  shard_o.bits[1] = static_cast<uint16_t>(good ^ 0x0100);
  Result<SyncReport> failed = SyncAll(ranks, model);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kDataLoss) << failed.status().ToString();
  EXPECT_NE(failed.status().message().find("replica 'tp-1'"), std::string::npos)
      << failed.status().ToString();
  shard_o.bits[1] = good;
  expect_fleet_holds(base, "after the abort");
  for (const std::unique_ptr<EmbeddedReceiver>& receiver : fleet) {
    EXPECT_EQ(receiver->node->status().version, 4u);
  }
  ASSERT_OK_AND_ASSIGN(SyncReport retried, SyncAll(ranks, model));
  EXPECT_EQ(retried.transfer.plan.target_version, 5u);
  EXPECT_EQ(retried.transfer.routes.size(), kTp + 1);
  expect_fleet_holds(model, "the retried step");
}

// ---- Sharded publishing: every rank holds and sends only its boxes. ---------------------------

// A sharded trainer rank: its local tensors (named as the canonical ones) and its layout.
struct ShardedRank {
  std::map<std::string, std::vector<uint16_t>> bits;
  ShardedModel model;
};

// torch.chunk's split of n into `parts`: ceil(n / parts) each, the last ones shorter or empty.
std::pair<uint64_t, uint64_t> ChunkOf(uint64_t n, uint64_t parts, uint64_t index) {
  const uint64_t size = (n + parts - 1) / parts;
  const uint64_t begin = std::min(n, index * size);
  return {begin, std::min(n, begin + size)};
}

// Shard `shard` of `shards` of every tensor, FSDP2-style (dim 0), except the tensors in
// `by_column`, sharded on dim 1 (as a tensor-parallel row-parallel layer is).
ShardedRank ShardedRankOf(const std::vector<Canonical>& model, uint64_t shard, uint64_t shards,
                          const std::vector<std::string>& by_column = {}) {
  ShardedRank rank;
  for (const Canonical& t : model) {
    const bool column = std::find(by_column.begin(), by_column.end(), t.name) != by_column.end();
    LayoutPiece piece;
    piece.tensor = t.name;
    piece.dtype = DType::kBFloat16;
    piece.shape = t.view().shape;
    piece.offset.assign(piece.shape.size(), 0);
    piece.extent = piece.shape;
    const auto [begin, end] = ChunkOf(column ? t.cols : t.rows, shards, shard);
    piece.offset[column ? 1 : 0] = static_cast<int64_t>(begin);
    piece.extent[column ? 1 : 0] = static_cast<int64_t>(end - begin);
    piece.local = t.name;
    piece.local_shape = piece.extent;
    piece.local_offset.assign(piece.shape.size(), 0);
    rank.bits[t.name] = column ? Columns(t, begin, end) : Rows(t, begin, end);
    rank.model.layout.pieces.push_back(std::move(piece));
  }
  for (const LayoutPiece& piece : rank.model.layout.pieces) {
    rank.model.locals.push_back(
        ExportTensor::Host(TensorView{piece.local, DType::kBFloat16, piece.local_shape,
                                      std::as_bytes(std::span(rank.bits.at(piece.local)))}));
  }
  return rank;
}

// Sync every rank's sharded model at once (SPMD); return every rank's result.
std::vector<Result<SyncReport>> SyncSharded(std::vector<std::unique_ptr<Publisher>>& ranks,
                                            const std::vector<ShardedRank>& held) {
  std::vector<Result<SyncReport>> results(ranks.size(), Status(StatusCode::kInternal, "unset"));
  std::vector<std::jthread> threads;
  for (size_t p = 1; p < ranks.size(); ++p) {
    threads.emplace_back([&, p] { results[p] = ranks[p]->Sync(held[p].model); });
  }
  results[0] = ranks[0]->Sync(held[0].model);
  threads.clear();
  return results;
}

// A TP = 2 group (fused qkv, gate_up, vocabulary-parallel) and an unsharded receiver in one relay
// tree, loaded with `model`.
std::vector<std::unique_ptr<EmbeddedReceiver>> TpPairAndUnsharded(
    const std::vector<Canonical>& model) {
  const std::vector<std::string> endpoints = testing::FreeLoopbackEndpoints(3);
  std::vector<std::unique_ptr<EmbeddedReceiver>> fleet;
  for (uint32_t r = 0; r < 2; ++r) {
    fleet.push_back(
        StartReceiver(ShardOf(model, r, 2), TpLoader(r, 2), "tp-group", endpoints[r], endpoints));
  }
  fleet.push_back(StartReceiver(Unsharded(model), std::nullopt, "", endpoints[2], endpoints));
  return fleet;
}

void ExpectTpPairAndUnshardedHold(const std::vector<std::unique_ptr<EmbeddedReceiver>>& fleet,
                                  const std::vector<Canonical>& model, const std::string& when) {
  for (uint32_t r = 0; r < 2; ++r) {
    ExpectHolds(*fleet[r], ShardOf(model, r, 2), when + ", TP shard " + std::to_string(r));
  }
  ExpectHolds(*fleet[2], Unsharded(model), when + ", unsharded");
}

uint64_t BoxBytes(const ShardedRank& rank) {
  uint64_t bytes = 0;
  for (const LayoutPiece& piece : rank.model.layout.pieces) bytes += piece.numel() * 2;
  return bytes;
}

TEST(ShardedPublisherTest, ThreeRanksRefitAnUnshardedReceiverAndATpGroupFromTheirShards) {
  std::vector<Canonical> model = MakeModel(21);
  std::vector<std::unique_ptr<EmbeddedReceiver>> fleet = TpPairAndUnsharded(model);
  std::vector<EmbeddedReceiver*> receivers;
  for (auto& receiver : fleet) receivers.push_back(receiver.get());
  std::vector<std::unique_ptr<Publisher>> ranks = MakeRanks(3, receivers, 4096);
  // Rows not divisible by 3 everywhere (100, 32, 8, 64 rows); two tensors sharded by column.
  const std::vector<std::string> by_column = {"model.layers.0.self_attn.o_proj.weight",
                                              "model.layers.0.mlp.down_proj.weight"};
  std::mt19937_64 rng(22);
  for (int step = 1; step <= 4; ++step) {
    Step(model, rng, 0.03);
    std::vector<ShardedRank> held;
    for (uint32_t r = 0; r < 3; ++r) held.push_back(ShardedRankOf(model, r, 3, by_column));
    std::vector<Result<SyncReport>> results = SyncSharded(ranks, held);
    for (uint32_t r = 0; r < 3; ++r) {
      ASSERT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r].status().ToString();
    }
    const SyncReport& report = *results[0];
    // The first sharded sync anchors (the ranks' trackers are empty); then deltas.
    EXPECT_EQ(report.transfer.plan.anchor, step == 1) << "step " << step;
    ASSERT_EQ(report.transfer.producers.size(), 3u);
    for (uint32_t r = 0; r < 3; ++r) {
      EXPECT_GT(report.transfer.producers[r].payloads, 0u) << "rank " << r << " sent nothing";
      // A rank keeps its own boxes, not the model.
      EXPECT_EQ(ranks[r]->baseline_bytes(), BoxBytes(held[r])) << "rank " << r;
    }
    const std::string when = "step " + std::to_string(step);
    ExpectTpPairAndUnshardedHold(fleet, model, when);
  }
}

// A sync with a diverged data-parallel copy: rank 0 fails with DataLoss naming the copying rank
// and the canonical tensor, and every other rank fails too.
void ExpectDivergedCopyFailedEveryRank(const std::vector<Result<SyncReport>>& failed,
                                       const std::string& rank, const std::string& tensor) {
  ASSERT_FALSE(failed[0].ok());
  EXPECT_EQ(failed[0].status().code(), StatusCode::kDataLoss) << failed[0].status().ToString();
  for (const std::string& expected : {rank, tensor}) {
    EXPECT_NE(failed[0].status().message().find(expected), std::string::npos)
        << expected << " not named: " << failed[0].status().ToString();
  }
  for (size_t r = 1; r < failed.size(); ++r) EXPECT_FALSE(failed[r].ok()) << "rank " << r;
}

TEST(ShardedPublisherTest, DataParallelCopiesAreSentOnceAndADivergedCopyRollsEveryoneBack) {
  std::vector<Canonical> model = MakeModel(31);
  const std::string endpoint = testing::FreeLoopbackEndpoint();
  std::unique_ptr<EmbeddedReceiver> receiver =
      StartReceiver(Unsharded(model), std::nullopt, "", endpoint, {endpoint});
  // W = 4: two FSDP shards, each held by two data-parallel replicas (ranks r and r + 2).
  std::vector<std::unique_ptr<Publisher>> ranks = MakeRanks(4, {receiver.get()}, 4096);
  auto hold = [](const std::vector<Canonical>& m) {
    std::vector<ShardedRank> held;
    for (uint32_t r = 0; r < 4; ++r) held.push_back(ShardedRankOf(m, r % 2, 2));
    return held;
  };
  std::mt19937_64 rng(32);
  for (int step = 1; step <= 2; ++step) {
    Step(model, rng, 0.03);
    std::vector<Result<SyncReport>> results = SyncSharded(ranks, hold(model));
    ASSERT_OK(results[0].status());
    const SyncReport& report = *results[0];
    EXPECT_GT(report.transfer.producers[0].payloads, 0u);
    EXPECT_GT(report.transfer.producers[1].payloads, 0u);
    EXPECT_EQ(report.transfer.producers[2].payloads, 0u) << "a copy was sent twice";
    EXPECT_EQ(report.transfer.producers[3].payloads, 0u) << "a copy was sent twice";
    EXPECT_EQ(ranks[3]->baseline_bytes(), 0u) << "a rank that sends nothing keeps nothing";
    ExpectHolds(*receiver, Unsharded(model), "step " + std::to_string(step));
  }
  // Rank 3's copy of shard 1 diverges from rank 1's by one bit of q_proj.
  const std::vector<Canonical> base = model;
  Step(model, rng, 0.03);
  std::vector<ShardedRank> held = hold(model);
  held[3].bits.at("model.layers.0.self_attn.q_proj.weight")[5] ^= 0x0100;
  std::vector<Result<SyncReport>> failed = SyncSharded(ranks, held);
  ASSERT_NO_FATAL_FAILURE(ExpectDivergedCopyFailedEveryRank(
      failed, "rank 3", "model.layers.0.self_attn.q_proj.weight"));
  EXPECT_EQ(receiver->node->status().version, 2u);
  ExpectHolds(*receiver, Unsharded(base), "after the diverged copy");
  // The replicas agree again: the same step commits, as a delta.
  std::vector<Result<SyncReport>> retried = SyncSharded(ranks, hold(model));
  ASSERT_OK(retried[0].status());
  EXPECT_FALSE(retried[0]->transfer.plan.anchor);
  EXPECT_EQ(retried[0]->transfer.plan.target_version, 3u);
  ExpectHolds(*receiver, Unsharded(model), "the retried step");
}

TEST(ShardedPublisherTest, ALayoutWithAGapAnOverlapOrARankMissingIsRefusedBeforeAnythingIsSent) {
  std::vector<Canonical> model = MakeModel(41);
  const std::string endpoint = testing::FreeLoopbackEndpoint();
  std::unique_ptr<EmbeddedReceiver> receiver =
      StartReceiver(Unsharded(model), std::nullopt, "", endpoint, {endpoint});
  std::vector<std::unique_ptr<Publisher>> ranks = MakeRanks(2, {receiver.get()}, 4096);
  const std::string k_proj = "model.layers.0.self_attn.k_proj.weight";
  // A gap: rank 1 does not hold its rows of k_proj.
  std::vector<ShardedRank> gap = {ShardedRankOf(model, 0, 2), ShardedRankOf(model, 1, 2)};
  std::erase_if(gap[1].model.layout.pieces,
                [&](const LayoutPiece& piece) { return piece.tensor == k_proj; });
  std::vector<Result<SyncReport>> refused = SyncSharded(ranks, gap);
  EXPECT_STATUS_MSG(InvalidArgument, k_proj, refused[0].status());
  // An overlap: rank 1 claims rows 3 … 7 of k_proj, rank 0 rows 0 … 3.
  std::vector<ShardedRank> overlap = {ShardedRankOf(model, 0, 2), ShardedRankOf(model, 1, 2)};
  for (LayoutPiece& piece : overlap[1].model.layout.pieces) {
    if (piece.tensor == k_proj) piece.offset[0] = 3;
  }
  refused = SyncSharded(ranks, overlap);
  EXPECT_STATUS_MSG(InvalidArgument, k_proj, refused[0].status());
  // A rank missing: rank 1 states no piece at all (its local tensors are still given).
  std::vector<ShardedRank> missing = {ShardedRankOf(model, 0, 2), ShardedRankOf(model, 1, 2)};
  missing[1].model.layout.pieces.clear();
  refused = SyncSharded(ranks, missing);
  EXPECT_STATUS_MSG(InvalidArgument, "rank(s) 1 hold no piece at all", refused[0].status());
  for (const Result<SyncReport>& result : refused) EXPECT_FALSE(result.ok());
  // Nothing reached the receiver: no transfer was prepared.
  EXPECT_EQ(receiver->node->status().version, 0u);
  std::lock_guard lock(receiver->hooks_mutex);
  EXPECT_TRUE(receiver->hooks.empty()) << receiver->hooks.front();
}

TEST(ShardedPublisherTest, ARestartedRankSendsItsBoxesFullWhileTheOthersSendDeltas) {
  std::vector<Canonical> model = MakeModel(51);
  const std::string endpoint = testing::FreeLoopbackEndpoint();
  std::unique_ptr<EmbeddedReceiver> receiver =
      StartReceiver(Unsharded(model), std::nullopt, "", endpoint, {endpoint});
  // Three ranks over a TCP group, whose rank 0 takes a restarted rank back.
  PublisherOptions options;
  options.transport_uri = "zmq://?timeout_ms=10000";
  options.stream.chunk_bytes = 4096;
  options.transfer_timeout = std::chrono::seconds(60);
  options.receivers.push_back({receiver->node->control_url(), receiver->node->producer_endpoint()});
  auto group_options = [](uint32_t rank, const std::string& address) {
    TcpGroupOptions group;
    group.address = address;
    group.rank = rank;
    group.world_size = 3;
    group.connect_timeout = std::chrono::seconds(30);
    return group;
  };
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ProducerGroup> root,
                       MakeTcpGroup(group_options(0, "tcp://127.0.0.1:0")));
  const std::string address = fmt::format("127.0.0.1:{}", TcpGroupPort(*root));
  std::vector<std::unique_ptr<Publisher>> ranks;
  ASSERT_OK_AND_ASSIGN(ranks.emplace_back(), Publisher::Make(options, std::move(root)));
  for (uint32_t r = 1; r < 3; ++r) {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ProducerGroup> member,
                         MakeTcpGroup(group_options(r, address)));
    ASSERT_OK_AND_ASSIGN(ranks.emplace_back(), Publisher::Make(options, std::move(member)));
  }
  std::mt19937_64 rng(52);
  auto step = [&](int number) -> SyncReport {
    Step(model, rng, 0.03);
    std::vector<ShardedRank> held;
    for (uint32_t r = 0; r < 3; ++r) held.push_back(ShardedRankOf(model, r, 3));
    std::vector<Result<SyncReport>> results = SyncSharded(ranks, held);
    for (uint32_t r = 0; r < 3; ++r) {
      EXPECT_TRUE(results[r].ok())
          << "step " << number << " rank " << r << ": " << results[r].status().ToString();
    }
    ExpectHolds(*receiver, Unsharded(model), "step " + std::to_string(number));
    return results[0].ok() ? *results[0] : SyncReport{};
  };
  EXPECT_TRUE(step(1).transfer.plan.anchor);
  EXPECT_FALSE(step(2).transfer.plan.anchor);
  // Rank 2's process restarts: a new endpoint and a new publisher, with no baseline.
  ranks[2].reset();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ProducerGroup> again,
                       MakeTcpGroup(group_options(2, address)));
  ASSERT_OK_AND_ASSIGN(ranks[2], Publisher::Make(options, std::move(again)));
  const SyncReport mixed = step(3);
  EXPECT_FALSE(mixed.transfer.plan.anchor) << "one restarted rank re-anchored the whole fleet";
  ASSERT_EQ(mixed.transfer.producers.size(), 3u);
  const StreamReport& full = mixed.transfer.producers[2];
  EXPECT_EQ(full.changed_elements, full.total_elements) << "rank 2 did not send its boxes FULL";
  for (uint32_t r = 0; r < 2; ++r) {
    const StreamReport& delta = mixed.transfer.producers[r];
    EXPECT_LT(delta.changed_elements * 10, delta.total_elements) << "rank " << r << " sent FULL";
  }
  // From now on every rank sends deltas.
  const SyncReport after = step(4);
  EXPECT_FALSE(after.transfer.plan.anchor);
  EXPECT_LT(after.transfer.producers[2].changed_elements * 10,
            after.transfer.producers[2].total_elements);
}

TEST(ShardedPublisherTest, ARestartedRankThatAdoptsItsBoxesSendsADelta) {
  std::vector<Canonical> model = MakeModel(53);
  const std::string endpoint = testing::FreeLoopbackEndpoint();
  std::unique_ptr<EmbeddedReceiver> receiver =
      StartReceiver(Unsharded(model), std::nullopt, "", endpoint, {endpoint});
  PublisherOptions options;
  options.transport_uri = "zmq://?timeout_ms=10000";
  options.stream.chunk_bytes = 4096;
  options.transfer_timeout = std::chrono::seconds(60);
  options.receivers.push_back({receiver->node->control_url(), receiver->node->producer_endpoint()});
  auto group_options = [](uint32_t rank, const std::string& address) {
    TcpGroupOptions group;
    group.address = address;
    group.rank = rank;
    group.world_size = 3;
    group.connect_timeout = std::chrono::seconds(30);
    return group;
  };
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ProducerGroup> root,
                       MakeTcpGroup(group_options(0, "tcp://127.0.0.1:0")));
  const std::string address = fmt::format("127.0.0.1:{}", TcpGroupPort(*root));
  std::vector<std::unique_ptr<Publisher>> ranks;
  ASSERT_OK_AND_ASSIGN(ranks.emplace_back(), Publisher::Make(options, std::move(root)));
  for (uint32_t r = 1; r < 3; ++r) {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ProducerGroup> member,
                         MakeTcpGroup(group_options(r, address)));
    ASSERT_OK_AND_ASSIGN(ranks.emplace_back(), Publisher::Make(options, std::move(member)));
  }
  // Every rank adopts the checkpoint the receiver loaded: the first sync is already a delta.
  for (uint32_t r = 0; r < 3; ++r) {
    const ShardedRank held = ShardedRankOf(model, r, 3);
    ASSERT_OK(ranks[r]->AdoptBaseline(held.model, 0));
  }
  std::mt19937_64 rng(54);
  auto step = [&](int number) -> SyncReport {
    Step(model, rng, 0.03);
    std::vector<ShardedRank> held;
    for (uint32_t r = 0; r < 3; ++r) held.push_back(ShardedRankOf(model, r, 3));
    std::vector<Result<SyncReport>> results = SyncSharded(ranks, held);
    for (uint32_t r = 0; r < 3; ++r) {
      EXPECT_TRUE(results[r].ok())
          << "step " << number << " rank " << r << ": " << results[r].status().ToString();
    }
    ExpectHolds(*receiver, Unsharded(model), "step " + std::to_string(number));
    return results[0].ok() ? *results[0] : SyncReport{};
  };
  EXPECT_FALSE(step(1).transfer.plan.anchor) << "every rank adopted: a delta";
  EXPECT_FALSE(step(2).transfer.plan.anchor);
  // Rank 2's process restarts from the checkpoint of version 2 and adopts its boxes (those it
  // sends and the replicated ones rank 0 sends, which it drops at the next sync).
  ranks[2].reset();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ProducerGroup> again,
                       MakeTcpGroup(group_options(2, address)));
  ASSERT_OK_AND_ASSIGN(ranks[2], Publisher::Make(options, std::move(again)));
  {
    const ShardedRank held = ShardedRankOf(model, 2, 3);
    ASSERT_OK(ranks[2]->AdoptBaseline(held.model, 2));
  }
  const SyncReport resumed = step(3);
  EXPECT_FALSE(resumed.transfer.plan.anchor);
  ASSERT_EQ(resumed.transfer.producers.size(), 3u);
  for (uint32_t r = 0; r < 3; ++r) {
    const StreamReport& delta = resumed.transfer.producers[r];
    EXPECT_LT(delta.changed_elements * 10, delta.total_elements) << "rank " << r << " sent FULL";
  }
  // From then on too (the adopted baseline was committed).
  const SyncReport after = step(4);
  EXPECT_FALSE(after.transfer.plan.anchor);
}

// A Megatron-style rank of TP 2 × PP 2 × DP 2 (rank = dp·4 + pp·2 + tp), with plain local
// tensors in Megatron's own layout: a fused linear_qkv interleaved per query group (q heads of
// the group, then its k head, then its v head), a fused linear_fc1 (gate rows, then up rows),
// row-parallel projections split by column, a vocabulary split by rows, and the norm replicated
// over TP. Stage 0 holds the embedding and the attention, stage 1 the MLP and the head.
ShardedRank MegatronRank(const std::vector<Canonical>& model, uint32_t tp, uint32_t pp) {
  ShardedRank rank;
  auto add = [&](const std::string& local, Shape local_shape, const Canonical& t,
                 std::vector<int64_t> offset, Shape extent, std::vector<int64_t> local_offset) {
    rank.model.layout.pieces.push_back(
        LayoutPiece{t.name, DType::kBFloat16, t.view().shape, std::move(offset), std::move(extent),
                    local, std::move(local_shape), std::move(local_offset)});
  };
  auto whole = [&](const Canonical& t) {
    rank.bits[t.name] = t.bits;
    add(t.name, t.view().shape, t, std::vector<int64_t>(t.view().shape.size(), 0), t.view().shape,
        std::vector<int64_t>(t.view().shape.size(), 0));
  };
  auto rows = [&](const Canonical& t) {
    const auto [begin, end] = ChunkOf(t.rows, 2, tp);
    const Shape extent{static_cast<int64_t>(end - begin), static_cast<int64_t>(t.cols)};
    rank.bits[t.name] = Rows(t, begin, end);
    add(t.name, extent, t, {static_cast<int64_t>(begin), 0}, extent, {0, 0});
  };
  auto columns = [&](const Canonical& t) {
    const auto [begin, end] = ChunkOf(t.cols, 2, tp);
    const Shape extent{static_cast<int64_t>(t.rows), static_cast<int64_t>(end - begin)};
    rank.bits[t.name] = Columns(t, begin, end);
    add(t.name, extent, t, {0, static_cast<int64_t>(begin)}, extent, {0, 0});
  };
  const std::string attn = "model.layers.0.self_attn.";
  const std::string mlp = "model.layers.0.mlp.";
  const auto h = static_cast<int64_t>(kHidden);
  if (pp == 0) {
    rows(Find(model, "model.embed_tokens.weight"));
    whole(Find(model, "model.layers.0.input_layernorm.weight"));
    // linear_qkv: this TP rank's query groups, each [q heads of the group; k; v].
    const std::string qkv = "decoder.layers.0.self_attention.linear_qkv.weight";
    const uint64_t groups = kKvHeads / 2;
    const uint64_t group_rows = (kHeads / kKvHeads + 2) * kHeadDim;
    const Shape qkv_shape{static_cast<int64_t>(groups * group_rows), h};
    std::vector<uint16_t>& bits = rank.bits[qkv];
    for (uint64_t g = tp * groups; g < (tp + 1) * groups; ++g) {
      const auto local_row = static_cast<int64_t>((g - tp * groups) * group_rows);
      const uint64_t q_rows = (kHeads / kKvHeads) * kHeadDim;
      const Canonical& q = Find(model, attn + "q_proj.weight");
      Append(bits, Rows(q, g * q_rows, (g + 1) * q_rows));
      add(qkv, qkv_shape, q, {static_cast<int64_t>(g * q_rows), 0},
          {static_cast<int64_t>(q_rows), h}, {local_row, 0});
      int64_t at = local_row + static_cast<int64_t>(q_rows);
      for (const char* part : {"k_proj.weight", "v_proj.weight"}) {
        const Canonical& kv = Find(model, attn + part);
        Append(bits, Rows(kv, g * kHeadDim, (g + 1) * kHeadDim));
        add(qkv, qkv_shape, kv, {static_cast<int64_t>(g * kHeadDim), 0},
            {static_cast<int64_t>(kHeadDim), h}, {at, 0});
        at += static_cast<int64_t>(kHeadDim);
      }
    }
    columns(Find(model, attn + "o_proj.weight"));
  } else {
    // linear_fc1: [this rank's gate rows; its up rows].
    const std::string fc1 = "decoder.layers.0.mlp.linear_fc1.weight";
    const auto half = static_cast<int64_t>(kMlp / 2);
    const Shape fc1_shape{2 * half, h};
    for (const char* part : {"gate_proj.weight", "up_proj.weight"}) {
      const Canonical& t = Find(model, mlp + part);
      const auto at = static_cast<int64_t>(rank.bits[fc1].size() / kHidden);
      Append(rank.bits[fc1], Rows(t, tp * kMlp / 2, (tp + 1) * kMlp / 2));
      add(fc1, fc1_shape, t, {tp * half, 0}, {half, h}, {at, 0});
    }
    columns(Find(model, mlp + "down_proj.weight"));
    rows(Find(model, "lm_head.weight"));
  }
  std::map<std::string, Shape> local_shapes;
  for (const LayoutPiece& piece : rank.model.layout.pieces) {
    local_shapes[piece.local] = piece.local_shape;
  }
  for (const auto& [name, bits] : rank.bits) {
    rank.model.locals.push_back(ExportTensor::Host(
        TensorView{name, DType::kBFloat16, local_shapes.at(name), std::as_bytes(std::span(bits))}));
  }
  return rank;
}

// The same rank's layout in the loader vocabulary, as a Megatron-style trainer states it: the
// rules of its TP rank and the canonical tensors of its pipeline stage.
LoaderSpec MegatronSpec(uint32_t tp) {
  return LoaderSpec{
      tp,
      2,
      {{.kind = LoaderKind::kVocab,
        .match = R"(model\.embed_tokens\.weight|lm_head\.weight)",
        .vocab_size = kVocab,
        .pad_to = 1},
       {.kind = LoaderKind::kQkvInterleaved,
        .to = "decoder.layers.$1.self_attention.linear_qkv.weight",
        .q = R"(model\.layers\.(\d+)\.self_attn\.q_proj\.weight)",
        .k = R"(model\.layers\.(\d+)\.self_attn\.k_proj\.weight)",
        .v = R"(model\.layers\.(\d+)\.self_attn\.v_proj\.weight)",
        .num_heads = kHeads,
        .num_kv_heads = kKvHeads},
       {.kind = LoaderKind::kGateUp,
        .to = "decoder.layers.$1.mlp.linear_fc1.weight",
        .gate = R"(model\.layers\.(\d+)\.mlp\.gate_proj\.weight)",
        .up = R"(model\.layers\.(\d+)\.mlp\.up_proj\.weight)"},
       {.kind = LoaderKind::kColumn,
        .match = R"(model\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.weight)"}}};
}

std::vector<std::string> StageTensors(uint32_t pp) {
  const std::string attn = "model.layers.0.self_attn.";
  const std::string mlp = "model.layers.0.mlp.";
  if (pp == 0) {
    return {"model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
            attn + "q_proj.weight",      attn + "k_proj.weight",
            attn + "v_proj.weight",      attn + "o_proj.weight"};
  }
  return {mlp + "gate_proj.weight", mlp + "up_proj.weight", mlp + "down_proj.weight",
          "lm_head.weight"};
}

std::vector<std::string> PieceKeys(const ProducerLayout& layout) {
  std::vector<std::string> keys;
  for (const LayoutPiece& piece : layout.pieces) {
    keys.push_back(fmt::format("{} in {} {} at [{}]", piece.ToString(), piece.local,
                               ShapeToString(piece.local_shape),
                               fmt::join(piece.local_offset, ", ")));
  }
  std::sort(keys.begin(), keys.end());
  return keys;
}

// Eight ranks hold Megatron's own layouts (sliced by hand, MegatronRank) and state them as loader
// rules (ProducerLayoutFromLoader), which must give the hand-written pieces. Data-parallel copies
// are sent once; then one copy of linear_qkv diverges: the sync fails by name everywhere and the
// receivers keep the step before.
TEST(ShardedPublisherTest, MegatronTp2Pp2Dp2WithFusedInterleavedQkvRefitsUnshardedAndTpReceivers) {
  std::vector<Canonical> model = MakeModel(61);
  std::vector<std::unique_ptr<EmbeddedReceiver>> fleet = TpPairAndUnsharded(model);
  std::vector<EmbeddedReceiver*> receivers;
  for (auto& receiver : fleet) receivers.push_back(receiver.get());
  std::vector<std::unique_ptr<Publisher>> ranks = MakeRanks(8, receivers, 4096);
  // rank = dp·4 + pp·2 + tp.
  auto hold = [](const std::vector<Canonical>& m) {
    std::vector<ShardedRank> held;
    for (uint32_t r = 0; r < 8; ++r) {
      const uint32_t tp = r % 2;
      const uint32_t pp = (r / 2) % 2;
      held.push_back(MegatronRank(m, tp, pp));
      std::vector<TensorView> locals;
      for (const ExportTensor& local : held.back().model.locals) {
        locals.push_back(TensorView{local.name, local.dtype, local.shape, local.host});
      }
      Result<ProducerLayout> stated =
          ProducerLayoutFromLoader(MegatronSpec(tp), locals, StageTensors(pp));
      EXPECT_TRUE(stated.ok()) << "rank " << r << ": " << stated.status().ToString();
      if (!stated.ok()) continue;
      EXPECT_EQ(PieceKeys(*stated), PieceKeys(held.back().model.layout)) << "rank " << r;
      held.back().model.layout = std::move(*stated);
    }
    return held;
  };
  std::mt19937_64 rng(62);
  for (int step = 1; step <= 3; ++step) {
    Step(model, rng, 0.03);
    std::vector<Result<SyncReport>> results = SyncSharded(ranks, hold(model));
    for (uint32_t r = 0; r < 8; ++r) {
      ASSERT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r].status().ToString();
    }
    const SyncReport& report = *results[0];
    EXPECT_EQ(report.transfer.plan.anchor, step == 1);
    for (uint32_t r = 0; r < 8; ++r) {
      // The data-parallel copies (ranks 4 … 7) send nothing; every rank of DP group 0 sends.
      EXPECT_EQ(report.transfer.producers[r].payloads > 0, r < 4)
          << "step " << step << " rank " << r;
    }
    const std::string when = "step " + std::to_string(step);
    ExpectTpPairAndUnshardedHold(fleet, model, when);
  }
  // Rank 5 (DP 1, stage 0, TP 1) holds a copy of rank 1's linear_qkv; its first row (a q row of
  // query group 1) diverges by one bit.
  const std::vector<Canonical> before = model;
  Step(model, rng, 0.03);
  std::vector<ShardedRank> held = hold(model);
  held[5].bits.at("decoder.layers.0.self_attention.linear_qkv.weight")[3] ^= 0x0100;
  std::vector<Result<SyncReport>> failed = SyncSharded(ranks, held);
  ASSERT_NO_FATAL_FAILURE(ExpectDivergedCopyFailedEveryRank(
      failed, "rank 5", "model.layers.0.self_attn.q_proj.weight"));
  ExpectTpPairAndUnshardedHold(fleet, before, "after the diverged copy");
  for (const auto& receiver : fleet) EXPECT_EQ(receiver->node->status().version, 3u);
}

}  // namespace
}  // namespace refit
