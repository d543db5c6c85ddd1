// CURVE keys, key files and whom a CURVE relay admits (zmq_curve.h).
#include "transport/zmq/zmq_curve.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "refit/status_format.h"
#include "transport/transport_internal.h"

namespace refit::internal::zmq {
namespace {

// A CURVE key is written as 40 Z85 characters (ZeroMQ RFC 32); libzmq's Z85 text buffers hold a
// terminating NUL too.
constexpr size_t kCurveKeyZ85Chars = 40;
constexpr size_t kCurveKeyZ85Buffer = kCurveKeyZ85Chars + 1;
// A key file holds one key and a line end; anything much longer is not a key file.
constexpr size_t kMaxKeyFileBytes = 256;
// About 24,000 keys of 41 bytes: far more clients than a fleet has producers.
constexpr size_t kMaxAuthorizedKeysBytes = size_t{1} << 20;
// Like ssh, a secret key file must give group and others no access at all, and a file that
// lists who may connect must not be writable by them.
constexpr mode_t kSecretKeyForbiddenMode = S_IRWXG | S_IRWXO;
constexpr mode_t kAuthorizedKeysForbiddenMode = S_IWGRP | S_IWOTH;
// A public key file is public.
constexpr mode_t kPublicKeyForbiddenMode = 0;

// The mechanism name ZAP requests carry for CURVE.
constexpr std::string_view kZapCurve = "CURVE";

std::string_view TrimSpace(std::string_view text) {
  constexpr std::string_view kSpace = " \t\r\n";
  const size_t first = text.find_first_not_of(kSpace);
  if (first == std::string_view::npos) return {};
  return text.substr(first, text.find_last_not_of(kSpace) - first + 1);
}

// Read the file that URI parameter `param` names: a regular file of at most `max_bytes`, none of
// whose `forbidden_mode` bits is set (`mend` says how to fix that). Every error is
// InvalidArgument naming the parameter and the path: the file is configuration.
Result<std::string> ReadConfigFile(std::string_view param, const std::string& path,
                                   size_t max_bytes, mode_t forbidden_mode, std::string_view mend) {
  const auto bad = [&](std::string_view why) {
    return InvalidArgument("zmq {} '{}': {}", param, Printable(path), why);
  };
  // fstat the open descriptor, so the mode checked is that of the file read.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return bad(std::strerror(errno));
  std::string text;
  Status status = [&]() -> Status {
    struct stat info {};
    if (::fstat(fd, &info) != 0) return bad(std::strerror(errno));
    if (!S_ISREG(info.st_mode)) return bad("not a regular file");
    if ((info.st_mode & forbidden_mode) != 0) {
      return bad(fmt::format("mode {:04o} is too open; {}", info.st_mode & 07777, mend));
    }
    if (static_cast<uint64_t>(info.st_size) > max_bytes) {
      return bad(
          fmt::format("{} bytes, more than the {} such a file may hold", info.st_size, max_bytes));
    }
    text.resize(static_cast<size_t>(info.st_size));
    size_t done = 0;
    while (done < text.size()) {
      const ssize_t got = ::read(fd, text.data() + done, text.size() - done);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) return bad(std::strerror(errno));
      if (got == 0) return bad("shorter than its size (truncated while reading?)");
      done += static_cast<size_t>(got);
    }
    return Status::OK();
  }();
  ::close(fd);
  if (!status.ok()) return status;
  return text;
}

// Decode one Z85 key; `what` names it for errors (never its text, which may be a secret).
Result<CurveKey> DecodeZ85Key(std::string_view z85, std::string_view what) {
  if (z85.size() != kCurveKeyZ85Chars) {
    return InvalidArgument("{}: {} characters, expected a {}-character Z85 key", what, z85.size(),
                           kCurveKeyZ85Chars);
  }
  const std::string terminated(z85);
  CurveKey key{};
  if (zmq_z85_decode(key.data(), terminated.c_str()) == nullptr) {
    return InvalidArgument("{}: not a Z85 key (a character outside the Z85 alphabet)", what);
  }
  return key;
}

// The public key of the relays, or a listed client key.
Result<CurveKey> ReadPublicKey(std::string_view param, const std::string& path) {
  REFIT_ASSIGN_OR_RETURN(const std::string text, ReadConfigFile(param, path, kMaxKeyFileBytes,
                                                                kPublicKeyForbiddenMode, ""));
  return DecodeZ85Key(TrimSpace(text), fmt::format("zmq {} '{}'", param, Printable(path)));
}

// This side's key pair from its secret key file; the public key is derived.
Result<CurveKeyPair> ReadSecretKey(const std::string& path) {
  REFIT_ASSIGN_OR_RETURN(
      const std::string text,
      ReadConfigFile(kSecretKeyParam, path, kMaxKeyFileBytes, kSecretKeyForbiddenMode,
                     fmt::format("chmod 600 '{}'", Printable(path))));
  const std::string what = fmt::format("zmq {} '{}'", kSecretKeyParam, Printable(path));
  const std::string z85(TrimSpace(text));
  CurveKeyPair pair;
  REFIT_ASSIGN_OR_RETURN(pair.secret_key, DecodeZ85Key(z85, what));
  std::array<char, kCurveKeyZ85Buffer> public_z85{};
  if (zmq_curve_public(public_z85.data(), z85.c_str()) != 0) {
    return InvalidArgument("{}: cannot derive its public key: {}", what, ZmqError());
  }
  REFIT_ASSIGN_OR_RETURN(pair.public_key, DecodeZ85Key(public_z85.data(), what));
  return pair;
}

// The client keys listed in curve_authorized_keys: one Z85 key per line; blank lines and lines
// starting with '#' are skipped.
Result<std::set<CurveKey>> ReadAuthorizedKeys(const std::string& path) {
  REFIT_ASSIGN_OR_RETURN(const std::string text,
                         ReadConfigFile(kAuthorizedKeysParam, path, kMaxAuthorizedKeysBytes,
                                        kAuthorizedKeysForbiddenMode,
                                        fmt::format("chmod go-w '{}'", Printable(path))));
  std::set<CurveKey> keys;
  size_t line_number = 0;
  for (size_t begin = 0; begin < text.size();) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    ++line_number;
    const std::string_view line = TrimSpace(std::string_view(text).substr(begin, end - begin));
    begin = end + 1;
    if (line.empty() || line.front() == '#') continue;
    REFIT_ASSIGN_OR_RETURN(
        const CurveKey key,
        DecodeZ85Key(line, fmt::format("zmq {} '{}' line {}", kAuthorizedKeysParam, Printable(path),
                                       line_number)));
    keys.insert(key);
  }
  return keys;
}

}  // namespace

