// Value operations: what travels for each changed element, and how a receiver applies it.
//
// All element values are handled as bit patterns of their width (1, 2, 4 or 8 bytes),
// little-endian, zero-extended to uint64_t where a scalar is needed. Floating-point arithmetic
// happens only in AddExact, with the rounding fixed by the format spec.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "refit/dtype.h"
#include "refit/item.h"
#include "refit/status.h"

namespace refit {

/// Read element `index` of `bytes` (element width `width`) as zero-extended bits.
uint64_t LoadBits(std::span<const std::byte> bytes, uint32_t width, uint64_t index);
/// Write the low `width` bytes of `bits` to element `index` of `bytes`.
void StoreBits(std::span<std::byte> bytes, uint32_t width, uint64_t index, uint64_t bits);

/// Return whether ADD is defined for a tensor of `dtype` with deltas of `delta_dtype`: both must
/// be float16, bfloat16, float32 or float64.
bool AddSupported(DType dtype, DType delta_dtype);

/// Return the receiver's ADD result: the bits of `old + delta`, both widened exactly to float64,
/// summed in float64 with round-to-nearest-even, then rounded to `dtype` with
/// round-to-nearest-even (the fixed rounding of payload format v1). Precondition: AddSupported.
uint64_t AddExact(DType dtype, DType delta_dtype, uint64_t old_bits, uint64_t delta_bits);

/// Return the bits of the delta the producer sends for `old → new` under ADD: (new − old) computed
/// in float64 and rounded to `delta_dtype` (round-to-nearest-even).
uint64_t AddDelta(DType dtype, DType delta_dtype, uint64_t old_bits, uint64_t new_bits);

/// The values of one op over a set of locations, produced by the tracker.
struct OpValues {
  /// Locations whose values are in `values` under the requested op.
  std::vector<uint64_t> locations;
  std::vector<std::byte> values;
  /// ADD only: locations where AddExact would not reproduce `new`, with their new bits; they
  /// travel as an OVERWRITE item of the same tensor in the same payload.
  std::vector<uint64_t> demoted_locations;
  std::vector<std::byte> demoted_values;
};

/// Compute wire values for `op` (kXor, kOverwrite or kAdd) at `locations` from the old and new
/// bytes of a whole tensor of `dtype`. For kAdd, `value_dtype` is the delta dtype; for other ops
/// it must equal `dtype`. Locations are moved into the result.
/// Errors: InvalidArgument for kFull, an unsupported ADD pairing, or mismatched sizes.
Result<OpValues> MakeOpValues(Op op, DType dtype, DType value_dtype,
                              std::span<const std::byte> old_bytes,
                              std::span<const std::byte> new_bytes,
                              std::vector<uint64_t> locations);

/// Apply `values` (count = locations.size(), width DTypeSize(value_dtype)) to `tensor` at
/// `locations` under `op`. If `undo` is non-null, append the old bits of each touched element
/// to it (same width as the tensor's dtype). Returns nothing: inputs were validated before.
/// Preconditions: locations < numel; sizes consistent; ADD pairing supported.
void ApplyOpValues(Op op, DType dtype, DType value_dtype, std::span<std::byte> tensor,
                   std::span<const uint64_t> locations, std::span<const std::byte> values,
                   std::vector<std::byte>* undo);

/// Rearrange `count` little-endian values of `width` bytes into `width` planes: all byte 0s, then
/// all byte 1s, … Appends count × width bytes to `out`.
void SplitBytePlanes(std::span<const std::byte> values, uint32_t width,
                     std::vector<std::byte>* out);
/// Inverse of SplitBytePlanes. `planes.size()` must be a multiple of `width`; writes to `out`
/// which must have the same size.
void JoinBytePlanes(std::span<const std::byte> planes, uint32_t width, std::span<std::byte> out);

}  // namespace refit
