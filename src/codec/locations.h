// Location encodings: analyze → estimate → encode / decode (DuckDB-style plug-ins).
//
// Locations are flat element indices into a tensor, sorted and unique, inside an item's span
// [span_begin, span_end). Every encoding stores them relative to span_begin. The byte-exact
// layout of each encoding is in docs/format/payload.md.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "refit/item.h"
#include "refit/status.h"

namespace refit {

/// Return the exact encoded size in bytes of `locations` under `encoding`, or UINT64_MAX when the
/// encoding cannot represent them (a gap wider than the width; kAll when not every element of
/// the span is present). Preconditions: sorted, unique, inside [span_begin, span_end).
/// Complexity: O(1) for kAll/kBitmask, O(n) otherwise.
uint64_t EstimateLocationBytes(LocationEncoding encoding, std::span<const uint64_t> locations,
                               uint64_t span_begin, uint64_t span_end);

/// Return the encoding whose bytes should cost the least on the wire after zstd; ties go to the
/// lower wire code. The cost model: a gap encoding costs the significant bytes of its gaps,
/// Σ max(1, ceil(bit_width(gap) / 8)), whatever its width (it stores byte planes, and the
/// all-zero high planes of small gaps compress to almost nothing), so among the gap widths the
/// narrowest that holds the largest gap wins; kRange and kBitmask cost their exact size; kAll
/// costs 0. This is an encoder choice, not a format rule: every valid encoding decodes. With
/// `force`, return it if it can represent the locations, else InvalidArgument naming it.
/// Errors: InvalidArgument when the locations are unsorted, repeated or outside the span, or the
/// span has begin > end.
/// Complexity: O(n).
Result<LocationEncoding> ChooseLocationEncoding(std::span<const uint64_t> locations,
                                                uint64_t span_begin, uint64_t span_end,
                                                std::optional<LocationEncoding> force = {});

/// Append the encoding of `locations` to `out`. Errors: InvalidArgument if `encoding` cannot
/// represent them or they are unsorted / outside the span.
Status EncodeLocations(LocationEncoding encoding, std::span<const uint64_t> locations,
                       uint64_t span_begin, uint64_t span_end, std::vector<uint8_t>* out);

/// ChooseLocationEncoding then EncodeLocations with one pass over `locations` instead of two
/// (the encoder's path: the check and statistics pass is a fifth of a delta's location work).
/// Append the encoding to `out` and return which it is. Errors: those of both.
Result<LocationEncoding> ChooseAndEncodeLocations(std::span<const uint64_t> locations,
                                                  uint64_t span_begin, uint64_t span_end,
                                                  std::optional<LocationEncoding> force,
                                                  std::vector<uint8_t>* out);

/// Decodes untrusted location bytes in batches, checking as it goes that every location is
/// strictly increasing and inside the span, and that exactly `count` locations are present.
///
/// Thread-safety: one decoder per thread. Does not own `bytes`.
class LocationDecoder {
 public:
  /// Check the cheap invariants (byte length consistent with count and encoding; width
  /// boundaries) without decoding. Errors: DataLoss naming the encoding and the sizes.
  static Result<LocationDecoder> Make(LocationEncoding encoding, std::span<const uint8_t> bytes,
                                      uint64_t count, uint64_t span_begin, uint64_t span_end);

  /// Decode up to out.size() further locations into `out`; return how many (0 at the end).
  /// Errors: DataLoss on an out-of-span, non-increasing, missing or surplus location, or on
  /// trailing bytes once all `count` locations are read.
  Result<size_t> Next(std::span<uint64_t> out);

  /// Decode everything left, only to validate it. With `marks`, append the decoder's mark at
  /// every multiple of kLocationMarkInterval locations before the end. Errors as Next().
  Status ValidateAll(std::vector<LocationMark>* marks = nullptr);

  /// Where the decoder stands: it has emitted mark().emitted locations.
  LocationMark mark() const { return {emitted_, byte_pos_, cursor_, run_left_}; }
  /// Go on from `mark`, which a decoder of the same item's bytes reported (ValidateAll's marks):
  /// the next location is the one at index mark.emitted. Precondition: the mark came from this
  /// item, decoded without error that far (a mark is not checked).
  void Seek(const LocationMark& mark) {
    emitted_ = mark.emitted;
    byte_pos_ = mark.byte_pos;
    cursor_ = mark.cursor;
    run_left_ = mark.run_left;
  }

  uint64_t count() const { return count_; }

 private:
  LocationDecoder(LocationEncoding encoding, std::span<const uint8_t> bytes, uint64_t count,
                  uint64_t span_begin, uint64_t span_end)
      : encoding_(encoding),
        bytes_(bytes),
        count_(count),
        span_begin_(span_begin),
        span_end_(span_end) {}

  LocationEncoding encoding_;
  std::span<const uint8_t> bytes_;
  uint64_t count_;
  uint64_t span_begin_;
  uint64_t span_end_;
  // Decoding state.
  uint64_t emitted_ = 0;
  uint64_t byte_pos_ = 0;
  /// The next location candidate (gap encodings) or the current position in a run (kRange).
  uint64_t cursor_ = 0;
  uint64_t run_left_ = 0;
};

/// Decode all locations into a vector. Convenience for tests and tools; O(count) memory.
Result<std::vector<uint64_t>> DecodeAllLocations(const ItemView& item);

}  // namespace refit
