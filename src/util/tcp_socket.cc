#include "util/tcp_socket.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <system_error>

#include <fmt/format.h>

#include "refit/status_format.h"

namespace refit::internal {

void CloseFd(int fd) { ::close(fd); }

std::string ErrnoText(int errnum) { return std::generic_category().message(errnum); }

int PollTimeout(SocketClock::time_point deadline) {
  const auto left = deadline - SocketClock::now();
  if (left <= SocketClock::duration::zero()) return 0;
  return static_cast<int>(
      std::min<int64_t>(std::chrono::ceil<std::chrono::milliseconds>(left).count(), INT_MAX));
}

std::string EndpointText(std::string_view host, uint16_t port) {
  if (host.find(':') != std::string_view::npos) return fmt::format("[{}]:{}", host, port);
  return fmt::format("{}:{}", host, port);
}

Result<Endpoint> ParseAddress(std::string_view address) {
  const auto malformed = [&](std::string_view why) {
    return InvalidArgument("address '{}' is not tcp://HOST:PORT or HOST:PORT: {}", address, why);
  };
  std::string_view rest = address;
  if (rest.starts_with("tcp://")) rest.remove_prefix(std::string_view("tcp://").size());
  std::string_view host;
  std::string_view port_text;
  if (rest.starts_with('[')) {
    const size_t close = rest.find(']');
    if (close == std::string_view::npos || close + 1 >= rest.size() || rest[close + 1] != ':') {
      return malformed("an IPv6 host needs the form [HOST]:PORT");
    }
    host = rest.substr(1, close - 1);
    port_text = rest.substr(close + 2);
  } else {
    const size_t colon = rest.rfind(':');
    if (colon == std::string_view::npos) return malformed("no port");
    host = rest.substr(0, colon);
    if (host.find(':') != std::string_view::npos) {
      return malformed("an IPv6 host needs brackets");
    }
    port_text = rest.substr(colon + 1);
  }
  if (host.empty()) return malformed("no host");
  unsigned port = 0;
  const auto [end, error] =
      std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (port_text.empty() || error != std::errc() || end != port_text.data() + port_text.size() ||
      port > UINT16_MAX) {
    return malformed(fmt::format("port '{}' is not a number in [0, 65535]", port_text));
  }
  return Endpoint{std::string(host), static_cast<uint16_t>(port)};
}

Result<AddrInfoList> Resolve(const Endpoint& endpoint, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* list = nullptr;
  const std::string port = std::to_string(endpoint.port);
  const int error = ::getaddrinfo(endpoint.host.c_str(), port.c_str(), &hints, &list);
  if (error != 0) {
    return Unavailable("cannot resolve '{}': {}", endpoint.host, ::gai_strerror(error));
  }
  return AddrInfoList(list);
}

void SetNoDelay(int fd) {
  const int on = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
}

bool PeerClosed(int fd) {
  pollfd entry{fd, POLLRDHUP, 0};
  return ::poll(&entry, 1, 0) > 0 && (entry.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

Status AwaitReady(int fd, short events, SocketClock::time_point deadline) {
  for (;;) {
    pollfd entry{fd, events, 0};
    const int ready = ::poll(&entry, 1, PollTimeout(deadline));
    if (ready > 0) return Status::OK();
    if (ready < 0 && errno != EINTR) return Unavailable("poll: {}", ErrnoText(errno));
    if (ready == 0 && SocketClock::now() >= deadline) return DeadlineExceeded("deadline passed");
  }
}

Result<UniqueFd> ConnectOnce(const Endpoint& endpoint, SocketClock::time_point deadline) {
  REFIT_ASSIGN_OR_RETURN(AddrInfoList addresses, Resolve(endpoint, /*passive=*/false));
  Status last = Unavailable("'{}' resolved to no address", endpoint.host);
  for (const addrinfo* address = addresses.get(); address != nullptr; address = address->ai_next) {
    UniqueFd fd(::socket(address->ai_family, address->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                         address->ai_protocol));
    if (!fd.valid()) {
      last = Unavailable("socket: {}", ErrnoText(errno));
      continue;
    }
    if (::connect(fd.get(), address->ai_addr, address->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        last = Unavailable("connect: {}", ErrnoText(errno));
        continue;
      }
      if (Status ready = AwaitReady(fd.get(), POLLOUT, deadline); !ready.ok()) {
        last = ready;
        continue;
      }
      int error = 0;
      socklen_t error_bytes = sizeof(error);
      if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &error_bytes) != 0) error = errno;
      if (error != 0) {
        last = Unavailable("connect: {}", ErrnoText(error));
        continue;
      }
    }
    SetNoDelay(fd.get());
    return fd;
  }
  return last;
}

}  // namespace refit::internal
