#include "refit/receiver_node.h"

#include <algorithm>
#include <memory>
#include <stop_token>
#include <string>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "control/control_server.h"
#include "node/chain_replay.h"
#include "node/peer_bootstrap.h"
#include "receiver/receiver_session.h"
#include "refit/control_client.h"
#include "refit/lineage.h"
#include "refit/safetensors.h"
#include "refit/status_format.h"
#include "refit/transport.h"
#include "transport/transport_internal.h"
#include "util/logging.h"
#include "util/mutex.h"

namespace refit {

uint64_t DefaultMaxPayloadBytes(const WeightStore& store, uint64_t bucket_bytes) {
  uint64_t canonical_per_local = 1;
  if (const Loader* loader = store.loader(); loader != nullptr) {
    const LoaderSpec& spec = loader->spec();
    uint64_t expert_split = 1;
    for (const LoaderRule& rule : spec.rules) {
      if (!rule.experts.empty() && rule.num_experts > rule.experts.size()) {
        expert_split = std::max<uint64_t>(
            expert_split, (rule.num_experts + rule.experts.size() - 1) / rule.experts.size());
      }
    }
    canonical_per_local = uint64_t{spec.tp_size} * expert_split;
  }
  uint64_t largest = 0;
  for (const TensorView& tensor : store.tensors()) {
    // From the shape: a device tensor's view has no bytes.
    const Result<uint64_t> bytes = TensorBytes(tensor.shape, tensor.dtype);
    if (bytes.ok()) largest = std::max(largest, *bytes);
  }
  const uint64_t one_message = std::max(bucket_bytes, largest * canonical_per_local);
  return std::max(kMinDefaultMaxPayloadBytes, 2 * one_message);
}

struct ReceiverNode::Impl {
  ReceiverNodeOptions options;
  TransportUri uri;
  std::unique_ptr<Transport> transport;
  std::unique_ptr<WeightStore> store;
  std::optional<ChainBootstrapReport> bootstrap_report;
  // Declared in the order they are built; Stop tears them down in reverse.
  std::unique_ptr<internal::ReceiverSession> session;
  std::unique_ptr<Listener> listener;
  std::unique_ptr<ControlServer> server;
  std::string producer_endpoint;
  uint64_t max_payload_bytes = 0;
  bool started = false;

  // Join, Leave and Stop run one at a time: any of them may start or stop the fleet watch, and
  // they come from the user's thread and from control-plane handlers alike. Held across their
  // calls to the publisher; the watch never takes it (Stop waits for the watch while holding it).
  internal::Mutex lifecycle_mutex;
  bool stopped REFIT_GUARDED_BY(lifecycle_mutex) = false;
  // The fleet this receiver joined (Join), for Leave: its publisher and what it advertised.
  internal::Mutex membership_mutex;
  std::string joined_publisher REFIT_GUARDED_BY(membership_mutex);
  MemberEndpoint joined_as REFIT_GUARDED_BY(membership_mutex);
  // The watch is announcing this receiver again (RejoinIfUnlisted), and a Leave is under way:
  // each waits for the other (membership_changed), so a leave is never undone by a re-join that
  // crossed it.
  bool rejoining REFIT_GUARDED_BY(membership_mutex) = false;
  bool leaving REFIT_GUARDED_BY(membership_mutex) = false;
  internal::CondVar membership_changed;
  // While joined: asks the publisher for the fleet's version every fleet_watch_interval
  // (WatchFleet). Only Join, Leave and Stop start and stop it.
  internal::Mutex watch_mutex;
  internal::CondVar watch_wake;
  std::jthread fleet_watch;

