#include "anchor_compression.h"

#include <algorithm>
#include <string_view>
#include <utility>

#include "refit/status_format.h"
#include "util/logging.h"
#include "util/mutex.h"

namespace refit {
namespace {
constexpr std::pair<AnchorCompression, std::string_view> kAnchorCompressionNames[] = {
    {AnchorCompression::kAuto, "auto"},
    {AnchorCompression::kZstd, "zstd"},
    {AnchorCompression::kNone, "none"}};
}  // namespace

std::string_view AnchorCompressionName(AnchorCompression mode) {
  for (const auto& [value, name] : kAnchorCompressionNames) {
    if (value == mode) return name;
  }
  return "unknown";
}

Result<AnchorCompression> ParseAnchorCompression(std::string_view name) {
  for (const auto& [value, spelled] : kAnchorCompressionNames) {
    if (spelled == name) return value;
  }
  return InvalidArgument("anchor_compression '{}' is not one of auto, zstd, none", name);
}

namespace internal {

AnchorCompressionChooser::AnchorCompressionChooser(const ProducerStreamOptions& options,
                                                   bool anchor)
    : base_(options.payload),
      serialize_threads_(options.serialize_threads),
      send_threads_(options.send_threads),
      probe_payloads_(std::max<uint64_t>(
          kMinProbePayloads,
          static_cast<uint64_t>(options.serialize_threads + options.send_threads))),
      probe_min_payloads_(
          static_cast<uint64_t>(std::max({1, options.serialize_threads, options.send_threads}))) {
  report_.anchor = anchor;
  if (!anchor || options.anchor_compression == AnchorCompression::kZstd) {
    choice_ = Choice::kZstd;
  } else if (options.anchor_compression == AnchorCompression::kNone) {
    choice_ = Choice::kRaw;
  } else {
    choice_ = Choice::kProbing;
  }
}

PayloadEncodeOptions AnchorCompressionChooser::Next() {
  internal::MutexLock lock(mutex_);
  if (choice_ == Choice::kZstd) return base_;
  // Probing: every other payload raw, so that each path is timed end to end (the link, and the
  // receivers' decode and apply behind its acknowledgements) under the same conditions.
  if (choice_ == Choice::kProbing && probe_issued_++ % 2 == 0) return base_;
  PayloadEncodeOptions raw = base_;
  raw.compress = false;
  // Byte planes only help a compressor; without one they are a pass over the values for nothing.
  raw.byte_planes = false;
  return raw;
}

void AnchorCompressionChooser::RecordEncoded(const PayloadEncodeOptions& options,
                                             uint64_t body_bytes, uint64_t wire_bytes,
                                             double seconds) {
  if (!options.compress) return;
  internal::MutexLock lock(mutex_);
  if (choice_ != Choice::kProbing) return;
  probe_body_bytes_ += body_bytes;
  probe_compressed_bytes_ += wire_bytes;
  probe_compress_s_ += seconds;
}

void AnchorCompressionChooser::RecordSent(bool compressed, uint64_t wire_bytes, double seconds) {
  internal::MutexLock lock(mutex_);
  ++(compressed ? report_.compressed_payloads : report_.raw_payloads);
  if (choice_ != Choice::kProbing) return;
  if (compressed) {
    ++probe_sent_;
    probe_sent_bytes_ += wire_bytes;
    probe_send_s_ += seconds;
  } else {
    ++probe_raw_sent_;
    probe_raw_bytes_ += wire_bytes;
    probe_raw_s_ += seconds;
  }
  const auto enough = [&](uint64_t payloads, uint64_t bytes) {
    return payloads >= probe_payloads_ || (payloads >= probe_min_payloads_ && bytes >= kProbeBytes);
  };
  if (enough(probe_sent_, probe_sent_bytes_) && enough(probe_raw_sent_, probe_raw_bytes_)) {
    DecideLocked();
  }
}

void AnchorCompressionChooser::DecideLocked() {
  // Each stage's threads work concurrently: a stage's rate is its threads × one thread's rate.
  const double compress =
      probe_compress_s_ > 0 ? serialize_threads_ * probe_body_bytes_ / probe_compress_s_ : 0;
  const double ratio = probe_body_bytes_ > 0
                           ? static_cast<double>(probe_compressed_bytes_) / probe_body_bytes_
                           : 1.0;
  // What a send takes is the link and whatever holds its acknowledgement back: a receiver's
  // queue full of payloads to decompress and apply. Timing each path's own sends measures both;
  // timing only the compressed ones (as before) charged the raw path with the receivers'
  // decompression, and chose zstd on loopback where raw blocks were 1.5 x faster.
  const double compressed_link =
      probe_send_s_ > 0 ? send_threads_ * probe_sent_bytes_ / probe_send_s_ : 0;
  const double raw_rate = probe_raw_s_ > 0 ? send_threads_ * probe_raw_bytes_ / probe_raw_s_ : 0;
  report_.measured = true;
  report_.compress_bytes_per_s = compress;
  report_.link_bytes_per_s = raw_rate;
  report_.ratio = ratio;
  // Body bytes per second through each path: compressed payloads are limited by the compressor
  // and by their sends, each carrying 1 ÷ ratio bytes of body per wire byte; raw ones by theirs.
  const double compressed_rate = std::min(compress, ratio > 0 ? compressed_link / ratio : compress);
  const bool keep = raw_rate <= 0 || compressed_rate > kMinGain * raw_rate;
  choice_ = keep ? Choice::kZstd : Choice::kRaw;
  REFIT_LOG_INFO(
      "anchor compression: zstd compresses {:.0f} MB/s over {} threads to {:.3f} of the body and "
      "its payloads send {:.0f} MB/s of body; raw payloads send {:.0f} MB/s, over {} threads: {}",
      compress / 1e6, serialize_threads_, ratio, (ratio > 0 ? compressed_link / ratio : 0) / 1e6,
      raw_rate / 1e6, send_threads_, keep ? "compressing the rest" : "sending the rest raw");
}

AnchorCompressionReport AnchorCompressionChooser::report() const {
  internal::MutexLock lock(mutex_);
  return report_;
}

}  // namespace internal
}  // namespace refit
