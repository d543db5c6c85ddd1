// A newcomer copies the fleet's version from a peer replica (internal::BootstrapFromPeer) over
// the peer's real HTTP control plane: the copy is bit-identical and verified as a whole, the
// store is written only when it is; tensor sets that differ, a peer that cannot be reached, a
// wrong key and device tensors are refused by name with the store untouched. Through a loader it
// copies the peer's local tensors (the same loader) or the peer's canonical tensors (a TP shard
// from an unsharded peer).
#include "node/peer_bootstrap.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "bf16_model.h"
#include "core/digest.h"
#include "loopback.h"
#include "refit/control_client.h"
#include "refit/loader.h"
#include "refit/producer_group.h"
#include "refit/publisher.h"
#include "refit/receiver_node.h"
#include "refit/weight_store.h"
#include "test_util.h"

namespace refit {
namespace {

using bf16_model::MakeModel;
using bf16_model::Step;
using bf16_model::Tensor;
using bf16_model::Views;

constexpr char kKey[] = "peer-bootstrap-test-key";

// Names a URL must carry intact: spaces, slashes, percent signs, non-ASCII.
std::vector<Tensor> OddlyNamedModel(uint64_t seed) {
  std::vector<Tensor> model = MakeModel(seed, 11);
  const char* names[] = {"model.embed tokens/weight", "lm_head%2Fweight", "blocks.0.mlp.w₁",
                         "a?b=c&d", "x#frag"};
  for (size_t t = 0; t < std::size(names); ++t) model[t].name = names[t];
  return model;
}

// The peer: a receiver node over buffers it owns, synced to version 2 by a publisher.
class PeerBootstrapTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = OddlyNamedModel(7);
    buffers_ = model_;
    ReceiverNodeOptions options;
    options.transport_uri = "zmq://?timeout_ms=10000";
    options.data_endpoint = testing::FreeLoopbackEndpoint();
    options.control.api_key = kKey;
    peer_ = ReceiverNode::Make(options).ValueOrDie();
    for (Tensor& t : buffers_) {
      ASSERT_OK(peer_->RegisterTensor(t.mutable_view()));
    }
    ASSERT_OK(peer_->Start());
    PublisherOptions publisher;
    publisher.transport_uri = "zmq://?timeout_ms=10000";
    publisher.control.api_key = kKey;
    publisher.receivers = {{peer_->control_url(), peer_->producer_endpoint()}};
    trainer_ =
        Publisher::Make(publisher, std::move(MakeInProcessGroup(1).ValueOrDie()[0])).ValueOrDie();
    ASSERT_OK(trainer_->AdoptBaseline(Views(model_), 0));
    for (int step = 0; step < 2; ++step) {
      Step(model_, rng_);
      ASSERT_OK(trainer_->Sync(Views(model_)).status());
    }
  }

  // A newcomer's store: `loaded` copied in (a checkpoint it loaded), at version 0.
  static std::unique_ptr<WeightStore> Newcomer(const std::vector<Tensor>& loaded) {
    std::unique_ptr<WeightStore> store = WeightStore::Make();
    for (const Tensor& t : loaded) EXPECT_OK(store->AddCopy(t.view()));
    return store;
  }

  static bool Holds(const WeightStore& store, const std::vector<Tensor>& model) {
    for (const Tensor& t : model) {
      Result<TensorView> held = store.Find(t.name);
      if (!held.ok()) return false;
      const auto want = t.view().bytes;
      if (!std::equal(want.begin(), want.end(), held->bytes.begin(), held->bytes.end())) {
        return false;
      }
    }
    return true;
  }

  internal::PeerBootstrapOptions Options() const {
    internal::PeerBootstrapOptions options;
    options.api_key = kKey;
    options.call_timeout = std::chrono::seconds(5);
    return options;
  }

  std::mt19937_64 rng_{11};
  std::vector<Tensor> model_;    // The trainer's, at version 2 after SetUp.
  std::vector<Tensor> buffers_;  // The peer's memory.
  std::unique_ptr<ReceiverNode> peer_;
  std::unique_ptr<Publisher> trainer_;
};

