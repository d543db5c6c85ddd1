// zmq://[?timeout_ms=10000&retries=3&api_key=K|api_key_env=NAME&curve_…=FILE]: a ZeroMQ relay
// tree.
//
// Endpoints are "host:port" (TCP). A sender holds one DEALER per sending thread, connected to its
// producer's root relay endpoints[producer_id % n]. Each relay's listener binds a ROUTER on its
// endpoint (or on ListenerContext::bind_address with the endpoint's port: the endpoint stays its
// name among the peers) and, given the relay list as ListenerContext::peers, forwards what its
// sink staged to its children in a binary heap rooted at the producer's root: with relays r0 …
// r(n−1) and root R, relay i sits at heap position (i − R + n) % n, and position p's children are
// 2p+1 and 2p+2, i.e. relays (2p+1 + R) % n and (2p+2 + R) % n. Each payload thus crosses into the
// fleet once, and each relay sends it at most twice.
//
// Frames (integers are u32 little-endian):
//   DATA  request  [ "refit-zmq/1", "DATA",  api key (may be empty), root index, payload ]
//   FLUSH request  [ "refit-zmq/1", "FLUSH", api key, root index, transfer id (16 raw bytes),
//                    producer id, payload count ]
//   reply          [ "refit-zmq/1", "ACK"|"NACK", transfer id hex, producer id,
//                    payload id (empty for FLUSH), status code (0 for ACK), message ]
// (A ROUTER sees the DEALER's identity frame before these.)
//
// A NACK names no ids (all three frames empty) when the relay refused the request before it
// read them: a wrong api key or root index, a malformed request or FLUSH, or a payload whose
// header fails the check (its ids cannot be trusted). A sender takes such a NACK as the answer
// to its request: a DEALER has one request outstanding, and a sender replaces its socket after
// every attempt that ended without the answer (a timeout, a failed handshake), so no reply of an
// earlier attempt can arrive on it. A reply that names other ids is ignored.
//
// ACK means staged on the whole subtree: a relay replies once its own sink staged the payload
// and its children ACKed it. The relay remembers, per payload it staged, whether its subtree
// ACKed it: a duplicate (kDuplicate, or a late copy in a sealed stream) is ACKed at once when
// the subtree did, waits for the forward in flight when there is one (and gets its verdict), and
// is forwarded again otherwise (its earlier forward failed; the children deduplicate). The
// listener's I/O thread never waits for children, so trees of different roots that cross each
// other cannot deadlock: a forwarding thread per relay sends to the children, waits for their
// ACKs, and hands the upstream reply back to the I/O thread over an inproc socket. FLUSH
// travels the same path behind the producer's payloads: every relay hands the stream end to
// its sink and forwards it, and the FLUSH ACK means the whole tree has it.
//
// Seal: once a relay's sink took the stream end of (transfer, producer), that stream is sealed
// on the relay: a later DATA of it is NACKed FailedPrecondition and neither delivered nor
// forwarded, except an exact duplicate (same payload id and checksum) of a payload the relay
// staged, which is not delivered again and is ACKed like any duplicate (a late copy of a retried
// request is harmless). The ReceiverSession seals only at its own Flush, so without this a
// payload arriving between the relay flush and the receiver flush would be staged behind the
// declared count. A FLUSH is refused (FailedPrecondition) unless the relay's receiver has the
// transfer open (PayloadSink::IsTransferOpen): the coordinator prepares every receiver before
// any producer streams, so a FLUSH before Prepare is a coordinator bug or a forgery, and it must
// not seal a stream. A relay remembers at most kMaxStreamsPerTransfer producers per transfer.
//
// Every request is untrusted. Frame count, protocol and kind are checked first; then the api
// key (in constant time) and the root index, so an unauthenticated client's payload is never
// parsed; then the FLUSH frames or the payload header; only then is anything delivered. A
// request that does not speak the protocol is dropped (counted as a failure); one that does but
// is malformed or refused is NACKed with the reason. Requests beyond the payload size limit are
// dropped by ZeroMQ itself (ZMQ_MAXMSGSIZE), which disconnects the peer.
//
// CURVE (ZeroMQ RFC 26, optional): every relay of a fleet holds the same server key pair. A
// listener with curve_secret_key makes its ROUTER a CURVE server; with curve_authorized_keys it
// also binds a ZAP handler (RFC 27) in its own context that admits only the listed client keys
// and the fleet's own public key, which relays present as clients when they forward. Senders
// connect with curve_server_key and their own key pair (curve_secret_key, or an ephemeral one).
// Every DEALER watches its handshake through a socket monitor, so a refused client key is
// PermissionDenied at once and a failed handshake (wrong server key, CURVE on one side only) is
// Unavailable after the retries, instead of a silent timeout. Key files are read when a sender or
// listener is made, not by the factory (which does no I/O).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "refit/transport.h"
#include "transport/transport_internal.h"

namespace refit::internal {
namespace {

constexpr TransportCapabilities kZmqCapabilities{
    .staged_ack = true, .fan_out_tree = true, .reports_stream_end = true};

constexpr std::string_view kProtocol = "refit-zmq/1";
constexpr std::string_view kKindData = "DATA";
constexpr std::string_view kKindFlush = "FLUSH";
constexpr std::string_view kKindAck = "ACK";
constexpr std::string_view kKindNack = "NACK";

// Frame counts of each message, without the ROUTER's identity frame.
constexpr size_t kDataFrames = 5;
constexpr size_t kFlushFrames = 7;
constexpr size_t kReplyFrames = 7;
// A ROUTER reads the identity frame plus the longest request; anything longer is malformed.
constexpr size_t kMaxRequestFrames = 1 + kFlushFrames;
constexpr size_t kU32Bytes = 4;
constexpr size_t kTransferIdBytes = 16;
// An api key longer than this is a misconfiguration, not a key.
constexpr size_t kMaxApiKeyBytes = 1024;
// Non-payload frames (protocol, kind, key, root) fit well inside this; it is added to the payload
// limit for ZMQ_MAXMSGSIZE, which ZeroMQ applies per frame.
constexpr int64_t kFrameSlackBytes = 4096;

// Per-attempt reply wait and retry count when the URI sets none: a relay's ACK waits for its
// subtree, and applying a full apply queue may take seconds under load.
constexpr uint64_t kDefaultTimeoutMs = 10'000;
constexpr uint64_t kMaxTimeoutMs = 3'600'000;
constexpr uint64_t kDefaultRetries = 3;
constexpr uint64_t kMaxRetries = 100;
// Backoff between attempts doubles from the first value up to the cap.
constexpr int kFirstBackoffMs = 50;
constexpr int kMaxBackoffMs = 500;
// How often a listener's threads check for Stop while waiting.
constexpr int kStopCheckMs = 50;
constexpr uint16_t kMaxPort = 65535;

const char* const kReplyInbox = "inproc://refit-zmq-replies";
// Each DEALER's handshake monitor gets its own name: "<prefix><counter>".
constexpr std::string_view kMonitorPrefix = "inproc://refit-zmq-monitor-";
// A monitor event is two frames: event id (u16) and value (u32), then the endpoint.
constexpr size_t kMonitorEventFrames = 2;
constexpr size_t kMonitorEventBytes = 6;

// The URI parameters of CURVE.
constexpr std::string_view kSecretKeyParam = "curve_secret_key";
constexpr std::string_view kServerKeyParam = "curve_server_key";
constexpr std::string_view kAuthorizedKeysParam = "curve_authorized_keys";
// A CURVE key is 32 bytes, written as 40 Z85 characters (ZeroMQ RFC 32); libzmq's Z85 text
// buffers hold a terminating NUL too.
constexpr size_t kCurveKeyBytes = 32;
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

// ZAP (ZeroMQ RFC 27): libzmq asks the handler bound at this name in the socket's context.
const char* const kZapEndpoint = "inproc://zeromq.zap.01";
constexpr std::string_view kZapVersion = "1.0";
constexpr std::string_view kZapCurve = "CURVE";
// version, request id, domain, address, identity, mechanism, and CURVE's one credential.
constexpr size_t kZapCurveRequestFrames = 7;
// Read at most this many frames of a ZAP request; anything beyond CURVE's 7 is refused.
constexpr size_t kMaxZapRequestFrames = kZapCurveRequestFrames + 1;
constexpr std::string_view kZapAllowed = "200";
constexpr std::string_view kZapDenied = "400";
constexpr std::string_view kZapInternalError = "500";

// How many transfers a relay remembers stream seals and staged checksums for. Transfers run one
// at a time per receiver; older ones are refused by the session itself, which remembers its
// finished transfers.
constexpr size_t kSealedTransfers = SessionSink::kRememberedTransfers;
// Producers per transfer whose streams a relay remembers (and whose stream ends it hands to its
// sink): far more than a fleet has trainer ranks, few enough that forged producer ids cannot
// grow a relay's memory without bound (about 100 bytes per stream, a few MiB per transfer).
constexpr size_t kMaxStreamsPerTransfer = size_t{1} << 16;
// Requests for one payload that may wait for its forward in flight. It reaches a relay from one
// upstream (its sender or parent relay), which makes at most kMaxRetries + 1 attempts.
constexpr size_t kMaxWaitingDuplicates = kMaxRetries + 1;
// A forward's job id, which travels with its reply from the forwarding thread to the I/O thread.
constexpr size_t kJobIdBytes = sizeof(uint64_t);

// A CURVE key in binary.
using CurveKey = std::array<uint8_t, kCurveKeyBytes>;

struct CurveKeyPair {
  CurveKey public_key{};
  CurveKey secret_key{};
};

// The files the URI names (empty: not set); read by MakeSender and MakeListener.
struct CurveFiles {
  std::string secret_key;
  std::string server_key;
  std::string authorized_keys;

