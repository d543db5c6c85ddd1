// An in-process fleet for coordinator tests: W producers (trackers over one simulated trainer
// model) and N receivers (WeightStore + ReceiverSession + a transport listener, controlled
// directly or through a real HTTP control plane), wired by a transport URI. With "zmq://" and
// HTTP control every byte crosses real loopback sockets, as between processes. With "s3://…"
// (HTTP control required) payloads go through the bucket and manifests to each control plane,
// and the senders' transport is the coordinator's TransferObserver, as in `refit push`.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "codec/tracker.h"
#include "control/control_server.h"
#include "loopback.h"
#include "node/chain_replay.h"
#include "pipeline/coordinator.h"
#include "pipeline/staged_source.h"
#include "receiver/receiver_session.h"
#include "refit/chunk_source.h"
#include "refit/commit_policy.h"
#include "refit/control_client.h"
#include "refit/transport.h"
#include "refit/weight_store.h"
#include "store_snapshot.h"
#include "test_data.h"
#include "test_util.h"
#include "transport/s3/s3_chain.h"

namespace refit::testing {

/// A small model of mixed dtypes and sizes that spans several export chunks of kFleetChunkBytes.
inline std::vector<OwnedTensor> FleetModel(uint64_t seed) {
  return {RandomTensor("model.embed_tokens.weight", DType::kBFloat16, {96, 64}, seed + 1),
          RandomTensor("model.layers.0.self_attn.qkv_proj.weight", DType::kBFloat16, {48, 64},
                       seed + 2),
          RandomTensor("model.layers.0.mlp.up_proj.weight", DType::kFloat32, {40, 33}, seed + 3),
          RandomTensor("model.layers.0.input_layernorm.weight", DType::kBFloat16, {64}, seed + 4),
          RandomTensor("model.layers.1.mlp.down_proj.weight", DType::kFloat16, {33, 70}, seed + 5),
          RandomTensor("model.norm.weight", DType::kFloat32, {64}, seed + 6),
          RandomTensor("lm_head.weight", DType::kBFloat16, {80, 64}, seed + 7)};
}
/// Export chunk target: the model above splits into 5 chunks.
inline constexpr uint64_t kFleetChunkBytes = 8 << 10;

struct FleetOptions {
  size_t receivers = 3;
  uint32_t producers = 2;
  /// "zmq://…" (endpoints are loopback ports), "inproc://<hub>" (endpoints are names) or
  /// "s3://…" (endpoints are the control planes' URLs).
  std::string transport = "zmq://";
  /// Drive receivers through ControlServer/ControlClient over HTTP instead of directly.
  bool http_control = true;
  std::chrono::milliseconds transfer_timeout{std::chrono::seconds(60)};
  uint64_t seed = 7;
  /// The trainer's model; empty: FleetModel(seed).
  std::vector<OwnedTensor> model = {};
  /// Export chunk and payload bucket targets.
  uint64_t chunk_bytes = kFleetChunkBytes;
  uint64_t bucket_bytes = 4 << 10;
  /// Told of each transfer's outcome; null: the senders' transport, as in `refit push`.
  TransferObserver* observer = nullptr;
  /// An s3:// chain receivers catch up from when a prepare finds them behind (as `refit serve
  /// --bootstrap` does); empty: none.
  std::string catch_up_chain = {};
  /// Every receiver's transfer lease (ReceiverSessionOptions::transfer_lease).
  std::chrono::milliseconds transfer_lease = ReceiverSessionOptions{}.transfer_lease;
  /// Every receiver's apply and decode threads (ReceiverSessionOptions).
  int apply_threads = ReceiverSessionOptions{}.apply_threads;
  int decode_threads = ReceiverSessionOptions{}.decode_threads;
  /// The coordinator's commit policy ("all", "quorum:…"). A quorum makes the coordinator name
  /// each transfer's relay tree and plan per receiver, as a Publisher does (zmq:// only).
  std::string commit_policy = "all";
};

/// One receiver: what `refit serve` holds.
struct FleetReceiver {
  std::string endpoint;
  std::unique_ptr<WeightStore> store;
  std::unique_ptr<internal::ReceiverSession> session;
  std::unique_ptr<Listener> listener;
  std::unique_ptr<ControlServer> server;
  std::unique_ptr<ControlClient> client;
  /// Called on the apply thread before each payload (see ReceiverSessionOptions::before_apply).
  std::function<void(const PayloadIds&)> before_apply;

