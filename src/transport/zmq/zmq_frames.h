// The frames of the zmq:// data plane (protocol `refit-zmq/2`, docs/protocol.md "ZeroMQ wire
// frames"), and the socket plumbing every zmq:// file shares: owning handles, sending and
// receiving one multipart message, u32 fields, replies.
//
// Frames (integers are u32 little-endian):
//   DATA  request  [ "refit-zmq/2", "DATA",  api key (may be empty), root index,
//                    payload part 1, …, payload part n ]   (n >= 1, each <= kMaxFrameBytes)
//   FLUSH request  [ "refit-zmq/2", "FLUSH", api key, root index, transfer id (16 raw bytes),
//                    producer id, payload count ]
//   reply          [ "refit-zmq/2", "ACK"|"NACK", transfer id hex, producer id,
//                    payload id (empty for FLUSH), status code (0 for ACK), message ]
// (A ROUTER sees the DEALER's identity frame before these.)
//
// Why a payload travels in parts: libzmq applies one size limit (ZMQ_MAXMSGSIZE) to every frame
// it reads, the commands of the handshake included, and reads a command whole before the security
// mechanism sees it. A payload in one frame needs that limit as large as the largest payload, and
// so lets any peer that reaches the port, with no key, make the relay buffer that much per
// connection during the handshake. With every frame at most kMaxFrameBytes, the limit is small,
// and so is what an unauthenticated peer can make a relay hold (docs/security.md).
//
// A NACK names no ids (all three frames empty) when the relay refused the request before it
// read them: a wrong api key or root index, a malformed request or FLUSH, or a payload whose
// header fails the check (its ids cannot be trusted). A sender takes such a NACK as the answer
// to its request: a DEALER has one request outstanding, and a sender replaces its socket after
// every attempt that ended without the answer (a timeout, a failed handshake), so no reply of an
// earlier attempt can arrive on it. A reply that names other ids is ignored.
#pragma once

#include <zmq.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "refit/status.h"