  bool configured() const { return !secret_key.empty() || !server_key.empty(); }
};

// What a DEALER presents: the server's public key and its own key pair.
struct CurveClientKeys {
  CurveKey server_key{};
  CurveKeyPair own;
};

// What a relay's ROUTER holds, and whom it admits.
struct CurveServerKeys {
  CurveKeyPair fleet;
  // Set (with the fleet key) when curve_authorized_keys is: only these clients pass the ZAP
  // handler. Unset: every client that knows the server key is admitted.
  std::optional<std::set<CurveKey>> authorized;
};

struct ZmqConfig {
  int timeout_ms = 0;
  int retries = 0;
  // Empty: no key sent, none required.
  std::string api_key;
  CurveFiles curve;
};

struct ContextCloser {
  void operator()(void* context) const { zmq_ctx_term(context); }
};
struct SocketCloser {
  void operator()(void* socket) const { zmq_close(socket); }
};
using ZmqContext = std::unique_ptr<void, ContextCloser>;
using ZmqSocket = std::unique_ptr<void, SocketCloser>;

std::string ZmqError() { return zmq_strerror(zmq_errno()); }

std::string TcpAddress(const std::string& endpoint) { return "tcp://" + endpoint; }

std::string U32Bytes(uint32_t value) {
  std::string out(kU32Bytes, '\0');
  for (size_t i = 0; i < kU32Bytes; ++i) out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  return out;
}

std::optional<uint32_t> ReadU32(std::string_view bytes) {
  if (bytes.size() != kU32Bytes) return std::nullopt;
  uint32_t value = 0;
  for (size_t i = 0; i < kU32Bytes; ++i) {
    value |= uint32_t{static_cast<unsigned char>(bytes[i])} << (8 * i);
  }
  return value;
}

std::string_view AsText(std::span<const std::byte> bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

// Compare without an early exit, so the time taken does not reveal how much of a guessed key
// was right. The length is not secret.
bool ConstantTimeEqual(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  volatile unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = diff | static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

// "host:port" with a printable host and a port in [1, 65535].
Status CheckEndpoint(const std::string& endpoint) {
  const size_t colon = endpoint.rfind(':');
  const auto bad = [&](std::string_view why) {
    return InvalidArgument("zmq endpoint '{}': {} (expected host:port)", Printable(endpoint), why);
  };
  if (colon == std::string::npos || colon == 0) return bad("no host");
  for (const char c : endpoint) {
    if (c < 0x21 || c > 0x7e || c == '/') return bad("a space, '/' or non-printable byte");
  }
  const std::string_view port = std::string_view(endpoint).substr(colon + 1);
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return bad("the port is not a number");
  }
  const int value = std::stoi(std::string(port));
  if (value < 1 || value > kMaxPort) return bad("the port is outside [1, 65535]");
  return Status::OK();
}

// The port of a checked endpoint.
std::string_view EndpointPort(const std::string& endpoint) {
  return std::string_view(endpoint).substr(endpoint.rfind(':') + 1);
}

// ListenerContext::bind_address: a host to bind with the endpoint's port, such as 0.0.0.0, *
// (every interface) or one interface's address.
Status CheckBindAddress(const std::string& host) {
  const auto bad = [&](std::string_view why) {
    return InvalidArgument(
        "zmq bind address '{}': {} (expected a host without a port, e.g. 0.0.0.0 or *)",
        Printable(host), why);
  };
  for (const char c : host) {
    if (c < 0x21 || c > 0x7e || c == '/') return bad("a space, '/' or non-printable byte");
  }
  if (host.find(':') != std::string::npos) return bad("a ':' (the port is the endpoint's)");
  return Status::OK();
}

// Send `frames` as one multipart message.
Status SendFrames(void* socket, const std::vector<std::string_view>& frames,
                  const std::string& where) {
  for (size_t i = 0; i < frames.size(); ++i) {
    const int flags = i + 1 < frames.size() ? ZMQ_SNDMORE : 0;
    if (zmq_send(socket, frames[i].data(), frames[i].size(), flags) < 0) {
      return Unavailable("zmq send to {}: {}", where, ZmqError());
    }
  }
  return Status::OK();
}

Status SendFrames(void* socket, const std::vector<std::string>& frames, const std::string& where) {
  return SendFrames(socket, std::vector<std::string_view>(frames.begin(), frames.end()), where);
}

// Receive one whole multipart message (non-blocking: call when the socket is readable).
// Errors: InvalidArgument when it has more than `max_frames` parts (all are drained);
// Unavailable when nothing could be read.
Result<std::vector<std::string>> ReceiveFrames(void* socket, size_t max_frames) {
  std::vector<std::string> frames;
  bool too_many = false;
  int more = 1;
  while (more != 0) {
    zmq_msg_t message;
    zmq_msg_init(&message);
    if (zmq_msg_recv(&message, socket, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&message);
      return Unavailable("zmq receive: {}", ZmqError());
    }
    if (frames.size() < max_frames) {
      frames.emplace_back(static_cast<const char*>(zmq_msg_data(&message)), zmq_msg_size(&message));
    } else {
      too_many = true;
    }
    more = zmq_msg_more(&message);
    zmq_msg_close(&message);
  }
  if (too_many) return InvalidArgument("zmq message with more than {} frames", max_frames);
  return frames;
}

// The reply a request waits for: transfer hex, producer id and payload id frames.
struct ReplyKey {
  std::string transfer_hex;
  std::string producer;
  std::string payload;
};

std::vector<std::string> MakeReply(const ReplyKey& key, const Status& status) {
  return {std::string(kProtocol),
          std::string(status.ok() ? kKindAck : kKindNack),
          key.transfer_hex,
          key.producer,
          key.payload,
          U32Bytes(static_cast<uint32_t>(status.code())),
          status.message()};
}

// ---- CURVE keys ---------------------------------------------------------------------------------

std::string_view TrimSpace(std::string_view text) {
  constexpr std::string_view kSpace = " \t\r\n";
  const size_t first = text.find_first_not_of(kSpace);
  if (first == std::string_view::npos) return {};
  return text.substr(first, text.find_last_not_of(kSpace) - first + 1);
}

std::string Z85Text(const CurveKey& key) {
  std::array<char, kCurveKeyZ85Buffer> text{};
  zmq_z85_encode(text.data(), key.data(), key.size());
  return std::string(text.data(), kCurveKeyZ85Chars);
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

// A sender's CURVE keys, or nullopt without CURVE. Without curve_secret_key the sender gets an
// ephemeral key pair: enough where the relays admit every client (no curve_authorized_keys).
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

// A relay's CURVE keys, or nullopt without CURVE.
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

// Why a handshake failed, from a monitor event: PermissionDenied when the relay refused this
// client's key (final), Unavailable otherwise (the next attempt may reach a relay that is ready).
Status HandshakeFailure(uint16_t event, uint32_t value, const std::string& endpoint) {
  if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
    return PermissionDenied(
        "zmq endpoint {} refused this client's CURVE key (ZAP status {}): list its public key in "
        "the relays' {}",
        endpoint, value, kAuthorizedKeysParam);
  }
  if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) {
    if (value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH) {
      return Unavailable(
          "zmq endpoint {}: security mechanism mismatch in the handshake (CURVE is configured "
          "on one side only)",
          endpoint);
    }
    return Unavailable("zmq endpoint {}: handshake failed with ZMTP protocol error {:#x}", endpoint,
                       value);
  }
  return Unavailable(
      "zmq endpoint {} closed the connection during the handshake ({} is not the relays' public "
      "key, or CURVE is configured on one side only?)",
      endpoint, kServerKeyParam);
}

// One DEALER connected to one endpoint, used by one thread at a time.
class Connection {
 public:
  // `curve`: the keys to present, or nullopt for a plain connection.
  Connection(void* context, std::string endpoint, const ZmqConfig& config,
             const std::optional<CurveClientKeys>& curve)
      : context_(context), endpoint_(std::move(endpoint)), config_(config), curve_(curve) {}