  /// What the coordinator calls: the HTTP client, or the session itself.
  ReceiverControl* control() {
    return client != nullptr ? static_cast<ReceiverControl*>(client.get()) : session.get();
  }
};

class Fleet {
 public:
  explicit Fleet(FleetOptions options) : options_(std::move(options)) {}

  /// Build trackers (adopting the model as their baseline), receivers (holding the model at
  /// version 0) and the coordinator.
  void Start() {
    model_ = options_.model.empty() ? FleetModel(options_.seed) : options_.model;
    ASSERT_OK_AND_ASSIGN(transport_, MakeTransport(options_.transport));
    sender_transport_uri_ = options_.transport;
    const bool tree = transport_->capabilities().fan_out_tree;
    for (size_t r = 0; r < options_.receivers; ++r) {
      // A manifest transport's endpoint is the control URL, known once the server listens.
      endpoints_.push_back(tree ? FreeLoopbackEndpoint() : fmt::format("r{}", r));
    }
    receivers_.resize(options_.receivers);
    for (size_t r = 0; r < options_.receivers; ++r) {
      ASSERT_NO_FATAL_FAILURE(StartReceiver(r, /*version=*/0, model_));
    }
    std::vector<TensorView> views;
    for (const OwnedTensor& t : model_) views.push_back(t.view());
    for (uint32_t p = 0; p < options_.producers; ++p) {
      ASSERT_OK_AND_ASSIGN(std::unique_ptr<internal::DeltaTracker> tracker,
                           internal::DeltaTracker::Make({}));
      ASSERT_OK(AdoptOwnedBaseline(*tracker, views, options_.chunk_bytes, p, options_.producers));
      trackers_.push_back(std::move(tracker));
    }
    ASSERT_NO_FATAL_FAILURE(MakeCoordinator());
  }

  /// (Re)start receiver r holding `tensors` at `version`, on its endpoint.
  void StartReceiver(size_t r, uint64_t version, const std::vector<OwnedTensor>& tensors) {
    FleetReceiver& node = receivers_[r];
    const bool manifests = transport_->capabilities().needs_manifest;
    ASSERT_TRUE(!manifests || options_.http_control) << "manifests need HTTP control planes";
    node.endpoint = manifests ? fmt::format("r{}", r) : endpoints_[r];
    node.store = WeightStore::Make();
    for (const OwnedTensor& t : tensors) ASSERT_OK(node.store->AddCopy(t.view()));
    node.store->set_version(version);
    ReceiverSessionOptions session_options;
    session_options.transfer_lease = options_.transfer_lease;
    session_options.apply_threads = options_.apply_threads;
    session_options.decode_threads = options_.decode_threads;
    session_options.before_apply = [&node](const PayloadIds& ids) {
      if (node.before_apply) node.before_apply(ids);
    };
    ASSERT_OK_AND_ASSIGN(node.session,
                         internal::ReceiverSession::Make(session_options, *node.store));
    ListenerContext context;
    context.endpoint = node.endpoint;
    if (transport_->capabilities().fan_out_tree) context.peers = endpoints_;
    ASSERT_OK_AND_ASSIGN(node.listener, transport_->MakeListener(context, *node.session));
    ASSERT_OK(node.listener->Start());
    if (options_.http_control) {
      ControlServerOptions server_options;
      if (manifests) {
        server_options.manifest_handler = [&node](std::string_view manifest,
                                                  std::stop_token stop) -> Result<StagedManifest> {
          REFIT_ASSIGN_OR_RETURN(const ManifestDelivery delivered,
                                 node.listener->AcceptManifest(manifest, std::move(stop)));
          return StagedManifest{.result = delivered.result,
                                .payload_bytes = delivered.payload_bytes};
        };
      }
      if (!options_.catch_up_chain.empty()) {
        server_options.catch_up = [&node, uri = options_.catch_up_chain](uint64_t base_version) {
          return CatchUpFromChain(uri, *node.session, *node.store, base_version).status();
        };
      }
      if (transport_->capabilities().fan_out_tree) {
        server_options.route_transfer = [&node](const TransferId& id, const RelayTree& tree) {
          return node.listener->RouteTransfer(id, tree);
        };
      }
      ASSERT_OK_AND_ASSIGN(node.server,
                           ControlServer::Make(server_options, *node.session, *node.store));
      ASSERT_OK(node.server->Start());
      if (manifests) endpoints_[r] = node.server->base_url();
      ControlClientOptions client_options;
      client_options.base_url = node.server->base_url();
      // A dead receiver must fail fast: the coordinator's own budget bounds the transfer.
      client_options.timeout = std::chrono::seconds(5);
      client_options.max_retries = 1;
      ASSERT_OK_AND_ASSIGN(node.client, ControlClient::Make(client_options));
    }
  }