TEST_F(PeerBootstrapTest, ANewcomerCopiesThePeersVersionBitForBitWithItsDigests) {
  const std::vector<Tensor> step0 = OddlyNamedModel(7);
  std::unique_ptr<WeightStore> store = Newcomer(step0);
  ASSERT_OK_AND_ASSIGN(internal::PeerBootstrapReport report,
                       internal::BootstrapFromPeer(peer_->control_url(), *store, Options()));
  EXPECT_EQ(report.start_version, 0u);
  EXPECT_EQ(report.final_version, 2u);
  EXPECT_EQ(report.tensors, model_.size());
  EXPECT_EQ(report.bytes, model_.size() * 4096 * 2);
  EXPECT_EQ(report.attempts, 1);
  EXPECT_EQ(store->version(), 2u);
  EXPECT_TRUE(Holds(*store, model_));
  // The digests written with the tensors are those of the bytes.
  EXPECT_EQ(store->Digests(), store->RecomputeDigests());

  // A second bootstrap finds the state already held and writes nothing.
  ASSERT_OK_AND_ASSIGN(internal::PeerBootstrapReport again,
                       internal::BootstrapFromPeer(peer_->control_url(), *store, Options()));
  EXPECT_EQ(again.final_version, 2u);
  EXPECT_EQ(again.tensors, 0u);
}

// GET /v1/tensors lists what a newcomer needs to plan its copy: every tensor, in name order, with
// its dtype, shape and digest, at the version the peer holds; only with the key.
TEST_F(PeerBootstrapTest, TheTensorListingNamesEveryTensorWithItsDigestAtTheHeldVersion) {
  ControlClientOptions options;
  options.base_url = peer_->control_url();
  options.api_key = kKey;
  std::unique_ptr<ControlClient> client = ControlClient::Make(options).ValueOrDie();
  ASSERT_OK_AND_ASSIGN(const TensorListing listing, client->ListTensors());
  EXPECT_EQ(listing.version, 2u);
  ASSERT_EQ(listing.tensors.size(), model_.size());
  std::map<std::string, uint64_t> digests;
  for (size_t t = 0; t < listing.tensors.size(); ++t) {
    const HeldTensor& held = listing.tensors[t];
    if (t > 0) {
      EXPECT_LT(listing.tensors[t - 1].name, held.name);
    }
    EXPECT_EQ(held.dtype, DType::kBFloat16);
    EXPECT_EQ(held.shape, Shape{4096});
    digests[held.name] = held.digest;
  }
  std::map<std::string, uint64_t> want;
  for (const Tensor& t : model_) want[t.name] = TensorDigest(t.view());
  EXPECT_EQ(digests, want) << "the digests of the trainer's version 2";

  options.api_key = "not-the-key";
  std::unique_ptr<ControlClient> stranger = ControlClient::Make(options).ValueOrDie();
  EXPECT_EQ(stranger->ListTensors().status().code(), StatusCode::kPermissionDenied);
}

// The peer commits version after version while newcomers copy it: every copy that succeeds is
// exactly one version the trainer published (never a mix of two), and one that straddled the
// peer's transfers on every attempt is refused with the store untouched.
TEST_F(PeerBootstrapTest, ACopyOfAPeerThatKeepsMovingIsOneVersionOrRefused) {
  std::map<uint64_t, std::vector<Tensor>> published{{2, model_}};
  std::mutex published_mutex;
  std::atomic<bool> stop{false};
  Status trainer_status;
  std::jthread trainer([&] {
    // Until the newcomers are done (bounded: each version is kept to compare with).
    for (uint64_t version = 3; version <= 400 && !stop; ++version) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));  // a training step
      Step(model_, rng_);
      {
        std::lock_guard lock(published_mutex);
        published.emplace(version, model_);
      }
      Result<SyncReport> synced = trainer_->Sync(Views(model_));
      if (!synced.ok()) {
        trainer_status = synced.status();
        return;
      }
    }
  });
  const std::vector<Tensor> step0 = OddlyNamedModel(7);
  int copied = 0;
  for (int newcomer = 0; newcomer < 12; ++newcomer) {
    std::unique_ptr<WeightStore> store = Newcomer(step0);
    internal::PeerBootstrapOptions options = Options();
    options.attempts = 2;
    Result<internal::PeerBootstrapReport> report =
        internal::BootstrapFromPeer(peer_->control_url(), *store, options);
    if (!report.ok()) {
      EXPECT_EQ(report.status().code(), StatusCode::kUnavailable) << report.status().ToString();
      EXPECT_EQ(store->version(), 0u);
      EXPECT_TRUE(Holds(*store, step0)) << "a refused copy writes nothing";
      continue;
    }
    ++copied;
    std::lock_guard lock(published_mutex);
    ASSERT_TRUE(published.contains(report->final_version)) << report->final_version;
    EXPECT_TRUE(Holds(*store, published.at(report->final_version)))
        << "newcomer " << newcomer << " holds a mix, not version " << report->final_version;
    EXPECT_EQ(store->version(), report->final_version);
    EXPECT_EQ(store->Digests(), store->RecomputeDigests());
  }
  stop = true;
  trainer.join();
  EXPECT_OK(trainer_status);
  EXPECT_GT(copied, 0) << "no copy succeeded in 12 tries of 2 attempts";
}

