// A receiver's HTTP control plane, as its users configure it: bind address, port, API key, TLS,
// limits and timeouts (docs/security.md), and the hooks the node sets. Options of
// ReceiverNodeOptions::control; the server and its routes are internal
// (src/control/control_server.h).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>

#include "refit/membership.h"
#include "refit/status.h"
#include "refit/transfer.h"

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
  /// Connections one peer address may hold open that have not completed a request head yet
  /// (plain HTTP): past it a new one replaces the peer's oldest such connection, or is answered
  /// 503 when none is left to replace, so one host's slow or silent connections cannot take
  /// the room every other client needs. Connections that sent a request do not count: a client
  /// at full speed is never refused for its own load.
  size_t max_connections_per_peer = 64;
  /// Open connections in all (plain HTTP): past it a new one replaces the oldest connection
  /// that has not completed a request head, else the oldest idle keep-alive one, else it is
  /// answered 503.
  size_t max_connections = 1024;
  /// Called by POST /v1/prepare, before the session opens the transfer, with the relay tree the
  /// prepare names (PrepareRequest::relay_tree): the data plane's Listener::RouteTransfer. An
  /// error fails the prepare with it. Null (a data plane without relays): a prepare that names a
  /// tree is refused.
  std::function<Status(const TransferId& transfer_id, const RelayTree& tree)> route_transfer =
      nullptr;
  /// Called by POST /v1/join {"publisher_url", optional "control_url", "data_endpoint"}: join the
  /// publisher's fleet as this receiver (ReceiverNode::Join; the optional fields advertise other
  /// addresses than the node's own). Null: the route answers 409.
  std::function<Result<FleetMembership>(const std::string& publisher_url,
                                        const MemberEndpoint& advertised)>
      join = nullptr;
  /// Called by POST /v1/leave: leave the fleet joined last (ReceiverNode::Leave). Null: 409.
  std::function<Result<FleetMembership>()> leave = nullptr;
};

}  // namespace refit
