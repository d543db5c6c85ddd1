// The state digest's sums, vectorized and chosen at run time (AVX-512DQ, AVX2 or scalar): over a
// run of contiguous elements (digest.h's DigestRange and RemappedDigestRange), and the change of
// scattered elements (digest.h's DigestChange: a delta's encode and apply). Every target returns
// the scalar sum bit for bit. Internal.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace refit::internal {

/// Return Σ ElementHash(first_index + k, element k of `data`) over k < count (mod 2^64), with
/// elements of `width` bytes (1, 2, 4 or 8), little-endian, zero-extended, unaligned.
/// Complexity: O(count).
uint64_t DigestRun(const std::byte* data, uint32_t width, uint64_t first_index, uint64_t count);

/// Return Σ ElementHash(index[k], now[k]) − ElementHash(index[k], before[k]) over k < count
/// (mod 2^64): the digest change of `count` elements whose bits (zero-extended) moved from
/// before[k] to now[k]. Each index is mixed once for both hashes. Complexity: O(count).
uint64_t DigestChangeRun(const uint64_t* index, const uint64_t* now, const uint64_t* before,
                         uint64_t count);

/// The kernel DigestRun dispatches to: "avx512", "avx2" or "scalar" — the best this CPU runs,
/// or a lesser one named by the environment variable REFIT_DIGEST_TARGET (read once, at start;
/// for benchmarks that compare kernels in one binary).
std::string_view DigestTargetName();

/// Which kernels this CPU can run, and DigestRun through one of them (for the tests, which check
/// every one against the scalar sum). `target` is a name DigestTargetName returns.
bool DigestTargetSupported(std::string_view target);
uint64_t DigestRunOn(std::string_view target, const std::byte* data, uint32_t width,
                     uint64_t first_index, uint64_t count);
uint64_t DigestChangeRunOn(std::string_view target, const uint64_t* index, const uint64_t* now,
                           const uint64_t* before, uint64_t count);

}  // namespace refit::internal
