// libFuzzer target for DecodeContextCoded (src/codec/context_coding.h): hostile context-coded
// bytes, decoded against hostile old elements, must never crash, hang or read out of bounds;
// what decodes must be a valid change set (sorted locations inside the span, nonzero XOR values,
// the declared count); a round trip of changes derived from the input must reproduce them
// exactly and encode deterministically.
//
// Input layout:
//   byte 0       dtype selector (the seven float dtypes context coding supports, and int16)
//   byte 1       mode: 0 decode the tail as bytes; 1 round trip; 2 round trip, then flip the
//                bits of one byte of the encoding (at bytes 4-5 mod its length, by byte 6) and
//                decode that
//   bytes 2-3    span length in elements (u16)
//   bytes 4-5    mode 0: the count the item declares; mode 2: the position of the flip
//   byte 6       mode 1, 2: at most this many classes (mod 16, + 1); mode 2: the flip mask
//   then         span × width bytes of old elements, then the tail: mode 0 the encoded bytes;
//                modes 1, 2 the changes, byte pairs (gap to the next location, signed step of
//                the bit pattern; 0 skips)
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "codec/context_coding.h"

namespace {

constexpr size_t kHeaderBytes = 7;
constexpr refit::DType kDTypes[] = {refit::DType::kBFloat16,       refit::DType::kFloat16,
                                    refit::DType::kFloat32,        refit::DType::kFloat8E4M3FN,
                                    refit::DType::kFloat8E5M2,     refit::DType::kFloat8E4M3FNUZ,
                                    refit::DType::kFloat8E5M2FNUZ, refit::DType::kInt16};

void Check(bool condition) {
  if (!condition) std::abort();
}

uint64_t Load(const std::byte* base, uint32_t width, uint64_t index) {
  uint64_t bits = 0;
  std::memcpy(&bits, base + index * width, width);
  return bits;
}

void CheckValid(const refit::internal::ContextDecoded& decoded, uint32_t width, uint64_t span,
                uint64_t count) {
  Check(decoded.locations.size() == count);
  Check(decoded.xor_values.size() == count * width);
  for (size_t i = 0; i < decoded.locations.size(); ++i) {
    Check(decoded.locations[i] < span);
    if (i > 0) Check(decoded.locations[i - 1] < decoded.locations[i]);
    Check(Load(decoded.xor_values.data(), width, i) != 0);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < kHeaderBytes) return 0;
  const refit::DType dtype = kDTypes[data[0] % std::size(kDTypes)];
  const uint32_t mode = data[1] % 3;
  const uint64_t span = data[2] | (uint64_t{data[3]} << 8);
  const uint64_t field = data[4] | (uint64_t{data[5]} << 8);
  const uint32_t width = refit::DTypeSize(dtype);
  if (size - kHeaderBytes < span * width) return 0;
  std::vector<std::byte> old_bytes(span * width);
  if (!old_bytes.empty()) std::memcpy(old_bytes.data(), data + kHeaderBytes, old_bytes.size());
  const std::span<const uint8_t> tail(data + kHeaderBytes + old_bytes.size(),
                                      size - kHeaderBytes - old_bytes.size());
  const bool supported = refit::internal::ContextCodingSupported(dtype);

  if (mode == 0) {
    auto decoded = refit::internal::DecodeContextCoded(dtype, old_bytes, tail, field);
    if (decoded.ok()) CheckValid(*decoded, width, span, field);
    return 0;
  }
  // Changes derived from the tail.
  std::vector<uint64_t> locations;
  std::vector<std::byte> xor_values;
  const uint64_t mask = width == 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * width)) - 1;
  uint64_t next = 0;
  for (size_t i = 0; i + 1 < tail.size() && next < span; i += 2) {
    const uint64_t location = next + tail[i];
    if (location >= span) break;
    next = location + 1;
    const auto step = static_cast<int8_t>(tail[i + 1]);
    if (step == 0) continue;
    const uint64_t old_bits = Load(old_bytes.data(), width, location);
    const uint64_t new_bits = (old_bits + static_cast<uint64_t>(int64_t{step})) & mask;
    if (new_bits == old_bits) continue;
    const uint64_t x = old_bits ^ new_bits;
    locations.push_back(location);
    xor_values.resize(xor_values.size() + width);
    std::memcpy(xor_values.data() + xor_values.size() - width, &x, width);
  }
  const refit::internal::ContextCodingOptions options{.max_classes = 1u + data[6] % 16u};
  auto encoded =
      refit::internal::EncodeContextCoded(dtype, old_bytes, locations, xor_values, options);
  Check(encoded.ok() == supported);
  if (!encoded.ok()) return 0;
  auto again =
      refit::internal::EncodeContextCoded(dtype, old_bytes, locations, xor_values, options);
  Check(again.ok() && *again == *encoded);
  if (mode == 1) {
    auto decoded =
        refit::internal::DecodeContextCoded(dtype, old_bytes, *encoded, locations.size());
    Check(decoded.ok());
    Check(decoded->locations == locations);
    Check(decoded->xor_values == xor_values);
    return 0;
  }
  std::vector<uint8_t> flipped = *encoded;
  flipped[field % flipped.size()] ^= data[6] | 1;
  auto decoded = refit::internal::DecodeContextCoded(dtype, old_bytes, flipped, locations.size());
  if (decoded.ok()) CheckValid(*decoded, width, span, locations.size());
  return 0;
}
