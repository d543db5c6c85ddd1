#include "anchor_compression.h"

#include <algorithm>
#include <string_view>
#include <utility>

#include "util/logging.h"

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
          static_cast<uint64_t>(options.serialize_threads + options.send_threads))) {
  report_.anchor = anchor;
  if (!anchor || options.anchor_compression == AnchorCompression::kZstd) {
    choice_ = Choice::kZstd;
  } else if (options.anchor_compression == AnchorCompression::kNone) {
    choice_ = Choice::kRaw;
  } else {
    choice_ = Choice::kProbing;
  }
}

PayloadEncodeOptions AnchorCompressionChooser::Next() const {
  std::lock_guard lock(mutex_);
  if (choice_ != Choice::kRaw) return base_;
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
  std::lock_guard lock(mutex_);
  if (choice_ != Choice::kProbing) return;
  probe_body_bytes_ += body_bytes;
  probe_compressed_bytes_ += wire_bytes;
  probe_compress_s_ += seconds;
}

void AnchorCompressionChooser::RecordSent(bool compressed, uint64_t wire_bytes, double seconds) {
  std::lock_guard lock(mutex_);
  ++(compressed ? report_.compressed_payloads : report_.raw_payloads);
  if (choice_ != Choice::kProbing || !compressed) return;
  ++probe_sent_;
  probe_sent_bytes_ += wire_bytes;
  probe_send_s_ += seconds;
  if (probe_sent_ >= probe_payloads_) DecideLocked();
}

void AnchorCompressionChooser::DecideLocked() {
  // Each stage's threads work concurrently: a stage's rate is its threads × one thread's rate.
  const double compress =
      probe_compress_s_ > 0 ? serialize_threads_ * probe_body_bytes_ / probe_compress_s_ : 0;
  const double link = probe_send_s_ > 0 ? send_threads_ * probe_sent_bytes_ / probe_send_s_ : 0;
  const double ratio = probe_body_bytes_ > 0
                           ? static_cast<double>(probe_compressed_bytes_) / probe_body_bytes_
                           : 1.0;
  report_.measured = true;
  report_.compress_bytes_per_s = compress;
  report_.link_bytes_per_s = link;
  report_.ratio = ratio;
  // Body bytes per second through each path: compressed payloads are limited by the compressor
  // and by the link carrying ratio × the body; raw ones by the link alone.
  const double compressed_rate = std::min(compress, ratio > 0 ? link / ratio : compress);
  const bool keep = link <= 0 || compressed_rate > kMinGain * link;
  choice_ = keep ? Choice::kZstd : Choice::kRaw;
  REFIT_LOG_INFO(
      "anchor compression: zstd compresses {:.0f} MB/s over {} threads to {:.3f} of the body, the "
      "link takes {:.0f} MB/s over {} threads: {}",
      compress / 1e6, serialize_threads_, ratio, link / 1e6, send_threads_,
      keep ? "compressing the rest" : "sending the rest raw");
}

AnchorCompressionReport AnchorCompressionChooser::report() const {
  std::lock_guard lock(mutex_);
  return report_;
}

}  // namespace internal
}  // namespace refit
