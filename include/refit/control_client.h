// ControlClient: calls a receiver's HTTP control plane (ControlServer) — what a coordinator uses
// to prepare, flush, commit and abort transfers, and the simple HTTP data path for payloads.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "refit/control_message.h"
#include "refit/manifest_announcer.h"
#include "refit/membership.h"
#include "refit/payload.h"
#include "refit/readiness.h"
#include "refit/receiver_session_options.h"
#include "refit/status.h"
#include "refit/tensor.h"

namespace refit {

/// Options of ControlClient::Make.
struct ControlClientOptions {
  /// "http://host:port" or "https://host:port", optionally followed by a path prefix that every
  /// route is appended to (a receiver behind a reverse proxy). A trailing '/' is ignored.
  std::string base_url;
  /// Sent as "Authorization: Bearer <key>" when not empty.
  std::string api_key;
  /// Limit of one control call, every attempt together: connecting, writing the request and
  /// reading the reply, however slowly the server sends it (DeadlineExceeded beyond it). A Flush
  /// adds its own wait and a manifest the receiver's stage time. Bulk calls (SendPayload,
  /// GetTensor) take as long as their bytes need: for them it limits each connect, read and
  /// write. A caller with a budget of its own (`refit push --timeout`) sets at most that.
  std::chrono::milliseconds timeout{std::chrono::seconds(30)};
  /// Extra attempts after a connection error or an HTTP 502/503/504, with exponential backoff
  /// from retry_backoff, capped at max_retry_backoff. Every control call is safe to repeat:
  /// Prepare, Commit, Abort and Flush are idempotent and a re-sent payload is deduplicated.
  /// Other HTTP errors are application errors and are never retried (upstream: 500 is not
  /// retried), nor is a 504 whose body reports DeadlineExceeded: that is the caller's own Flush
  /// timeout, and retrying would silently multiply it.
  int max_retries = 3;
  std::chrono::milliseconds retry_backoff{std::chrono::milliseconds(50)};
  std::chrono::milliseconds max_retry_backoff{std::chrono::seconds(1)};
  /// HTTPS: a PEM file of the certificates to trust (e.g. the server's self-signed certificate);
  /// empty uses the system's trust store.
  std::string tls_ca_cert_path;
  /// HTTPS: verify the server's certificate and host name. Turn off only for tests.
  bool tls_verify = true;
  /// Carry the JSON routes (prepare, flush, commit, abort, status) some other way than HTTP: an
  /// MPI communicator (mpi://, refit/control_message.h). `base_url` then only names the receiver
  /// in errors (e.g. "mpi://rank/3"), and the bulk routes (SendPayload, GetTensor, manifests)
  /// fail with FailedPrecondition: the carrier's transport moves payloads itself. Connection
  /// retries are the carrier's business. (Last, with an initializer.)
  ControlCarrier carrier = nullptr;
};

/// What GET /v1/status reports.
struct ControlStatus {
  /// The session's state and counters.
  ReceiverStatus receiver;
  /// Tensors in the receiver's store.
  uint64_t tensors = 0;
  /// One fingerprint of every tensor's state digest (equal on two receivers that hold the same
  /// weights); absent while a transfer is receiving, when the store cannot be read.
  std::optional<uint64_t> state_fingerprint;
  /// Its replica and shard (ControlServerOptions::place).
  ReplicaPlace place;
  /// Its place in its relay tree (ControlServerOptions::relay); nullopt without relays, or from
  /// a receiver older than this field. (Last, with an initializer, for aggregate initializers.)
  std::optional<RelayPlace> relay = std::nullopt;
  /// Whether it may serve (GET /ready); nullopt from a receiver older than readiness.
  std::optional<Readiness> readiness = std::nullopt;
};

/// One tensor of a receiver's store as GET /v1/tensors lists it: its (local) name, dtype, shape
/// and state digest.
struct HeldTensor {
  std::string name;
  DType dtype = DType::kUInt8;
  Shape shape;
  uint64_t digest = 0;
};

/// What GET /v1/tensors reports: every tensor of a receiver's store, in name order, read under
/// the store's lock at the version it holds (one version, never a mix).
struct TensorListing {
  uint64_t version = 0;
  std::vector<HeldTensor> tensors;
};

/// Return `status` as GET /v1/status reports it (JSON text, without the "ok" envelope): the
/// one place that layout is written, for tools that print a status.
std::string ControlStatusToJson(const ControlStatus& status);
/// Return `membership` as GET /v1/members reports it (JSON text, without the "ok" envelope).
std::string ControlMembershipToJson(const FleetMembership& membership);

/// A client of one receiver's control plane.
///
/// Every call maps an HTTP error back to a Status with the server's code and message; a body that
/// is not the server's JSON error (a proxy's page) gives the code of the HTTP status and the first
/// 512 characters of the body. Connection failures after the last retry give Unavailable.
///
/// Thread-safety: every member function may be called concurrently from any thread. Idle
/// connections are kept for reuse (keep-alive); each call uses one connection exclusively.
class ControlClient final : public ReceiverControl, public ManifestAnnouncer {
 public:
  /// Validate the options; connects nothing yet.
  /// Errors: InvalidArgument (a base URL that is not http(s)://host:port[/prefix]; a negative
  /// retry count or timeout).
  static Result<std::unique_ptr<ControlClient>> Make(const ControlClientOptions& options);

