#include "refit/transfer.h"

namespace refit {

PayloadSender PayloadChannel::AsPayloadSender() {
  return [this](uint32_t payload_id, std::span<const std::byte> payload) {
    return Send(payload_id, payload);
  };
}

SenderCleanup PayloadChannel::AsSenderCleanup() {
  return [this] { CleanupThread(); };
}

Status PayloadSink::EndOfStream(const StreamEnd& /*end*/) { return Status::OK(); }

}  // namespace refit