TEST_F(PeerBootstrapTest, ATensorSetThatDiffersIsRefusedByNameAndNothingIsWritten) {
  std::vector<Tensor> other = OddlyNamedModel(7);
  other[3].bits.resize(2048);  // "a?b=c&d" has another shape here.
  std::unique_ptr<WeightStore> store = Newcomer(other);
  Result<internal::PeerBootstrapReport> copied =
      internal::BootstrapFromPeer(peer_->control_url(), *store, Options());
  EXPECT_STATUS_MSG(FailedPrecondition, "a?b=c&d", copied.status());
  EXPECT_STATUS_MSG(FailedPrecondition, "[2048]", copied.status());
  EXPECT_EQ(store->version(), 0u);
  EXPECT_TRUE(Holds(*store, other)) << "nothing is written before the whole copy is verified";

  // A tensor the peer does not hold.
  std::vector<Tensor> more = OddlyNamedModel(7);
  more.push_back(Tensor{"only.here", std::vector<uint16_t>(16)});
  std::unique_ptr<WeightStore> bigger = Newcomer(more);
  copied = internal::BootstrapFromPeer(peer_->control_url(), *bigger, Options());
  EXPECT_STATUS_MSG(NotFound, "only.here", copied.status());
  EXPECT_TRUE(Holds(*bigger, more));
}

TEST_F(PeerBootstrapTest, AWrongKeyOrAPeerThatIsNotThereIsRefusedAndNothingIsWritten) {
  const std::vector<Tensor> step0 = OddlyNamedModel(7);
  std::unique_ptr<WeightStore> store = Newcomer(step0);
  internal::PeerBootstrapOptions wrong = Options();
  wrong.api_key = "not-the-key";
  Result<internal::PeerBootstrapReport> copied =
      internal::BootstrapFromPeer(peer_->control_url(), *store, wrong);
  EXPECT_EQ(copied.status().code(), StatusCode::kPermissionDenied) << copied.status().ToString();
  EXPECT_TRUE(Holds(*store, step0));

  const std::string gone = peer_->control_url();
  peer_->Stop();
  internal::PeerBootstrapOptions once = Options();
  once.attempts = 2;
  copied = internal::BootstrapFromPeer(gone, *store, once);
  EXPECT_STATUS_MSG(Unavailable, gone, copied.status());
  EXPECT_STATUS_MSG(Unavailable, "2 attempt(s)", copied.status());
  EXPECT_EQ(store->version(), 0u);
  EXPECT_TRUE(Holds(*store, step0));

  copied = internal::BootstrapFromPeer("not a url", *store, Options());
  EXPECT_EQ(copied.status().code(), StatusCode::kInvalidArgument) << copied.status().ToString();
}