  // Send `frames` and wait for the reply that matches `key`, retrying with backoff.
  // Errors: the receiver's NACK; PermissionDenied when the relay refuses this client's CURVE key;
  // DeadlineExceeded when no attempt got a reply; Unavailable (a failed handshake among them);
  // Cancelled soon after `stop` is requested.
  Status Request(const std::vector<std::string_view>& frames, const ReplyKey& key,
                 const std::stop_token& stop = {}) {
    Status last;
    int backoff_ms = kFirstBackoffMs;
    for (int attempt = 0; attempt <= config_.retries; ++attempt) {
      if (attempt > 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
        backoff_ms = std::min(2 * backoff_ms, kMaxBackoffMs);
      }
      if (stop.stop_requested()) return Cancelled("request to zmq endpoint {}", endpoint_);
      Result<std::optional<Status>> reply = Attempt(frames, key, stop);
      if (!reply.ok()) {
        last = reply.status();
        // A fresh socket drops what the old one queued and any reply still on its way.
        Disconnect();
        continue;
      }
      if (reply->has_value()) return **reply;
      last = DeadlineExceeded("no reply from zmq endpoint {} within {} ms", endpoint_,
                              config_.timeout_ms);
      Disconnect();
    }
    return last.WithContext(
        fmt::format("zmq endpoint {}, {} attempts", endpoint_, config_.retries + 1));
  }

 private:
  Status Connect() {
    if (socket_ != nullptr) return Status::OK();
    ZmqSocket socket(zmq_socket(context_, ZMQ_DEALER));
    ZmqSocket monitor(zmq_socket(context_, ZMQ_PAIR));
    if (socket == nullptr || monitor == nullptr) {
      return Unavailable("zmq DEALER for {}: {}", endpoint_, ZmqError());
    }
    const int linger = 0;
    for (void* s : {socket.get(), monitor.get()}) {
      zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
    }
    if (curve_.has_value()) {
      REFIT_RETURN_NOT_OK(SetCurveKey(socket.get(), ZMQ_CURVE_SERVERKEY, curve_->server_key));
      REFIT_RETURN_NOT_OK(SetCurveKey(socket.get(), ZMQ_CURVE_PUBLICKEY, curve_->own.public_key));
      REFIT_RETURN_NOT_OK(SetCurveKey(socket.get(), ZMQ_CURVE_SECRETKEY, curve_->own.secret_key));
    }
    // Watch the handshake: a refused key or a mechanism mismatch would otherwise look like a
    // silent relay until the timeout. The monitor is connected before the DEALER, so it sees
    // every event.
    static std::atomic<uint64_t> next_monitor{0};
    const std::string monitor_endpoint = fmt::format("{}{}", kMonitorPrefix, next_monitor++);
    if (zmq_socket_monitor(socket.get(), monitor_endpoint.c_str(),
                           ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                               ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                               ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) != 0 ||
        zmq_connect(monitor.get(), monitor_endpoint.c_str()) != 0) {
      return Unavailable("zmq handshake monitor for {}: {}", endpoint_, ZmqError());
    }
    if (zmq_connect(socket.get(), TcpAddress(endpoint_).c_str()) != 0) {
      return Unavailable("zmq connect to {}: {}", endpoint_, ZmqError());
    }
    socket_ = std::move(socket);
    monitor_ = std::move(monitor);
    return Status::OK();
  }

  void Disconnect() {
    socket_.reset();
    monitor_.reset();
  }

  // The failure a monitor event reports (the monitor is readable).
  Status ReadHandshakeFailure() {
    REFIT_ASSIGN_OR_RETURN(const std::vector<std::string> event,
                           ReceiveFrames(monitor_.get(), kMonitorEventFrames));
    if (event.empty() || event[0].size() != kMonitorEventBytes) {
      return Unavailable("zmq endpoint {}: malformed handshake monitor event", endpoint_);
    }
    uint16_t id = 0;
    std::memcpy(&id, event[0].data(), sizeof(id));
    const std::optional<uint32_t> value = ReadU32(std::string_view(event[0]).substr(sizeof(id)));
    return HandshakeFailure(id, value.value_or(0), endpoint_);
  }