namespace refit::internal::zmq {

inline constexpr std::string_view kProtocol = "refit-zmq/2";
inline constexpr std::string_view kKindData = "DATA";
inline constexpr std::string_view kKindFlush = "FLUSH";
inline constexpr std::string_view kKindAck = "ACK";
inline constexpr std::string_view kKindNack = "NACK";

// Frame counts of each message, without the ROUTER's identity frame: a DATA request has its
// head frames and then at least one payload part.
inline constexpr size_t kDataHeadFrames = 4;
inline constexpr size_t kFlushFrames = 7;
inline constexpr size_t kReplyFrames = 7;
inline constexpr size_t kU32Bytes = 4;
inline constexpr size_t kTransferIdBytes = 16;
// The largest frame of a request, and so of a payload part; a relay sets it as ZMQ_MAXMSGSIZE,
// which libzmq applies to every frame and handshake command as it arrives. 128 KiB: each frame
// costs libzmq one allocation and the relay one zmq_msg_t, which is noise against 128 KiB of
// bytes, and 256 peers holding one such command each during the handshake come to 32 MiB. The
// other frames are far smaller (an api key is at most 1024 bytes).
inline constexpr size_t kMaxFrameBytes = size_t{128} << 10;

/// The payload parts of a payload of `payload_bytes` (at least one, an empty payload included).
inline constexpr size_t PayloadParts(uint64_t payload_bytes) {
  // Divided first, so that no limit near 2^64 overflows.
  const uint64_t parts =
      payload_bytes / kMaxFrameBytes + (payload_bytes % kMaxFrameBytes != 0 ? 1 : 0);
  return parts == 0 ? 1 : static_cast<size_t>(parts);
}

/// The most frames a relay takes in one request (its identity frame included) when payloads are
/// at most `max_payload_bytes`: a DATA request of the largest payload and one part more (so that
/// a payload just over the limit is refused with the reason, not dropped), or a FLUSH.
inline constexpr size_t MaxRequestFrames(uint64_t max_payload_bytes) {
  const size_t data = kDataHeadFrames + PayloadParts(max_payload_bytes) + 1;
  return 1 + (data > kFlushFrames ? data : kFlushFrames);
}

// How often a thread that polls zmq sockets checks for a stop request.
inline constexpr int kStopCheckMs = 50;

struct ContextCloser {
  void operator()(void* context) const { zmq_ctx_term(context); }
};
struct SocketCloser {
  void operator()(void* socket) const { zmq_close(socket); }
};
using ZmqContext = std::unique_ptr<void, ContextCloser>;
using ZmqSocket = std::unique_ptr<void, SocketCloser>;

/// The text of the calling thread's last ZeroMQ error.
std::string ZmqError();

/// The ZeroMQ address of a "host:port" endpoint.
std::string TcpAddress(const std::string& endpoint);

/// `value` as the 4 bytes of a u32 frame.
std::string U32Bytes(uint32_t value);

/// A u32 frame's value, or nullopt when `bytes` is not 4 bytes long.
std::optional<uint32_t> ReadU32(std::string_view bytes);

std::string_view AsText(std::span<const std::byte> bytes);

/// Send `frames` as one multipart message. Errors: Unavailable naming `where`.
Status SendFrames(void* socket, const std::vector<std::string_view>& frames,
                  const std::string& where);
Status SendFrames(void* socket, const std::vector<std::string>& frames, const std::string& where);

/// Receive one whole multipart message (non-blocking: call when the socket is readable).
/// Errors: InvalidArgument when it has more than `max_frames` parts (all are drained);
/// Unavailable when nothing could be read.
Result<std::vector<std::string>> ReceiveFrames(void* socket, size_t max_frames);

/// One received frame: the zmq_msg_t taken from the socket, whose bytes are never copied.
/// ZeroMQ shares the content of a long message by reference count, so Share() hands a relay's
/// children the payload frame it received without copying it either.
///
/// Thread-safety: one Frame is used by one thread at a time; frames that Share() made may be
/// used and closed on different threads (the reference count is atomic).
class Frame {
 public:
  Frame() { zmq_msg_init(&message_); }
  ~Frame() { zmq_msg_close(&message_); }
  Frame(Frame&& other) noexcept : Frame() { zmq_msg_move(&message_, &other.message_); }
  Frame& operator=(Frame&& other) noexcept {
    if (this != &other) zmq_msg_move(&message_, &other.message_);
    return *this;
  }
  Frame(const Frame&) = delete;
  Frame& operator=(const Frame&) = delete;

  std::string_view text() const {
    return {static_cast<const char*>(zmq_msg_data(mutable_message())), size()};
  }
  std::span<const std::byte> bytes() const {
    return {static_cast<const std::byte*>(zmq_msg_data(mutable_message())), size()};
  }
  size_t size() const { return zmq_msg_size(mutable_message()); }

  /// Another frame of the same bytes. Errors: Unavailable (libzmq could not copy the handle).
  Result<Frame> Share() const;

  zmq_msg_t* message() { return &message_; }

 private:
  // libzmq's accessors take a non-const zmq_msg_t* although they only read.
  zmq_msg_t* mutable_message() const { return const_cast<zmq_msg_t*>(&message_); }

  zmq_msg_t message_;
};

/// Receive one whole multipart message as frames, without copying any byte of it
/// (non-blocking: call when the socket is readable). Frames beyond `max_frames` are closed
/// unread. Errors: InvalidArgument when it has more than `max_frames` parts (all are drained);
/// Unavailable when nothing could be read.
Result<std::vector<Frame>> ReceiveMessage(void* socket, size_t max_frames);

/// Send a Share() of each of `frames` as one multipart message, so that `frames` can be sent
/// again (a retry, the next child). Errors: Unavailable naming `where`.
Status SendSharedFrames(void* socket, const std::vector<Frame>& frames, const std::string& where);

/// The reply a request waits for: transfer hex, producer id and payload id frames.
struct ReplyKey {
  std::string transfer_hex;
  std::string producer;
  std::string payload;
};

/// The reply frames (without an identity) that answer the request of `key` with `status`.
std::vector<std::string> MakeReply(const ReplyKey& key, const Status& status);

}  // namespace refit::internal::zmq
