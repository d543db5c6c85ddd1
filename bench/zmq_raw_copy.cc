#include "zmq_raw_copy.h"

#include <xxhash.h>
#include <zmq.hpp>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

#include "bench_util.h"

namespace refit::bench {
namespace {

constexpr int kAckTimeoutMs = 60'000;

/// One message of the stream: `size` bytes of the tensors' concatenation from `offset`, read at
/// `data`.
struct Slice {
  uint64_t offset = 0;
  const std::byte* data = nullptr;
  uint64_t size = 0;
};

std::vector<Slice> SliceTensors(const std::vector<TensorView>& tensors, uint64_t message_bytes) {
  std::vector<Slice> slices;
  uint64_t offset = 0;
  for (const TensorView& tensor : tensors) {
    for (uint64_t done = 0; done < tensor.bytes.size();) {
      const uint64_t n = std::min<uint64_t>(message_bytes, tensor.bytes.size() - done);
      slices.push_back(Slice{offset + done, tensor.bytes.data() + done, n});
      done += n;
    }
    offset += tensor.bytes.size();
  }
  return slices;
}

}  // namespace

Result<RawCopySinkResult> RunZmqRawCopySink(const std::string& endpoint, uint64_t total_bytes,
                                            const std::string& ready_file) {
  // Touched page by page as the bytes land, as a receiver's weight buffer would be.
  std::unique_ptr<std::byte[]> buffer(new std::byte[std::max<uint64_t>(total_bytes, 1)]);
  RawCopySinkResult result;
  try {
    zmq::context_t context(1);
    zmq::socket_t router(context, zmq::socket_type::router);
    router.set(zmq::sockopt::linger, 0);
    router.bind(endpoint);
    REFIT_RETURN_NOT_OK(WriteTextFileAtomically(ready_file, "ready\n"));
    while (result.bytes < total_bytes) {
      zmq::message_t identity, offset_frame, data;
      if (!router.recv(identity) || !identity.more() || !router.recv(offset_frame) ||
          !offset_frame.more() || !router.recv(data) || data.more() ||
          offset_frame.size() != sizeof(uint64_t)) {
        return InvalidArgument("raw copy sink: a message that is not [offset, data]");
      }
      uint64_t offset = 0;
      std::memcpy(&offset, offset_frame.data(), sizeof(offset));
      if (offset > total_bytes || data.size() > total_bytes - offset) {
        return InvalidArgument("raw copy sink: {} bytes at {} lie outside the {}-byte buffer",
                               data.size(), offset, total_bytes);
      }
      std::memcpy(buffer.get() + offset, data.data(), data.size());
      result.bytes += data.size();
      ++result.messages;
      router.send(identity, zmq::send_flags::sndmore);
      router.send(zmq::message_t(), zmq::send_flags::none);
    }
  } catch (const zmq::error_t& error) {
    return Unavailable("raw copy sink on {}: {}", endpoint, error.what());
  }
  result.checksum = XXH3_64bits(buffer.get(), total_bytes);
  return result;
}

Result<RawCopyResult> ZmqRawCopy(const std::string& endpoint,
                                 const std::vector<TensorView>& tensors, uint64_t message_bytes,
                                 int threads) {
  const std::vector<Slice> slices = SliceTensors(tensors, std::max<uint64_t>(message_bytes, 1));
  RawCopyResult result;
  {
    XXH3_state_t* state = XXH3_createState();
    XXH3_64bits_reset(state);
    for (const TensorView& tensor : tensors) {
      XXH3_64bits_update(state, tensor.bytes.data(), tensor.bytes.size());
    }
    result.checksum = XXH3_64bits_digest(state);
    XXH3_freeState(state);
  }
  zmq::context_t context(1);
  std::vector<zmq::socket_t> sockets;
  try {
    for (int t = 0; t < threads; ++t) {
      zmq::socket_t dealer(context, zmq::socket_type::dealer);
      dealer.set(zmq::sockopt::linger, 0);
      dealer.set(zmq::sockopt::rcvtimeo, kAckTimeoutMs);
      dealer.connect(endpoint);
      sockets.push_back(std::move(dealer));
    }
  } catch (const zmq::error_t& error) {
    return Unavailable("raw copy to {}: {}", endpoint, error.what());
  }
  std::atomic<size_t> next{0};
  std::mutex error_mutex;
  Status first_error;
  const double start = Now();
  std::vector<std::jthread> senders;
  for (int t = 0; t < threads; ++t) {
    senders.emplace_back([&, t] {
      zmq::socket_t& socket = sockets[static_cast<size_t>(t)];
      try {
        for (size_t i = next.fetch_add(1); i < slices.size(); i = next.fetch_add(1)) {
          const Slice& slice = slices[i];
          socket.send(zmq::buffer(&slice.offset, sizeof(slice.offset)), zmq::send_flags::sndmore);
          // Copied into ZeroMQ's message, as the zmq:// transport's senders copy a payload.
          socket.send(zmq::buffer(slice.data, slice.size), zmq::send_flags::none);
          zmq::message_t ack;
          if (!socket.recv(ack)) {
            std::lock_guard lock(error_mutex);
            if (first_error.ok()) {
              first_error =
                  Unavailable("raw copy to {}: no ACK within {} ms", endpoint, kAckTimeoutMs);
            }
            return;
          }
        }
      } catch (const zmq::error_t& error) {
        std::lock_guard lock(error_mutex);
        if (first_error.ok())
          first_error = Unavailable("raw copy to {}: {}", endpoint, error.what());
      }
    });
  }
  senders.clear();
  result.seconds = Now() - start;
  REFIT_RETURN_NOT_OK(first_error);
  for (const Slice& slice : slices) result.bytes += slice.size;
  result.messages = slices.size();
  return result;
}

}  // namespace refit::bench