  Status Start();
  void Stop();
  Result<FleetMembership> Join(const std::string& publisher_url, const MemberEndpoint& advertised);
  Result<FleetMembership> Leave(std::chrono::milliseconds timeout, int max_retries);
  Result<FleetMembership> LeaveLocked(std::chrono::milliseconds timeout, int max_retries)
      REFIT_REQUIRES(lifecycle_mutex);
  // Until `stop`: every fleet_watch_interval, the fleet's version from `publisher`'s membership
  // endpoint into the readiness; a failed ask is logged once per outage and changes nothing (the
  // receiver knows what it knew).
  void WatchFleet(const std::stop_token& stop, const std::string& publisher);
  // Ask the publisher behind `client` for its roster once and tell the readiness the fleet's
  // version. Returns the roster, or why not when it could not.
  Result<FleetMembership> AskFleet(ControlClient& client);
  // The watch's ask: the fleet's version into the readiness, and, when the publisher's roster
  // does not list this receiver (a publisher restarted without its roster, or one that dropped
  // this receiver while it was cut off), this receiver announces itself again.
  Status WatchOnce(ControlClient& client, const std::string& publisher);
  void StopWatchingFleet() REFIT_REQUIRES(lifecycle_mutex);
  // A client of the publisher's membership endpoint, with this receiver's key.
  Result<std::unique_ptr<ControlClient>> PublisherClient(const std::string& publisher_url,
                                                         std::chrono::milliseconds timeout,
                                                         int max_retries) const;
};

namespace {

// Stop leaves the fleet it joined, but must not hang on a publisher that is gone: one attempt,
// this long.
constexpr std::chrono::milliseconds kLeaveAtStopTimeout{std::chrono::seconds(5)};
// The longest a readiness answer waits for its own ask of the publisher (FleetStanding::
// RefreshIfOverdue): probes time out after about a second.
constexpr std::chrono::milliseconds kInlineAskLimit{300};

}  // namespace

Result<std::unique_ptr<ReceiverNode>> ReceiverNode::Make(const ReceiverNodeOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  REFIT_ASSIGN_OR_RETURN(TransportUri uri, TransportUri::Parse(options.transport_uri));
  REFIT_ASSIGN_OR_RETURN(
      impl->uri, internal::KeyDataPlane(std::move(uri), options.control.api_key, "receiver node"));
  TransportOptions transport_options;
  transport_options.limits = options.session.limits;
  REFIT_ASSIGN_OR_RETURN(impl->transport, MakeTransport(impl->uri, transport_options));
  const TransportCapabilities caps = impl->transport->capabilities();
  if (!caps.fan_out_tree && !caps.needs_manifest && !caps.carries_control) {
    return InvalidArgument(
        "receiver node: transport '{}' is neither a relay tree (zmq://), an object store (s3://) "
        "nor a collective (mpi://)",
        impl->uri.scheme);
  }
  if (caps.fan_out_tree && options.data_endpoint.empty()) {
    return InvalidArgument(
        "receiver node: a relay-tree transport needs data_endpoint (host:port): other relays "
        "and producers address this receiver by it");
  }
  if (!caps.fan_out_tree && (!options.data_endpoint.empty() || !options.peers.empty())) {
    return InvalidArgument(
        "receiver node: data_endpoint and peers are for relay-tree transports (zmq://); an "
        "object store announces payloads through the control plane, and a collective (mpi://) "
        "knows its ranks");
  }
  ReplicaPlace& place = impl->options.place;
  if (options.loader.has_value() && options.loader->tp_size > 1) {
    if (place.replica.empty()) {
      return InvalidArgument(
          "receiver node: a tensor-parallel loader (tp_size {}) needs a replica name: the "
          "shards of one replica are verified together",
          options.loader->tp_size);
    }
    if (place.shards == 1 && place.shard == 0) {
      place.shard = options.loader->tp_rank;
      place.shards = options.loader->tp_size;
    }
  }
  if (place.shards == 0 || place.shard >= place.shards) {
    return InvalidArgument("receiver node: shard {} of {}", place.shard, place.shards);
  }
  if (!options.model_path.empty()) {
    uint64_t version = options.version.value_or(0);
    // The lineage travels with the version it was recorded with (docs/protocol.md "Lineage and
    // fencing"): a version given on the command line overrides both.
    HeldLineage lineage;
    if (!options.version.has_value()) {
      Result<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(options.model_path);
      if (!file.ok()) return file.status().WithContext("receiver node: model");
      version = WeightVersionOf(**file);
      Result<HeldLineage> recorded = LineageFromMetadata((*file)->metadata());
      if (!recorded.ok()) {
        return recorded.status().WithContext(
            fmt::format("receiver node: model '{}'", options.model_path));
      }
      lineage = *std::move(recorded);
    }
    Result<std::unique_ptr<WeightStore>> opened =
        WeightStore::Open(options.model_path, options.store_mode);
    if (!opened.ok()) return opened.status().WithContext("receiver node: model");
    impl->store = std::move(opened).ValueOrDie();
    impl->store->set_version(version);
    impl->store->set_lineage(std::move(lineage));
  } else {
    impl->store = WeightStore::Make();
    impl->store->set_version(options.version.value_or(0));
  }
  return std::unique_ptr<ReceiverNode>(new ReceiverNode(std::move(impl)));
}

ReceiverNode::ReceiverNode(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ReceiverNode::~ReceiverNode() { Stop(); }

Status ReceiverNode::RegisterTensor(const MutableTensorView& tensor) {
  if (impl_->started) {
    return FailedPrecondition("receiver node: tensor '{}' registered after Start", tensor.name);
  }
  if (!impl_->options.model_path.empty()) {
    return FailedPrecondition(
        "receiver node: tensor '{}' registered, but the model comes from file '{}'", tensor.name,
        impl_->options.model_path);
  }
  return impl_->store->AddExternal(tensor);
}

Status ReceiverNode::RegisterDeviceTensor(std::string name, DType dtype, Shape shape,
                                          std::shared_ptr<TensorMemory> memory) {
  if (impl_->started) {
    return FailedPrecondition("receiver node: tensor '{}' registered after Start", name);
  }
  if (!impl_->options.model_path.empty()) {
    return FailedPrecondition(
        "receiver node: tensor '{}' registered, but the model comes from file '{}'", name,
        impl_->options.model_path);
  }
  return impl_->store->AddDevice(std::move(name), dtype, std::move(shape), std::move(memory));
}

Status ReceiverNode::Start() { return impl_->Start(); }

Status ReceiverNode::Impl::Start() {
  if (started) return FailedPrecondition("receiver node: already started");
  started = true;
  if (store->size() == 0) {
    return FailedPrecondition("receiver node: no tensors (name a model file or register tensors)");
  }
  if (options.loader.has_value()) {
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<Loader> loader, Loader::Make(*options.loader, *store));
    REFIT_RETURN_NOT_OK(store->AttachLoader(std::move(loader)).WithContext("receiver node"));
  }
  // The payload limit, once the model (and its loader) is known; the transport made by Make
  // checked the URI and its capabilities, and is made again with the limit.
  max_payload_bytes = options.max_payload_bytes.value_or(
      DefaultMaxPayloadBytes(*store, options.producer_bucket_bytes));
  options.session.limits.max_payload_bytes = max_payload_bytes;
  options.session.limits.max_body_bytes = max_payload_bytes;
  options.control.max_request_bytes = max_payload_bytes;
  TransportOptions transport_options;
  transport_options.limits = options.session.limits;
  REFIT_ASSIGN_OR_RETURN(transport, MakeTransport(uri, transport_options));
  if (!options.bootstrap_uri.empty()) {
    ChainBootstrapOptions bootstrap;
    bootstrap.session = options.session;
    bootstrap.on_version = options.on_bootstrap_version;
    Result<ChainBootstrapReport> caught_up =
        BootstrapFromChain(options.bootstrap_uri, *store, bootstrap);
    if (!caught_up.ok()) return caught_up.status().WithContext("receiver node: bootstrap");
    bootstrap_report = *caught_up;
  }
  if (!options.bootstrap_peer.empty()) {
    if (!options.bootstrap_uri.empty()) {
      return InvalidArgument("receiver node: bootstrap from peer {} and from chain {}: choose one",
                             options.bootstrap_peer, options.bootstrap_uri);
    }
    internal::PeerBootstrapOptions peer;
    peer.api_key = options.control.api_key;
    Result<internal::PeerBootstrapReport> copied =
        internal::BootstrapFromPeer(options.bootstrap_peer, *store, peer);
    if (!copied.ok()) return copied.status().WithContext("receiver node");
    REFIT_LOG_INFO(
        "receiver node: copied version {} ({} tensors, {} bytes{}) from peer {} in {:.2f} s "
        "({} attempt(s)); held version {} before",
        copied->final_version, copied->tensors, copied->bytes,
        copied->canonical ? ", canonical, through the loader" : "", copied->peer, copied->seconds,
        copied->attempts, copied->start_version);
  }
  Result<std::unique_ptr<internal::ReceiverSession>> made =
      internal::ReceiverSession::Make(options.session, *store);
  if (!made.ok()) return made.status().WithContext("receiver node: session");
  session = std::move(made).ValueOrDie();

  // The control plane, made before the data plane and started after it: a transport that
  // carries its own control channel (mpi://) answers it through the server's Serve.
  const TransportCapabilities caps = transport->capabilities();
  ControlServerOptions control = options.control;
  control.place = options.place;
  if (caps.fan_out_tree) {
    // The peers list holds the data endpoint exactly once (the listener refuses it otherwise).
    const auto self = std::find(options.peers.begin(), options.peers.end(), options.data_endpoint);
    control.relay = RelayPlace{
        static_cast<uint32_t>(self == options.peers.end() ? 0 : self - options.peers.begin()),
        static_cast<uint32_t>(std::max<size_t>(options.peers.size(), 1))};
  }
  if (caps.fan_out_tree) {
    // Each transfer's prepare names the relay tree its payloads take; the listener exists by
    // the time the control plane serves a prepare (it starts after the data plane).
    control.route_transfer = [this](const TransferId& transfer_id, const RelayTree& tree) {
      return listener->RouteTransfer(transfer_id, tree);
    };
  }
  if (!options.bootstrap_uri.empty()) {
    // Fallen behind (the fleet moved on while this receiver was cut off): replay the chain's
    // deltas through the live session, then take the prepare.
    control.catch_up = [this](uint64_t base_version) -> Status {
      ChainBootstrapOptions catch_up;
      catch_up.session = options.session;
      REFIT_ASSIGN_OR_RETURN(
          const ChainBootstrapReport report,
          CatchUpFromChain(options.bootstrap_uri, *session, *store, base_version, catch_up));
      REFIT_LOG_INFO("receiver node: caught up from version {} to {}: {} version(s), {} payloads",
                     report.start_version, report.final_version, report.versions_replayed,
                     report.payloads);
      return Status::OK();
    };
  }
  if (caps.needs_manifest) {
    control.manifest_handler = [this](std::string_view manifest,
                                      std::stop_token stop) -> Result<StagedManifest> {
      REFIT_ASSIGN_OR_RETURN(const ManifestDelivery delivered,
                             listener->AcceptManifest(manifest, std::move(stop)));
      return StagedManifest{.result = delivered.result, .payload_bytes = delivered.payload_bytes};
    };
  }
  control.join = [this](const std::string& publisher_url, const MemberEndpoint& advertised) {
    return Join(publisher_url, advertised);
  };
  control.leave = [this] {
    return Leave(ControlClientOptions{}.timeout, ControlClientOptions{}.max_retries);
  };
  Result<std::unique_ptr<ControlServer>> server_made =
      ControlServer::Make(control, *session, *store);
  if (!server_made.ok()) return server_made.status().WithContext("receiver node: control plane");
  server = std::move(server_made).ValueOrDie();

  // The data plane. An object store's listener binds nothing; it is named by the control plane
  // that hands it the manifests.
  ListenerContext context;
  if (caps.fan_out_tree) {
    context.endpoint = options.data_endpoint;
    context.peers = options.peers;
    context.bind_address = options.data_bind_address;
  } else {
    context.endpoint = fmt::format("{}://{}", uri.scheme, uri.target);
  }
  if (caps.carries_control) {
    ControlServer* served = server.get();
    context.control_handler = [served](const ControlRequest& request) {
      return served->Serve(request);
    };
  }
  Result<std::unique_ptr<Listener>> listener_made = transport->MakeListener(context, *session);
  if (!listener_made.ok()) {
    return listener_made.status().WithContext(
        "receiver node: data plane (the peers must list this receiver's data endpoint exactly)");
  }
  listener = std::move(listener_made).ValueOrDie();
  REFIT_RETURN_NOT_OK(listener->Start().WithContext("receiver node: data plane"));
  REFIT_RETURN_NOT_OK(server->Start().WithContext("receiver node: control plane"));

  const bool data_plane_keyed =
      uri.Param(kUriApiKeyParam) != nullptr || uri.Param(kUriApiKeyEnvParam) != nullptr;
  if (!data_plane_keyed && caps.fan_out_tree) {
    REFIT_LOG_WARN(
        "receiver node: no api key on the data plane ({}): anyone who can reach {} can write "
        "this receiver's weights",
        options.transport_uri, listener->endpoint());
  }
  // Producers address an object-store receiver by its control plane, where manifests go.
  // The listener's endpoint: the data endpoint, with the port the kernel chose for port 0.
  producer_endpoint = caps.fan_out_tree      ? listener->endpoint()
                      : caps.carries_control ? listener->endpoint()
                                             : server->base_url();
  return Status::OK();
}

void ReceiverNode::Stop() { impl_->Stop(); }

void ReceiverNode::Impl::Stop() {
  {
    internal::MutexLock life(lifecycle_mutex);
    if (stopped) return;
    bool joined = false;
    {
      internal::MutexLock lock(membership_mutex);
      joined = !joined_publisher.empty();
    }
    if (joined && server != nullptr) {
      // A worker that shuts down cleanly leaves; one that dies is dropped after missed syncs.
      Result<FleetMembership> left = LeaveLocked(kLeaveAtStopTimeout, 0);
      if (!left.ok()) {
        REFIT_LOG_WARN("receiver node: could not leave the fleet at stop: {}",
                       left.status().ToString());
      }
    }
    StopWatchingFleet();
    // A Join waiting for the lock sees this and refuses: no watch starts after this point.
    stopped = true;
  }
  // No new transfer can start once the control plane is down, and no payload arrives once the
  // data plane is; only then may the session go (its end rolls an open transfer back).
  if (server != nullptr) server->Stop();
  if (listener != nullptr) listener->Stop();
  server.reset();
  listener.reset();
  session.reset();
}

std::string ReceiverNode::control_url() const {
  return impl_->server == nullptr ? std::string() : impl_->server->base_url();
}

uint16_t ReceiverNode::control_port() const {
  return impl_->server == nullptr ? 0 : impl_->server->port();
}

uint64_t ReceiverNode::max_payload_bytes() const { return impl_->max_payload_bytes; }

std::string ReceiverNode::producer_endpoint() const { return impl_->producer_endpoint; }

ReceiverStatus ReceiverNode::status() const {
  if (impl_->session == nullptr) {
    ReceiverStatus idle;
    idle.version = impl_->store->version();
    return idle;
  }
  return impl_->session->GetStatus();
}

Result<std::unique_ptr<ControlClient>> ReceiverNode::Impl::PublisherClient(
    const std::string& publisher_url, std::chrono::milliseconds timeout, int max_retries) const {
  ControlClientOptions client;
  client.base_url = publisher_url;
  client.api_key = options.control.api_key;
  client.timeout = timeout;
  client.max_retries = max_retries;
  return ControlClient::Make(client);
}

Result<FleetMembership> ReceiverNode::Impl::Join(const std::string& publisher_url,
                                                 const MemberEndpoint& advertised) {
  internal::MutexLock life(lifecycle_mutex);
  if (server == nullptr || stopped) {
    return FailedPrecondition("receiver node: join {} after Start (and before Stop)",
                              publisher_url);
  }
  MemberEndpoint self{
      advertised.control_url.empty() ? server->base_url() : advertised.control_url,
      advertised.data_endpoint.empty() ? producer_endpoint : advertised.data_endpoint};
  for (std::string_view wildcard : {"0.0.0.0", "[::]", "*"}) {
    if (self.control_url.find(wildcard) != std::string::npos ||
        self.data_endpoint.find(wildcard) != std::string::npos) {
      return InvalidArgument(
          "receiver node: cannot join {} as control URL '{}', data endpoint '{}': a wildcard "
          "address is not reachable; advertise the addresses the publisher reaches",
          publisher_url, self.control_url, self.data_endpoint);
    }
  }
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ControlClient> client,
                         PublisherClient(publisher_url, ControlClientOptions{}.timeout,
                                         ControlClientOptions{}.max_retries));
  Result<FleetMembership> joined = client->AddMember(self);
  if (!joined.ok()) {
    return joined.status().WithContext(fmt::format("joining the fleet of {}", publisher_url));
  }
  // A join to another fleet replaces the watch of the last one, before anything of the new
  // fleet is recorded (the old watch cannot report the old fleet's version after that).
  StopWatchingFleet();
  {
    internal::MutexLock lock(membership_mutex);
    joined_publisher = client->base_url();
    joined_as = self;
  }
  internal::FleetStanding& standing = server->fleet_standing();
  if (joined->fleet_version.has_value()) standing.ObserveFleetVersion(*joined->fleet_version);
  standing.Joined(client->base_url());
  if (options.fleet_watch_interval.count() > 0) {
    const std::string publisher = client->base_url();
    // A readiness answer asks the publisher itself when the watch is overdue (a process that
    // was stopped): briefly, since a probe waits for it.
    const std::chrono::milliseconds inline_limit =
        std::min(options.fleet_watch_interval, kInlineAskLimit);
    standing.StartWatch(
        [this, publisher, inline_limit] {
          Result<std::unique_ptr<ControlClient>> asker =
              PublisherClient(publisher, inline_limit, 0);
          if (asker.ok()) AskFleet(**asker).status().IgnoreError();
        },
        options.fleet_watch_interval);
    fleet_watch = std::jthread(
        [this, publisher](const std::stop_token& stop) { WatchFleet(stop, publisher); });
  }
  REFIT_LOG_INFO("receiver node: joined the fleet of {} as {} (fleet version {}, {} members)",
                 client->base_url(), self.control_url,
                 joined->fleet_version.has_value() ? std::to_string(*joined->fleet_version)
                                                   : std::string("unknown"),
                 joined->members.size());
  return joined;
}

