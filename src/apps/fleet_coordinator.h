// The trainer's side of a networked refit, as `refit push` and `refit demo` assemble it: W
// producers (trackers over one exported model) and a Coordinator that streams through a
// transport to a fleet of `refit serve` daemons and drives their HTTP control planes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "codec/tracker.h"
#include "pipeline/coordinator.h"
#include "refit/control_client.h"
#include "refit/tensor.h"
#include "refit/transport.h"

namespace refit::cli {

/// Where the receivers are and how to reach them.
struct FleetAddress {
  /// Control plane base URLs, one per receiver.
  std::vector<std::string> control_urls;
  /// Data endpoints in the transport's syntax, in tree order (for zmq://, host:port relays).
  /// Ignored for transports that announce payloads through the control plane (s3://): their
  /// endpoints are the control URLs.
  std::vector<std::string> data_endpoints;
  /// The transport URI producers send through (zmq://…, fault+zmq://…, s3://…). The transport
  /// is the coordinator's TransferObserver (an s3:// chain records each committed version).
  std::string transport_uri = "zmq://";
  /// The api key the control planes require (empty: none). The data plane's key travels in the
  /// transport URI (api_key_env=…).
  std::string api_key;
  /// Control-plane client settings other than the URL and key.
  ControlClientOptions client;
};

/// Producers over one model and a coordinator that refits a fleet.
class FleetCoordinator {
 public:
  /// Make `producers` trackers that split the model by chunk ownership (chunk k belongs to
  /// producer k % W, chunks of options.stream.chunk_bytes) and a coordinator over them.
  /// `model` is read at every Refit; it must outlive this object. With a `baseline` (tensors of
  /// the same names and shapes, in the same order), each tracker adopts its chunks of it as what
  /// the receivers hold now (they loaded that checkpoint), so the first Refit is a delta against
  /// it; without, the first Refit is an anchor. The baseline is copied; it need not outlive Make.
  /// Errors: InvalidArgument (no receivers, control URLs and data endpoints of different
  /// counts), and those of DeltaTracker::Make, MakeTransport, ControlClient::Make and
  /// Coordinator::Make.
  static Result<std::unique_ptr<FleetCoordinator>> Make(const FleetAddress& address,
                                                        const std::vector<TensorView>* model,
                                                        uint32_t producers,
                                                        const TrackerOptions& tracker_options,
                                                        const internal::CoordinatorOptions& options,
                                                        const std::vector<TensorView>* baseline);

  /// One transfer of the model's current bytes to every receiver.
  Result<RefitReport> Refit(bool force_anchor = false) { return coordinator_->Refit(force_anchor); }

  /// Download every tensor of `model` from every receiver and compare it with `model`'s bytes.
  /// Errors: DataLoss naming the receiver and the first tensor that differs; the errors of
  /// ControlClient::GetTensor.
  Status CheckReceiversHold(const std::vector<TensorView>& model) const;

  const std::vector<std::unique_ptr<ControlClient>>& clients() const { return clients_; }
  const std::vector<std::unique_ptr<internal::DeltaTracker>>& trackers() const { return trackers_; }

 private:
  FleetCoordinator() = default;
  std::unique_ptr<Transport> transport_;
  std::vector<std::string> endpoints_;
  std::vector<std::unique_ptr<ControlClient>> clients_;
  std::vector<std::unique_ptr<internal::DeltaTracker>> trackers_;
  std::unique_ptr<internal::Coordinator> coordinator_;
};

}  // namespace refit::cli