  // One attempt: the reply's verdict, or nullopt on timeout.
  Result<std::optional<Status>> Attempt(const std::vector<std::string_view>& frames,
                                        const ReplyKey& key, const std::stop_token& stop) {
    REFIT_RETURN_NOT_OK(Connect());
    REFIT_RETURN_NOT_OK(SendFrames(socket_.get(), frames, endpoint_));
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(config_.timeout_ms);
    while (true) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::optional<Status>();
      if (stop.stop_requested()) return Cancelled("request to zmq endpoint {}", endpoint_);
      std::array<zmq_pollitem_t, 2> items{
          {{socket_.get(), 0, ZMQ_POLLIN, 0}, {monitor_.get(), 0, ZMQ_POLLIN, 0}}};
      // Wake up at least every kStopCheckMs to notice a stop request.
      const int ready = zmq_poll(items.data(), items.size(),
                                 static_cast<long>(std::min<int64_t>(left.count(), kStopCheckMs)));
      if (ready < 0) {
        if (zmq_errno() == EINTR) continue;
        return Unavailable("zmq poll on {}: {}", endpoint_, ZmqError());
      }
      if ((items[1].revents & ZMQ_POLLIN) != 0) {
        const Status failure = ReadHandshakeFailure();
        // The connection is dead either way (libzmq does not retry a refused key).
        Disconnect();
        // A refused key stays refused: final, like a NACK. Anything else is this attempt's.
        if (failure.code() == StatusCode::kPermissionDenied) return std::optional<Status>(failure);
        return failure;
      }
      if ((items[0].revents & ZMQ_POLLIN) == 0) continue;
      REFIT_ASSIGN_OR_RETURN(std::vector<std::string> reply,
                             ReceiveFrames(socket_.get(), kReplyFrames));
      if (reply.size() != kReplyFrames || reply[0] != kProtocol) continue;
      const bool names_this_request =
          reply[2] == key.transfer_hex && reply[3] == key.producer && reply[4] == key.payload;
      // A refusal issued before the relay read any ids answers the one request outstanding on
      // this socket (see "A NACK names no ids" above).
      const bool names_nothing =
          reply[1] == kKindNack && reply[2].empty() && reply[3].empty() && reply[4].empty();
      // Not ours (a reply naming another request): keep waiting.
      if (!names_this_request && !names_nothing) continue;
      if (reply[1] == kKindAck) return std::optional<Status>(Status::OK());
      const std::optional<uint32_t> code = ReadU32(reply[5]);
      if (reply[1] != kKindNack || !code.has_value() || *code == 0 ||
          *code > static_cast<uint32_t>(StatusCode::kInternal)) {
        return std::optional<Status>(DataLoss("zmq endpoint {}: malformed reply (kind '{}')",
                                              endpoint_, Printable(reply[1])));
      }
      return std::optional<Status>(
          Status(static_cast<StatusCode>(*code),
                 fmt::format("refused by zmq endpoint {}: {}", endpoint_, Printable(reply[6]))));
    }
  }

  void* const context_;
  const std::string endpoint_;
  const ZmqConfig config_;
  const std::optional<CurveClientKeys> curve_;
  // The DEALER and the PAIR that receives its handshake failures; both set or both null.
  ZmqSocket socket_;
  ZmqSocket monitor_;
};

class ZmqSender final : public TransportSender {
 public:
  ZmqSender(ZmqContext context, ZmqConfig config, std::optional<CurveClientKeys> curve,
            SenderContext sender, PayloadLimits limits)
      : context_(std::move(context)),
        config_(std::move(config)),
        curve_(std::move(curve)),
        sender_(std::move(sender)),
        limits_(limits),
        root_index_(sender_.producer_id % sender_.endpoints.size()),
        root_(sender_.endpoints[root_index_]) {}

  ~ZmqSender() override {
    // Sockets close before the context terminates (zmq_ctx_term waits for them).
    connections_.clear();
  }

  Status Send(uint32_t payload_id, std::span<const std::byte> payload) override {
    REFIT_RETURN_NOT_OK(progress_.CheckOpen(sender_));
    REFIT_RETURN_NOT_OK(CheckOutgoingPayload(sender_, payload_id, payload, limits_).status());
    progress_.RecordSent(payload_id);
    const std::string root = U32Bytes(root_index_);
    const ReplyKey key{sender_.transfer_id.ToHex(), U32Bytes(sender_.producer_id),
                       U32Bytes(payload_id)};
    return ThreadConnection()
        .Request({kProtocol, kKindData, config_.api_key, root, AsText(payload)}, key)
        .WithContext(fmt::format("sending payload {} of producer {} to root relay {}", payload_id,
                                 sender_.producer_id, root_));
  }

  void CleanupThread() override {
    std::lock_guard lock(mutex_);
    connections_.erase(std::this_thread::get_id());
  }

  Status Finish(uint64_t payloads) override {
    REFIT_RETURN_NOT_OK(progress_.CheckFinish(sender_, payloads));
    const std::string root = U32Bytes(root_index_);
    const auto& id = sender_.transfer_id.bytes;
    const std::string transfer(reinterpret_cast<const char*>(id.data()), id.size());
    const std::string producer = U32Bytes(sender_.producer_id);
    const std::string count = U32Bytes(static_cast<uint32_t>(payloads));
    const ReplyKey key{sender_.transfer_id.ToHex(), producer, ""};
    REFIT_RETURN_NOT_OK(
        ThreadConnection()
            .Request({kProtocol, kKindFlush, config_.api_key, root, transfer, producer, count}, key)
            .WithContext(fmt::format("finishing producer {} ({} payloads) at root relay {}",
                                     sender_.producer_id, payloads, root_)));
    progress_.MarkFinished();
    return Status::OK();
  }

 private:
  // The calling thread's connection to the root; only this thread uses it until CleanupThread.
  Connection& ThreadConnection() {
    std::lock_guard lock(mutex_);
    std::unique_ptr<Connection>& connection = connections_[std::this_thread::get_id()];
    if (connection == nullptr) {
      connection = std::make_unique<Connection>(context_.get(), root_, config_, curve_);
    }
    return *connection;
  }

  const ZmqContext context_;
  const ZmqConfig config_;
  const std::optional<CurveClientKeys> curve_;
  const SenderContext sender_;
  const PayloadLimits limits_;
  const uint32_t root_index_;
  const std::string root_;
  SenderProgress progress_;
  std::mutex mutex_;
  std::map<std::thread::id, std::unique_ptr<Connection>> connections_;
};

// A request that must reach the children before its upstream reply.
struct ForwardJob {
  // Numbers the forward, so that its outcome finds the payload and the requests waiting on it.
  uint64_t id = 0;
  std::string identity;
  std::vector<std::string> request;
  ReplyKey key;
  std::vector<size_t> children;
};

// A payload a relay's sink staged (accepted or duplicate), and how far its subtree has it.
struct StagedPayload {
  // The header checksum: a copy with another one is not this payload.
  std::array<uint8_t, 16> checksum{};
  // The root of the tree whose subtree below this relay ACKed the payload (or in which this
  // relay is a leaf), if any: a duplicate of that tree is ACKed at once.
  std::optional<uint32_t> acked_root = std::nullopt;
  // The forward in flight (its job id and the root of its tree), if any.
  std::optional<std::pair<uint64_t, uint32_t>> forwarding = std::nullopt;
};

// What a relay staged of one producer's stream in one transfer, and whether the stream ended.
struct StreamRecord {
  // The stream end was handed to the sink: later payloads are refused (see "Seal" above).
  bool sealed = false;
  // Each payload id the sink staged.
  std::map<uint32_t, StagedPayload> staged;
};

// A payload's forward in flight, and the identities of the duplicates waiting for its verdict.
struct PendingForward {
  TransferId transfer_id;
  uint32_t producer_id = 0;
  uint32_t payload_id = 0;
  std::vector<std::string> waiting;
};

class ZmqListener final : public Listener {
 public:
  // `curve`: the relay's CURVE keys, or nullopt for a plain relay.
  ZmqListener(ZmqConfig config, std::optional<CurveServerKeys> curve, ListenerContext context,
              size_t self, PayloadSink& sink, PayloadLimits limits)
      : config_(std::move(config)),
        curve_(std::move(curve)),
        bind_(context.bind_address.empty()
                  ? context.endpoint
                  : fmt::format("{}:{}", context.bind_address, EndpointPort(context.endpoint))),
        endpoint_(std::move(context.endpoint)),
        peers_(std::move(context.peers)),
        self_(self),
        sink_(sink),
        limits_(limits) {}