Result<FleetMembership> ReceiverNode::Impl::Leave(std::chrono::milliseconds timeout,
                                                  int max_retries) {
  internal::MutexLock life(lifecycle_mutex);
  return LeaveLocked(timeout, max_retries);
}

Result<FleetMembership> ReceiverNode::Impl::LeaveLocked(std::chrono::milliseconds timeout,
                                                        int max_retries) {
  std::string publisher;
  MemberEndpoint self;
  {
    internal::MutexLock lock(membership_mutex);
    publisher = joined_publisher;
    self = joined_as;
  }
  if (publisher.empty()) return FailedPrecondition("receiver node: it joined no fleet to leave");
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ControlClient> client,
                         PublisherClient(publisher, timeout, max_retries));
  {
    // No re-join of the watch may land after the leave.
    internal::MutexLock lock(membership_mutex);
    leaving = true;
    membership_changed.wait(lock, [&]() REFIT_REQUIRES(membership_mutex) { return !rejoining; });
  }
  Result<FleetMembership> left = client->RemoveMember(self.control_url);
  // Still a member when the publisher did not take the leave: the watch goes on.
  if (!left.ok()) {
    internal::MutexLock lock(membership_mutex);
    leaving = false;
    return left.status().WithContext(fmt::format("leaving the fleet of {}", publisher));
  }
  StopWatchingFleet();
  {
    internal::MutexLock lock(membership_mutex);
    joined_publisher.clear();
    leaving = false;
  }
  if (server != nullptr) server->fleet_standing().Left();
  REFIT_LOG_INFO("receiver node: left the fleet of {}", publisher);
  return left;
}

