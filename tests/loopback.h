// Loopback addresses for tests that need a port nobody listens on (a server to start, a peer
// that refuses connections).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace refit::testing {

/// A loopback "127.0.0.1:port" nobody listens on now: bind port 0, read it, release it.
inline std::string FreeLoopbackEndpoint() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_GE(fd, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  socklen_t length = sizeof(address);
  EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length), 0);
  ::close(fd);
  return fmt::format("127.0.0.1:{}", ntohs(address.sin_port));
}

}  // namespace refit::testing
