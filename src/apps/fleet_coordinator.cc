#include "fleet_coordinator.h"

#include <cstring>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "pipeline/staged_source.h"
#include "refit/chunk_source.h"
#include "refit/status_format.h"

namespace refit::cli {

Result<std::unique_ptr<FleetCoordinator>> FleetCoordinator::Make(
    const FleetAddress& address, const std::vector<TensorView>* model, uint32_t producers,
    const TrackerOptions& tracker_options, const internal::CoordinatorOptions& options,
    const std::vector<TensorView>* baseline) {
  if (address.control_urls.empty()) return InvalidArgument("no receivers to refit");
  std::unique_ptr<FleetCoordinator> fleet(new FleetCoordinator());
  ControlClientOptions announcer_options = address.client;
  announcer_options.api_key = address.api_key;
  TransportOptions transport_options;
  transport_options.manifest_announcers = MakeControlManifestAnnouncers(announcer_options);
  REFIT_ASSIGN_OR_RETURN(fleet->transport_,
                         MakeTransport(address.transport_uri, transport_options));
  // An object store's payloads are announced on each receiver's control plane.
  const bool manifests = fleet->transport_->capabilities().needs_manifest;
  fleet->endpoints_ = manifests ? address.control_urls : address.data_endpoints;
  if (!manifests && address.control_urls.size() != address.data_endpoints.size()) {
    return InvalidArgument("{} control URLs but {} data endpoints: give one of each per receiver",
                           address.control_urls.size(), address.data_endpoints.size());
  }
  for (size_t r = 0; !manifests && r < address.data_endpoints.size(); ++r) {
    if (address.data_endpoints[r].empty()) {
      return InvalidArgument(
          "receiver {} ({}) has no data endpoint: transport '{}' sends to data endpoints "
          "(CONTROL_URL=DATA_ENDPOINT); only s3:// announces payloads on the control URL",
          r, address.control_urls[r], address.transport_uri);
    }
  }
  if (producers == 0) return InvalidArgument("producers must be at least 1");
  if (baseline != nullptr && baseline->size() != model->size()) {
    return InvalidArgument("the baseline has {} tensors but the model {}", baseline->size(),
                           model->size());
  }
  for (const std::string& url : address.control_urls) {
    ControlClientOptions client_options = address.client;
    client_options.base_url = url;
    client_options.api_key = address.api_key;
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<ControlClient> client,
                           ControlClient::Make(client_options));
    fleet->clients_.push_back(std::move(client));
  }

  // Each producer tracks the chunks it owns; with a baseline it starts from them.
  if (baseline != nullptr) {
    for (size_t t = 0; t < model->size(); ++t) {
      const TensorView& held = (*baseline)[t];
      const TensorView& current = (*model)[t];
      if (held.name != current.name || held.dtype != current.dtype || held.shape != current.shape) {
        return InvalidArgument(
            "baseline tensor {} is '{}' {} {} but the model's is '{}' {} {}: a delta needs the "
            "same tensors in the same order",
            t, held.name, DTypeName(held.dtype), fmt::format("{}", fmt::join(held.shape, "x")),
            current.name, DTypeName(current.dtype),
            fmt::format("{}", fmt::join(current.shape, "x")));
      }
    }
  }
  for (uint32_t p = 0; p < producers; ++p) {
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<internal::DeltaTracker> tracker,
                           internal::DeltaTracker::Make(tracker_options));
    if (baseline != nullptr) {
      REFIT_RETURN_NOT_OK(
          AdoptOwnedBaseline(*tracker, *baseline, options.stream.chunk_bytes, p, producers));
    }
    fleet->trackers_.push_back(std::move(tracker));
  }

  std::vector<internal::CoordinatedProducer> coordinated;
  const uint64_t chunk_bytes = options.stream.chunk_bytes;
  for (const std::unique_ptr<internal::DeltaTracker>& tracker : fleet->trackers_) {
    coordinated.push_back(
        {tracker.get(), [model, chunk_bytes](const TransferPlan&) -> Result<ChunkSource> {
           return TensorListSource(*model, chunk_bytes);
         }});
  }
  std::vector<internal::CoordinatedReceiver> receivers;
  const bool relays = fleet->transport_->capabilities().fan_out_tree;
  for (size_t r = 0; r < fleet->clients_.size(); ++r) {
    receivers.push_back({fleet->clients_[r]->base_url(),
                         fleet->clients_[r].get(),
                         {},
                         relays ? fleet->endpoints_[r] : std::string()});
  }
  FleetCoordinator* self = fleet.get();
  internal::ChannelFactory channels =
      [self](const internal::ChannelRequest& request) -> Result<std::unique_ptr<PayloadChannel>> {
    SenderContext context;
    context.transfer_id = request.transfer_id;
    context.producer_id = request.producer_id;
    context.base_version = request.base_version;
    context.target_version = request.target_version;
    context.endpoints = request.endpoints.empty() ? self->endpoints_ : request.endpoints;
    context.deadline = request.deadline;
    REFIT_ASSIGN_OR_RETURN(std::unique_ptr<TransportSender> sender,
                           self->transport_->MakeSender(context));
    return std::unique_ptr<PayloadChannel>(std::move(sender));
  };
  // The transport learns each transfer's outcome (an s3:// chain records committed versions).
  internal::CoordinatorOptions observed = options;
  observed.observer = fleet->transport_.get();
  // Every transfer names its relay trees: the receivers in the order given, as the senders pick
  // their roots (receivers need no peers list); payloads are routed by what each one holds.
  observed.relay_trees = relays;
  observed.route_by_holdings = relays;
  REFIT_ASSIGN_OR_RETURN(fleet->coordinator_,
                         internal::Coordinator::Make(observed, std::move(coordinated),
                                                     std::move(receivers), std::move(channels)));
  return fleet;
}

Status FleetCoordinator::CheckReceiversHold(const std::vector<TensorView>& model) const {
  for (const std::unique_ptr<ControlClient>& client : clients_) {
    for (const TensorView& tensor : model) {
      REFIT_ASSIGN_OR_RETURN(OwnedTensor held, client->GetTensor(tensor.name));
      if (held.bytes.size() != tensor.bytes.size() ||
          std::memcmp(held.bytes.data(), tensor.bytes.data(), tensor.bytes.size()) != 0) {
        return DataLoss("{}: tensor '{}' differs from the producer's bytes", client->base_url(),
                        tensor.name);
      }
    }
  }
  return Status::OK();
}

}  // namespace refit::cli
