// Reading the messages of refit-zmq/2 (zmq_frames.h has their layout): pure functions over the
// frames' bytes, so that the relay, the client and the fuzz target (tests/fuzz/zmq_frames_fuzz.cc)
// read untrusted frames the same way, with no socket involved.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "refit/status.h"
#include "refit/transfer.h"
#include "transport/zmq/zmq_frames.h"

namespace refit::internal::zmq {

enum class RequestKind : uint8_t { kData, kFlush };

/// What a relay reads of a request before it authenticates it.
struct RequestHead {
  RequestKind kind = RequestKind::kData;
  /// The key frame; empty when none was presented.
  std::string_view api_key;
  /// The root relay index, or nullopt when that frame is not a u32.
  std::optional<uint32_t> root;
};

/// Read the head of a request whose frames (`frames`, the ROUTER's identity frame first) came
/// from a peer. Returns nullopt when the message does not speak kProtocol at all (the relay
/// drops it unanswered: it cannot be one of our senders).
/// Errors: InvalidArgument naming `endpoint`, the kind and the frame count, for a request of
/// our protocol with an unknown kind or the wrong number of frames.
Result<std::optional<RequestHead>> ReadRequestHead(std::span<const std::string_view> frames,
                                                   std::string_view endpoint);

/// Read the stream end a FLUSH request carries (identity frame first; its head already read).
/// Errors: InvalidArgument "malformed FLUSH" naming `endpoint`.
Result<StreamEnd> ReadFlush(std::span<const std::string_view> frames, std::string_view endpoint);

/// Read a reply (no identity frame) to the request of `key`: nullopt when it is not a reply of
/// our protocol or answers another request (the caller keeps waiting); OK for an ACK; the
/// refusal's status for a NACK, its message prefixed with `endpoint`. A NACK that names no ids
/// answers the one request outstanding (zmq_frames.h, "A NACK names no ids").
/// Errors (as the value): DataLoss naming `endpoint` for a malformed reply to this request.
std::optional<Status> ReadReply(std::span<const std::string> reply, const ReplyKey& key,
                                std::string_view endpoint);

}  // namespace refit::internal::zmq
