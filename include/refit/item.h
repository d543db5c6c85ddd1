// Items: the unit of change inside a payload — one tensor, or one element range of it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "refit/dtype.h"
#include "refit/tensor.h"

namespace refit {

/// How the receiver combines a wire value `v` with its current element `dst`. The numeric values
/// are wire codes of payload format v1 and must never change.
enum class Op : uint8_t {
  /// `dst ^= v`; v = new ^ old. Exact for every dtype. The default.
  kXor = 1,
  /// `dst = v`; v = new. Exact and idempotent.
  kOverwrite = 2,
  /// `dst = AddExact(dst, v)` with v = new − old in the item's value dtype. Only emitted where the
  /// producer proved the sum reproduces `new` bit-exactly; see values.h.
  kAdd = 3,
  /// `dst = v` for every element of the span (an anchor). Locations are `kAll`.
  kFull = 4,
};

/// Return "xor", "overwrite", "add" or "full".
std::string_view OpName(Op op);
/// Parse an op name (as OpName spells it). Errors: InvalidArgument listing the accepted names.
Result<Op> ParseOp(std::string_view text);

/// How the changed locations of an item are stored. Wire codes of payload format v1 (1–6) and v2
/// (7).
enum class LocationEncoding : uint8_t {
  /// Every element of the span; no location bytes.
  kAll = 1,
  /// Maximal runs as LEB128 varint pairs (gap, length); see docs/format/payload.md.
  kRange = 2,
  /// Gaps between consecutive locations as little-endian u16 / u32 / u64.
  kGap16 = 3,
  kGap32 = 4,
  kGap64 = 5,
  /// One bit per element of the span, LSB first.
  kBitmask = 6,
  /// Payload format v2: an XOR item's locations *and* values coded given the old elements of its
  /// span (docs/format/context-coding.md); the item carries no values. Only a receiver holding
  /// the old span can decode it (ExpandContextItems, refit/payload.h), so no
  /// LocationDecoder reads it.
  kContext = 7,
};

/// Return "all", "range", "gap16", "gap32", "gap64", "bitmask" or "context".
std::string_view LocationEncodingName(LocationEncoding encoding);
/// Parse a location encoding name. Errors: InvalidArgument listing the accepted names.
Result<LocationEncoding> ParseLocationEncoding(std::string_view text);

/// A point in an item's location stream that decoding can go on from: the decoder's whole state
/// after `emitted` locations (LocationDecoder::mark). A full decode of the item records one every
/// kLocationMarkInterval locations (DecodedPayload::location_marks), so that the item's apply can
/// decode and apply its slices on several threads.
struct LocationMark {
  uint64_t emitted = 0;
  uint64_t byte_pos = 0;
  uint64_t cursor = 0;
  uint64_t run_left = 0;
};

/// Locations between two marks of an item: a slice of its apply on one thread. A multiple of the
/// decoders' batch (4096), so that a full decode stands at every mark between batches.
inline constexpr uint64_t kLocationMarkInterval = 32768;

/// A read-only view of one item: what changed in elements [span_begin, span_end) of one tensor.
/// Borrowed: the bytes belong to an `Item` or a `DecodedPayload` and must outlive the view.
struct ItemView {
  std::string_view name;
  /// The tensor's dtype and full canonical shape.
  DType dtype = DType::kUInt8;
  Shape shape;
  Op op = Op::kXor;
  /// The dtype of the wire values: equal to `dtype` except for kAdd (the delta dtype).
  DType value_dtype = DType::kUInt8;
  /// The element range of the tensor this item covers; locations lie inside it.
  uint64_t span_begin = 0;
  uint64_t span_end = 0;
  /// Number of locations (= span length for kAll).
  uint64_t count = 0;
  LocationEncoding location_encoding = LocationEncoding::kAll;
  std::span<const uint8_t> locations;
  /// `count` values of DTypeSize(value_dtype) bytes each, little-endian, contiguous.
  std::span<const std::byte> values;
  /// For kFull: the absolute state digest of the span after the update. Otherwise the change of
  /// the tensor's state digest, Σ h(i, new) − h(i, old) over the locations (mod 2^64).
  uint64_t digest = 0;
};

/// An owning item, as produced by the tracker.
struct Item {
  std::string name;
  DType dtype = DType::kUInt8;
  Shape shape;
  Op op = Op::kXor;
  DType value_dtype = DType::kUInt8;
  uint64_t span_begin = 0;
  uint64_t span_end = 0;
  uint64_t count = 0;
  LocationEncoding location_encoding = LocationEncoding::kAll;
  std::vector<uint8_t> locations;
  std::vector<std::byte> values;
  uint64_t digest = 0;

  ItemView view() const {
    return ItemView{
        name,      dtype,  shape, op, value_dtype, span_begin, span_end, count, location_encoding,
        locations, values, digest};
  }
};

}  // namespace refit
