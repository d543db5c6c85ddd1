#include "refit/digest.h"

#include <cstring>

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

}  // namespace refit
