// Context-coded deltas: an item's changes coded given the old values both sides hold.
//
// The old element's magnitude class (a range of exponents) predicts whether the element changes
// (an Adam step of ~lr crosses a rounding boundary far more often at small magnitudes) and by how
// much. The encoding splits a span's elements into up to 16 classes by magnitude thresholds the
// encoder chooses per item; per class it codes the change mask as gaps between the changed ranks
// within the class, and each change as the zig-zagged integer difference new − old of the bit
// patterns, byte plane by byte plane; every stream goes through htscodecs' rANS (order 0 or 1,
// or stored), whichever is smallest. Decoding needs the old elements and makes one pass over
// them (ContextClassMasks, SIMD); it returns ordinary locations and XOR values, so that applying,
// digests and undo are those of an XOR item.
//
// Defined for bfloat16, float16, float32 and the four float8 dtypes (a sign bit over
// magnitude-ordered bits: the magnitude class is meaningful). Not for float64 (not worth an
// 8-byte-lane kernel: no trainer exports float64 weights) nor integer dtypes (no exponent).
//
// The byte layout is that of payload format v2's `context` location encoding
// (docs/format/context-coding.md); pipeline/context_items.h codes items into it, ExpandContextItems
// (refit/payload.h) back.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "refit/dtype.h"
#include "refit/status.h"

namespace refit::internal {

/// Return whether context coding is defined for `dtype`.
bool ContextCodingSupported(DType dtype);

/// Options of EncodeContextCoded.
struct ContextCodingOptions {
  /// Most magnitude classes; the encoder picks 1 to this many per item by estimated size.
  /// At most 16 (kMaxContextThresholds + 1). 8: on the step pairs of bench/context_bench.cc 16
  /// saved nothing measurable and cost decode time (the pass makes one compare per class and
  /// vector); 4 cost 1–3 % more bytes and decoded 15–35 % faster.
  uint32_t max_classes = 8;
};

/// Encode the changes of one span. `old_span` holds the span's old elements (`span_length` =
/// old_span.size() / DTypeSize(dtype)); `locations` are the changed elements relative to the
/// span start, sorted and unique; `xor_values` their new ^ old bits, one element each.
/// Errors: InvalidArgument for an unsupported dtype, unsorted or out-of-span locations, a value
/// count other than the location count, or a span of 2^40 elements or more.
/// Deterministic: the same inputs give the same bytes. Complexity: O(span + changes).
Result<std::vector<uint8_t>> EncodeContextCoded(DType dtype, std::span<const std::byte> old_span,
                                                std::span<const uint64_t> locations,
                                                std::span<const std::byte> xor_values,
                                                const ContextCodingOptions& options = {});

/// What a context-coded span decodes to: an ordinary XOR change set.
struct ContextDecoded {
  /// Changed elements relative to the span start, ascending.
  std::vector<uint64_t> locations;
  /// new ^ old of each, DTypeSize(dtype) bytes each, little-endian.
  std::vector<std::byte> xor_values;
};

/// Decode untrusted `bytes` against the old elements of the span. `expected_count` is the
/// change count the enclosing item declares. Every size is checked before it is allocated:
/// allocations are bounded by the span and the byte length.
/// Errors: DataLoss for any inconsistency (truncation, trailing bytes, a count or class size
/// that does not add up, a class layout that the old elements contradict — a receiver whose
/// old weights differ from the producer's), InvalidArgument for an unsupported dtype or a
/// layout version this decoder does not know.
/// Complexity: O(span + changes); one pass over the old elements.
Result<ContextDecoded> DecodeContextCoded(DType dtype, std::span<const std::byte> old_span,
                                          std::span<const uint8_t> bytes, uint64_t expected_count);

/// Check the layout's fixed preamble (layout version, dtype, class count, reserved byte, span
/// length, count) against the item that carries it, without the old span: what a payload decoder
/// can check before the receiver decodes the item against its old elements.
/// Errors: as DecodeContextCoded for those fields. Complexity: O(1).
Status CheckContextCodedPreamble(DType dtype, uint64_t span_length, std::span<const uint8_t> bytes,
                                 uint64_t expected_count);

/// Return the Highway target the decoder's and encoder's O(N) pass runs on, e.g. "AVX3".
std::string_view ContextCodingSimdTarget();

}  // namespace refit::internal
