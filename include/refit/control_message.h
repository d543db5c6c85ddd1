// The control plane's JSON routes (docs/protocol.md) as plain messages, apart from HTTP: what a
// transport that carries its own control channel (mpi://, docs/transports.md) moves between a
// coordinator and a receiver. The bodies, status codes and replies are exactly those of the HTTP
// routes, so ControlClient and ControlServer keep one protocol whatever carries it:
//
//   ControlClient ──ControlCarrier──▶ (HTTP, or an MPI communicator) ──▶ ControlServer::Serve
//
// Only the JSON routes travel this way (prepare, flush, commit, abort, status); payloads travel on
// the data plane of the same transport.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "refit/status.h"

namespace refit {

/// One control request: an HTTP method and route ("POST", "/v1/prepare") and its JSON body.
struct ControlRequest {
  std::string method;
  std::string path;
  std::string body;
};

/// The reply: the HTTP status the route answers with (200, or the error's mapping in
/// docs/protocol.md) and its JSON body.
struct ControlReply {
  int status = 0;
  std::string body;
};

/// Carry `request` to one receiver and return its reply within `timeout`. Errors: Unavailable
/// (the receiver cannot be reached), DeadlineExceeded (no reply within the timeout); a reply that
/// reports an error is a reply, not an error of the carrier.
using ControlCarrier = std::function<Result<ControlReply>(const ControlRequest& request,
                                                          std::chrono::milliseconds timeout)>;

/// Answer one control request on the receiver's side (ControlServer::Serve).
using ControlHandler = std::function<ControlReply(const ControlRequest& request)>;

}  // namespace refit
