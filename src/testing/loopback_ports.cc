#include "loopback_ports.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <random>

#include "refit/status_format.h"

namespace refit::testkit {
namespace {

/// The lowest port drawn: above the well-known and most registered services' ports.
constexpr int kLowestPort = 10000;
/// The ephemeral range's start when /proc does not say (Linux's default).
constexpr int kDefaultEphemeralLow = 32768;
/// Draws before giving up: each is one bind, and a busy range is reported instead of searched.
constexpr int kMaxDraws = 1000;

/// Whether `port` on 127.0.0.1 can be bound now.
bool LoopbackPortIsFree(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  ::close(fd);
  return bound;
}

}  // namespace

Result<std::vector<uint16_t>> FreeLoopbackPorts(size_t count) {
  int ephemeral_low = kDefaultEphemeralLow;
  if (std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range"); range) {
    range >> ephemeral_low;
  }
  if (ephemeral_low - kLowestPort < static_cast<int>(count)) {
    return ResourceExhausted(
        "no {} free loopback ports: ip_local_port_range starts at {}, leaving no room above {}",
        count, ephemeral_low, kLowestPort);
  }
  std::mt19937 random(std::random_device{}());
  std::uniform_int_distribution<int> draw(kLowestPort, ephemeral_low - 1);
  std::vector<uint16_t> ports;
  for (int attempt = 0; ports.size() < count && attempt < kMaxDraws; ++attempt) {
    const int port = draw(random);
    if (std::find(ports.begin(), ports.end(), port) == ports.end() && LoopbackPortIsFree(port)) {
      ports.push_back(static_cast<uint16_t>(port));
    }
  }
  if (ports.size() < count) {
    return ResourceExhausted("found {} of {} free loopback ports in [{}, {}) in {} draws",
                             ports.size(), count, kLowestPort, ephemeral_low, kMaxDraws);
  }
  return ports;
}

}  // namespace refit::testkit
