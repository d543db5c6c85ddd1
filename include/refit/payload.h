// Payload format v1: the self-contained, checksummed, compressed unit on the wire.
//
// The byte-exact spec is docs/format/payload.md. A payload is a fixed header followed by a zstd
// frame (the body) holding the item table, the location bytes and the values grouped by element
// width (optionally split into byte planes). Every byte of a received payload is untrusted:
//   ValidatePayload()        — cheap: header fields, limits and sizes. A receiver's listener
//                              calls it once; the ValidatedPayload it returns carries the header
//                              with the bytes through relays and the session to the decoder.
//   DecodePayload()          — full: checksum, bounded decompression, item table, every location
//                              and value bound. Nothing may be applied before it returns OK.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "refit/item.h"
#include "refit/status.h"

namespace refit {

/// The 128-bit id of one transfer (one version step of the fleet).
struct TransferId {
  std::array<uint8_t, 16> bytes{};

  /// Return a random id (from the OS entropy source).
  static TransferId Random();
  /// Parse 32 hex digits. Errors: InvalidArgument naming the text.
  static Result<TransferId> FromHex(std::string_view hex);
  /// Return 32 lower-case hex digits.
  std::string ToHex() const;

  friend bool operator==(const TransferId&, const TransferId&) = default;
};

/// The identity and version step of one payload.
struct PayloadIds {
  TransferId transfer_id;
  uint32_t producer_id = 0;
  uint32_t payload_id = 0;
  uint64_t base_version = 0;
  uint64_t target_version = 0;

  friend bool operator==(const PayloadIds&, const PayloadIds&) = default;
};

/// The newest format version this library reads and writes. EncodePayload writes version 2 only
/// when an item is context-coded (LocationEncoding::kContext), version 1 otherwise, so that a
/// payload without such items is exactly what a v1 writer made; DecodePayload reads both.
inline constexpr uint16_t kPayloadFormatVersion = 2;
/// The first format version: what payloads without context-coded items still are.
inline constexpr uint16_t kPayloadFormatVersionV1 = 1;
/// Return the format version EncodePayload writes for `items`: 2 when one is context-coded, else 1.
uint16_t PayloadFormatVersionFor(std::span<const ItemView> items);
/// Size in bytes of the fixed header (the same in v1 and v2).
inline constexpr size_t kPayloadHeaderSize = 128;

/// Options of EncodePayload.
struct PayloadEncodeOptions {
  /// zstd compression level; 1 is the measured sweet spot for sparse deltas (upstream default).
  int zstd_level = 1;
  /// Split each value group into byte planes before compression: XOR values of 1-ulp changes
  /// are mostly low bits, so planes compress far better.
  bool byte_planes = true;
  /// false: do not compress (zstd_level is then unused, and byte planes would only cost a pass).
  /// A payload of FULL items only — an anchor's — stores its body as it is (compression 0, which
  /// a receiver decodes without a copy); any other is written as a zstd frame of raw blocks. For
  /// anchors on links faster than the compressor (ProducerStreamOptions::anchor_compression).
  bool compress = true;
};

/// Hard limits applied while decoding untrusted payloads.
struct PayloadLimits {
  /// Largest accepted payload (header + compressed body).
  uint64_t max_payload_bytes = uint64_t{4} << 30;
  /// Largest accepted decompressed body; checked against the zstd frame header before
  /// decompressing.
  uint64_t max_body_bytes = uint64_t{4} << 30;
  uint32_t max_items = 1u << 20;
  uint32_t max_name_length = 1024;
  uint32_t max_rank = 16;
};

/// The decoded fixed header of a payload.
struct PayloadHeader {
  uint16_t format_version = kPayloadFormatVersionV1;
  uint16_t flags = 0;
  PayloadIds ids;
  uint32_t item_count = 0;
  uint64_t body_bytes = 0;        ///< Decompressed body length.
  uint64_t compressed_bytes = 0;  ///< Compressed body length (the payload is header + this).
  /// `compression` 0: the body follows the header as it is (compressed_bytes == body_bytes), and
  /// every item is FULL — an anchor's payload sent raw. Otherwise one zstd frame.
  bool stored_body = false;
  std::array<uint8_t, 16> checksum{};  ///< XXH3-128 of the compressed body.
};

/// Flag bits of the header (docs/format/payload.md). Unknown bits are rejected.
inline constexpr uint16_t kPayloadFlagBytePlanes = 1u << 0;

/// Serialize, compress and checksum `items` into one payload.
/// Errors: InvalidArgument for an inconsistent item (value size vs count, span vs shape, name
/// too long). Deterministic: the same inputs give the same bytes.
Result<std::vector<std::byte>> EncodePayload(const PayloadIds& ids, std::span<const ItemView> items,
                                             const PayloadEncodeOptions& options = {});

/// Check the header of `payload` against `limits` without touching the body.
/// Errors: DataLoss (bad magic, header checksum, truncated or trailing bytes), InvalidArgument
/// (unsupported version or flags), ResourceExhausted (a declared size over a limit).
Result<PayloadHeader> ValidatePayloadHeader(std::span<const std::byte> payload,
                                            const PayloadLimits& limits = {});

/// Check the sizes a validated header declares against other `limits` — a receiver session's,
/// which may be tighter than those of the transport that validated it — without reading bytes.
/// Errors: ResourceExhausted naming the payload, the size and the limit.
Status CheckPayloadLimits(const PayloadHeader& header, const PayloadLimits& limits);

class DecodedPayload;

/// A payload whose header passed ValidatePayload, and that header: the two travel together from
/// the listener that received the bytes through relays and the receiver's session to the decoder,
/// so the header is parsed once on a payload's way in. The body is not checked yet:
/// DecodePayload checks its checksum, decompresses it and validates every item.
///
/// Thread-safety: immutable; safe to read from many threads.
class ValidatedPayload {
 public:
  const PayloadHeader& header() const { return header_; }
  const PayloadIds& ids() const { return header_.ids; }
  std::span<const std::byte> bytes() const { return bytes_; }
  /// Header + compressed body, in bytes.
  size_t size() const { return bytes_.size(); }