  /// Add a receiver (a late joiner) holding `tensors` at `version`; the coordinator refits it
  /// from the next transfer on. Returns its index.
  size_t AddReceiver(uint64_t version, const std::vector<OwnedTensor>& tensors) {
    const size_t r = receivers_.size();
    const bool tree = transport_->capabilities().fan_out_tree;
    EXPECT_FALSE(tree) << "a relay tree's peer list is fixed at start";
    endpoints_.push_back(fmt::format("r{}", r));
    receivers_.emplace_back();
    EXPECT_NO_FATAL_FAILURE(StartReceiver(r, version, tensors));
    EXPECT_NO_FATAL_FAILURE(MakeCoordinator());
    return r;
  }

  /// Take receiver r off the network as a crashed process would be: its ports close. Its session
  /// and store stay until RestartReceiver (a dead process's memory would be gone).
  void KillReceiver(size_t r) {
    FleetReceiver& node = receivers_[r];
    if (node.server != nullptr) node.server->Stop();
    if (node.listener != nullptr) node.listener->Stop();
  }

  /// Replace receiver r by a fresh process loaded from `tensors` at `version`.
  void RestartReceiver(size_t r, uint64_t version, const std::vector<OwnedTensor>& tensors) {
    FleetReceiver& node = receivers_[r];
    node.client.reset();
    node.server.reset();
    node.listener.reset();
    node.session.reset();
    node.store.reset();
    node.before_apply = nullptr;
    ASSERT_NO_FATAL_FAILURE(StartReceiver(r, version, tensors));
    ASSERT_NO_FATAL_FAILURE(MakeCoordinator());
  }

  /// Senders use this transport from now on (e.g. "fault+zmq://?seed=3&corrupt=1"); listeners
  /// stay those of the fleet's transport.
  void SetSenderTransport(const std::string& uri) {
    sender_transport_uri_ = uri;
    ASSERT_NO_FATAL_FAILURE(MakeCoordinator());
  }

  /// The trainer takes a step: each element changes with probability `density`.
  void TrainStep(double density, uint64_t seed) {
    for (size_t t = 0; t < model_.size(); ++t) {
      model_[t] = Perturb(model_[t], density, seed * 1000 + t);
    }
  }

  Result<RefitReport> Refit() { return coordinator_->Refit(); }

  /// Every receiver holds `expected` bit-exactly at `version`, with digests that match the bytes.
  void ExpectReceiversHold(const StoreSnapshot& expected) const {
    for (size_t r = 0; r < receivers_.size(); ++r) {
      SCOPED_TRACE(fmt::format("receiver {}", r));
      const WeightStore& store = *receivers_[r].store;
      EXPECT_EQ(TakeSnapshot(store), expected);
      EXPECT_EQ(store.RecomputeDigests(), store.Digests());
      EXPECT_EQ(receivers_[r].session->GetStatus().state, ReceiverState::kIdle);
    }
  }

  /// The trainer's model as a receiver should hold it at `version`.
  StoreSnapshot ModelSnapshot(uint64_t version) const {
    std::unique_ptr<WeightStore> store = WeightStore::Make();
    for (const OwnedTensor& t : model_) EXPECT_TRUE(store->AddCopy(t.view()).ok());
    store->set_version(version);
    return TakeSnapshot(*store);
  }