  ~ZmqListener() override { Stop(); }

  Status Start() override {
    std::lock_guard lock(lifecycle_mutex_);
    if (started_ || stopped_) {
      return FailedPrecondition("zmq listener at {} was started or stopped before", endpoint_);
    }
    started_ = true;
    context_.reset(zmq_ctx_new());
    if (context_ == nullptr) return Unavailable("zmq context for {}: {}", endpoint_, ZmqError());
    router_.reset(zmq_socket(context_.get(), ZMQ_ROUTER));
    replies_in_.reset(zmq_socket(context_.get(), ZMQ_PULL));
    replies_out_.reset(zmq_socket(context_.get(), ZMQ_PUSH));
    if (router_ == nullptr || replies_in_ == nullptr || replies_out_ == nullptr) {
      return Unavailable("zmq sockets for {}: {}", endpoint_, ZmqError());
    }
    const int linger = 0;
    const int64_t max_frame = static_cast<int64_t>(
        std::min<uint64_t>(limits_.max_payload_bytes, INT64_MAX - kFrameSlackBytes) +
        kFrameSlackBytes);
    for (void* socket : {router_.get(), replies_in_.get(), replies_out_.get()}) {
      zmq_setsockopt(socket, ZMQ_LINGER, &linger, sizeof(linger));
    }
    zmq_setsockopt(router_.get(), ZMQ_MAXMSGSIZE, &max_frame, sizeof(max_frame));
    REFIT_RETURN_NOT_OK(SetUpCurve());
    if (zmq_bind(router_.get(), TcpAddress(bind_).c_str()) != 0) {
      const bool taken = zmq_errno() == EADDRINUSE;
      const std::string error = ZmqError();
      const std::string where =
          bind_ == endpoint_ ? endpoint_ : fmt::format("{} (endpoint {})", bind_, endpoint_);
      if (taken) return AlreadyExists("zmq listener: endpoint {} is taken: {}", where, error);
      return Unavailable("zmq listener: bind {}: {}", where, error);
    }
    if (zmq_bind(replies_in_.get(), kReplyInbox) != 0 ||
        zmq_connect(replies_out_.get(), kReplyInbox) != 0) {
      return Unavailable("zmq listener {}: reply channel: {}", endpoint_, ZmqError());
    }
    io_thread_ = std::jthread([this](std::stop_token stop) {
      NameCurrentThread("refit-zmq-relay");
      ServeLoop(stop);
    });
    if (!peers_.empty()) {
      forward_thread_ = std::jthread([this](std::stop_token stop) {
        NameCurrentThread("refit-zmq-fwd");
        ForwardLoop(stop);
      });
    }
    if (zap_ != nullptr) {
      zap_thread_ = std::jthread([this](std::stop_token stop) {
        NameCurrentThread("refit-zmq-zap");
        ZapLoop(stop);
      });
    }
    return Status::OK();
  }

  void Stop() override {
    std::lock_guard lock(lifecycle_mutex_);
    if (stopped_) return;
    stopped_ = true;
    // Request every stop before joining any: the I/O thread's sink call, the forwarder's queue
    // wait and requests, and the ZAP handler's poll all watch their own stop tokens.
    io_thread_.request_stop();
    forward_thread_.request_stop();
    zap_thread_.request_stop();
    for (std::jthread* thread : {&io_thread_, &forward_thread_, &zap_thread_}) {
      if (thread->joinable()) thread->join();
    }
    router_.reset();
    replies_in_.reset();
    replies_out_.reset();
    zap_.reset();
    context_.reset();
  }

  ListenerStats stats() const override {
    std::lock_guard lock(stats_mutex_);
    return stats_;
  }

  const std::string& endpoint() const override { return endpoint_; }

 private:
  void RecordFailure(const Status& status) {
    std::lock_guard lock(stats_mutex_);
    ++stats_.failures;
    stats_.last_error = status;
  }

  // Make the ROUTER a CURVE server, and bind the ZAP handler before the ROUTER accepts anyone:
  // libzmq admits every client while no handler is bound.
  Status SetUpCurve() {
    if (!curve_.has_value()) return Status::OK();
    const int server = 1;
    if (zmq_setsockopt(router_.get(), ZMQ_CURVE_SERVER, &server, sizeof(server)) != 0) {
      return Unavailable("zmq listener {}: CURVE server: {}", endpoint_, ZmqError());
    }
    REFIT_RETURN_NOT_OK(SetCurveKey(router_.get(), ZMQ_CURVE_SECRETKEY, curve_->fleet.secret_key)
                            .WithContext(fmt::format("zmq listener {}", endpoint_)));
    if (!curve_->authorized.has_value()) return Status::OK();
    zap_.reset(zmq_socket(context_.get(), ZMQ_REP));
    if (zap_ == nullptr) {
      return Unavailable("zmq listener {}: ZAP socket: {}", endpoint_, ZmqError());
    }
    const int linger = 0;
    zmq_setsockopt(zap_.get(), ZMQ_LINGER, &linger, sizeof(linger));
    if (zmq_bind(zap_.get(), kZapEndpoint) != 0) {
      return Unavailable("zmq listener {}: bind the ZAP handler: {}", endpoint_, ZmqError());
    }
    return Status::OK();
  }

  // Answer libzmq's ZAP requests: admit the authorized client keys, refuse the others.
  void ZapLoop(std::stop_token stop) {
    while (!stop.stop_requested()) {
      zmq_pollitem_t item{zap_.get(), 0, ZMQ_POLLIN, 0};
      const int ready = zmq_poll(&item, 1, kStopCheckMs);
      if (ready < 0 && zmq_errno() != EINTR) {
        RecordFailure(Unavailable("zmq listener {}: ZAP poll: {}", endpoint_, ZmqError()));
      }
      if (ready <= 0) continue;
      Result<std::vector<std::string>> request = ReceiveFrames(zap_.get(), kMaxZapRequestFrames);
      if (!request.ok() && request.status().code() == StatusCode::kUnavailable) continue;
      std::string_view verdict = kZapDenied;
      std::string request_id;
      if (!request.ok() || request->size() != kZapCurveRequestFrames ||
          (*request)[0] != kZapVersion || (*request)[5] != kZapCurve ||
          (*request)[6].size() != kCurveKeyBytes) {
        // libzmq asks only well-formed CURVE questions; anything else is refused, and answered
        // all the same: a REP socket must reply before it reads the next request.
        verdict = kZapInternalError;
        RecordFailure(Internal("zmq listener {}: malformed ZAP request", endpoint_));
        if (request.ok() && request->size() > 1) request_id = (*request)[1];
      } else {
        request_id = (*request)[1];
        CurveKey client{};
        std::memcpy(client.data(), (*request)[6].data(), client.size());
        if (curve_->authorized->count(client) != 0) {
          verdict = kZapAllowed;
        } else {
          RecordFailure(PermissionDenied("zmq listener {}: refused CURVE client key {} from {}",
                                         endpoint_, Z85Text(client), Printable((*request)[3])));
        }
      }
      const std::vector<std::string> reply{
          std::string(kZapVersion), request_id, std::string(verdict), "", "", ""};
      if (Status sent = SendFrames(zap_.get(), reply, kZapEndpoint); !sent.ok()) {
        RecordFailure(sent);
      }
    }
  }