std::string Z85Text(const CurveKey& key) {
  std::array<char, kCurveKeyZ85Buffer> text{};
  zmq_z85_encode(text.data(), key.data(), key.size());
  return std::string(text.data(), kCurveKeyZ85Chars);
}

Result<std::optional<CurveClientKeys>> LoadSenderKeys(const CurveFiles& files) {
  if (!files.configured()) return std::optional<CurveClientKeys>();
  if (files.server_key.empty()) {
    return InvalidArgument(
        "zmq sender: {} needs {}, the relays' public key, to connect to CURVE relays",
        kSecretKeyParam, kServerKeyParam);
  }
  CurveClientKeys keys;
  REFIT_ASSIGN_OR_RETURN(keys.server_key, ReadPublicKey(kServerKeyParam, files.server_key));
  if (!files.secret_key.empty()) {
    REFIT_ASSIGN_OR_RETURN(keys.own, ReadSecretKey(files.secret_key));
    return std::optional<CurveClientKeys>(keys);
  }
  std::array<char, kCurveKeyZ85Buffer> public_z85{};
  std::array<char, kCurveKeyZ85Buffer> secret_z85{};
  if (zmq_curve_keypair(public_z85.data(), secret_z85.data()) != 0) {
    return Unavailable("zmq sender: ephemeral CURVE key pair: {}", ZmqError());
  }
  REFIT_ASSIGN_OR_RETURN(keys.own.secret_key,
                         DecodeZ85Key(secret_z85.data(), "ephemeral secret key"));
  REFIT_ASSIGN_OR_RETURN(keys.own.public_key,
                         DecodeZ85Key(public_z85.data(), "ephemeral public key"));
  return std::optional<CurveClientKeys>(keys);
}