  /// No tracker has an open transfer, and each is at `version`.
  void ExpectTrackersAt(uint64_t version) const {
    for (size_t p = 0; p < trackers_.size(); ++p) {
      SCOPED_TRACE(fmt::format("producer {}", p));
      EXPECT_FALSE(trackers_[p]->open_transfer().has_value());
      EXPECT_EQ(trackers_[p]->version(), version);
    }
  }

  std::deque<FleetReceiver>& receivers() { return receivers_; }
  std::vector<std::unique_ptr<internal::DeltaTracker>>& trackers() { return trackers_; }
  const std::vector<OwnedTensor>& model() const { return model_; }
  const std::vector<std::string>& endpoints() const { return endpoints_; }
  FleetOptions& options() { return options_; }
  internal::Coordinator& coordinator() { return *coordinator_; }

  /// Called when a producer opens its channel: every receiver is prepared, nothing is sent yet.
  std::function<void(const internal::ChannelRequest&)> on_channel_open;

 private:
  void MakeCoordinator() {
    TransportOptions transport_options;
    // Manifests (s3://) go to the receivers' control planes as the coordinator's calls do.
    ControlClientOptions announcer_options;
    announcer_options.timeout = std::chrono::seconds(5);
    announcer_options.max_retries = 1;
    transport_options.manifest_announcers = MakeControlManifestAnnouncers(announcer_options);
    ASSERT_OK_AND_ASSIGN(sender_transport_,
                         MakeTransport(sender_transport_uri_, transport_options));
    std::vector<internal::CoordinatedProducer> producers;
    for (const std::unique_ptr<internal::DeltaTracker>& tracker : trackers_) {
      producers.push_back({tracker.get(), [this](const TransferPlan&) -> Result<ChunkSource> {
                             std::vector<TensorView> views;
                             for (const OwnedTensor& t : model_) views.push_back(t.view());
                             return TensorListSource(std::move(views), options_.chunk_bytes);
                           }});
    }
    std::vector<internal::CoordinatedReceiver> receivers;
    for (size_t r = 0; r < receivers_.size(); ++r) {
      receivers.push_back({fmt::format("receiver {}", r), receivers_[r].control()});
      receivers.back().data_endpoint = endpoints_[r];
    }
    internal::CoordinatorOptions options;
    ASSERT_OK_AND_ASSIGN(options.commit_policy, ParseCommitPolicy(options_.commit_policy));
    if (options.commit_policy.kind == CommitPolicy::Kind::kQuorum) {
      options.relay_trees = true;
      options.per_receiver_plans = true;
    }
    options.observer = options_.observer != nullptr ? options_.observer : sender_transport_.get();
    options.stream.chunk_bytes = options_.chunk_bytes;
    options.stream.bucket_bytes = options_.bucket_bytes;
    options.stream.encode_threads = 2;
    options.stream.serialize_threads = 1;
    options.stream.send_threads = 2;
    options.transfer_timeout = options_.transfer_timeout;
    internal::ChannelFactory channels =
        [this](const internal::ChannelRequest& request) -> Result<std::unique_ptr<PayloadChannel>> {
      if (on_channel_open) on_channel_open(request);
      REFIT_ASSIGN_OR_RETURN(
          std::unique_ptr<TransportSender> sender,
          sender_transport_->MakeSender(SenderContext{.transfer_id = request.transfer_id,
                                                      .producer_id = request.producer_id,
                                                      .base_version = request.base_version,
                                                      .target_version = request.target_version,
                                                      .endpoints = endpoints_}));
      return std::unique_ptr<PayloadChannel>(std::move(sender));
    };
    ASSERT_OK_AND_ASSIGN(coordinator_, internal::Coordinator::Make(options, std::move(producers),
                                                                   std::move(receivers), channels));
  }

  FleetOptions options_;
  std::vector<OwnedTensor> model_;
  std::unique_ptr<Transport> transport_;
  std::string sender_transport_uri_;
  std::unique_ptr<Transport> sender_transport_;
  std::vector<std::string> endpoints_;
  // A deque: AddReceiver must not move the nodes the handlers and hooks capture.
  std::deque<FleetReceiver> receivers_;
  std::vector<std::unique_ptr<internal::DeltaTracker>> trackers_;
  std::unique_ptr<internal::Coordinator> coordinator_;
};

}  // namespace refit::testing