Result<FleetMembership> ReceiverNode::Impl::AskFleet(ControlClient& client) {
  REFIT_ASSIGN_OR_RETURN(FleetMembership fleet, client.GetMembership());
  if (fleet.fleet_version.has_value()) server->fleet_standing().Watched(*fleet.fleet_version);
  return fleet;
}

Status ReceiverNode::Impl::WatchOnce(ControlClient& client, const std::string& publisher) {
  REFIT_ASSIGN_OR_RETURN(const FleetMembership fleet, AskFleet(client));
  MemberEndpoint self;
  {
    internal::MutexLock lock(membership_mutex);
    if (joined_publisher != publisher || leaving) return Status::OK();
    self = joined_as;
  }
  if (std::any_of(fleet.members.begin(), fleet.members.end(), [&](const MemberStanding& member) {
        return member.endpoint.control_url == self.control_url;
      })) {
    return Status::OK();
  }
  {
    internal::MutexLock lock(membership_mutex);
    if (joined_publisher != publisher || leaving) return Status::OK();
    rejoining = true;
  }
  Result<FleetMembership> joined = client.AddMember(self);
  {
    internal::MutexLock lock(membership_mutex);
    rejoining = false;
  }
  membership_changed.notify_all();
  if (!joined.ok()) {
    return joined.status().WithContext(fmt::format(
        "joining the fleet of {} again (its roster does not list this receiver)", publisher));
  }
  if (joined->fleet_version.has_value()) {
    server->fleet_standing().ObserveFleetVersion(*joined->fleet_version);
  }
  REFIT_LOG_WARN(
      "receiver node: the fleet of {} did not list this receiver (a publisher restarted without "
      "its roster, or one that dropped it while it was cut off): joined it again as {}",
      publisher, self.control_url);
  return Status::OK();
}

