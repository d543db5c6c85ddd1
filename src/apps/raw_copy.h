// The raw-copy yardstick over ZeroMQ: the model's bytes sent uncompressed over the same transport
// (ZeroMQ over TCP loopback, `threads` DEALERs per receiver, each message ACKed before the thread
// sends its next, as the zmq:// transport's senders do) to N receiver processes (`refit
// raw-copy-sink`, src/apps/raw_copy_sink.cc), each of which copies every message into a buffer of
// the model's size. No codec, no digest, no apply: what a plain broadcast of the bytes costs,
// against which `refit demo`, e2e_bench and s3_bench put every refit time as a ratio
// (docs/benchmarking.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "refit/status.h"
#include "refit/tensor.h"

namespace refit::cli {

/// What one receiving process got.
struct RawCopySinkResult {
  uint64_t bytes = 0;
  uint64_t messages = 0;
  /// XXH3-64 of the buffer the bytes were copied into, in stream order.
  uint64_t checksum = 0;
};

/// The receiving side: bind a ROUTER at `endpoint` (tcp://host:port), write `ready_file`, copy
/// every message [offset (8 bytes LE), data] into a buffer of `total_bytes`, ACK it, and return
/// once every byte arrived. Errors: InvalidArgument for a message outside the buffer; Unavailable
/// when ZeroMQ fails; IoError when the ready file cannot be written.
Result<RawCopySinkResult> RunZmqRawCopySink(const std::string& endpoint, uint64_t total_bytes,
                                            const std::string& ready_file);

/// `refit raw-copy-sink`: RunZmqRawCopySink, then what it got as JSON in `result_file`
/// ({"bytes", "messages", "checksum"}). Errors: RunZmqRawCopySink's; IoError.
Status RunRawCopySinkCommand(const std::string& endpoint, uint64_t bytes,
                             const std::string& ready_file, const std::string& result_file);

/// Options of MeasureZmqRawCopy.
struct RawCopyOptions {
  /// The `refit` executable whose `raw-copy-sink` subcommand receives; empty: this process's.
  std::string refit_binary{};
  /// Where the receivers' ready, result and log files go (must exist).
  std::string work_dir{};
  /// Receiving processes: every one gets every byte (a plain broadcast from this process).
  size_t receivers = 1;
  /// Bytes per message at most: the refits' payload (bucket) size.
  uint64_t message_bytes = uint64_t{32} << 20;
  /// Sending threads (DEALER sockets) per receiver: the refits' send threads.
  int threads = 1;
};

/// What one raw copy took.
struct RawCopyMeasurement {
  /// From the first send to the last ACK of the last receiver.
  double seconds = 0;
  /// Bytes per receiver.
  uint64_t bytes = 0;
  /// Messages per receiver.
  uint64_t messages = 0;
  size_t receivers = 0;
  uint64_t message_bytes = 0;
  int threads = 0;
};

/// Start `options.receivers` receiving processes on free loopback ports, send every byte of
/// `tensors` (in order) to each of them at once, and check that each one's checksum equals the
/// tensors'. Errors: InvalidArgument (no receivers or threads); Unavailable when a receiver does
/// not start, ZeroMQ fails or an ACK does not come within a minute; DataLoss when a receiver got
/// other bytes than were sent.
Result<RawCopyMeasurement> MeasureZmqRawCopy(const std::vector<TensorView>& tensors,
                                             const RawCopyOptions& options);

}  // namespace refit::cli
