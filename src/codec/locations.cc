// Location encodings of payload format v1.
//
// Every encoding stores the sorted, unique locations L0 < L1 < … < L(n-1) of an item, all inside
// [span_begin, span_end), relative to span_begin. Let span_length = span_end - span_begin. The
// decoder accepts exactly one byte string per (locations, span): the one the encoder writes, so
// re-encoding decoded locations reproduces the input bytes (the fuzzer checks this).
//
//   kAll      no bytes. Valid only when n == span_length (every element of the span).
//   kRange    the maximal runs of consecutive locations, in order, each as two unsigned LEB128
//             varints (gap, length). For the first run gap = run_start - span_begin (may be 0);
//             for every later run gap = run_start - previous_run_end, where
//             run_end = run_start + length; runs are maximal, so that gap is >= 1. length >= 1.
//             LEB128: 7 value bits per byte, least significant group first, bit 7 set on every
//             byte but the last; at most 10 bytes; minimal (the last byte of a multi-byte varint
//             is non-zero, and a 10th byte is 0x01). No bytes follow the run that completes the
//             n-th location; n == 0 is the empty string.
//   kGap16    n fixed-width unsigned gaps: g0 = L0 - span_begin and gi = Li - L(i-1) - 1 for
//   kGap32    i >= 1, each of width w = 2 / 4 / 8 bytes, stored as w byte planes: first the
//   kGap64    least significant byte of every gap (n bytes), then byte 1 of every gap, …, so
//             byte k of gap i is at offset k·n + i. Exactly n × w bytes; every gap must fit.
//             Planes, because gaps of sparse changes are small: the high planes are nearly all
//             zero and compress to almost nothing, while interleaved they cost ~2 bits a gap.
//   kBitmask  ceil(span_length / 8) bytes; bit i of the span (byte i / 8, bit i % 8 with bit 0
//             the least significant) is set iff span_begin + i is a location. Padding bits
//             beyond span_length in the last byte are 0, and exactly n bits are set.
//
// Choosing: EstimateLocationBytes is exact (the encoder's output size, UINT64_MAX when the
// encoding cannot represent the set). ChooseLocationEncoding minimises what the bytes will cost
// *after* zstd, which is what goes on the wire: an all-zero byte plane compresses to nearly
// nothing, so a gap encoding costs its significant bytes, Σ max(1, ceil(bit_width(gi) / 8)),
// whatever its width; kRange and kBitmask cost their size; kAll costs 0. Ties go to the lower
// wire code, so among the gap widths the narrowest one holding max(g) wins: max(g) <= 0xFFFF →
// gap16, <= 0xFFFFFFFF → gap32, else gap64; and kRange beats the gaps on runs of length >= 2.
// An empty set in an empty span is kAll; in a non-empty span it is kRange (tied at 0).
//
// Decoding reads untrusted bytes. Make() rejects, as DataLoss, an unknown encoding code,
// span_begin > span_end, count > span_length, and byte lengths that contradict the count: kAll
// not empty or count != span_length; gaps not exactly count × width; a bitmask not
// ceil(span_length / 8) bytes or with padding bits set; a run list empty iff count == 0 and not
// longer than 20 bytes per location. Next() rejects, as DataLoss naming the encoding, the
// position and the value: out-of-span or overflowing locations, non-canonical varints and
// runs, too few or too many locations, and trailing bytes. Every read is bounds-checked by
// construction, every loop advances by at least one byte or one location, and the state only
// advances past data that decoded correctly, so a failed decoder fails again if called again.
#include "codec/locations.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <limits>
#include <string>

#include "refit/status_format.h"
#include "util/check.h"
#include "util/endian.h"

