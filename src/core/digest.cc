#include "core/digest.h"

#include <xxhash.h>

#include "core/digest_kernels.h"

namespace refit {
uint64_t DigestRange(std::span<const std::byte> bytes, uint32_t width, uint64_t begin,
                     uint64_t end) {
  return internal::DigestRun(bytes.data() + begin * width, width, begin, end - begin);
}

uint64_t RemappedDigestRange(std::span<const std::byte> local_bytes, uint32_t width,
                             uint64_t local_begin, uint64_t canonical_begin, uint64_t count) {
  return internal::DigestRun(local_bytes.data() + local_begin * width, width, canonical_begin,
                             count);
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
