#include "core/digest.h"

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

template <typename Word>
uint64_t RemappedWords(const std::byte* data, uint64_t local_begin, uint64_t canonical_begin,
                       uint64_t count) {
  uint64_t sum = 0;
  for (uint64_t k = 0; k < count; ++k) {
    Word word;
    std::memcpy(&word, data + (local_begin + k) * sizeof(Word), sizeof(Word));
    sum += ElementHash(canonical_begin + k, static_cast<uint64_t>(word));
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

uint64_t RemappedDigestRange(std::span<const std::byte> local_bytes, uint32_t width,
                             uint64_t local_begin, uint64_t canonical_begin, uint64_t count) {
  switch (width) {
    case 1:
      return RemappedWords<uint8_t>(local_bytes.data(), local_begin, canonical_begin, count);
    case 2:
      return RemappedWords<uint16_t>(local_bytes.data(), local_begin, canonical_begin, count);
    case 4:
      return RemappedWords<uint32_t>(local_bytes.data(), local_begin, canonical_begin, count);
    default:
      return RemappedWords<uint64_t>(local_bytes.data(), local_begin, canonical_begin, count);
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