// Receivers whose engine names its tensors its own way (a loader: canonical "model.layers.N.weight"
// held as "engine.block.N.w") copy each other's local tensors: the newcomer, started with a peer
// through the same loader, holds the peer's version, its canonical piece digests describe the
// copied bytes, and the next sync is the fleet's delta for it, bit-identical.
TEST(PeerBootstrapLoaderTest, ANewcomerThroughTheSameLoaderCopiesAPeerAndTakesTheNextDelta) {
  const LoaderSpec spec{.tp_rank = 0,
                        .tp_size = 1,
                        .rules = {{.kind = LoaderKind::kRename,
                                   .match = "model\\.layers\\.(\\d+)\\.weight",
                                   .to = "engine.block.$1.w"}}};
  struct Engine {
    std::vector<Tensor> buffers;  // under the engine's names
    std::unique_ptr<ReceiverNode> node;
  };
  const auto start = [&](const std::vector<Tensor>& canonical, const std::string& peer) {
    auto engine = std::make_unique<Engine>();
    for (size_t t = 0; t < canonical.size(); ++t) {
      engine->buffers.push_back(
          Tensor{"engine.block." + std::to_string(t) + ".w", canonical[t].bits});
    }
    ReceiverNodeOptions options;
    options.transport_uri = "zmq://?timeout_ms=10000";
    options.data_endpoint = testing::FreeLoopbackEndpoint();
    options.loader = spec;
    options.bootstrap_peer = peer;
    engine->node = ReceiverNode::Make(options).ValueOrDie();
    for (Tensor& t : engine->buffers) {
      EXPECT_OK(engine->node->RegisterTensor(t.mutable_view()));
    }
    EXPECT_OK(engine->node->Start());
    return engine;
  };
  const auto holds = [](const Engine& engine, const std::vector<Tensor>& canonical) {
    for (size_t t = 0; t < canonical.size(); ++t) {
      if (engine.buffers[t].bits != canonical[t].bits) return false;
    }
    return true;
  };
  const std::vector<Tensor> step0 = MakeModel(5);
  std::vector<Tensor> model = step0;
  std::unique_ptr<Engine> peer = start(step0, "");
  PublisherOptions options;
  options.transport_uri = "zmq://?timeout_ms=10000";
  options.receivers = {{peer->node->control_url(), peer->node->producer_endpoint()}};
  auto trainer =
      Publisher::Make(options, std::move(MakeInProcessGroup(1).ValueOrDie()[0])).ValueOrDie();
  ASSERT_OK(trainer->AdoptBaseline(Views(model), 0));
  std::mt19937_64 rng(3);
  for (int step = 0; step < 3; ++step) {
    Step(model, rng);
    ASSERT_OK(trainer->Sync(Views(model)).status());
  }
  ASSERT_TRUE(holds(*peer, model));

  // The copy into a bare store whose canonical pieces were resolved before it.
  {
    std::unique_ptr<WeightStore> store = WeightStore::Make();
    std::vector<Tensor> local;
    for (size_t t = 0; t < step0.size(); ++t) {
      local.push_back(Tensor{"engine.block." + std::to_string(t) + ".w", step0[t].bits});
    }
    for (Tensor& t : local) {
      ASSERT_OK(store->AddExternal(t.mutable_view()));
    }
    ASSERT_OK(store->AttachLoader(Loader::Make(spec, *store).ValueOrDie()));
    const std::vector<std::string> names{"model.layers.0.weight"};
    ASSERT_OK(store->Holdings(names).status());  // resolves it: its piece digest is computed
    ASSERT_OK_AND_ASSIGN(const uint64_t stale, store->PieceDigest(names[0], 0));
    ASSERT_OK_AND_ASSIGN(const internal::PeerBootstrapReport report,
                         internal::BootstrapFromPeer(peer->node->control_url(), *store));
    EXPECT_EQ(report.final_version, 3u);
    ASSERT_OK_AND_ASSIGN(const uint64_t piece, store->PieceDigest(names[0], 0));
    EXPECT_NE(piece, stale);
    ASSERT_OK_AND_ASSIGN(const auto fresh, store->RecomputeHoldings(names));
    ASSERT_EQ(fresh.at(names[0]).pieces.size(), 1u);
    EXPECT_EQ(piece, fresh.at(names[0]).pieces.begin()->second) << "the piece describes the copy";
    EXPECT_EQ(store->Digests(), store->RecomputeDigests());
  }

  // A newcomer node started with the peer joins; the next sync is a delta for both.
  std::unique_ptr<Engine> newcomer = start(step0, peer->node->control_url());
  EXPECT_EQ(newcomer->node->status().version, 3u);
  EXPECT_TRUE(holds(*newcomer, model));
  ASSERT_OK(trainer->SetReceivers(
      {{peer->node->control_url(), peer->node->producer_endpoint()},
       {newcomer->node->control_url(), newcomer->node->producer_endpoint()}}));
  Step(model, rng);
  ASSERT_OK_AND_ASSIGN(const SyncReport synced, trainer->Sync(Views(model)));
  EXPECT_FALSE(synced.transfer.plan.anchor);
  for (const ReceiverOutcome& outcome : synced.transfer.receivers) {
    EXPECT_EQ(outcome.caught_up_by, CatchUp::kDelta) << outcome.name;
  }
  EXPECT_TRUE(holds(*peer, model));
  EXPECT_TRUE(holds(*newcomer, model)) << "bit-identical to the trainer through the loader";
}

