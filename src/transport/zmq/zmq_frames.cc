// The frames of refit-zmq/2 and the socket plumbing (zmq_frames.h).
#include "transport/zmq/zmq_frames.h"

#include <zmq.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "refit/status_format.h"
#include "util/endian.h"

namespace refit::internal::zmq {

std::string ZmqError() { return zmq_strerror(zmq_errno()); }

std::string TcpAddress(const std::string& endpoint) { return "tcp://" + endpoint; }

std::string U32Bytes(uint32_t value) {
  std::string out(kU32Bytes, '\0');
  StoreLittleEndian(out.data(), value);
  return out;
}

std::optional<uint32_t> ReadU32(std::string_view bytes) {
  if (bytes.size() != kU32Bytes) return std::nullopt;
  return LoadLittleEndian<uint32_t>(bytes.data());
}

std::string_view AsText(std::span<const std::byte> bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

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

Result<Frame> Frame::Share() const {
  Frame copy;
  if (zmq_msg_copy(copy.message(), mutable_message()) != 0) {
    return Unavailable("zmq message copy: {}", ZmqError());
  }
  return copy;
}

Result<std::vector<Frame>> ReceiveMessage(void* socket, size_t max_frames) {
  std::vector<Frame> frames;
  bool too_many = false;
  int more = 1;
  while (more != 0) {
    Frame frame;
    if (zmq_msg_recv(frame.message(), socket, ZMQ_DONTWAIT) < 0) {
      return Unavailable("zmq receive: {}", ZmqError());
    }
    more = zmq_msg_more(frame.message());
    if (frames.size() < max_frames) {
      frames.push_back(std::move(frame));
    } else {
      too_many = true;
    }
  }
  if (too_many) return InvalidArgument("zmq message with more than {} frames", max_frames);
  return frames;
}

Status SendSharedFrames(void* socket, const std::vector<Frame>& frames, const std::string& where) {
  for (size_t i = 0; i < frames.size(); ++i) {
    REFIT_ASSIGN_OR_RETURN(Frame shared, frames[i].Share());
    const int flags = i + 1 < frames.size() ? ZMQ_SNDMORE : 0;
    // On success the message belongs to ZeroMQ (`shared` is left empty); on failure `shared`
    // still holds its reference and releases it.
    if (zmq_msg_send(shared.message(), socket, flags) < 0) {
      return Unavailable("zmq send to {}: {}", where, ZmqError());
    }
  }
  return Status::OK();
}

std::vector<std::string> MakeReply(const ReplyKey& key, const Status& status) {
  return {std::string(kProtocol),
          std::string(status.ok() ? kKindAck : kKindNack),
          key.transfer_hex,
          key.producer,
          key.payload,
          U32Bytes(static_cast<uint32_t>(status.code())),
          status.message()};
}

}  // namespace refit::internal::zmq
