// Reading the messages of refit-zmq/2 (zmq_messages.h).
#include "transport/zmq/zmq_messages.h"

#include <cstring>

#include <fmt/format.h>

#include "refit/status_format.h"
#include "transport/transport_internal.h"

namespace refit::internal::zmq {

Result<std::optional<RequestHead>> ReadRequestHead(std::span<const std::string_view> frames,
                                                   std::string_view endpoint) {
  // frames[0] is the identity the ROUTER added.
  if (frames.size() < 3 || frames[1] != kProtocol) return std::optional<RequestHead>();
  const std::string_view kind = frames[2];
  // A DATA request has one payload part at least; a FLUSH exactly its frames.
  const bool counted =
      kind == kKindData ? frames.size() > 1 + kDataHeadFrames : frames.size() == 1 + kFlushFrames;
  if ((kind != kKindData && kind != kKindFlush) || !counted) {
    return InvalidArgument("zmq listener {}: malformed request: kind '{}' with {} frames", endpoint,
                           Printable(kind), frames.size() - 1);
  }
  return std::optional<RequestHead>(RequestHead{
      .kind = kind == kKindData ? RequestKind::kData : RequestKind::kFlush,
      .api_key = frames[3],
      .root = ReadU32(frames[4]),
  });
}

Result<StreamEnd> ReadFlush(std::span<const std::string_view> frames, std::string_view endpoint) {
  if (frames.size() != 1 + kFlushFrames) {
    return InvalidArgument("zmq listener {}: malformed FLUSH", endpoint);
  }
  const std::optional<uint32_t> producer = ReadU32(frames[6]);
  const std::optional<uint32_t> count = ReadU32(frames[7]);
  if (frames[5].size() != kTransferIdBytes || !producer.has_value() || !count.has_value()) {
    return InvalidArgument("zmq listener {}: malformed FLUSH", endpoint);
  }
  StreamEnd end;
  std::memcpy(end.transfer_id.bytes.data(), frames[5].data(), kTransferIdBytes);
  end.producer_id = *producer;
  end.payloads = *count;
  return end;
}

std::optional<Status> ReadReply(std::span<const std::string> reply, const ReplyKey& key,
                                std::string_view endpoint) {
  if (reply.size() != kReplyFrames || reply[0] != kProtocol) return std::nullopt;
  const bool names_this_request =
      reply[2] == key.transfer_hex && reply[3] == key.producer && reply[4] == key.payload;
  const bool names_nothing =
      reply[1] == kKindNack && reply[2].empty() && reply[3].empty() && reply[4].empty();
  if (!names_this_request && !names_nothing) return std::nullopt;
  if (reply[1] == kKindAck) return Status::OK();
  const std::optional<uint32_t> code = ReadU32(reply[5]);
  if (reply[1] != kKindNack || !code.has_value() || *code == 0 ||
      *code > static_cast<uint32_t>(StatusCode::kInternal)) {
    return DataLoss("zmq endpoint {}: malformed reply (kind '{}')", endpoint, Printable(reply[1]));
  }
  return Status(static_cast<StatusCode>(*code),
                fmt::format("refused by zmq endpoint {}: {}", endpoint, Printable(reply[6])));
}

}  // namespace refit::internal::zmq