 private:
  friend Result<ValidatedPayload> ValidatePayload(std::vector<std::byte>, const PayloadLimits&);
  friend Result<ValidatedPayload> ValidatePayload(std::span<const std::byte>, const PayloadLimits&);
  friend Result<DecodedPayload> DecodePayload(ValidatedPayload&&, const PayloadLimits&);
  ValidatedPayload(const PayloadHeader& header, std::vector<std::byte> bytes)
      : header_(header), bytes_(std::move(bytes)) {}
  PayloadHeader header_;
  std::vector<std::byte> bytes_;
};

/// Check `payload`'s header as ValidatePayloadHeader does and keep it with the bytes.
/// Errors: as ValidatePayloadHeader (the bytes are dropped).
Result<ValidatedPayload> ValidatePayload(std::vector<std::byte> payload,
                                         const PayloadLimits& limits = {});
/// As above for bytes the caller keeps (a received frame): copied only once the header passed,
/// so a refused payload costs no copy.
Result<ValidatedPayload> ValidatePayload(std::span<const std::byte> payload,
                                         const PayloadLimits& limits = {});

/// Return the total size (header + compressed body) of the payload at the start of `stream`, after
/// checking its header exactly as ValidatePayloadHeader does — for payloads stored back to back,
/// as `.rfp` files do. Unlike ValidatePayloadHeader, bytes may follow the payload.
/// Errors: as ValidatePayloadHeader; DataLoss when the declared body runs past the stream.
Result<uint64_t> PayloadSizeAt(std::span<const std::byte> stream, const PayloadLimits& limits = {});

/// A fully validated payload. Owns the decompressed body; items view into it.
///
/// Thread-safety: immutable after DecodePayload; safe to read from many threads.
class DecodedPayload {
 public:
  const PayloadHeader& header() const { return header_; }
  std::span<const ItemView> items() const { return items_; }
  /// Where the decode of item `index`'s locations stood at every kLocationMarkInterval
  /// locations (none for an item of fewer): the starts of its slices after the first.
  std::span<const LocationMark> location_marks(size_t index) const { return marks_[index]; }
  /// Whether an item is context-coded (LocationEncoding::kContext, format v2): such a payload is
  /// applied only after ExpandContextItems.
  bool has_context_items() const;

