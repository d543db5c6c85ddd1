// Loopback addresses for tests that need a port nobody listens on (a server to start, a peer
// that refuses connections): testkit's ports (src/testing/loopback_ports.h) as endpoints.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "loopback_ports.h"

namespace refit::testing {

/// `n` distinct loopback "127.0.0.1:port" endpoints nobody listens on now.
inline std::vector<std::string> FreeLoopbackEndpoints(size_t n) {
  Result<std::vector<uint16_t>> ports = testkit::FreeLoopbackPorts(n);
  EXPECT_TRUE(ports.ok()) << ports.status().ToString();
  std::vector<std::string> endpoints;
  if (!ports.ok()) return endpoints;
  for (const uint16_t port : *ports) endpoints.push_back(fmt::format("127.0.0.1:{}", port));
  return endpoints;
}

/// A loopback "127.0.0.1:port" nobody listens on now.
inline std::string FreeLoopbackEndpoint() { return FreeLoopbackEndpoints(1).at(0); }

}  // namespace refit::testing
