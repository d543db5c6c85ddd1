// Loopback addresses for tests that need a port nobody listens on (a server to start, a peer
// that refuses connections).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace refit::testing {

/// Whether `port` on 127.0.0.1 can be bound now.
inline bool LoopbackPortIsFree(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_GE(fd, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  ::close(fd);
  return bound;
}

/// `n` distinct loopback "127.0.0.1:port" endpoints nobody listens on now.
///
/// The ports are drawn at random from *below* the kernel's ephemeral range
/// (ip_local_port_range), not bound to port 0: a port-0 probe hands out an ephemeral port, which
/// another test's outgoing connection (ctest runs tests in parallel) can take as its source port
/// between the probe and the bind under test. python/refit/_ports.py chooses the same way.
inline std::vector<std::string> FreeLoopbackEndpoints(size_t n) {
  int ephemeral_low = 32768;
  if (std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range"); range) {
    range >> ephemeral_low;
  }
  constexpr int kFloor = 10000;
  EXPECT_GE(ephemeral_low - kFloor, 1000) << "ip_local_port_range leaves no room below it";
  std::mt19937 random(std::random_device{}());
  std::uniform_int_distribution<int> draw(kFloor, ephemeral_low - 1);
  std::vector<int> ports;
  for (int attempt = 0; ports.size() < n && attempt < 1000; ++attempt) {
    const int port = draw(random);
    if (std::find(ports.begin(), ports.end(), port) == ports.end() && LoopbackPortIsFree(port)) {
      ports.push_back(port);
    }
  }
  EXPECT_EQ(ports.size(), n) << "no " << n << " free loopback ports";
  std::vector<std::string> endpoints;
  for (const int port : ports) endpoints.push_back(fmt::format("127.0.0.1:{}", port));
  return endpoints;
}

/// A loopback "127.0.0.1:port" nobody listens on now.
inline std::string FreeLoopbackEndpoint() { return FreeLoopbackEndpoints(1)[0]; }

}  // namespace refit::testing