  // The record of (transfer, producer), or null when this relay staged nothing of it and saw
  // no stream end.
  StreamRecord* FindStream(const TransferId& transfer, uint32_t producer) {
    for (auto& [id, producers] : streams_) {
      if (id != transfer) continue;
      const auto found = producers.find(producer);
      return found == producers.end() ? nullptr : &found->second;
    }
    return nullptr;
  }

  // The record of (transfer, producer), made if needed; the oldest transfer is forgotten beyond
  // kSealedTransfers.
  StreamRecord& Stream(const TransferId& transfer, uint32_t producer) {
    auto it = std::find_if(streams_.begin(), streams_.end(),
                           [&](const auto& entry) { return entry.first == transfer; });
    if (it == streams_.end()) {
      if (streams_.size() == kSealedTransfers) streams_.erase(streams_.begin());
      streams_.emplace_back(transfer, std::map<uint32_t, StreamRecord>{});
      it = streams_.end() - 1;
    }
    return it->second[producer];
  }

  void ServeLoop(std::stop_token stop) {
    while (!stop.stop_requested()) {
      std::array<zmq_pollitem_t, 2> items{
          {{router_.get(), 0, ZMQ_POLLIN, 0}, {replies_in_.get(), 0, ZMQ_POLLIN, 0}}};
      if (zmq_poll(items.data(), items.size(), kStopCheckMs) < 0) {
        if (zmq_errno() != EINTR) RecordFailure(Unavailable("zmq poll: {}", ZmqError()));
        continue;
      }
      if ((items[1].revents & ZMQ_POLLIN) != 0) {
        Result<std::vector<std::string>> outcome =
            ReceiveFrames(replies_in_.get(), 2 + kReplyFrames);
        if (outcome.ok()) FinishForward(std::move(outcome).ValueOrDie());
      }
      if ((items[0].revents & ZMQ_POLLIN) != 0) {
        Result<std::vector<std::string>> request = ReceiveFrames(router_.get(), kMaxRequestFrames);
        if (!request.ok()) {
          RecordFailure(request.status().WithContext(endpoint_));
          continue;
        }
        HandleRequest(std::move(request).ValueOrDie(), stop);
      }
    }
  }

  void Reply(const std::string& identity, const ReplyKey& key, const Status& status) {
    if (!status.ok()) RecordFailure(status);
    std::vector<std::string> frames = MakeReply(key, status);
    frames.insert(frames.begin(), identity);
    SendUpstream(frames);
  }

  // Send a reply, identity first, through the ROUTER.
  void SendUpstream(const std::vector<std::string>& frames) {
    Status sent = SendFrames(router_.get(), frames, "upstream");
    if (!sent.ok()) RecordFailure(sent);
  }

  // The relays below this one in the heap rooted at `root` (none without peers).
  std::vector<size_t> Children(size_t root) const {
    const size_t n = peers_.size();
    if (n == 0) return {};
    const size_t position = (self_ + n - root) % n;
    std::vector<size_t> children;
    for (const size_t child : {2 * position + 1, 2 * position + 2}) {
      if (child < n) children.push_back((child + root) % n);
    }
    return children;
  }

  void HandleRequest(std::vector<std::string> frames, const std::stop_token& stop) {
    // frames[0] is the identity the ROUTER added.
    if (frames.size() < 3 || frames[1] != kProtocol) {
      RecordFailure(
          InvalidArgument("zmq listener {}: dropped a request of {} frames that does "
                          "not speak {}",
                          endpoint_, frames.size() - 1, kProtocol));
      return;
    }
    const std::string identity = frames[0];
    const std::string_view kind = frames[2];
    const size_t expected_frames = kind == kKindData ? kDataFrames : kFlushFrames;
    if ((kind != kKindData && kind != kKindFlush) || frames.size() != 1 + expected_frames) {
      Reply(identity, {},
            InvalidArgument("zmq listener {}: malformed request: kind '{}' with {} "
                            "frames",
                            endpoint_, Printable(kind), frames.size() - 1));
      return;
    }
    const std::optional<uint32_t> root = ReadU32(frames[4]);
    const size_t relays = std::max<size_t>(peers_.size(), 1);
    // Authenticate before reading anything else of the request: a client without the key gets
    // no diagnostics about its payload, and its bytes are never parsed. Such refusals name no
    // ids (see "A NACK names no ids").
    if (Status access = CheckAccess(frames[3], root, relays); !access.ok()) {
      Reply(identity, {}, access);
      return;
    }
    if (kind == kKindData) {
      HandleData(identity, std::move(frames), *root, stop);
    } else {
      HandleFlush(identity, std::move(frames), *root);
    }
  }

  // Check the key, then the root index. Errors: PermissionDenied; InvalidArgument.
  Status CheckAccess(const std::string& key, std::optional<uint32_t> root, size_t relays) const {
    if (!config_.api_key.empty() && !ConstantTimeEqual(key, config_.api_key)) {
      return PermissionDenied("zmq listener {}: wrong api key", endpoint_);
    }
    if (!root.has_value() || *root >= relays) {
      return InvalidArgument("zmq listener {}: root relay index is not one of {} relays", endpoint_,
                             relays);
    }
    return Status::OK();
  }

  // Refuse a stream of a producer this relay has no record of in `transfer` once the transfer
  // has kMaxStreamsPerTransfer of them. Errors: ResourceExhausted.
  Status CheckStreamRoom(const TransferId& transfer, uint32_t producer) const {
    for (const auto& [id, producers] : streams_) {
      if (id != transfer || producers.size() < kMaxStreamsPerTransfer) continue;
      return ResourceExhausted(
          "zmq relay {}: producer {} of transfer {}: the transfer has streams of {} producers "
          "already, the most a relay takes",
          endpoint_, producer, transfer.ToHex(), kMaxStreamsPerTransfer);
    }
    return Status::OK();
  }

  void CountStaged(StageResult result) {
    std::lock_guard lock(stats_mutex_);
    ++(result == StageResult::kDuplicate ? stats_.duplicates : stats_.delivered);
  }

  void HandleData(const std::string& identity, std::vector<std::string> frames, uint32_t root,
                  const std::stop_token& stop) {
    const std::string& payload = frames[5];
    const auto bytes = std::as_bytes(std::span(payload.data(), payload.size()));
    Result<PayloadHeader> header = ValidatePayloadHeader(bytes, limits_);
    if (!header.ok()) {
      Reply(identity, {}, header.status().WithContext(fmt::format("zmq listener {}", endpoint_)));
      return;
    }
    const PayloadIds& ids = header->ids;
    const ReplyKey key{ids.transfer_id.ToHex(), U32Bytes(ids.producer_id),
                       U32Bytes(ids.payload_id)};
    StreamRecord* stream = FindStream(ids.transfer_id, ids.producer_id);
    if (stream != nullptr && stream->sealed) {
      const auto staged = stream->staged.find(ids.payload_id);
      if (staged == stream->staged.end() || staged->second.checksum != header->checksum) {
        Reply(identity, key,
              FailedPrecondition("zmq relay {}: payload {} of producer {} (transfer {}) came "
                                 "after the producer's stream end: the stream is sealed",
                                 endpoint_, ids.payload_id, ids.producer_id,
                                 ids.transfer_id.ToHex()));
        return;
      }
      // A late copy of a staged payload (a retried request): staged here already, so not
      // delivered again, and answered like any duplicate.
      CountStaged(StageResult::kDuplicate);
      ReplyOnceSubtreeHas(identity, std::move(frames), key, ids, staged->second, root);
      return;
    }
    if (stream == nullptr) {
      if (Status room = CheckStreamRoom(ids.transfer_id, ids.producer_id); !room.ok()) {
        Reply(identity, key, room);
        return;
      }
    }
    Result<StageResult> staged =
        sink_.Deliver(std::vector<std::byte>(bytes.begin(), bytes.end()), stop);
    if (!staged.ok()) {
      Reply(identity, key, staged.status());
      return;
    }
    CountStaged(*staged);
    // The record is made only now, so refused payloads (of transfers never prepared, say) cannot
    // push the streams of real transfers out of streams_.
    StagedPayload& record =
        Stream(ids.transfer_id, ids.producer_id)
            .staged.try_emplace(ids.payload_id, StagedPayload{.checksum = header->checksum})
            .first->second;
    ReplyOnceSubtreeHas(identity, std::move(frames), key, ids, record, root);
  }