 private:
  friend Result<DecodedPayload> DecodePayload(std::span<const std::byte>, const PayloadLimits&);
  friend Result<DecodedPayload> DecodePayload(const ValidatedPayload&, const PayloadLimits&);
  friend Result<DecodedPayload> DecodePayload(ValidatedPayload&&, const PayloadLimits&);
  // The body that follows `header` (validated, and within `limits`), decoded and checked. A
  // stored body takes over `payload_bytes` (the whole payload's, `compressed` inside it) when
  // given instead of copying it.
  static Result<DecodedPayload> DecodeBody(const PayloadHeader& header,
                                           std::span<const std::byte> compressed,
                                           const PayloadLimits& limits,
                                           std::vector<std::byte>* payload_bytes = nullptr);
  friend Result<DecodedPayload> ExpandContextItems(
      const DecodedPayload&,
      const std::function<Result<bool>(const ItemView&, std::span<std::byte>)>&);
  PayloadHeader header_;
  // unique_ptr keeps item views valid when the DecodedPayload moves.
  std::unique_ptr<std::vector<std::byte>> body_;
  std::vector<ItemView> items_;
  std::vector<std::vector<LocationMark>> marks_;
  // The plain XOR items that ExpandContextItems decoded context-coded ones to (items_ views them).
  std::vector<std::unique_ptr<Item>> expanded_;
};

/// Reads the old elements of an item's span [span_begin, span_end) into `out` (span length ×
/// DTypeSize(dtype) bytes): the receiver's current bits of that span, host or device. Returns
/// false when the receiver does not hold the tensor at all (a loader's skip rule): the item is
/// then left context-coded, for an applier that ignores it.
using OldSpanReader = std::function<Result<bool>(const ItemView& item, std::span<std::byte> out)>;

/// Return `payload` with every context-coded item decoded, against the old span `read_old` gives
/// for it, into a plain XOR item of the same tensor, span, count and digest (locations in the
/// encoding ChooseLocationEncoding picks, location marks as DecodePayload makes them); the other
/// items unchanged. Call it right before the apply, against the bits the payload applies to.
/// Errors: DataLoss naming the payload and item when the bytes do not decode against the old
/// span (a receiver not at the payload's base, or corrupt bytes); the reader's errors.
/// Complexity: O(span) per context-coded item, O(body) for the copy of the rest.
Result<DecodedPayload> ExpandContextItems(const DecodedPayload& payload,
                                          const OldSpanReader& read_old);

/// Validate everything (header, checksum, bounded decompression, item table, every location and
/// value size) and return the decoded items. Nothing in a payload that fails here may be applied.
/// Errors: as ValidatePayloadHeader, plus DataLoss for a checksum mismatch or any inconsistent
/// body content, each naming the payload ids and the item.
Result<DecodedPayload> DecodePayload(std::span<const std::byte> payload,
                                     const PayloadLimits& limits = {});
/// As above for a payload whose header was validated already: its sizes are checked against
/// `limits` (CheckPayloadLimits), the header is not parsed again.
Result<DecodedPayload> DecodePayload(const ValidatedPayload& payload,
                                     const PayloadLimits& limits = {});
/// As above, taking the payload: a stored body (an anchor's payload sent raw,
/// PayloadHeader::stored_body) is decoded in the payload's own bytes, without a copy; any other
/// is decoded as from a const payload.
Result<DecodedPayload> DecodePayload(ValidatedPayload&& payload, const PayloadLimits& limits = {});

}  // namespace refit
