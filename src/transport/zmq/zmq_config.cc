// The checks of zmq:// endpoints and bind addresses (zmq_config.h).
#include "transport/zmq/zmq_config.h"

#include <algorithm>
#include <string>
#include <string_view>

#include "refit/status_format.h"
#include "transport/transport_internal.h"

namespace refit::internal::zmq {
namespace {

constexpr uint16_t kMaxPort = 65535;

}  // namespace

Status CheckEndpoint(const std::string& endpoint, bool any_port) {
  const size_t colon = endpoint.rfind(':');
  const auto bad = [&](std::string_view why) {
    return InvalidArgument("zmq endpoint '{}': {} (expected host:port)", Printable(endpoint), why);
  };
  if (colon == std::string::npos || colon == 0) return bad("no host");
  for (const char c : endpoint) {
    if (c < 0x21 || c > 0x7e || c == '/') return bad("a space, '/' or non-printable byte");
  }
  const std::string_view port = std::string_view(endpoint).substr(colon + 1);
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return bad("the port is not a number");
  }
  const int value = std::stoi(std::string(port));
  if (value == 0 && any_port) return Status::OK();
  if (value < 1 || value > kMaxPort) return bad("the port is outside [1, 65535]");
  return Status::OK();
}

std::string_view EndpointPort(const std::string& endpoint) {
  return std::string_view(endpoint).substr(endpoint.rfind(':') + 1);
}

Status CheckBindAddress(const std::string& host) {
  const auto bad = [&](std::string_view why) {
    return InvalidArgument(
        "zmq bind address '{}': {} (expected a host without a port, e.g. 0.0.0.0 or *)",
        Printable(host), why);
  };
  for (const char c : host) {
    if (c < 0x21 || c > 0x7e || c == '/') return bad("a space, '/' or non-printable byte");
  }
  if (host.find(':') != std::string::npos) return bad("a ':' (the port is the endpoint's)");
  return Status::OK();
}

}  // namespace refit::internal::zmq
