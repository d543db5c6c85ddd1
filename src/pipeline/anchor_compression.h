// AnchorCompressionChooser: which PayloadEncodeOptions each payload of a stream is encoded with,
// and, for AnchorCompression::kAuto, the measurement an anchor's choice is made from.
#pragma once

#include <cstdint>
#include <mutex>

#include "refit/payload.h"
#include "refit/producer_stream.h"

namespace refit::internal {

/// Thread-safety: every member function may be called from any of a stream's threads.
class AnchorCompressionChooser {
 public:
  /// Compressed payloads an auto anchor sends before it decides: enough that every serializer
  /// and sender has timed at least one, and at least kMinProbePayloads.
  static constexpr uint64_t kMinProbePayloads = 4;
  /// How much faster the compressed path must be to keep compressing: a margin over the noise of
  /// a few timed payloads, and over the receiver's cost of decompressing them.
  static constexpr double kMinGain = 1.10;

  /// `base`: the deltas' options. `anchor`: whether this stream sends an anchor.
  AnchorCompressionChooser(const ProducerStreamOptions& options, bool anchor);

  /// The options to encode the next payload with.
  PayloadEncodeOptions Next() const;
  /// A payload was encoded with `options` (from Next) in `seconds`: `body_bytes` in, `wire_bytes`
  /// out.
  void RecordEncoded(const PayloadEncodeOptions& options, uint64_t body_bytes, uint64_t wire_bytes,
                     double seconds);
  /// A payload of `wire_bytes`, encoded with `compressed` options, was sent in `seconds`.
  void RecordSent(bool compressed, uint64_t wire_bytes, double seconds);

  AnchorCompressionReport report() const;

 private:
  enum class Choice : uint8_t { kZstd, kRaw, kProbing };
  // Precondition: mutex_ held.
  void DecideLocked();

  const PayloadEncodeOptions base_;
  const int serialize_threads_;
  const int send_threads_;
  const uint64_t probe_payloads_;

  mutable std::mutex mutex_;
  Choice choice_;
  AnchorCompressionReport report_;
  // The probe: compressed payloads encoded (body in, bytes out, seconds) and sent.
  uint64_t probe_body_bytes_ = 0;
  uint64_t probe_compressed_bytes_ = 0;
  double probe_compress_s_ = 0;
  uint64_t probe_sent_ = 0;
  uint64_t probe_sent_bytes_ = 0;
  double probe_send_s_ = 0;
};

}  // namespace refit::internal
