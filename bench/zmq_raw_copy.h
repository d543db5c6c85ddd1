// The raw-copy yardstick over ZeroMQ: the model's bytes sent uncompressed over the same
// transport (ZeroMQ over TCP loopback, one DEALER per send thread, each message ACKed before the
// thread sends its next, as the zmq:// transport's senders do) into a receiver process that copies
// each message into a buffer of the model's size. No codec, no digest, no apply: what a plain
// broadcast of the bytes costs, against which every refit time is a ratio (docs/benchmarking.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "refit/status.h"
#include "refit/tensor.h"

namespace refit::bench {

/// What the receiving side got, written to its result file.
struct RawCopySinkResult {
  uint64_t bytes = 0;
  uint64_t messages = 0;
  /// XXH3-64 of the buffer the bytes were copied into, in stream order.
  uint64_t checksum = 0;
};

/// The receiving process: bind a ROUTER at `endpoint` (tcp://host:port), write `ready_file`, copy
/// every message [offset (8 bytes LE), data] into a buffer of `total_bytes`, ACK it, and return
/// once every byte arrived. Errors: InvalidArgument for a message outside the buffer; Unavailable
/// when ZeroMQ fails.
Result<RawCopySinkResult> RunZmqRawCopySink(const std::string& endpoint, uint64_t total_bytes,
                                            const std::string& ready_file);

/// What one copy took.
struct RawCopyResult {
  double seconds = 0;
  uint64_t bytes = 0;
  uint64_t messages = 0;
  /// XXH3-64 of the tensors' bytes in order: equals the sink's when every byte arrived intact.
  uint64_t checksum = 0;
};

/// Send every byte of `tensors`, in order, in messages of at most `message_bytes`, from `threads`
/// DEALER sockets connected to `endpoint`; time from the first send to the last ACK.
/// Errors: Unavailable when ZeroMQ fails or an ACK does not come within a minute.
Result<RawCopyResult> ZmqRawCopy(const std::string& endpoint,
                                 const std::vector<TensorView>& tensors, uint64_t message_bytes,
                                 int threads);

}  // namespace refit::bench
