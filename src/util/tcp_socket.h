// TCP sockets as refit's own protocols use them (the TCP producer group): owned descriptors,
// HOST:PORT addresses, name resolution, and non-blocking connects and waits bounded by a deadline.
#pragma once

#include <netdb.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "refit/status.h"

namespace refit::internal {

using SocketClock = std::chrono::steady_clock;

/// close(2). Not retried on EINTR: on Linux the descriptor is released whatever close returns.
void CloseFd(int fd);

/// The text of an errno value.
std::string ErrnoText(int errnum);

/// Milliseconds poll() should wait for `deadline`, rounded up so that a wait never ends early.
int PollTimeout(SocketClock::time_point deadline);

/// An owned file descriptor.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) {
      Reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { Reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void Reset() {
    if (fd_ >= 0) CloseFd(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

/// A TCP address: host (without IPv6 brackets) and port.
struct Endpoint {
  std::string host;
  uint16_t port = 0;
};

/// "host:port", with IPv6 hosts in brackets.
std::string EndpointText(std::string_view host, uint16_t port);

/// Parse "tcp://HOST:PORT" or "HOST:PORT" ("[v6]:PORT" for IPv6 hosts). Errors: InvalidArgument
/// naming the address and what is wrong with it.
Result<Endpoint> ParseAddress(std::string_view address);

struct AddrInfoDeleter {
  void operator()(addrinfo* list) const { ::freeaddrinfo(list); }
};
using AddrInfoList = std::unique_ptr<addrinfo, AddrInfoDeleter>;

/// Resolve `endpoint` (a blocking name lookup: numeric hosts resolve at once); `passive` for a
/// listener. Errors: Unavailable naming the host.
Result<AddrInfoList> Resolve(const Endpoint& endpoint, bool passive);

/// Turn off Nagle's algorithm on `fd` (small frames must not wait); failure only costs latency.
void SetNoDelay(int fd);

/// Whether the peer of `fd` has closed its end (or the connection broke), without reading.
bool PeerClosed(int fd);

/// Wait until `fd` is ready for `events` (or has an error, which the next I/O call reports).
/// Errors: DeadlineExceeded, Unavailable (poll failed).
Status AwaitReady(int fd, short events, SocketClock::time_point deadline);

/// Connect to `endpoint` once, trying each resolved address until the deadline; the socket is
/// non-blocking, close-on-exec, with TCP_NODELAY.
/// Errors: Unavailable (refused, unreachable, unresolvable), DeadlineExceeded.
Result<UniqueFd> ConnectOnce(const Endpoint& endpoint, SocketClock::time_point deadline);

}  // namespace refit::internal
