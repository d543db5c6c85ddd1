// ControlServer: the receiver's HTTP control plane (docs/protocol.md, docs/security.md).
//
// Routes (JSON bodies unless noted; every success body has "ok": true, every error body is
// {"ok": false, "code": "<StatusCodeName>", "message": "…"}):
//
//   POST /v1/prepare   {"transfer_id": hex32, "base_version": n,
//                       "expected": {"producers": {"<id>": n, …}, "total": n},
//                       "expected_digests": {"<tensor>": hex16, …}}       →
//                       ReceiverSession::Prepare
//                      → {"repeated": bool, "implied_commit": hex32 | null,
//                         "implied_abort": hex32 | null, "version": n}
//   POST /v1/flush     {"transfer_id", "timeout_ms", "expected", "expected_digests"}
//                      → the FlushReport: {"transfer_id", "target_version", "payloads", "items",
//                        "changed_elements", "duplicates", "digests": {"<tensor>": hex16}}
//   POST /v1/commit    {"transfer_id"} → {"version": n}
//   POST /v1/abort     {"transfer_id"} → {"version": n}
//   POST /v1/payload   raw payload bytes (Content-Type: application/octet-stream)
//                      → ReceiverSession::Stage → {"result": "accepted" | "duplicate", "bytes": n}
//   POST /v1/manifest  a manifest of the data-plane transport (s3://: which object to fetch)
//                      → Options::manifest_handler (fetch, verify, Stage)
//                      → {"result": "accepted" | "duplicate", "bytes": n}; 409 without a handler
//   GET  /v1/status    → the session's ReceiverStatus, "tensors", and "state_fingerprint" (hex16
//                        over every tensor's digest; null while a transfer is receiving)
//   GET  /v1/tensors/{name}  (name percent-encoded) → the tensor's little-endian bytes, with
//                        headers X-Refit-Dtype (canonical name), X-Refit-Shape (JSON array),
//                        X-Refit-Digest (hex16) and X-Refit-Version
//   GET  /metrics      → Prometheus text exposition
//   POST /v1/join      {"publisher_url", optional "control_url", "data_endpoint"} → join that
//                      publisher's fleet (ControlServerOptions::join) → its FleetMembership
//   POST /v1/leave     {} → leave it (ControlServerOptions::leave) → its FleetMembership
//   GET  /ready        → readiness (refit/readiness.h): 200 {"ok": true, "ready": true, …} when
//                        the receiver may serve, else 503 with "ready_reason" and "message"
//   GET  /healthz      → {"ok": true}; with /ready, the only routes that need no API key
//
// Status codes map to HTTP as: InvalidArgument 400, PermissionDenied 403, NotFound 404,
// FailedPrecondition and AlreadyExists 409, ResourceExhausted 413, DataLoss 422, Unavailable 503,
// DeadlineExceeded 504, anything else 500. A request without a key gets 401, a wrong key 403,
// whatever its size: the key is checked before any of the body is read, and (plain HTTP) the
// connection is closed after the reply instead of reading the body. Only an authenticated
// request learns about size limits (413). Neither changes any state.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>

#include "control/readiness.h"
#include "receiver/receiver_session.h"
#include "refit/control_message.h"
#include "refit/control_server_options.h"
#include "refit/status.h"
#include "refit/weight_store.h"

namespace refit {

/// Serves the control plane of one receiver over HTTP(S), on its own threads.
///
/// Concurrency with the store: tensor downloads and the state fingerprint read the store, which
/// the session's apply thread writes while a transfer is receiving. The server therefore reads
/// the store only while the session is idle or prepared, and holds Prepare, Commit and Abort
/// requests until in-flight reads finish (a reader-writer lock), so no transfer can start or end
/// under a read. Reads requested while a transfer is receiving fail with FailedPrecondition (409).
/// Code that drives the same session directly (not through this server) must not Prepare, Commit
/// or Abort while a download may be running.
///
/// Thread-safety: Start, Stop and port may be called from any thread; Stop is idempotent. The
/// session and the store must outlive the server.
class ControlServer {
 public:
  /// Upper bound on Options::worker_threads (a mistyped value is reported, not obeyed).
  static constexpr size_t kMaxWorkerThreads = 1024;

  /// Validate `options` and prepare (but do not bind) the server; with TLS, load the certificate
  /// and key. Errors: InvalidArgument (only one of the TLS paths set; worker_threads, a byte
  /// limit or max_flush_timeout out of range; a certificate or key that does not load or match);
  /// NotFound (a TLS path that does not exist).
  static Result<std::unique_ptr<ControlServer>> Make(const ControlServerOptions& options,
                                                     internal::ReceiverSession& session,
                                                     WeightStore& store);

  /// Stop().
  ~ControlServer();
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;

  /// Bind the port and start serving on a thread named "refit-http" (workers "refit-http-N").
  /// Connections are accepted once this returns. Errors: FailedPrecondition (already started or
  /// stopped); Unavailable naming the address and port when binding fails (e.g. in use).
  Status Start();

  /// Stop accepting, cancel payload uploads blocked on a full apply queue (503), wait for the
  /// requests in flight (a Flush returns at its timeout at the latest) and for idle keep-alive
  /// connections to notice (about a second), and join every thread.
  void Stop();

  /// The bound TCP port (the ephemeral one when Options::port was 0); 0 before Start.
  uint16_t port() const;
  /// "http://<bind address>:<port>" or "https://…"; empty before Start.
  std::string base_url() const;

  /// Answer one request of a JSON route (POST prepare, flush, commit, abort; GET status, healthz)
  /// that came some other way than HTTP: the control channel of a transport that carries its own
  /// (mpi://, refit/control_message.h). Same validation, limits, session and metrics as over
  /// HTTP; no API key is checked, since the carrier (an MPI communicator) is the job's own trust
  /// boundary. Other routes answer 404. Works before Start and after Stop (the session decides).
  /// Thread-safe; a Flush blocks for up to its timeout.
  ControlReply Serve(const ControlRequest& request);

  /// Whether the receiver may serve now (GET /ready). Thread-safe.
  Readiness readiness() const;
  /// What the receiver heard of its fleet: the node reports joins, leaves and join replies here,
  /// and the quorum policy fences through it. Thread-safe; lives as long as the server.
  internal::FleetStanding& fleet_standing();

 private:
  struct Impl;
  explicit ControlServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace refit