// A newcomer of another layout than its peer: the peer holds the model whole (no loader, so its
// tensors are canonical), the newcomers are the two ranks of a TP = 2 group whose loader shards
// four tensors by rows, keeps three whole and skips one. Each copies the peer's version through
// its loader — the rows it holds, never the skipped tensor — and the next sync is the fleet's
// delta for the peer and the group, bit-identical. A loader that expects another shape, or a
// store the peer's tensors do not build, is refused by name before any download.
TEST(PeerBootstrapLoaderTest, ATensorParallelNewcomerCopiesAWholePeerThroughItsLoader) {
  constexpr int kTensors = 8;
  constexpr size_t kRows = 4096;
  const auto spec = [](uint32_t rank) {
    return LoaderSpec{
        .tp_rank = rank,
        .tp_size = 2,
        .rules = {{.kind = LoaderKind::kRow, .match = "model\\.layers\\.[0-3]\\.weight"},
                  {.kind = LoaderKind::kSkip, .match = "model\\.layers\\.7\\.weight"}}};
  };
  // What rank `rank` holds of `canonical`: its rows of tensors 0-3, tensors 4-6 whole.
  const auto shard_of = [](const std::vector<Tensor>& canonical, uint32_t rank) {
    std::vector<Tensor> local;
    for (int t = 0; t < 7; ++t) {
      const std::vector<uint16_t>& bits = canonical[t].bits;
      if (t < 4) {
        local.push_back(Tensor{canonical[t].name,
                               std::vector<uint16_t>(bits.begin() + rank * kRows / 2,
                                                     bits.begin() + (rank + 1) * kRows / 2)});
      } else {
        local.push_back(canonical[t]);
      }
    }
    return local;
  };

  const std::vector<Tensor> step0 = MakeModel(21, kTensors);
  std::vector<Tensor> model = step0;
  std::vector<Tensor> peer_buffers = step0;
  ReceiverNodeOptions peer_options;
  peer_options.transport_uri = "zmq://?timeout_ms=10000";
  peer_options.data_endpoint = testing::FreeLoopbackEndpoint();
  auto peer = ReceiverNode::Make(peer_options).ValueOrDie();
  for (Tensor& t : peer_buffers) ASSERT_OK(peer->RegisterTensor(t.mutable_view()));
  ASSERT_OK(peer->Start());
  PublisherOptions options;
  options.transport_uri = "zmq://?timeout_ms=10000";
  options.receivers = {{peer->control_url(), peer->producer_endpoint()}};
  auto trainer =
      Publisher::Make(options, std::move(MakeInProcessGroup(1).ValueOrDie()[0])).ValueOrDie();
  ASSERT_OK(trainer->AdoptBaseline(Views(model), 0));
  std::mt19937_64 rng(4);
  for (int step = 0; step < 3; ++step) {
    Step(model, rng);
    ASSERT_OK(trainer->Sync(Views(model)).status());
  }

  // Refused by name before any download, the store untouched: a local tensor none of the peer's
  // tensors builds, and a loader that cuts the peer's tensors into other shapes than the store's.
  {
    std::vector<Tensor> local = shard_of(step0, 0);
    std::unique_ptr<WeightStore> store = WeightStore::Make();
    for (Tensor& t : local) ASSERT_OK(store->AddExternal(t.mutable_view()));
    ASSERT_OK(store->AttachLoader(Loader::Make(spec(0), *store).ValueOrDie()));
    const std::vector<Tensor> before = local;
    std::vector<Tensor> extra = local;
    extra.push_back(Tensor{"engine.only.here", std::vector<uint16_t>(8)});
    std::unique_ptr<WeightStore> bigger = WeightStore::Make();
    for (Tensor& t : extra) ASSERT_OK(bigger->AddExternal(t.mutable_view()));
    ASSERT_OK(bigger->AttachLoader(Loader::Make(spec(0), *bigger).ValueOrDie()));
    Result<internal::PeerBootstrapReport> refused =
        internal::BootstrapFromPeer(peer->control_url(), *bigger);
    EXPECT_STATUS_MSG(FailedPrecondition, "engine.only.here", refused.status());
    EXPECT_EQ(bigger->version(), 0u);
    // Rank 0 of TP = 4 holds 1,024 rows of each sharded tensor; this store holds 2,048.
    LoaderSpec wrong = spec(0);
    wrong.tp_size = 4;
    std::unique_ptr<WeightStore> other = WeightStore::Make();
    for (Tensor& t : local) ASSERT_OK(other->AddExternal(t.mutable_view()));
    ASSERT_OK(other->AttachLoader(Loader::Make(wrong, *other).ValueOrDie()));
    refused = internal::BootstrapFromPeer(peer->control_url(), *other);
    EXPECT_STATUS_MSG(FailedPrecondition, "model.layers.0.weight", refused.status());
    EXPECT_EQ(other->version(), 0u);
    for (size_t t = 0; t < local.size(); ++t) {
      EXPECT_EQ(local[t].bits, before[t].bits) << "a refused copy writes nothing";
    }
    // The copy itself: seven canonical tensors downloaded whole, the skipped one not at all.
    ASSERT_OK_AND_ASSIGN(const internal::PeerBootstrapReport report,
                         internal::BootstrapFromPeer(peer->control_url(), *store));
    EXPECT_TRUE(report.canonical);
    EXPECT_EQ(report.final_version, 3u);
    EXPECT_EQ(report.tensors, 7u);
    EXPECT_EQ(report.bytes, 7 * kRows * sizeof(uint16_t));
    EXPECT_EQ(store->version(), 3u);
    EXPECT_EQ(store->Digests(), store->RecomputeDigests());
    const std::vector<Tensor> want = shard_of(model, 0);
    for (size_t t = 0; t < want.size(); ++t) EXPECT_EQ(local[t].bits, want[t].bits) << want[t].name;
  }

  struct Shard {
    std::vector<Tensor> buffers;
    std::unique_ptr<ReceiverNode> node;
  };
  std::vector<std::unique_ptr<Shard>> group;
  for (uint32_t rank = 0; rank < 2; ++rank) {
    auto shard = std::make_unique<Shard>();
    shard->buffers = shard_of(step0, rank);
    ReceiverNodeOptions shard_options;
    shard_options.transport_uri = "zmq://?timeout_ms=10000";
    shard_options.data_endpoint = testing::FreeLoopbackEndpoint();
    shard_options.loader = spec(rank);
    shard_options.place = ReplicaPlace{"tp2", rank, 2};
    shard_options.bootstrap_peer = peer->control_url();
    shard->node = ReceiverNode::Make(shard_options).ValueOrDie();
    for (Tensor& t : shard->buffers) ASSERT_OK(shard->node->RegisterTensor(t.mutable_view()));
    ASSERT_OK(shard->node->Start());
    EXPECT_EQ(shard->node->status().version, 3u);
    const std::vector<Tensor> want = shard_of(model, rank);
    for (size_t t = 0; t < want.size(); ++t) {
      EXPECT_EQ(shard->buffers[t].bits, want[t].bits)
          << "rank " << rank << " " << want[t].name << " after the copy";
    }
    group.push_back(std::move(shard));
  }
  ASSERT_OK(trainer->SetReceivers(
      {{peer->control_url(), peer->producer_endpoint()},
       {group[0]->node->control_url(), group[0]->node->producer_endpoint()},
       {group[1]->node->control_url(), group[1]->node->producer_endpoint()}}));
  for (int step = 0; step < 2; ++step) {
    Step(model, rng);
    ASSERT_OK_AND_ASSIGN(const SyncReport synced, trainer->Sync(Views(model)));
    EXPECT_FALSE(synced.transfer.plan.anchor);
    for (const ReceiverOutcome& outcome : synced.transfer.receivers) {
      EXPECT_EQ(outcome.caught_up_by, CatchUp::kDelta) << outcome.name;
    }
  }
  for (size_t t = 0; t < model.size(); ++t) EXPECT_EQ(peer_buffers[t].bits, model[t].bits);
  for (uint32_t rank = 0; rank < 2; ++rank) {
    const std::vector<Tensor> want = shard_of(model, rank);
    for (size_t t = 0; t < want.size(); ++t) {
      EXPECT_EQ(group[rank]->buffers[t].bits, want[t].bits)
          << "rank " << rank << " " << want[t].name << " after two deltas";
    }
  }
}
}  // namespace
}  // namespace refit
