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
//   GET  /healthz      → {"ok": true}; the only route that needs no API key
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

#include "refit/control_message.h"
#include "refit/receiver_session.h"
#include "refit/status.h"
#include "refit/weight_store.h"

namespace refit {

/// What a manifest handler staged (see ControlServerOptions::manifest_handler).
struct StagedManifest {
  StageResult result = StageResult::kAccepted;
  /// The size of the payload the manifest named.
  uint64_t payload_bytes = 0;
};

/// Fetch, verify and stage the payload a manifest names (the request body, untrusted), or cancel
/// soon after `stop` is requested.
using ManifestHandler =
    std::function<Result<StagedManifest>(std::string_view manifest, std::stop_token stop)>;

/// Options of ControlServer::Make.
struct ControlServerOptions {
  /// The address to listen on. The default reaches only this host; `refit serve` binds "0.0.0.0"
  /// to serve a cluster, and then an api_key (and TLS on untrusted networks) should be set.
  std::string bind_address = "127.0.0.1";
  /// The TCP port; 0 picks a free ephemeral port (read it back with ControlServer::port()).
  uint16_t port = 0;
  /// The shared secret every request except GET /healthz must present, as
  /// "Authorization: Bearer <key>" or "X-Refit-Api-Key: <key>". Empty disables authentication
  /// (Start then logs a loud warning: anyone who can reach the port can write weights).
  std::string api_key;
  /// PEM certificate (chain) and private key. Both set: serve HTTPS; both empty: plain HTTP.
  std::string tls_cert_path;
  std::string tls_key_path;
  /// The largest request body accepted (413 beyond it). A payload is held in memory once while it
  /// is staged, so this bounds the memory one upload can take. The default admits the largest
  /// payload PayloadLimits accepts by default.
  uint64_t max_request_bytes = uint64_t{4} << 30;
  /// The largest JSON body accepted on the JSON routes: enough for expected_digests of a model
  /// with a million tensors (about 64 bytes each), small enough that parsing stays cheap. The
  /// transfer routes (prepare, flush, commit, abort) take at most what naming every tensor of
  /// the store needs: 1 MiB + tensors × (6 × the longest name + 24) bytes, so a body listing
  /// names the model does not have is refused (413) before it is parsed.
  uint64_t max_json_bytes = uint64_t{64} << 20;
  /// Threads serving connections. A Flush holds one for up to its timeout and a Stage for as long
  /// as the apply queue is full, so there should be a few more than concurrent uploaders.
  size_t worker_threads = 8;
  /// The longest timeout_ms a Flush request may ask for (400 beyond it): a worker thread is held
  /// that long, and Stop waits for it.
  std::chrono::milliseconds max_flush_timeout{std::chrono::minutes(10)};
  /// Where POST /v1/manifest goes: the data-plane listener of a transport that announces its
  /// payloads through the control plane (s3://; Listener::AcceptManifest). Null: the route
  /// answers 409, naming the reason. Each call holds a worker thread while it downloads.
  ManifestHandler manifest_handler;
  /// Called by POST /v1/prepare, before the session sees it, when the session is idle at a
  /// version below the request's base: a receiver that fell behind catches up to `base_version`
  /// (`refit serve --bootstrap`: CatchUpFromChain) and is then prepared like the others. An error
  /// fails the prepare with it. Null: such a prepare is refused by version fencing.
  std::function<Status(uint64_t base_version)> catch_up;
  /// This receiver's replica and shard, reported by GET /v1/status and as /metrics labels.
  ReplicaPlace place;
  /// This receiver's place in its relay tree, reported by GET /v1/status; nullopt for a data
  /// plane without relays (s3://, mpi://).
  std::optional<RelayPlace> relay;
  /// How long a connection may take to send a complete request line and headers, from its
  /// accept or from its previous request's end (so it also ends an idle keep-alive connection).
  /// With plain HTTP a connection holds no worker thread until its head is complete: clients
  /// that drip their headers cost a socket each, never a worker, and are closed (408) at this
  /// limit. (Members below were added last so that existing aggregate initializers stay valid.)
  std::chrono::milliseconds request_head_timeout = std::chrono::seconds(10);
  /// Limit of each read of a request body and each write of a reply (and, with TLS, of each
  /// read of a head).
  std::chrono::milliseconds io_timeout = std::chrono::seconds(30);
  /// Open connections one peer address may hold (plain HTTP); more are answered 503 and closed
  /// at accept, so one host cannot take the connections every other client needs.
  size_t max_connections_per_peer = 64;
  /// Open connections in all (plain HTTP); more are answered 503 and closed at accept.
  size_t max_connections = 1024;
  /// Called by POST /v1/prepare, before the session opens the transfer, with the relay tree the
  /// prepare names (PrepareRequest::relay_tree): the data plane's Listener::RouteTransfer. An
  /// error fails the prepare with it. Null (a data plane without relays): a prepare that names a
  /// tree is refused.
  std::function<Status(const TransferId& transfer_id, const RelayTree& tree)> route_transfer =
      nullptr;
};

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
                                                     ReceiverSession& session, WeightStore& store);

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

 private:
  struct Impl;
  explicit ControlServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace refit
