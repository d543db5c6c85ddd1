// The state digest: an order-independent 64-bit fingerprint of a tensor's bits.
//
// digest(T) = Σ_i h(i, bits_i) mod 2^64 over every element i. Because it is a sum, a change of
// element i from a to b moves the digest by h(i, b) − h(i, a): both ends keep it current in
// O(changes) and compare it at flush without rehashing the model.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>

#include "core/digest_kernels.h"
#include "refit/tensor.h"

namespace refit {

namespace digest_internal {
/// The splitmix64 / Murmur3 finalizer: fast (no memory), well-distributed and bijective.
inline uint64_t Mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}
inline constexpr uint64_t kIndexOffset = 0x9e3779b97f4a7c15ULL;
}  // namespace digest_internal

/// Return h(index, bits): a 64-bit mix of the element index and its zero-extended bits.
/// The function is part of payload format v1 (docs/format/payload.md) and never changes.
inline uint64_t ElementHash(uint64_t index, uint64_t bits) {
  // Two rounds of the mixer: over the index, then over the mixed index ^ bits (bijective in
  // each argument).
  using digest_internal::Mix;
  return Mix(Mix(index + digest_internal::kIndexOffset) ^ bits);
}

/// Return h(index, now) − h(index, before): the digest change of one element, mixing the index
/// once for both.
inline uint64_t ElementHashChange(uint64_t index, uint64_t before, uint64_t now) {
  using digest_internal::Mix;
  const uint64_t mixed = Mix(index + digest_internal::kIndexOffset);
  return Mix(mixed ^ now) - Mix(mixed ^ before);
}

/// Return Σ h(index(k), now(k)) − h(index(k), before(k)) over k < count (mod 2^64): the digest
/// change of `count` scattered elements, whose index and bits the callables load. The hashing
/// runs vectorized (internal::DigestChangeRun) over blocks the callables fill.
template <typename Index, typename Now, typename Before>
uint64_t DigestChange(size_t count, Index index, Now now, Before before) {
  constexpr size_t kBlock = 256;
  uint64_t indices[kBlock];
  uint64_t now_bits[kBlock];
  uint64_t before_bits[kBlock];
  uint64_t change = 0;
  for (size_t start = 0; start < count; start += kBlock) {
    const size_t n = count - start < kBlock ? count - start : kBlock;
    for (size_t k = 0; k < n; ++k) {
      indices[k] = index(start + k);
      now_bits[k] = now(start + k);
      before_bits[k] = before(start + k);
    }
    change += internal::DigestChangeRun(indices, now_bits, before_bits, n);
  }
  return change;
}

/// Return the digest of elements [begin, end) of `bytes` (element width `width`).
/// Complexity: O(end − begin).
uint64_t DigestRange(std::span<const std::byte> bytes, uint32_t width, uint64_t begin,
                     uint64_t end);

/// Return Σ h(canonical_begin + k, bits of element local_begin + k of `local_bytes`) over
/// k < count (mod 2^64): the digest of a local run of elements in canonical coordinates (a
/// receiver's shard, a trainer rank's piece). Precondition: (local_begin + count) · width ≤
/// local_bytes.size(). Complexity: O(count).
uint64_t RemappedDigestRange(std::span<const std::byte> local_bytes, uint32_t width,
                             uint64_t local_begin, uint64_t canonical_begin, uint64_t count);

/// Return the digest of a whole tensor.
inline uint64_t TensorDigest(const TensorView& tensor) {
  const uint32_t width = DTypeSize(tensor.dtype);
  return DigestRange(tensor.bytes, width, 0, tensor.bytes.size() / width);
}

/// Return one 64-bit fingerprint of a whole store's state: XXH3-64 over every (name, digest) pair
/// in name order. Two stores with equal fingerprints hold the same tensors with the same digests
/// (up to hash collisions), so replicas, and a chain's recorded versions, compare with one number.
uint64_t StateFingerprint(const std::map<std::string, uint64_t>& digests);

}  // namespace refit