namespace refit {
namespace {

using internal::LoadLittleEndian;

/// Returned by EstimateLocationBytes for an encoding that cannot represent the locations.
constexpr uint64_t kNotRepresentable = std::numeric_limits<uint64_t>::max();
/// ceil(64 / 7): the longest LEB128 varint of a uint64_t.
constexpr uint64_t kMaxVarintBytes = 10;
/// LEB128 carries 7 value bits per byte; bit 7 says another byte follows.
constexpr uint32_t kVarintValueBits = 7;
constexpr uint8_t kVarintContinue = 0x80;
constexpr uint8_t kVarintValueMask = 0x7F;
/// The 10th byte of a varint carries only bit 63 of the value.
constexpr uint8_t kVarintLastByteMax = 0x01;
/// A run is two varints: (gap, length).
constexpr uint64_t kMaxRunBytes = 2 * kMaxVarintBytes;
constexpr uint64_t kBitsPerByte = 8;
/// Locations decoded per step by ValidateAll and DecodeAllLocations: 32 KiB of uint64_t, which
/// stays in L1 while keeping the per-call overhead negligible.
constexpr size_t kDecodeBatch = 4096;

uint64_t VarintSize(uint64_t value) {
  return std::max<uint64_t>(1, (std::bit_width(value) + kVarintValueBits - 1) / kVarintValueBits);
}

// Write `value` as LEB128 at `destination`; return the byte after it.
uint8_t* WriteVarint(uint64_t value, uint8_t* destination) {
  while (value > kVarintValueMask) {
    *destination++ = static_cast<uint8_t>((value & kVarintValueMask) | kVarintContinue);
    value >>= kVarintValueBits;
  }
  *destination++ = static_cast<uint8_t>(value);
  return destination;
}

uint64_t GapWidth(LocationEncoding encoding) {
  switch (encoding) {
    case LocationEncoding::kGap16:
      return sizeof(uint16_t);
    case LocationEncoding::kGap32:
      return sizeof(uint32_t);
    case LocationEncoding::kGap64:
      return sizeof(uint64_t);
    default:
      return 0;
  }
}

uint64_t GapMax(LocationEncoding encoding) {
  switch (encoding) {
    case LocationEncoding::kGap16:
      return std::numeric_limits<uint16_t>::max();
    case LocationEncoding::kGap32:
      return std::numeric_limits<uint32_t>::max();
    default:
      return std::numeric_limits<uint64_t>::max();
  }
}

bool IsKnownEncoding(LocationEncoding encoding) {
  return encoding >= LocationEncoding::kAll && encoding <= LocationEncoding::kBitmask;
}

/// kContext is a location encoding on the wire but not one of these plug-ins: its bytes code the
/// values too, given the old elements, which only a receiver holds.
Status ContextIsNotAPlugIn(std::string_view what) {
  return InvalidArgument(
      "location encoding 'context' cannot be {}: it codes an XOR item's locations and values "
      "given the old span (ExpandContextItems; producers choose it by "
      "delta_compression.item_coding)",
      what);
}

/// Bytes of `value` that are not leading zeros, at least 1.
uint64_t SignificantBytes(uint64_t value) {
  return std::max<uint64_t>(1, (std::bit_width(value) + kBitsPerByte - 1) / kBitsPerByte);
}

uint64_t BitmaskBytes(uint64_t span_length) {
  return span_length / kBitsPerByte + (span_length % kBitsPerByte != 0 ? 1 : 0);
}

/// What the estimators need to know about a set of locations, gathered in one pass.
struct LocationStats {
  /// The largest gap as the gap encodings define it (g0 = L0 - span_begin, gi = Li - L(i-1) - 1).
  uint64_t max_gap = 0;
  /// The exact kRange size.
  uint64_t range_bytes = 0;
  /// Σ max(1, ceil(bit_width(gi) / 8)): the cost model of the gap encodings (see top).
  uint64_t gap_significant_bytes = 0;
};

/// Check that `locations` are sorted, unique and inside [span_begin, span_end), and gather their
/// statistics. Errors: InvalidArgument naming the first offending location.
Status AnalyzeLocations(std::span<const uint64_t> locations, uint64_t span_begin, uint64_t span_end,
                        LocationStats* stats) {
  if (span_begin > span_end) {
    return InvalidArgument("location span [{}, {}) has begin > end", span_begin, span_end);
  }
  LocationStats result;
  uint64_t next = span_begin;  // The smallest value the next location may take.
  uint64_t previous_run_end = span_begin;
  uint64_t run_start = span_begin;
  for (size_t i = 0; i < locations.size(); ++i) {
    const uint64_t location = locations[i];
    if (location < next) {
      if (i == 0) {
        return InvalidArgument("location #0 = {} is below span begin {}", location, span_begin);
      }
      return InvalidArgument("location #{} = {} does not increase on location #{} = {}", i,
                             location, i - 1, locations[i - 1]);
    }
    if (location >= span_end) {
      return InvalidArgument("location #{} = {} is outside span [{}, {})", i, location, span_begin,
                             span_end);
    }
    result.max_gap = std::max(result.max_gap, location - next);
    result.gap_significant_bytes += SignificantBytes(location - next);
    if (i == 0) {
      run_start = location;
    } else if (location != next) {  // A run ended at `next`; a new one starts here.
      result.range_bytes += VarintSize(run_start - previous_run_end) + VarintSize(next - run_start);
      previous_run_end = next;
      run_start = location;
    }
    next = location + 1;  // Cannot overflow: location < span_end.
  }
  if (!locations.empty()) {
    result.range_bytes += VarintSize(run_start - previous_run_end) + VarintSize(next - run_start);
  }
  *stats = result;
  return Status::OK();
}

uint64_t EstimateFromStats(LocationEncoding encoding, const LocationStats& stats, uint64_t count,
                           uint64_t span_length) {
  switch (encoding) {
    case LocationEncoding::kAll:
      return count == span_length ? 0 : kNotRepresentable;
    case LocationEncoding::kRange:
      return stats.range_bytes;
    case LocationEncoding::kGap16:
    case LocationEncoding::kGap32:
    case LocationEncoding::kGap64:
      return stats.max_gap <= GapMax(encoding) ? count * GapWidth(encoding) : kNotRepresentable;
    case LocationEncoding::kBitmask:
      return BitmaskBytes(span_length);
    case LocationEncoding::kContext:
      return kNotRepresentable;
  }
  return kNotRepresentable;
}

/// The chooser's estimate of the compressed cost (see top); kNotRepresentable as above.
uint64_t CostFromStats(LocationEncoding encoding, const LocationStats& stats, uint64_t count,
                       uint64_t span_length) {
  const uint64_t bytes = EstimateFromStats(encoding, stats, count, span_length);
  if (bytes == kNotRepresentable) return bytes;
  switch (encoding) {
    case LocationEncoding::kGap16:
    case LocationEncoding::kGap32:
    case LocationEncoding::kGap64:
      return stats.gap_significant_bytes;
    default:
      return bytes;
  }
}

template <typename Gap>
void AppendGaps(std::span<const uint64_t> locations, uint64_t span_begin,
                std::vector<uint8_t>* out) {
  const size_t n = locations.size();
  const size_t offset = out->size();
  out->resize(offset + n * sizeof(Gap));
  uint8_t* planes = out->data() + offset;
  uint64_t next = span_begin;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t gap = locations[i] - next;
    for (size_t k = 0; k < sizeof(Gap); ++k) {
      planes[k * n + i] = static_cast<uint8_t>(gap >> (kBitsPerByte * k));
    }
    next = locations[i] + 1;
  }
}

/// Gap `index` of `count` planar gaps of type Gap at `planes`.
template <typename Gap>
inline uint64_t LoadPlanarGap(const uint8_t* planes, uint64_t count, uint64_t index) {
  uint64_t gap = planes[index];
  for (size_t k = 1; k < sizeof(Gap); ++k) {
    gap |= static_cast<uint64_t>(planes[k * count + index]) << (kBitsPerByte * k);
  }
  return gap;
}

// `range_bytes` is the exact size from AnalyzeLocations, so the output is sized once.
void AppendRanges(std::span<const uint64_t> locations, uint64_t span_begin, uint64_t range_bytes,
                  std::vector<uint8_t>* out) {
  const size_t offset = out->size();
  out->resize(offset + range_bytes);
  uint8_t* destination = out->data() + offset;
  uint64_t previous_run_end = span_begin;
  size_t i = 0;
  while (i < locations.size()) {
    const uint64_t run_start = locations[i];
    uint64_t run_end = run_start + 1;
    ++i;
    while (i < locations.size() && locations[i] == run_end) {
      ++run_end;
      ++i;
    }
    destination = WriteVarint(run_start - previous_run_end, destination);
    destination = WriteVarint(run_end - run_start, destination);
    previous_run_end = run_end;
  }
  REFIT_DCHECK(destination == out->data() + out->size(), "range size estimate is not exact");
}

void AppendBitmask(std::span<const uint64_t> locations, uint64_t span_begin, uint64_t span_end,
                   std::vector<uint8_t>* out) {
  const size_t offset = out->size();
  out->resize(offset + BitmaskBytes(span_end - span_begin), 0);
  uint8_t* mask = out->data() + offset;
  for (const uint64_t location : locations) {
    const uint64_t bit = location - span_begin;
    mask[bit / kBitsPerByte] |= static_cast<uint8_t>(1u << (bit % kBitsPerByte));
  }
}

/// Decode `out.size()` gaps of type Gap, numbers first_index, first_index + 1, …, of the `count`
/// planar gaps at `planes` (bounds were checked by the caller). `*next` is the smallest value the
/// next location may take; it advances only on success, so a failed batch fails again if
/// retried.
template <typename Gap>
Status DecodeGapBatch(LocationEncoding encoding, const uint8_t* planes, uint64_t count,
                      uint64_t first_index, uint64_t span_end, uint64_t* next,
                      std::span<uint64_t> out) {
  const size_t n = out.size();
  uint64_t cursor = *next;
  if constexpr (sizeof(Gap) < sizeof(uint64_t)) {
    // Each location advances the cursor by at most max(Gap) + 1, so when n such steps cannot
    // overflow, the hot loop needs no per-element check: the locations are strictly increasing
    // and all lie in the span iff the last one does.
    constexpr uint64_t kMaxStep = uint64_t{std::numeric_limits<Gap>::max()} + 1;
    if ((std::numeric_limits<uint64_t>::max() - cursor) / kMaxStep >= n) {
      for (size_t i = 0; i < n; ++i) {
        const uint64_t location = cursor + LoadPlanarGap<Gap>(planes, count, first_index + i);
        out[i] = location;
        cursor = location + 1;
      }
      if (n == 0 || out[n - 1] < span_end) {
        *next = cursor;
        return Status::OK();
      }
      size_t bad = 0;
      while (out[bad] < span_end) ++bad;
      return DataLoss("{} locations: location #{} is {} >= span end {}",
                      LocationEncodingName(encoding), first_index + bad, out[bad], span_end);
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const uint64_t gap = LoadPlanarGap<Gap>(planes, count, first_index + i);
    uint64_t location;
    if (__builtin_add_overflow(cursor, gap, &location)) {
      return DataLoss("{} locations: location #{}: gap {} after {} overflows 2^64",
                      LocationEncodingName(encoding), first_index + i, gap, cursor);
    }
    if (location >= span_end) {
      return DataLoss("{} locations: location #{} is {} >= span end {}",
                      LocationEncodingName(encoding), first_index + i, location, span_end);
    }
    out[i] = location;
    cursor = location + 1;
  }
  *next = cursor;
  return Status::OK();
}

/// Read one canonical LEB128 varint at `*position` of `data`, which must have kMaxVarintBytes
/// readable bytes there; advance `*position` past it. Return false, reading no further, on a
/// varint that is not canonical (ReadVarint then describes the defect).
inline bool ReadCanonicalVarintUnchecked(const uint8_t* data, uint64_t* position, uint64_t* value) {
  const uint8_t* source = data + *position;
  uint64_t result = 0;
  for (uint64_t i = 0; i < kMaxVarintBytes; ++i) {
    const uint8_t byte = source[i];
    result |= static_cast<uint64_t>(byte & kVarintValueMask) << (kVarintValueBits * i);
    if ((byte & kVarintContinue) == 0) {
      if ((byte == 0 && i > 0) || (i == kMaxVarintBytes - 1 && byte > kVarintLastByteMax)) {
        return false;
      }
      *value = result;
      *position += i + 1;
      return true;
    }
  }
  return false;
}

/// Read one canonical LEB128 varint at `*position` of `bytes`; advance `*position` past it.
/// Errors: DataLoss naming `field`, the byte offset and the defect.
Status ReadVarint(std::span<const uint8_t> bytes, uint64_t* position, const char* field,
                  uint64_t* value) {
  const uint64_t start = *position;
  if (start < bytes.size() && bytes[start] < kVarintContinue) {  // One byte: the common case.
    *value = bytes[start];
    *position = start + 1;
    return Status::OK();
  }
  uint64_t result = 0;
  for (uint64_t i = 0; i < kMaxVarintBytes; ++i) {
    if (start + i >= bytes.size()) {
      return DataLoss("range locations: {} varint at byte offset {} is truncated at byte {}", field,
                      start, bytes.size());
    }
    const uint8_t byte = bytes[start + i];
    if (i == kMaxVarintBytes - 1 && byte > kVarintLastByteMax) {
      return DataLoss(
          "range locations: {} varint at byte offset {} exceeds 64 bits (byte {} is 0x{:02x})",
          field, start, start + i, byte);
    }
    result |= static_cast<uint64_t>(byte & kVarintValueMask) << (kVarintValueBits * i);
    if ((byte & kVarintContinue) == 0) {
      if (byte == 0) {
        return DataLoss("range locations: {} varint at byte offset {} is not minimal ({} bytes)",
                        field, start, i + 1);
      }
      *value = result;
      *position = start + i + 1;
      return Status::OK();
    }
  }
  // The 10th byte either failed the width check or ended the varint.
  return Internal("range locations: varint decoder passed {} bytes", kMaxVarintBytes);
}

/// Read a run header (gap and length varints) at `*position` in the general, multi-byte case.
Status ReadRunHeader(std::span<const uint8_t> bytes, uint64_t emitted, uint64_t count,
                     uint64_t* position, uint64_t* gap, uint64_t* length) {
  if (*position == bytes.size()) {
    return DataLoss("range locations: bytes end after {} of {} locations", emitted, count);
  }
  REFIT_RETURN_NOT_OK(ReadVarint(bytes, position, "gap", gap));
  return ReadVarint(bytes, position, "length", length);
}

/// Describe the first defect of a decoded run header (the caller found one). Cold path.
[[gnu::cold]] Status RunError(uint64_t run_offset, uint64_t gap, uint64_t length, uint64_t cursor,
                              uint64_t emitted, uint64_t count, uint64_t span_end) {
  if (gap == 0 && emitted > 0) {
    return DataLoss(
        "range locations: run at byte offset {} has gap 0 after location {} (runs must be "
        "maximal)",
        run_offset, cursor - 1);
  }
  if (length == 0) {
    return DataLoss("range locations: run at byte offset {} has length 0", run_offset);
  }
  if (gap >= span_end - cursor) {
    return DataLoss(
        "range locations: run at byte offset {} starts at {} + gap {}, outside span end {}",
        run_offset, cursor, gap, span_end);
  }
  if (length > span_end - (cursor + gap)) {
    return DataLoss(
        "range locations: run at byte offset {} from {} of length {} passes span end {}",
        run_offset, cursor + gap, length, span_end);
  }
  return DataLoss(
      "range locations: run at byte offset {} of length {} exceeds the {} locations left of "
      "count {}",
      run_offset, length, count - emitted, count);
}

}  // namespace

uint64_t EstimateLocationBytes(LocationEncoding encoding, std::span<const uint64_t> locations,
                               uint64_t span_begin, uint64_t span_end) {
  if (span_begin > span_end) return kNotRepresentable;
  const uint64_t span_length = span_end - span_begin;
  LocationStats stats;
  // kAll and kBitmask depend only on the count and the span (O(1)); the others need a pass.
  if (encoding != LocationEncoding::kAll && encoding != LocationEncoding::kBitmask &&
      !AnalyzeLocations(locations, span_begin, span_end, &stats).ok()) {
    return kNotRepresentable;
  }
  return EstimateFromStats(encoding, stats, locations.size(), span_length);
}

namespace {

/// ChooseLocationEncoding's choice from the statistics of valid locations.
Result<LocationEncoding> ChooseFromStats(const LocationStats& stats, uint64_t count,
                                         uint64_t span_begin, uint64_t span_end,
                                         std::optional<LocationEncoding> force) {
  const uint64_t span_length = span_end - span_begin;
  if (force.has_value()) {
    if (*force == LocationEncoding::kContext) return ContextIsNotAPlugIn("forced here");
    if (!IsKnownEncoding(*force)) {
      return InvalidArgument("unknown location encoding code {}", static_cast<int>(*force));
    }
    if (EstimateFromStats(*force, stats, count, span_length) == kNotRepresentable) {
      return InvalidArgument(
          "location encoding '{}' cannot represent {} locations in span [{}, {}) (max gap {})",
          LocationEncodingName(*force), count, span_begin, span_end, stats.max_gap);
    }
    return *force;
  }
  // kRange represents every valid set, so the minimum is always finite.
  LocationEncoding best = LocationEncoding::kRange;
  uint64_t best_bytes = kNotRepresentable;
  for (uint8_t code = static_cast<uint8_t>(LocationEncoding::kAll);
       code <= static_cast<uint8_t>(LocationEncoding::kBitmask); ++code) {
    const auto encoding = static_cast<LocationEncoding>(code);
    const uint64_t bytes = CostFromStats(encoding, stats, count, span_length);
    if (bytes < best_bytes) {  // Strict: ties keep the lower wire code.
      best = encoding;
      best_bytes = bytes;
    }
  }
  return best;
}

/// EncodeLocations for locations AnalyzeLocations accepted with `stats`.
Status EncodeWithStats(LocationEncoding encoding, std::span<const uint64_t> locations,
                       uint64_t span_begin, uint64_t span_end, const LocationStats& stats,
                       std::vector<uint8_t>* out) {
  if (encoding == LocationEncoding::kContext) return ContextIsNotAPlugIn("encoded from locations");
  if (!IsKnownEncoding(encoding)) {
    return InvalidArgument("unknown location encoding code {}", static_cast<int>(encoding));
  }
  if (EstimateFromStats(encoding, stats, locations.size(), span_end - span_begin) ==
      kNotRepresentable) {
    return InvalidArgument(
        "location encoding '{}' cannot represent {} locations in span [{}, {}) (max gap {})",
        LocationEncodingName(encoding), locations.size(), span_begin, span_end, stats.max_gap);
  }
  switch (encoding) {
    case LocationEncoding::kContext:  // Refused before the switch.
      break;
    case LocationEncoding::kAll:
      break;
    case LocationEncoding::kRange:
      AppendRanges(locations, span_begin, stats.range_bytes, out);
      break;
    case LocationEncoding::kGap16:
      AppendGaps<uint16_t>(locations, span_begin, out);
      break;
    case LocationEncoding::kGap32:
      AppendGaps<uint32_t>(locations, span_begin, out);
      break;
    case LocationEncoding::kGap64:
      AppendGaps<uint64_t>(locations, span_begin, out);
      break;
    case LocationEncoding::kBitmask:
      AppendBitmask(locations, span_begin, span_end, out);
      break;
  }
  return Status::OK();
}

}  // namespace

Result<LocationEncoding> ChooseLocationEncoding(std::span<const uint64_t> locations,
                                                uint64_t span_begin, uint64_t span_end,
                                                std::optional<LocationEncoding> force) {
  LocationStats stats;
  REFIT_RETURN_NOT_OK(AnalyzeLocations(locations, span_begin, span_end, &stats));
  return ChooseFromStats(stats, locations.size(), span_begin, span_end, force);
}

Status EncodeLocations(LocationEncoding encoding, std::span<const uint64_t> locations,
                       uint64_t span_begin, uint64_t span_end, std::vector<uint8_t>* out) {
  LocationStats stats;
  REFIT_RETURN_NOT_OK(AnalyzeLocations(locations, span_begin, span_end, &stats));
  return EncodeWithStats(encoding, locations, span_begin, span_end, stats, out);
}

Result<LocationEncoding> ChooseAndEncodeLocations(std::span<const uint64_t> locations,
                                                  uint64_t span_begin, uint64_t span_end,
                                                  std::optional<LocationEncoding> force,
                                                  std::vector<uint8_t>* out) {
  LocationStats stats;
  REFIT_RETURN_NOT_OK(AnalyzeLocations(locations, span_begin, span_end, &stats));
  REFIT_ASSIGN_OR_RETURN(const LocationEncoding encoding,
                         ChooseFromStats(stats, locations.size(), span_begin, span_end, force));
  REFIT_RETURN_NOT_OK(EncodeWithStats(encoding, locations, span_begin, span_end, stats, out));
  return encoding;
}

Result<LocationDecoder> LocationDecoder::Make(LocationEncoding encoding,
                                              std::span<const uint8_t> bytes, uint64_t count,
                                              uint64_t span_begin, uint64_t span_end) {
  if (encoding == LocationEncoding::kContext) {
    // DataLoss as any code the decoder cannot read (the payload decoder never gets here).
    return Status(StatusCode::kDataLoss,
                  ContextIsNotAPlugIn("decoded without the old span").message());
  }
  if (!IsKnownEncoding(encoding)) {
    return DataLoss("unknown location encoding code {}", static_cast<int>(encoding));
  }
  const std::string_view name = LocationEncodingName(encoding);
  if (span_begin > span_end) {
    return DataLoss("{} locations: span [{}, {}) has begin > end", name, span_begin, span_end);
  }
  const uint64_t span_length = span_end - span_begin;
  if (count > span_length) {
    return DataLoss("{} locations: count {} exceeds span length {}", name, count, span_length);
  }
  switch (encoding) {
    case LocationEncoding::kContext:  // Refused before the switch.
      break;
    case LocationEncoding::kAll:
      if (count != span_length || !bytes.empty()) {
        return DataLoss("all locations: count {} and {} bytes, expected count {} and 0 bytes",
                        count, bytes.size(), span_length);
      }
      break;
    case LocationEncoding::kRange:
      // Each run holds at least one location and takes at most two maximal varints, so there
      // are at most `count` runs of at most kMaxRunBytes each; no locations, no bytes.
      if ((count == 0) != bytes.empty() ||
          (bytes.size() + kMaxRunBytes - 1) / kMaxRunBytes > count) {
        return DataLoss("range locations: {} bytes cannot hold {} locations", bytes.size(), count);
      }
      break;
    case LocationEncoding::kGap16:
    case LocationEncoding::kGap32:
    case LocationEncoding::kGap64: {
      const uint64_t width = GapWidth(encoding);
      if (bytes.size() % width != 0 || bytes.size() / width != count) {
        return DataLoss("{} locations: {} bytes, expected count {} x {} bytes", name, bytes.size(),
                        count, width);
      }
      break;
    }
    case LocationEncoding::kBitmask: {
      const uint64_t expected = BitmaskBytes(span_length);
      if (bytes.size() != expected) {
        return DataLoss("bitmask locations: {} bytes, expected {} for span length {}", bytes.size(),
                        expected, span_length);
      }
      const uint64_t used_bits = span_length % kBitsPerByte;
      if (used_bits != 0 && (bytes.back() >> used_bits) != 0) {
        return DataLoss(
            "bitmask locations: padding bits set in last byte {} (0x{:02x}) for span length {}",
            bytes.size() - 1, bytes.back(), span_length);
      }
      break;
    }
  }
  LocationDecoder decoder(encoding, bytes, count, span_begin, span_end);
  decoder.cursor_ = span_begin;
  return decoder;
}

Result<size_t> LocationDecoder::Next(std::span<uint64_t> out) {
  // Every location is decoded; only a bit stream can still hold surplus bits, only a run list
  // surplus bytes. Checked on every call so that a failure is reported again if retried.
  auto check_end = [&]() -> Status {
    if (encoding_ == LocationEncoding::kRange && byte_pos_ != bytes_.size()) {
      return DataLoss("range locations: {} trailing bytes at byte offset {} after all {} locations",
                      bytes_.size() - byte_pos_, byte_pos_, count_);
    }
    if (encoding_ == LocationEncoding::kBitmask) {
      if (run_left_ != 0) {
        return DataLoss("bitmask locations: surplus location {} beyond count {}",
                        cursor_ + std::countr_zero(run_left_), count_);
      }
      for (uint64_t i = byte_pos_; i < bytes_.size(); ++i) {
        if (bytes_[i] != 0) {
          return DataLoss("bitmask locations: surplus location {} (byte {}) beyond count {}",
                          span_begin_ + i * kBitsPerByte + std::countr_zero(bytes_[i]), i, count_);
        }
      }
    }
    return Status::OK();
  };
  if (emitted_ == count_) {
    REFIT_RETURN_NOT_OK(check_end());
    return size_t{0};
  }
  const size_t n = static_cast<size_t>(std::min<uint64_t>(out.size(), count_ - emitted_));
  out = out.first(n);
  switch (encoding_) {
    case LocationEncoding::kContext:  // Refused before the switch.
      break;
    case LocationEncoding::kAll: {
      const uint64_t first = cursor_;  // A local: `out` could alias the member.
      for (size_t i = 0; i < n; ++i) out[i] = first + i;
      cursor_ = first + n;
      emitted_ += n;
      break;
    }
    case LocationEncoding::kGap16:
      REFIT_RETURN_NOT_OK(DecodeGapBatch<uint16_t>(encoding_, bytes_.data(), count_, emitted_,
                                                   span_end_, &cursor_, out));
      byte_pos_ += n * sizeof(uint16_t);
      emitted_ += n;
      break;
    case LocationEncoding::kGap32:
      REFIT_RETURN_NOT_OK(DecodeGapBatch<uint32_t>(encoding_, bytes_.data(), count_, emitted_,
                                                   span_end_, &cursor_, out));
      byte_pos_ += n * sizeof(uint32_t);
      emitted_ += n;
      break;
    case LocationEncoding::kGap64:
      REFIT_RETURN_NOT_OK(DecodeGapBatch<uint64_t>(encoding_, bytes_.data(), count_, emitted_,
                                                   span_end_, &cursor_, out));
      byte_pos_ += n * sizeof(uint64_t);
      emitted_ += n;
      break;
    case LocationEncoding::kRange: {
      // cursor_ is the next location of the current run, or the end of the previous run (the
      // span begin before the first) when run_left_ == 0. State advances run by run, so an
      // error leaves it at the offending run and a retry fails the same way. The loop works on
      // locals: `out` could alias the members, which would force a reload after every store.
      const uint8_t* data = bytes_.data();
      const uint64_t size = bytes_.size();
      uint64_t position = byte_pos_;
      uint64_t cursor = cursor_;
      uint64_t run_left = run_left_;
      uint64_t emitted = emitted_;
      Status error;
      size_t produced = 0;
      while (produced < n) {
        if (run_left == 0) {
          uint64_t next_position = position;
          uint64_t gap;
          uint64_t length;
          // With a whole maximal run header in reach, canonical varints decode without bounds
          // checks; anything else (the tail, or a defect to describe) takes the checked path.
          if (size - position < kMaxRunBytes ||
              !ReadCanonicalVarintUnchecked(data, &next_position, &gap) ||
              !ReadCanonicalVarintUnchecked(data, &next_position, &length)) {
            next_position = position;
            error = ReadRunHeader(bytes_, emitted, count_, &next_position, &gap, &length);
            if (!error.ok()) break;
          }
          // cursor <= span_end_ always holds, so `room` cannot wrap.
          const uint64_t room = span_end_ - cursor;
          if ((gap == 0 && emitted > 0) || length == 0 || gap >= room || length > room - gap ||
              length > count_ - emitted) [[unlikely]] {
            error = RunError(position, gap, length, cursor, emitted, count_, span_end_);
            break;
          }
          cursor += gap;
          run_left = length;
          position = next_position;
        }
        const size_t take = static_cast<size_t>(std::min<uint64_t>(run_left, n - produced));
        uint64_t* destination = out.data() + produced;
        for (size_t i = 0; i < take; ++i) destination[i] = cursor + i;
        cursor += take;
        run_left -= take;
        emitted += take;
        produced += take;
      }
      byte_pos_ = position;
      cursor_ = cursor;
      run_left_ = run_left;
      emitted_ = emitted;
      REFIT_RETURN_NOT_OK(error);
      break;
    }
    case LocationEncoding::kBitmask: {
      // run_left_ holds the not yet emitted bits of the current 64-bit word and cursor_ the
      // location of that word's bit 0; byte_pos_ is the first byte not yet loaded.
      const uint8_t* data = bytes_.data();
      const uint64_t size = bytes_.size();
      uint64_t position = byte_pos_;
      uint64_t pending = run_left_;
      uint64_t word_base = cursor_;
      size_t produced = 0;
      while (produced < n) {
        if (pending == 0) {
          if (position == size) break;  // Fewer bits than count: reported below.
          if (size - position >= sizeof(uint64_t)) {
            pending = LoadLittleEndian<uint64_t>(data + position);
            word_base = span_begin_ + position * kBitsPerByte;
            position += sizeof(uint64_t);
          } else {  // The last, partial word: zero-fill the missing high bytes.
            std::array<uint8_t, sizeof(uint64_t)> word_bytes{};
            std::memcpy(word_bytes.data(), data + position, size - position);
            pending = LoadLittleEndian<uint64_t>(word_bytes.data());
            word_base = span_begin_ + position * kBitsPerByte;
            position = size;
          }
          // word_base cannot overflow: the word holds at least one bit of the span.
          continue;
        }
        out[produced++] = word_base + static_cast<uint64_t>(std::countr_zero(pending));
        pending &= pending - 1;
      }
      byte_pos_ = position;
      run_left_ = pending;
      cursor_ = word_base;
      emitted_ += produced;
      if (produced < n) {
        return DataLoss("bitmask locations: {} bits set, count says {}", emitted_, count_);
      }
      break;
    }
  }
  if (emitted_ == count_) REFIT_RETURN_NOT_OK(check_end());
  return n;
}

Status LocationDecoder::ValidateAll(std::vector<LocationMark>* marks) {
  static_assert(kLocationMarkInterval % kDecodeBatch == 0,
                "a mark must fall between two batches of a full decode");
  if (encoding_ == LocationEncoding::kAll) {  // Make() checked everything there is to check.
    if (marks != nullptr) {
      for (uint64_t at = (emitted_ / kLocationMarkInterval + 1) * kLocationMarkInterval;
           at < count_; at += kLocationMarkInterval) {
        marks->push_back(LocationMark{at, byte_pos_, cursor_ + (at - emitted_), 0});
      }
    }
    cursor_ += count_ - emitted_;
    emitted_ = count_;
    return Status::OK();
  }
  std::array<uint64_t, kDecodeBatch> scratch;
  while (true) {
    REFIT_ASSIGN_OR_RETURN(const size_t decoded, Next(scratch));
    if (decoded == 0) return Status::OK();
    if (marks != nullptr && emitted_ < count_ && emitted_ % kLocationMarkInterval == 0) {
      marks->push_back(mark());
    }
  }
}

Result<std::vector<uint64_t>> DecodeAllLocations(const ItemView& item) {
  REFIT_ASSIGN_OR_RETURN(LocationDecoder decoder,
                         LocationDecoder::Make(item.location_encoding, item.locations, item.count,
                                               item.span_begin, item.span_end));
  std::vector<uint64_t> locations;
  while (true) {
    // Grow step by step: `count` comes from the wire and is only proven by decoding.
    const size_t filled = locations.size();
    locations.resize(filled + kDecodeBatch);
    REFIT_ASSIGN_OR_RETURN(const size_t decoded,
                           decoder.Next(std::span<uint64_t>(locations).subspan(filled)));
    locations.resize(filled + decoded);
    if (decoded == 0) return locations;
  }
}

}  // namespace refit
