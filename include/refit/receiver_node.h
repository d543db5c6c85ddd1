// ReceiverNode: one receiver — everything `refit serve` runs — embeddable in any process: an
// inference worker that registers its own parameter memory, a test, or the daemon itself.
//
//   model (file, or the engine's buffers) ─▶ WeightStore ◀── Loader (canonical → local layout)
//                                               ▲
//   Listener (zmq data port / s3 manifests) ─▶ SessionSink ─▶ ReceiverSession ◀─ ControlServer
//                                                               │ hooks: before_first_apply,
//                                                               ▼        after_commit, after_abort
//
// Lifecycle: Make (validates, loads a model file if one is named) → RegisterTensor for external
// buffers → Start (loader, bootstrap, session, data plane, control plane) → Stop (control plane,
// then data plane, then the session, whose end rolls an open transfer back bit-exactly).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "refit/chain_version.h"
#include "refit/control_server_options.h"
#include "refit/loader.h"
#include "refit/membership.h"
#include "refit/readiness.h"
#include "refit/receiver_session_options.h"
#include "refit/status.h"
#include "refit/stream_options.h"
#include "refit/tensor.h"
#include "refit/transfer.h"
#include "refit/weight_store.h"

namespace refit {

/// Options of ReceiverNode::Make.
struct ReceiverNodeOptions {
  /// The model: a safetensors file to load (into memory, or mapped copy-on-write). Empty: the
  /// caller registers the tensors (RegisterTensor) before Start, zero-copy.
  std::string model_path;
  StoreMode store_mode = StoreMode::kMemory;
  /// The weight version the model is at. Unset: the file's "refit.version" metadata, else 0.
  std::optional<uint64_t> version;
  /// How canonical tensors map onto this receiver's tensors (rename, skip, tensor-parallel
  /// shards, fused concatenations). Unset: every canonical tensor is a local tensor of the same
  /// name and shape.
  std::optional<LoaderSpec> loader;
  /// This receiver's replica and shard; a loader with tp_size > 1 needs a replica name, and its
  /// shard defaults to the loader's tp_rank.
  ReplicaPlace place;

  /// The data-plane transport URI with its parameters (zmq://?api_key_env=…, s3://…).
  std::string transport_uri = "zmq://";
  /// zmq: this receiver's data endpoint host:port, its name in `peers` (required). Port 0 binds a
  /// port the kernel chooses as it binds (no probe that another process could race), which
  /// producer_endpoint() then names; it cannot be named in `peers`. s3: unused.
  std::string data_endpoint;
  /// zmq: the host to bind the data port on, when `data_endpoint` is not bindable (a wildcard,
  /// or a name). Empty: bind the endpoint itself.
  std::string data_bind_address;
  /// zmq: every relay's data endpoint in tree order, the same list on every receiver, this one
  /// included. Empty: this receiver alone.
  std::vector<std::string> peers;

  /// The largest payload either plane accepts (header + compressed body), which is also the
  /// largest decompressed body and control-plane request: it bounds what one message can make
  /// this receiver hold. Unset: DefaultMaxPayloadBytes of the model and producer_bucket_bytes,
  /// decided at Start. Either way the node writes it into session.limits (max_payload_bytes,
  /// max_body_bytes) and control.max_request_bytes.
  std::optional<uint64_t> max_payload_bytes;
  /// The producers' bucket size (ProducerStreamOptions::bucket_bytes), for the default above.
  uint64_t producer_bucket_bytes = kDefaultBucketBytes;

  /// The control plane: bind address, port (0: any free one), api key, TLS, limits. Its
  /// catch_up, manifest_handler and place are set by the node.
  ControlServerOptions control;
  /// The session: apply queue depth, payload limits, and the engine hooks
  /// (before_first_apply, after_commit, after_abort).
  ReceiverSessionOptions session;

