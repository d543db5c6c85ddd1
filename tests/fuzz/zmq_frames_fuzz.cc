// libFuzzer target for the zmq:// data plane's frames (refit-zmq/2): what a relay reads of a
// request from any peer that can connect (ReadRequestHead, then the payload header of a DATA or
// the stream end of a FLUSH), and what a sender reads of a relay's reply (ReadReply). Hostile
// frames must come back as a Status or "not ours", never a crash.
//
// Input layout: a status code byte and message (the reply of the round trip below), then a
// sequence of frames, each a FuzzedDataProvider random-length string; the first is the ROUTER's
// identity frame, as the relay sees it.
//
// Invariants: a FLUSH that reads re-encodes to the same frames; a reply the relay would make
// (MakeReply) for any status reads back as that status for its own key, and is "not ours" for
// another key; a NACK naming no ids answers any request.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "refit/payload.h"
#include "refit/status.h"
#include "transport/zmq/zmq_frames.h"
#include "transport/zmq/zmq_messages.h"

namespace {

namespace zmq = refit::internal::zmq;

constexpr std::string_view kEndpoint = "fuzz:1";
// More than any request has, so over-long messages are exercised too.
constexpr size_t kMaxFrames = 12;

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "zmq_frames_fuzz: %s\n", what);
  std::abort();
}

void Check(bool condition, const char* what) {
  if (!condition) Fail(what);
}

void CheckRequest(const std::vector<std::string>& frames) {
  std::vector<std::string_view> texts(frames.begin(), frames.end());
  refit::Result<std::optional<zmq::RequestHead>> head = zmq::ReadRequestHead(texts, kEndpoint);
  if (!head.ok()) {
    Check(head.status().code() == refit::StatusCode::kInvalidArgument, "head error code");
    return;
  }
  if (!head->has_value()) return;
  Check(texts.size() >= 5 && texts[1] == zmq::kProtocol, "head of a short or foreign request");
  if ((*head)->kind == zmq::RequestKind::kData) {
    Check(texts.size() > 1 + zmq::kDataHeadFrames, "DATA frame count");
    const std::span<const std::byte> payload(reinterpret_cast<const std::byte*>(texts[5].data()),
                                             texts[5].size());
    (void)refit::ValidatePayloadHeader(payload, refit::PayloadLimits{});
    return;
  }
  Check(texts.size() == 1 + zmq::kFlushFrames, "FLUSH frame count");
  refit::Result<refit::StreamEnd> end = zmq::ReadFlush(texts, kEndpoint);
  if (!end.ok()) {
    Check(end.status().code() == refit::StatusCode::kInvalidArgument, "FLUSH error code");
    return;
  }
  const std::string_view id(reinterpret_cast<const char*>(end->transfer_id.bytes.data()),
                            end->transfer_id.bytes.size());
  Check(id == texts[5] && zmq::U32Bytes(end->producer_id) == texts[6] &&
            zmq::U32Bytes(end->payloads) == texts[7],
        "FLUSH does not re-encode to its frames");
}

void CheckReply(const std::vector<std::string>& frames, const refit::Status& status) {
  // As a reply (no identity frame), for a key taken from the frames and for a fixed one.
  const zmq::ReplyKey fixed{"00112233445566778899aabbccddeeff", zmq::U32Bytes(1), zmq::U32Bytes(2)};
  (void)zmq::ReadReply(frames, fixed, kEndpoint);
  if (frames.size() >= 5) {
    const zmq::ReplyKey own{frames[2], frames[3], frames[4]};
    (void)zmq::ReadReply(frames, own, kEndpoint);
  }
  // What a relay sends reads back as what it meant.
  const std::vector<std::string> reply = zmq::MakeReply(fixed, status);
  const std::optional<refit::Status> read = zmq::ReadReply(reply, fixed, kEndpoint);
  Check(read.has_value() && read->code() == status.code(), "a relay's reply does not read back");
  const zmq::ReplyKey other{fixed.transfer_hex, fixed.producer, zmq::U32Bytes(3)};
  Check(!zmq::ReadReply(reply, other, kEndpoint).has_value(), "a reply answered another request");
  if (!status.ok()) {
    const std::optional<refit::Status> anonymous =
        zmq::ReadReply(zmq::MakeReply({}, status), other, kEndpoint);
    Check(anonymous.has_value() && anonymous->code() == status.code(),
          "a NACK naming no ids did not answer");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider input(data, size);
  // The status a relay replies with, for the round trip of CheckReply.
  const auto code = static_cast<refit::StatusCode>(input.ConsumeIntegralInRange<uint32_t>(
      0, static_cast<uint32_t>(refit::StatusCode::kInternal)));
  const refit::Status status = code == refit::StatusCode::kOk
                                   ? refit::Status::OK()
                                   : refit::Status(code, input.ConsumeRandomLengthString(64));
  std::vector<std::string> frames;
  while (input.remaining_bytes() > 0 && frames.size() < kMaxFrames) {
    frames.push_back(input.ConsumeRandomLengthString(1 << 16));
  }
  CheckRequest(frames);
  if (!frames.empty()) frames.erase(frames.begin());
  CheckReply(frames, status);
  return 0;
}
