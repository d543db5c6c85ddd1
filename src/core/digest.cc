#include "refit/digest.h"

#include <cstring>

#include <xxhash.h>

namespace refit {
namespace {

template <typename Word>
uint64_t DigestWords(const std::byte* data, uint64_t begin, uint64_t end) {
  uint64_t sum = 0;
  for (uint64_t i = begin; i < end; ++i) {
    Word word;
    std::memcpy(&word, data + i * sizeof(Word), sizeof(Word));
    sum += ElementHash(i, static_cast<uint64_t>(word));
  }
  return sum;
}

}  // namespace

uint64_t DigestRange(std::span<const std::byte> bytes, uint32_t width, uint64_t begin,
                     uint64_t end) {
  switch (width) {
    case 1:
      return DigestWords<uint8_t>(bytes.data(), begin, end);
    case 2:
      return DigestWords<uint16_t>(bytes.data(), begin, end);
    case 4:
      return DigestWords<uint32_t>(bytes.data(), begin, end);
    default:
      return DigestWords<uint64_t>(bytes.data(), begin, end);
  }
}

uint64_t StateFingerprint(const std::map<std::string, uint64_t>& digests) {
  // One buffer of every name and digest costs about as much as the names themselves (a few MB
  // for the largest models), far less than the store. The NUL after each name keeps ("ab", "c…")
  // and ("a", "bc…") apart; digests are written little-endian so the value is portable.
  std::string record;
  for (const auto& [name, digest] : digests) {
    record.append(name);
    record.push_back('\0');
    for (size_t i = 0; i < sizeof(uint64_t); ++i) {
      record.push_back(static_cast<char>(static_cast<uint8_t>(digest >> (8 * i))));
    }
  }
  return XXH3_64bits(record.data(), record.size());
}

}  // namespace refit
