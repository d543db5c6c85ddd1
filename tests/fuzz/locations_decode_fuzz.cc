// libFuzzer target for LocationDecoder: hostile location bytes must never crash, hang or read out
// of bounds, and whatever decodes successfully must be valid and canonical — re-encoding it with
// the same encoding reproduces the input bytes exactly.
//
// Input layout (little-endian):
//   byte 0       encoding wire code (any value, so unknown codes are exercised too)
//   byte 1       decode batch size - 1 (1..256 locations per Next() call)
//   bytes 2-3    count (u16: bounds the work a run list or kAll can ask for)
//   bytes 4-11   span begin (u64)
//   bytes 12-19  span length (u64; span end = begin + length, wrapping, so begin > end occurs)
//   bytes 20-    the location bytes
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <utility>
#include <vector>

#include "codec/locations.h"

namespace {

constexpr size_t kHeaderBytes = 20;

template <typename T>
T Load(const uint8_t* data) {
  T value = 0;
  for (size_t i = 0; i < sizeof(T); ++i)
    value |= static_cast<T>(static_cast<T>(data[i]) << (8 * i));
  return value;
}

void Check(bool condition) {
  if (!condition) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < kHeaderBytes) return 0;
  const auto encoding = static_cast<refit::LocationEncoding>(data[0]);
  const size_t batch = size_t{data[1]} + 1;
  const uint64_t count = Load<uint16_t>(data + 2);
  const uint64_t span_begin = Load<uint64_t>(data + 4);
  const uint64_t span_end = span_begin + Load<uint64_t>(data + 12);
  const std::span<const uint8_t> bytes(data + kHeaderBytes, size - kHeaderBytes);

  refit::Result<refit::LocationDecoder> made =
      refit::LocationDecoder::Make(encoding, bytes, count, span_begin, span_end);
  if (!made.ok()) {
    Check(made.status().code() == refit::StatusCode::kDataLoss);
    return 0;
  }
  refit::LocationDecoder decoder = std::move(made).ValueOrDie();
  std::vector<uint64_t> locations;
  std::vector<uint64_t> buffer(batch);
  while (true) {
    refit::Result<size_t> decoded = decoder.Next(buffer);
    if (!decoded.ok()) {
      Check(decoded.status().code() == refit::StatusCode::kDataLoss);
      // A failed decoder keeps failing: a retry must not skip past the defect.
      Check(!decoder.ValidateAll().ok());
      return 0;
    }
    if (*decoded == 0) break;
    Check(*decoded <= batch);
    locations.insert(locations.end(), buffer.begin(),
                     buffer.begin() + static_cast<std::ptrdiff_t>(*decoded));
    Check(locations.size() <= count);
  }
  Check(locations.size() == count);
  for (size_t i = 0; i < locations.size(); ++i) {
    Check(locations[i] >= span_begin && locations[i] < span_end);
    Check(i == 0 || locations[i] > locations[i - 1]);
  }
  std::vector<uint8_t> reencoded;
  Check(refit::EncodeLocations(encoding, locations, span_begin, span_end, &reencoded).ok());
  Check(std::equal(reencoded.begin(), reencoded.end(), bytes.begin(), bytes.end()));
  Check(refit::EstimateLocationBytes(encoding, locations, span_begin, span_end) == bytes.size());
  return 0;
}