void ReceiverNode::Impl::WatchFleet(const std::stop_token& stop, const std::string& publisher) {
  // One client for the watch's life: its connection is kept between asks.
  Result<std::unique_ptr<ControlClient>> client =
      PublisherClient(publisher, options.fleet_watch_interval, 0);
  if (!client.ok()) {
    REFIT_LOG_WARN("receiver node: cannot watch the fleet of {}: {}", publisher,
                   client.status().ToString());
    return;
  }
  bool reached = true;
  while (true) {
    {
      internal::MutexLock lock(watch_mutex);
      watch_wake.wait_for(lock, stop, options.fleet_watch_interval, [] { return false; });
    }
    if (stop.stop_requested()) return;
    const Status asked = WatchOnce(**client, publisher);
    if (!asked.ok() && reached) {
      REFIT_LOG_WARN("receiver node: cannot ask the fleet of {} for its version: {}", publisher,
                     asked.ToString());
    }
    reached = asked.ok();
  }
}

void ReceiverNode::Impl::StopWatchingFleet() {
  if (server != nullptr) server->fleet_standing().StopWatch();
  if (fleet_watch.joinable()) {
    fleet_watch.request_stop();
    fleet_watch.join();
  }
}

Readiness ReceiverNode::readiness() const {
  if (impl_->server == nullptr) {
    Readiness readiness;
    readiness.version = status().version;
    readiness.detail = "the receiver is not started";
    return readiness;
  }
  return impl_->server->readiness();
}

Result<FleetMembership> ReceiverNode::Join(const std::string& publisher_url,
                                           const MemberEndpoint& advertised) {
  return impl_->Join(publisher_url, advertised);
}

Result<FleetMembership> ReceiverNode::Leave() {
  return impl_->Leave(ControlClientOptions{}.timeout, ControlClientOptions{}.max_retries);
}

const std::optional<ChainBootstrapReport>& ReceiverNode::bootstrap_report() const {
  return impl_->bootstrap_report;
}

const WeightStore& ReceiverNode::store() const { return *impl_->store; }

const ReceiverNodeOptions& ReceiverNode::options() const { return impl_->options; }

}  // namespace refit