  // Answer a request for `staged` once the subtree below this relay in the tree of `root` has
  // it: at once when this relay is a leaf there or an earlier forward was ACKed; with the
  // verdict of the forward in flight; else after forwarding it now (again, if an earlier
  // forward failed: the children deduplicate). An ACK thus always means "staged on the whole
  // subtree", for a retry too.
  void ReplyOnceSubtreeHas(const std::string& identity, std::vector<std::string> frames,
                           const ReplyKey& key, const PayloadIds& ids, StagedPayload& staged,
                           uint32_t root) {
    std::vector<size_t> children = Children(root);
    if (children.empty()) staged.acked_root = root;
    if (staged.acked_root == root) {
      Reply(identity, key, Status::OK());
      return;
    }
    if (staged.forwarding.has_value() && staged.forwarding->second == root) {
      const auto pending = pending_.find(staged.forwarding->first);
      if (pending != pending_.end()) {
        if (pending->second.waiting.size() >= kMaxWaitingDuplicates) {
          Reply(identity, key,
                ResourceExhausted("zmq relay {}: payload {} of producer {} (transfer {}): {} "
                                  "copies wait for its forward already",
                                  endpoint_, ids.payload_id, ids.producer_id,
                                  ids.transfer_id.ToHex(), kMaxWaitingDuplicates));
          return;
        }
        pending->second.waiting.push_back(identity);
        return;
      }
    }
    const uint64_t job = next_job_++;
    staged.forwarding.emplace(job, root);
    pending_.emplace(job, PendingForward{ids.transfer_id, ids.producer_id, ids.payload_id, {}});
    Forward(job, identity, std::move(frames), key, std::move(children));
  }

  void HandleFlush(const std::string& identity, std::vector<std::string> frames, uint32_t root) {
    const std::optional<uint32_t> producer = ReadU32(frames[6]);
    const std::optional<uint32_t> count = ReadU32(frames[7]);
    if (frames[5].size() != kTransferIdBytes || !producer.has_value() || !count.has_value()) {
      Reply(identity, {}, InvalidArgument("zmq listener {}: malformed FLUSH", endpoint_));
      return;
    }
    StreamEnd end;
    std::memcpy(end.transfer_id.bytes.data(), frames[5].data(), kTransferIdBytes);
    end.producer_id = *producer;
    end.payloads = *count;
    const ReplyKey key{end.transfer_id.ToHex(), frames[6], ""};
    if (!sink_.IsTransferOpen(end.transfer_id)) {
      Reply(identity, key,
            FailedPrecondition("zmq relay {}: stream end of producer {} for transfer {}, which "
                               "this receiver does not have open: the coordinator prepares "
                               "every receiver before producers stream",
                               endpoint_, end.producer_id, end.transfer_id.ToHex()));
      return;
    }
    if (FindStream(end.transfer_id, end.producer_id) == nullptr) {
      if (Status room = CheckStreamRoom(end.transfer_id, end.producer_id); !room.ok()) {
        Reply(identity, key, room);
        return;
      }
    }
    if (Status ended = sink_.EndOfStream(end); !ended.ok()) {
      Reply(identity, key, ended);
      return;
    }
    Stream(end.transfer_id, end.producer_id).sealed = true;
    {
      std::lock_guard lock(stats_mutex_);
      ++stats_.streams_ended;
    }
    std::vector<size_t> children = Children(root);
    if (children.empty()) {
      Reply(identity, key, Status::OK());
      return;
    }
    // A repeated FLUSH is forwarded again: the children take an equal stream end again.
    Forward(next_job_++, identity, std::move(frames), key, std::move(children));
  }

  // Hand the request to the forwarding thread, which replies once `children` answered.
  void Forward(uint64_t job, const std::string& identity, std::vector<std::string> frames,
               const ReplyKey& key, std::vector<size_t> children) {
    frames.erase(frames.begin());
    {
      std::lock_guard lock(jobs_mutex_);
      jobs_.push_back(ForwardJob{job, identity, std::move(frames), key, std::move(children)});
    }
    jobs_changed_.notify_one();
  }

  // A forward ended ([job id, identity, reply…] from the forwarding thread): pass the reply
  // upstream and to the duplicates that waited for it, and remember whether the subtree ACKed.
  void FinishForward(std::vector<std::string> outcome) {
    if (outcome.size() != 2 + kReplyFrames || outcome[0].size() != kJobIdBytes) {
      RecordFailure(Internal("zmq listener {}: malformed forward outcome of {} frames", endpoint_,
                             outcome.size()));
      return;
    }
    uint64_t job = 0;
    std::memcpy(&job, outcome[0].data(), kJobIdBytes);
    std::vector<std::string> reply(std::make_move_iterator(outcome.begin() + 1),
                                   std::make_move_iterator(outcome.end()));
    SendUpstream(reply);
    const auto pending = pending_.find(job);
    // A FLUSH: nobody waits for it.
    if (pending == pending_.end()) return;
    const PendingForward& forward = pending->second;
    if (StreamRecord* stream = FindStream(forward.transfer_id, forward.producer_id);
        stream != nullptr) {
      const auto staged = stream->staged.find(forward.payload_id);
      if (staged != stream->staged.end() && staged->second.forwarding.has_value() &&
          staged->second.forwarding->first == job) {
        // reply[2] is the kind (after the identity and the protocol).
        if (reply[2] == kKindAck) staged->second.acked_root = staged->second.forwarding->second;
        staged->second.forwarding.reset();
      }
    }
    for (const std::string& waiting : forward.waiting) {
      reply[0] = waiting;
      SendUpstream(reply);
    }
    pending_.erase(pending);
  }

  // A relay forwards as a CURVE client holding the fleet key pair, which every relay admits.
  std::optional<CurveClientKeys> ForwardKeys() const {
    if (!curve_.has_value()) return std::nullopt;
    return CurveClientKeys{curve_->fleet.public_key, curve_->fleet};
  }

