#include "loopback_ports.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "refit/status_format.h"

namespace refit::testkit {

Result<std::vector<uint16_t>> FreeLoopbackPorts(size_t count) {
  std::vector<int> sockets;
  std::vector<uint16_t> ports;
  Status status;
  for (size_t i = 0; i < count && status.ok(); ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) {
      status = IoErrorFromErrno(errno, "socket");
      break;
    }
    sockets.push_back(fd);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
      status = IoErrorFromErrno(errno, "bind a free loopback port");
      break;
    }
    ports.push_back(ntohs(address.sin_port));
  }
  for (int fd : sockets) ::close(fd);
  if (!status.ok()) return status;
  return ports;
}

}  // namespace refit::testkit