  /// An s3:// chain (the trainer's URI with chain=1) to catch up from before serving, and
  /// again whenever a prepare finds this receiver behind. Empty: none.
  std::string bootstrap_uri;
  /// Told of each version replayed by the bootstrap.
  std::function<void(const ChainVersion&)> on_bootstrap_version;
  /// The control URL of a peer replica (a receiver of the fleet with the same tensors) to copy
  /// the fleet's version from before serving, instead of being sent an anchor by the trainer
  /// (docs/protocol.md "A peer replica"); the control plane's api_key authenticates it. Empty:
  /// none. Not with bootstrap_uri.
  std::string bootstrap_peer;
  /// While joined to a fleet (Join), how often it asks the publisher's membership endpoint for
  /// the fleet's version. A member learns of a new version from the transfers it takes part in;
  /// one that was left out or fenced while it could not be reached (stopped, partitioned) would
  /// otherwise report ready at its old version until the next sync reached it. 0: never ask.
  std::chrono::milliseconds fleet_watch_interval{std::chrono::seconds(1)};
};

/// The smallest default payload limit: room for any bucket of the default size with its names.
inline constexpr uint64_t kMinDefaultMaxPayloadBytes = uint64_t{256} << 20;

/// The payload limit a receiver holding `store` (its loader, if any, attached) takes by default:
/// twice the larger of `bucket_bytes` and the largest canonical tensor it may be sent, at least
/// kMinDefaultMaxPayloadBytes. A payload is one bucket (at most bucket_bytes of location and value
/// bytes, plus each item's name and entry) or one item larger than a bucket; an item of a tensor
/// of N elements holds at most its N values and N bytes of locations (the encoder never picks a
/// location encoding longer than the N/8-byte bitmask by more than its 8-byte width), so at most
/// twice the tensor's bytes. Without a loader the largest canonical tensor is the largest tensor
/// held; with one, a local tensor may be 1/tp_size of a canonical one (row, column and vocabulary
/// splits) and an expert stack a part of a stacked canonical tensor (`experts` of
/// `num_experts`), so the largest local tensor is scaled by both. A receiver whose loader skips
/// canonical tensors larger than that must set max_payload_bytes itself. O(tensors).
uint64_t DefaultMaxPayloadBytes(const WeightStore& store, uint64_t bucket_bytes);

/// One receiver of the fleet, embedded in the calling process.
///
/// Thread-safety: Make, RegisterTensor, Start and Stop are called from one thread (the owner);
/// the accessors may be called from any thread after Start. The registered buffers must outlive
/// the node and must not be written by anyone else while a transfer is open (between the
/// before_first_apply hook and after_commit / after_abort).
class ReceiverNode {
 public:
  /// Validate `options` and, if a model file is named, load it (O(model), with its digests).
  /// Errors: InvalidArgument (a malformed transport URI or endpoint, a transport that is neither
  /// a relay tree nor an object store, a shard group without a replica name); those of
  /// WeightStore::Open and MakeTransport.
  static Result<std::unique_ptr<ReceiverNode>> Make(const ReceiverNodeOptions& options);

  /// Stop().
  ~ReceiverNode();
  ReceiverNode(const ReceiverNode&) = delete;
  ReceiverNode& operator=(const ReceiverNode&) = delete;

  /// Register caller-owned memory as one of the receiver's tensors, before Start: payloads are
  /// applied into exactly these bytes, never a copy. O(tensor) once, for its digest.
  /// Errors: FailedPrecondition after Start or with a model file; AlreadyExists; InvalidArgument
  /// (byte size does not match dtype × shape).
  Status RegisterTensor(const MutableTensorView& tensor);
  /// Register a tensor in device memory, reached through `memory` (refit/tensor_memory.h) in
  /// O(changes) per transfer; its digest is computed once here, reading it through the
  /// boundary. Errors: as RegisterTensor; as WeightStore::AddDevice.
  Status RegisterDeviceTensor(std::string name, DType dtype, Shape shape,
                              std::shared_ptr<TensorMemory> memory);

  /// Attach the loader, catch up from the bootstrap chain, start the session, the data plane and
  /// the control plane. Connections are accepted once this returns.
  /// Errors: FailedPrecondition (started before; no tensors); those of the loader, the bootstrap,
  /// the listener (an endpoint taken: Unavailable or AlreadyExists) and the control server.
  Status Start();

  /// Stop the control plane, then the data plane, then the session (an open transfer is rolled
  /// back). Idempotent; the registered memory holds the committed version afterwards.
  void Stop();

  /// The payload limit in force (ReceiverNodeOptions::max_payload_bytes); 0 before Start.
  uint64_t max_payload_bytes() const;
  /// The control plane's base URL ("http://host:port"); empty before Start.
  std::string control_url() const;
  uint16_t control_port() const;
  /// What producers send to: the data endpoint (zmq) or the control URL (s3).
  std::string producer_endpoint() const;
  /// The session's state; an idle status before Start.
  ReceiverStatus status() const;
  /// Whether this receiver may serve (GET /ready; refit/readiness.h): it holds the fleet's
  /// committed version, no transfer is open, it is neither behind, fenced nor left.
  Readiness readiness() const;

  /// Join the fleet of the publisher whose membership endpoint is `publisher_url` (rank 0's;
  /// refit/membership.h), with this receiver's control key (ReceiverNodeOptions::control.api_key,
  /// the fleet's one key), as control_url() and producer_endpoint() — or the addresses set in
  /// `advertised` (a receiver bound to a wildcard, behind NAT). It takes part from the publisher's
  /// next Sync, caught up on its own (folded deltas or an anchor for it alone); the reply's fleet
  /// version tells readiness what it must hold. Joining again (the same or another publisher)
  /// replaces the membership. After Start; thread-safe.
  /// Errors: FailedPrecondition before Start; InvalidArgument for a bad URL; the publisher's
  /// (PermissionDenied for a key it refuses, Unavailable when it cannot be reached), naming it.
  Result<FleetMembership> Join(const std::string& publisher_url,
                               const MemberEndpoint& advertised = {});
  /// Leave the fleet joined last: the publisher's next Sync goes without this receiver, and
  /// readiness turns false (reason "left"). Stop leaves too (best effort). Thread-safe.
  /// Errors: FailedPrecondition when it joined none; the publisher's, as Join.
  Result<FleetMembership> Leave();

  /// What the bootstrap did at Start, if one ran.
  const std::optional<ChainBootstrapReport>& bootstrap_report() const;
  /// The store (its tensors, digests, version). Read it only while no transfer is open.
  const WeightStore& store() const;
  const ReceiverNodeOptions& options() const;

 private:
  struct Impl;
  explicit ReceiverNode(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace refit