Result<std::optional<CurveServerKeys>> LoadListenerKeys(const CurveFiles& files) {
  if (!files.configured()) return std::optional<CurveServerKeys>();
  if (files.secret_key.empty()) {
    return InvalidArgument(
        "zmq listener: {} needs {}: a CURVE relay holds the fleet's secret key (it would "
        "otherwise serve in plain text)",
        kServerKeyParam, kSecretKeyParam);
  }
  CurveServerKeys keys;
  REFIT_ASSIGN_OR_RETURN(keys.fleet, ReadSecretKey(files.secret_key));
  if (!files.server_key.empty()) {
    REFIT_ASSIGN_OR_RETURN(const CurveKey server_key,
                           ReadPublicKey(kServerKeyParam, files.server_key));
    if (server_key != keys.fleet.public_key) {
      return InvalidArgument(
          "zmq listener: {} '{}' is not the public key of {} '{}': every relay of a fleet holds "
          "the one server key pair that senders connect to",
          kServerKeyParam, Printable(files.server_key), kSecretKeyParam,
          Printable(files.secret_key));
    }
  }
  if (!files.authorized_keys.empty()) {
    REFIT_ASSIGN_OR_RETURN(keys.authorized, ReadAuthorizedKeys(files.authorized_keys));
    // Relays forward to each other as clients holding the fleet key pair.
    keys.authorized->insert(keys.fleet.public_key);
  }
  return std::optional<CurveServerKeys>(std::move(keys));
}

Status SetCurveKey(void* socket, int option, const CurveKey& key) {
  if (zmq_setsockopt(socket, option, key.data(), key.size()) != 0) {
    return Unavailable("zmq CURVE key option {}: {}", option, ZmqError());
  }
  return Status::OK();
}

ZapAdmit AdmitCurveKeys(std::set<CurveKey> authorized, std::string endpoint) {
  return [authorized = std::move(authorized),
          endpoint = std::move(endpoint)](const ZapRequest& request) -> Status {
    if (request.mechanism != kZapCurve || request.credentials.size() != 1 ||
        request.credentials[0].size() != kCurveKeyBytes) {
      return PermissionDenied("zmq listener {}: refused a {} handshake from {}: CURVE expected",
                              endpoint, Printable(request.mechanism), Printable(request.address));
    }
    CurveKey client{};
    std::memcpy(client.data(), request.credentials[0].data(), client.size());
    if (authorized.count(client) == 0) {
      return PermissionDenied("zmq listener {}: refused CURVE client key {} from {}", endpoint,
                              Z85Text(client), Printable(request.address));
    }
    return Status::OK();
  };
}

Result<CurveFiles> CurveParams(const TransportUri& shown) {
  CurveFiles files;
  for (const auto& [param, path] : {std::pair{kSecretKeyParam, &files.secret_key},
                                    std::pair{kServerKeyParam, &files.server_key},
                                    std::pair{kAuthorizedKeysParam, &files.authorized_keys}}) {
    const std::string* value = shown.Param(param);
    if (value == nullptr) continue;
    if (value->empty()) {
      return InvalidArgument("transport URI '{}': {} must name a key file",
                             Printable(shown.ToString()), param);
    }
    *path = *value;
  }
  if (!files.authorized_keys.empty() && files.secret_key.empty()) {
    return InvalidArgument(
        "transport URI '{}': {} needs {}: only a CURVE relay (a server) admits clients",
        Printable(shown.ToString()), kAuthorizedKeysParam, kSecretKeyParam);
  }
  if (files.configured() && zmq_has("curve") == 0) {
    return InvalidArgument("transport URI '{}': this libzmq was built without CURVE",
                           Printable(shown.ToString()));
  }
  return files;
}

}  // namespace refit::internal::zmq
