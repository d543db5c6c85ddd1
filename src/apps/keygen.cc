// refit keygen: make a CURVE key pair for the zmq:// transport — PREFIX.key (the secret key, for
// curve_secret_key) and PREFIX.pub (the public key, for curve_server_key or a line of
// curve_authorized_keys), each one line of Z85 text.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <string_view>

#include "cli_common.h"
#include "refit/status_format.h"

namespace refit::cli {
namespace {

// 40 Z85 characters of a 32-byte key (ZeroMQ RFC 32) and libzmq's terminating NUL.
constexpr size_t kZ85KeyBuffer = 41;
// The secret key is for its owner alone (the zmq transport refuses anything more open); the
// public key is meant to be shared.
constexpr mode_t kSecretKeyMode = 0600;
constexpr mode_t kPublicKeyMode = 0644;

struct KeygenArgs {
  std::string prefix;
  bool force = false;
};

// Write `key` and a newline to `path` with `mode`. A file that exists is an error unless `force`;
// a symbolic link is never followed, so a key cannot be written through one.
Status WriteKeyFile(const std::string& path, std::string_view key, mode_t mode, bool force) {
  const int flags = O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW | (force ? O_TRUNC : O_EXCL);
  const int fd = ::open(path.c_str(), flags, mode);
  if (fd < 0) {
    if (errno == EEXIST) return AlreadyExists("'{}' exists; pass --force to replace it", path);
    return IoError("create '{}': {}", path, std::strerror(errno));
  }
  // An existing file keeps its mode through O_TRUNC: narrow it before writing the key.
  const std::string line = std::string(key) + "\n";
  Status status;
  ssize_t written = 0;
  if (::fchmod(fd, mode) != 0) {
    status = IoError("chmod '{}': {}", path, std::strerror(errno));
  } else if (written = ::write(fd, line.data(), line.size()); written < 0 || ::fsync(fd) != 0) {
    status = IoError("write '{}': {}", path, std::strerror(errno));
  } else if (static_cast<size_t>(written) != line.size()) {
    status = IoError("write '{}': {} of {} bytes written", path, written, line.size());
  }
  if (::close(fd) != 0 && status.ok()) {
    status = IoError("close '{}': {}", path, std::strerror(errno));
  }
  return status;
}

Status RunKeygen(const KeygenArgs& args) {
  std::array<char, kZ85KeyBuffer> public_key{};
  std::array<char, kZ85KeyBuffer> secret_key{};
  if (zmq_curve_keypair(public_key.data(), secret_key.data()) != 0) {
    return FailedPrecondition("CURVE key pair: {} (is libzmq built with CURVE?)",
                              zmq_strerror(zmq_errno()));
  }
  const std::string secret_path = args.prefix + ".key";
  const std::string public_path = args.prefix + ".pub";
  REFIT_RETURN_NOT_OK(WriteKeyFile(secret_path, secret_key.data(), kSecretKeyMode, args.force));
  if (Status written = WriteKeyFile(public_path, public_key.data(), kPublicKeyMode, args.force);
      !written.ok()) {
    // Leave no secret key without its public half.
    ::unlink(secret_path.c_str());
    return written;
  }
  std::cout << "secret key: " << secret_path << " (mode 0600; curve_secret_key)\n"
            << "public key: " << public_path << " " << public_key.data()
            << " (curve_server_key, or a line of curve_authorized_keys)\n";
  return Status::OK();
}

}  // namespace

void RegisterKeygen(CLI::App& app, Status* result) {
  auto args = std::make_shared<KeygenArgs>();
  CLI::App* cmd = app.add_subcommand(
      "keygen", "Make a CURVE key pair for zmq:// (PREFIX.key secret, PREFIX.pub public)");
  cmd->add_option("-o,--out", args->prefix, "Path prefix of the two key files")->required();
  cmd->add_flag("--force", args->force, "Replace existing key files");
  cmd->callback([args, result] { *result = RunKeygen(*args); });
}

}  // namespace refit::cli
