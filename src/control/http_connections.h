// The connection handling of the plain-HTTP control plane: which connections get a worker, and
// for how long (docs/security.md, "slow clients").
//
// httplib hands every accepted connection to a worker thread, which then waits for the request
// head with a per-read timeout only. A client that drips one header byte per read timeout holds a
// worker for ever; as many such clients as workers stop /healthz, and more fill the listen backlog
// so that new connections time out. Here a connection gets a worker only once its complete
// request head has arrived:
//
//   accept ─▶ admit (per-peer and total limits) ─▶ collector thread: poll() every waiting
//   connection, buffer its bytes until "\r\n\r\n", within head_timeout ─▶ worker: one request
//   (httplib's parser and routes, on a stream that serves the buffered bytes first) ─▶ back to
//   the collector for the next request of a keep-alive connection, or closed.
//
// Waiting costs a socket and its buffered head (at most kMaxRequestHeadBytes), never a thread.
//
// The per-peer limit counts only a peer's unproven connections: those that have not completed a
// request head yet. A connection that sent one is being served, or was and may send the next, so
// a client's own full-speed load never counts against it (issue 45: 64 `Connection: close`
// clients at one address got 503s when every connection counted). Over the per-peer limit a new
// connection takes the place of the peer's oldest unproven connection; over the total, of the
// oldest unproven one of any peer, else of the oldest idle keep-alive connection. Before
// choosing, what has arrived on the connections involved is read, so one whose head is complete
// is served rather than replaced: a flood of head drippers cannot lock out a client whose head
// comes with its connection, even from the same address. A refused request body (a 401 or 413
// before the body was read) is drained by the collector for a moment after the reply, not by a
// worker, within bounds per peer and in total, so that a body drip costs no worker either.

#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include <httplib.h>

#include "refit/status.h"

namespace refit::internal {

/// The limits of GuardedHttpServer.
struct HttpConnectionLimits {
  /// Threads that run requests.
  size_t worker_threads = 8;
  /// How long a connection may take to send a complete request head, counted from its accept
  /// or from the end of its previous request (so it also bounds an idle keep-alive connection).
  std::chrono::milliseconds head_timeout{std::chrono::seconds(10)};
  /// Limit of each read of a request body and each write of a reply, on a worker.
  std::chrono::milliseconds io_timeout{std::chrono::seconds(30)};
  /// Open connections one peer address may have that have not completed a request head yet;
  /// past it a new connection replaces the peer's oldest such one, or is answered 503.
  size_t max_connections_per_peer = 64;
  /// Open connections in all; past it a new connection replaces the oldest one still waiting for
  /// its first request head, else the oldest idle keep-alive one, or is answered 503.
  size_t max_connections = 1024;
};

/// Bytes a request line and headers may take together; a longer head is answered 431 and closed.
inline constexpr size_t kMaxRequestHeadBytes = size_t{64} << 10;

/// An httplib::Server whose connections wait for their request head without a thread (see the
/// file comment). Routes and handlers are httplib's as usual; its own new_task_queue must not
/// be replaced, and its read, write and keep-alive timeouts are those of the limits.
///
/// A handler can ask for the connection to be closed after its reply without reading the rest
/// of the request body (a refused upload): CloseConnectionAfterReply.
///
/// Thread-safety: as httplib::Server. StartThreads before listening; stop() ends the accept loop,
/// which shuts the threads down; the destructor joins them.
class GuardedHttpServer final : public httplib::Server {
 public:
  /// Validate `limits`; starts nothing. Errors: InvalidArgument for a zero limit.
  static Result<std::unique_ptr<GuardedHttpServer>> Make(const HttpConnectionLimits& limits);
  ~GuardedHttpServer() override;

  /// Start the collector and the workers. Errors: ResourceExhausted when the OS refuses a
  /// thread or an eventfd.
  Status StartThreads();

  /// From a handler: reply with "Connection: close", and, on one of this server's workers,
  /// close the connection after the reply instead of reading what is left of the request.
  /// Return whether it will be closed so (false on another server: the caller must then read
  /// the rest of the body itself, or it would be parsed as the next request).
  static bool CloseConnectionAfterReply(httplib::Response& response);

 private:
  class Connections;
  explicit GuardedHttpServer(std::unique_ptr<Connections> connections);
  // Called by httplib's accept loop (through the inline task queue) with each accepted socket.
  bool process_and_close_socket(socket_t sock) override;

  std::unique_ptr<Connections> connections_;
};

}  // namespace refit::internal
