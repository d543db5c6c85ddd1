// What a zmq:// URI configures (timeouts, retries, the api key, CURVE key files), and the checks
// of the endpoints and bind addresses a sender or listener is given.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "refit/status.h"
#include "transport/zmq/zmq_curve.h"

namespace refit::internal::zmq {

// Per-attempt reply wait and retry count when the URI sets none: a relay's ACK waits for its
// subtree, and applying a full apply queue may take seconds under load.
inline constexpr uint64_t kDefaultTimeoutMs = 10'000;
inline constexpr uint64_t kMaxTimeoutMs = 3'600'000;
inline constexpr uint64_t kDefaultRetries = 3;
inline constexpr uint64_t kMaxRetries = 100;

/// The settings of one zmq:// transport, shared by its senders and listeners.
struct ZmqConfig {
  int timeout_ms = 0;
  int retries = 0;
  /// Empty: no key sent, none required.
  std::string api_key;
  CurveFiles curve;
};

/// Check a "host:port" endpoint: a printable host and a port in [1, 65535], or 0 when
/// `any_port` (a listener binding a port the kernel chooses).
/// Errors: InvalidArgument naming the endpoint.
Status CheckEndpoint(const std::string& endpoint, bool any_port = false);

/// The port of a checked endpoint.
std::string_view EndpointPort(const std::string& endpoint);

/// Check ListenerContext::bind_address: a host to bind with the endpoint's port, such as 0.0.0.0,
/// * (every interface) or one interface's address. Errors: InvalidArgument naming the host.
Status CheckBindAddress(const std::string& host);

}  // namespace refit::internal::zmq
