// AnchorCompressionChooser: which PayloadEncodeOptions each payload of a stream is encoded with,
// and, for AnchorCompression::kAuto, the measurement an anchor's choice is made from.
#pragma once

#include <cstdint>
#include <mutex>

#include "pipeline/producer_stream.h"
#include "refit/payload.h"
#include "util/mutex.h"

namespace refit::internal {

/// Thread-safety: every member function may be called from any of a stream's threads.
class AnchorCompressionChooser {
 public:
  /// Payloads of each kind (compressed, raw) an auto anchor sends before it decides: enough that
  /// every serializer and sender has timed at least one, and at least kMinProbePayloads — or,
  /// of payloads that large, kProbeBytes on the wire (each compressed probe payload of a fast
  /// link costs the anchor time; e2e_bench's end-to-end section shows how many went compressed).
  /// The probe alternates the two kinds, so that both are timed against the same link and
  /// receivers.
  static constexpr uint64_t kMinProbePayloads = 4;
  static constexpr uint64_t kProbeBytes = uint64_t{16} << 20;
  /// How much faster the compressed path must be to keep compressing: a margin over the noise of
  /// a few timed payloads, and over the CPU that compressing costs both ends, which the probe
  /// under-measures where producer and receivers share cores. At 1.10, e2e_bench on a 2-core VM
  /// (1 GiB anchor, loopback) chose zstd at a measured 1.10–1.16 × in 3 of 3 runs, and those
  /// anchors took 4.4–5.7 s against 3.5–5.0 s for the runs that stayed raw.
  static constexpr double kMinGain = 1.25;

  /// `base`: the deltas' options. `anchor`: whether this stream sends an anchor.
  AnchorCompressionChooser(const ProducerStreamOptions& options, bool anchor);

  /// The options to encode the next payload with (while probing, alternately compressed and raw).
  PayloadEncodeOptions Next();
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
  // One per serializer and per sender: the fewest of each kind, however large.
  const uint64_t probe_min_payloads_;

  mutable internal::Mutex mutex_;
  Choice choice_;
  AnchorCompressionReport report_;
  // The probe: payloads handed out by Next while probing (odd ones raw); compressed payloads
  // encoded (body in, bytes out, seconds); compressed and raw payloads sent (count, wire bytes,
  // seconds).
  uint64_t probe_issued_ = 0;
  uint64_t probe_body_bytes_ = 0;
  uint64_t probe_compressed_bytes_ = 0;
  double probe_compress_s_ = 0;
  uint64_t probe_sent_ = 0;
  uint64_t probe_sent_bytes_ = 0;
  double probe_send_s_ = 0;
  uint64_t probe_raw_sent_ = 0;
  uint64_t probe_raw_bytes_ = 0;
  double probe_raw_s_ = 0;
};

}  // namespace refit::internal