  void ForwardLoop(std::stop_token stop) {
    std::map<size_t, std::unique_ptr<Connection>> connections;
    while (true) {
      ForwardJob job;
      {
        std::unique_lock lock(jobs_mutex_);
        if (!jobs_changed_.wait(lock, stop, [&] { return !jobs_.empty(); })) break;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      Status status;
      const std::vector<std::string_view> request(job.request.begin(), job.request.end());
      for (const size_t child : job.children) {
        std::unique_ptr<Connection>& connection = connections[child];
        if (connection == nullptr) {
          connection =
              std::make_unique<Connection>(context_.get(), peers_[child], config_, ForwardKeys());
        }
        status = connection->Request(request, job.key, stop)
                     .WithContext(fmt::format("relay {} forwarding", endpoint_));
        if (!status.ok()) break;
      }
      if (!status.ok()) RecordFailure(status);
      std::string job_id(kJobIdBytes, '\0');
      std::memcpy(job_id.data(), &job.id, kJobIdBytes);
      std::vector<std::string> outcome = MakeReply(job.key, status);
      outcome.insert(outcome.begin(), {std::move(job_id), job.identity});
      if (Status sent = SendFrames(replies_out_.get(), outcome, kReplyInbox); !sent.ok()) {
        RecordFailure(sent);
      }
    }
  }

  const ZmqConfig config_;
  const std::optional<CurveServerKeys> curve_;
  // The host:port the ROUTER binds; the endpoint unless ListenerContext::bind_address is set.
  const std::string bind_;
  const std::string endpoint_;
  const std::vector<std::string> peers_;
  // This relay's index in peers_ (0 without peers).
  const size_t self_;
  PayloadSink& sink_;
  const PayloadLimits limits_;

  std::mutex lifecycle_mutex_;
  bool started_ = false;
  bool stopped_ = false;
  // Declared before the sockets: they close first. The router and replies_in_ belong to the
  // I/O thread, replies_out_ to the forwarding thread, once started.
  ZmqContext context_;
  ZmqSocket router_;
  ZmqSocket replies_in_;
  ZmqSocket replies_out_;
  // The ZAP handler's socket (with curve_authorized_keys only), owned by the ZAP thread.
  ZmqSocket zap_;
  std::jthread io_thread_;
  std::jthread forward_thread_;
  std::jthread zap_thread_;

  // The streams this relay staged payloads of, per transfer, most recent last; at most
  // kSealedTransfers, each of at most kMaxStreamsPerTransfer producers. The I/O thread's alone.
  std::vector<std::pair<TransferId, std::map<uint32_t, StreamRecord>>> streams_;
  // The payload forwards in flight by job id, and the next job id. The I/O thread's alone.
  std::map<uint64_t, PendingForward> pending_;
  uint64_t next_job_ = 0;

  std::mutex jobs_mutex_;
  // Waits with the forwarding thread's stop token, so Stop needs no notification.
  std::condition_variable_any jobs_changed_;
  std::deque<ForwardJob> jobs_;

  mutable std::mutex stats_mutex_;
  ListenerStats stats_;
};

class ZmqTransport final : public Transport {
 public:
  ZmqTransport(TransportUri uri, ZmqConfig config, TransportOptions options)
      : Transport(std::move(uri)), config_(std::move(config)), options_(options) {}

  TransportCapabilities capabilities() const override {
    TransportCapabilities capabilities = kZmqCapabilities;
    capabilities.encrypted = config_.curve.configured();
    return capabilities;
  }

  Result<std::unique_ptr<TransportSender>> MakeSender(const SenderContext& context) override {
    REFIT_RETURN_NOT_OK(CheckSenderContext(uri(), context));
    for (const std::string& endpoint : context.endpoints) {
      REFIT_RETURN_NOT_OK(CheckEndpoint(endpoint));
    }
    REFIT_ASSIGN_OR_RETURN(std::optional<CurveClientKeys> curve, LoadSenderKeys(config_.curve));
    ZmqContext zmq_context(zmq_ctx_new());
    if (zmq_context == nullptr) return Unavailable("zmq context: {}", ZmqError());
    return std::unique_ptr<TransportSender>(std::make_unique<ZmqSender>(
        std::move(zmq_context), config_, std::move(curve), context, options_.limits));
  }

  Result<std::unique_ptr<Listener>> MakeListener(const ListenerContext& context,
                                                 PayloadSink& sink) override {
    REFIT_RETURN_NOT_OK(CheckEndpoint(context.endpoint));
    if (!context.bind_address.empty()) {
      REFIT_RETURN_NOT_OK(CheckBindAddress(context.bind_address)
                              .WithContext(fmt::format("zmq listener {}", context.endpoint)));
    }
    size_t self = 0;
    if (!context.peers.empty()) {
      for (const std::string& peer : context.peers) REFIT_RETURN_NOT_OK(CheckEndpoint(peer));
      const auto found = std::find(context.peers.begin(), context.peers.end(), context.endpoint);
      if (found == context.peers.end() ||
          std::count(context.peers.begin(), context.peers.end(), context.endpoint) != 1) {
        return InvalidArgument("zmq listener {}: must appear once among its {} relay peers",
                               context.endpoint, context.peers.size());
      }
      self = static_cast<size_t>(found - context.peers.begin());
    }
    REFIT_ASSIGN_OR_RETURN(std::optional<CurveServerKeys> curve, LoadListenerKeys(config_.curve));
    return std::unique_ptr<Listener>(std::make_unique<ZmqListener>(
        config_, std::move(curve), context, self, sink, options_.limits));
  }

 private:
  const ZmqConfig config_;
  const TransportOptions options_;
};

// The CURVE key files the URI names, checked for what needs no I/O.
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

}  // namespace

Result<std::unique_ptr<Transport>> MakeZmqTransport(const TransportUri& uri,
                                                    const TransportOptions& options) {
  // Error messages name the URI; never with the key in it.
  TransportUri shown = uri;
  for (auto& [name, value] : shown.params) {
    if (name == "api_key") value = "<redacted>";
  }
  REFIT_RETURN_NOT_OK(
      CheckKnownParams(shown, {"timeout_ms", "retries", "api_key", "api_key_env", kSecretKeyParam,
                               kServerKeyParam, kAuthorizedKeysParam}));
  if (!uri.target.empty()) {
    return InvalidArgument(
        "transport URI '{}': zmq takes no target; each endpoint names its host:port",
        Printable(shown.ToString()));
  }
  ZmqConfig config;
  REFIT_ASSIGN_OR_RETURN(const uint64_t timeout_ms,
                         UintParam(shown, "timeout_ms", kDefaultTimeoutMs, kMaxTimeoutMs));
  REFIT_ASSIGN_OR_RETURN(const uint64_t retries,
                         UintParam(shown, "retries", kDefaultRetries, kMaxRetries));
  if (timeout_ms == 0) {
    return InvalidArgument("transport URI '{}': timeout_ms must be positive",
                           Printable(shown.ToString()));
  }
  config.timeout_ms = static_cast<int>(timeout_ms);
  config.retries = static_cast<int>(retries);
  const std::string* key = uri.Param("api_key");
  const std::string* key_env = uri.Param("api_key_env");
  if (key != nullptr && key_env != nullptr) {
    return InvalidArgument("transport URI '{}': give api_key or api_key_env, not both",
                           Printable(shown.ToString()));
  }
  if (key != nullptr) config.api_key = *key;
  if (key_env != nullptr) {
    const char* value = std::getenv(key_env->c_str());
    if (value == nullptr || *value == '\0') {
      return InvalidArgument("transport URI '{}': environment variable {} is unset or empty",
                             Printable(shown.ToString()), Printable(*key_env));
    }
    config.api_key = value;
  }
  if (config.api_key.size() > kMaxApiKeyBytes) {
    return InvalidArgument("transport URI '{}': api key of {} bytes exceeds {}",
                           Printable(shown.ToString()), config.api_key.size(), kMaxApiKeyBytes);
  }
  REFIT_ASSIGN_OR_RETURN(config.curve, CurveParams(shown));
  return std::unique_ptr<Transport>(std::make_unique<ZmqTransport>(uri, config, options));
}

}  // namespace refit::internal
