// Loopback addresses for tests that need a port nobody listens on (a server to start, a peer
// that refuses connections).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace refit::testing {

/// `n` distinct loopback "127.0.0.1:port" endpoints nobody listens on now: bind port 0 `n` times,
/// all at once (so the kernel cannot hand out one port twice), read the ports, release them.
inline std::vector<std::string> FreeLoopbackEndpoints(size_t n) {
  std::vector<int> fds;
  std::vector<std::string> endpoints;
  for (size_t i = 0; i < n; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    EXPECT_GE(fd, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    socklen_t length = sizeof(address);
    EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length), 0);
    fds.push_back(fd);
    endpoints.push_back(fmt::format("127.0.0.1:{}", ntohs(address.sin_port)));
  }
  for (const int fd : fds) ::close(fd);
  return endpoints;
}

/// A loopback "127.0.0.1:port" nobody listens on now.
inline std::string FreeLoopbackEndpoint() { return FreeLoopbackEndpoints(1)[0]; }

}  // namespace refit::testing