  ~ControlClient();
  ControlClient(const ControlClient&) = delete;
  ControlClient& operator=(const ControlClient&) = delete;

  /// POST /v1/prepare. Errors: as ReceiverSession::Prepare.
  Result<PrepareResult> Prepare(const PrepareRequest& request) override;
  /// POST /v1/flush; waits up to options.timeout on the server (plus the client timeout).
  /// Errors: as ReceiverSession::Flush.
  Result<FlushReport> Flush(const TransferId& id, const FlushOptions& options = {}) override;
  /// POST /v1/commit. Errors: as ReceiverSession::Commit.
  Status Commit(const TransferId& id) override;
  /// POST /v1/abort. Errors: as ReceiverSession::Abort.
  Status Abort(const TransferId& id) override;
  /// POST /v1/abort with "fenced_at_version". Errors: as Abort.
  Status Fence(const TransferId& id, uint64_t fleet_version) override;
  /// POST /v1/regions. Errors: as ReceiverSession::Regions.
  Result<HeldRegions> Regions(const std::vector<std::string>& canonical_names) override;
  /// Bound every later call, each connect, read, write, retry and backoff of it, by `deadline`
  /// as well as by options.timeout (DeadlineExceeded past it); nullopt lifts the bound.
  /// Thread-safe; calls in flight keep the bound they started with.
  void SetCallDeadline(std::optional<std::chrono::steady_clock::time_point> deadline) override;
  /// POST /v1/payload with the payload's bytes (not copied). Errors: as ReceiverSession::Stage,
  /// ResourceExhausted beyond the server's body limit, Unavailable while it stops.
  Result<StageResult> SendPayload(std::span<const std::byte> payload);
  /// POST /v1/manifest with `manifest` (JSON text of the data-plane transport, not parsed
  /// here); the receiver's listener fetches, verifies and stages the payload it names before it
  /// answers, within `stage_time` on top of options.timeout. Errors: as ReceiverSession::Stage
  /// and the receiver's transport (DataLoss, PermissionDenied for a MAC); FailedPrecondition
  /// from a receiver that takes no manifests; InvalidArgument for a negative stage time.
  Result<StageResult> AnnounceManifest(std::string_view manifest,
                                       std::chrono::milliseconds stage_time) override;
  /// GET /v1/status.
  Result<ControlStatus> GetStatus();
  /// GET /v1/tensors: every tensor the receiver holds, with its state digest, at the version it
  /// holds. Errors: FailedPrecondition while a transfer is receiving; InvalidArgument naming the
  /// field of a malformed reply.
  Result<TensorListing> ListTensors();
  /// GET /v1/tensors/{name}: download one tensor and check its bytes against the digest the
  /// server sent; `digest`, when not null, receives that digest (TensorDigest of the bytes), so
  /// a caller that needs it does not hash the tensor again. Safe to call concurrently: each call
  /// takes its own connection. Errors: NotFound naming it; FailedPrecondition while a transfer
  /// is receiving; DataLoss when the bytes, shape or digest disagree.
  Result<OwnedTensor> GetTensor(std::string_view name, uint64_t* digest = nullptr);
  /// GET /healthz (no key needed). Errors: Unavailable when the server cannot be reached.
  Status CheckHealth();

  /// Of a receiver: POST /v1/join — make it join the fleet of the publisher's membership
  /// endpoint `publisher_url` (`refit join`), advertising `advertised` where set instead of its
  /// own addresses. Errors: those of the publisher (PermissionDenied for a key it refuses,
  /// Unavailable when it cannot be reached), naming it.
  Result<FleetMembership> JoinFleet(const std::string& publisher_url,
                                    const MemberEndpoint& advertised = {});
  /// Of a receiver: POST /v1/leave — make it leave the fleet it joined. Errors: as JoinFleet;
  /// FailedPrecondition when it joined none.
  Result<FleetMembership> LeaveFleet();
  /// Of a publisher's membership endpoint (base_url): GET /v1/members, POST
  /// /v1/members/join and /v1/members/leave (refit/membership.h). Errors: PermissionDenied for a
  /// missing or wrong key; InvalidArgument for a member it refuses; NotFound for leaving a fleet
  /// one is not a member of.
  Result<FleetMembership> GetMembership();
  Result<FleetMembership> AddMember(const MemberEndpoint& member);
  Result<FleetMembership> RemoveMember(const std::string& control_url);

  /// The base URL the client calls, without a trailing '/'.
  const std::string& base_url() const;

 private:
  struct Impl;
  explicit ControlClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// Return the announcers a transport with manifests (s3://) sends through: one ControlClient per
/// receiver endpoint (its control-plane base URL), made from `options` with that base URL on
/// first use and kept for reuse by later senders. Wire it in as
/// TransportOptions::manifest_announcers. The factory may be called concurrently.
/// Errors (of the factory): as ControlClient::Make, naming the endpoint.
ManifestAnnouncerFactory MakeControlManifestAnnouncers(const ControlClientOptions& options);

}  // namespace refit
