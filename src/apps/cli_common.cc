#include "cli_common.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>

#include "refit/status_format.h"
#include "util/environment.h"

namespace refit::cli {

Result<std::vector<std::byte>> ReadFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return IoErrorFromErrno(errno, fmt::format("open '{}'", path));
  std::vector<std::byte> bytes;
  const off_t size = ::lseek(fd, 0, SEEK_END);
  if (size > 0) bytes.resize(static_cast<size_t>(size));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n =
        ::pread(fd, bytes.data() + done, bytes.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      ::close(fd);
      return IoErrorFromErrno(err, fmt::format("read '{}'", path));
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return bytes;
}

Status WriteFileAtomically(const std::string& path,
                           const std::vector<std::vector<std::byte>>& parts) {
  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return IoErrorFromErrno(errno, fmt::format("create '{}'", tmp));
  for (const auto& part : parts) {
    size_t done = 0;
    while (done < part.size()) {
      const ssize_t n = ::write(fd, part.data() + done, part.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        const int err = errno;
        ::close(fd);
        ::unlink(tmp.c_str());
        return IoErrorFromErrno(err, fmt::format("write '{}'", tmp));
      }
      done += static_cast<size_t>(n);
    }
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return IoErrorFromErrno(err, fmt::format("sync '{}'", tmp));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return IoErrorFromErrno(err, fmt::format("rename '{}' to '{}'", tmp, path));
  }
  return Status::OK();
}

bool StdoutIsTty() { return ::isatty(STDOUT_FILENO) == 1; }

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace refit::cli

namespace refit::cli {

Result<ControlClientOptions> ControlClientOptionsFor(const std::string& url,
                                                     const std::string& api_key_env) {
  ControlClientOptions options;
  options.base_url = url;
  if (!api_key_env.empty()) {
    REFIT_ASSIGN_OR_RETURN(options.api_key, SecretFromEnvironment(api_key_env, "--api-key-env"));
  }
  return options;
}

Status ExplainReceiverError(const Status& error, std::string_view command, const std::string& url,
                            const std::string& api_key_env) {
  if (error.code() == StatusCode::kPermissionDenied) {
    return PermissionDenied("{}: unauthorized by {}: {}; {}", command, url, error.message(),
                            api_key_env.empty()
                                ? std::string("give the key with --api-key-env NAME")
                                : "check the key in " + api_key_env);
  }
  if (error.code() == StatusCode::kUnavailable) {
    return error.WithContext(fmt::format("{}: receiver {} is unreachable", command, url));
  }
  return error.WithContext(fmt::format("{}: {}", command, url));
}

Result<std::vector<std::span<const std::byte>>> SplitPayloadFile(std::span<const std::byte> file,
                                                                 const PayloadLimits& limits) {
  std::vector<std::span<const std::byte>> payloads;
  size_t offset = 0;
  while (offset < file.size()) {
    auto size = PayloadSizeAt(file.subspan(offset), limits);
    if (!size.ok()) return size.status().WithContext(fmt::format("payload at byte {}", offset));
    payloads.push_back(file.subspan(offset, *size));
    offset += *size;
  }
  return payloads;
}

}  // namespace refit::cli
