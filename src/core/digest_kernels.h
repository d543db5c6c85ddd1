// The state digest's sum over a run of contiguous elements, vectorized and chosen at run time
// (AVX-512DQ, AVX2 or scalar). digest.h's DigestRange and RemappedDigestRange call it; every
// target returns the scalar sum bit for bit. Internal.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace refit::internal {

/// Return Σ ElementHash(first_index + k, element k of `data`) over k < count (mod 2^64), with
/// elements of `width` bytes (1, 2, 4 or 8), little-endian, zero-extended, unaligned.
/// Complexity: O(count).
uint64_t DigestRun(const std::byte* data, uint32_t width, uint64_t first_index, uint64_t count);

/// The kernel DigestRun dispatches to: "avx512", "avx2" or "scalar" — the best this CPU runs,
/// or a lesser one named by the environment variable REFIT_DIGEST_TARGET (read once, at start;
/// for benchmarks that compare kernels in one binary).
std::string_view DigestTargetName();

/// Which kernels this CPU can run, and DigestRun through one of them (for the tests, which check
/// every one against the scalar sum). `target` is a name DigestTargetName returns.
bool DigestTargetSupported(std::string_view target);
uint64_t DigestRunOn(std::string_view target, const std::byte* data, uint32_t width,
                     uint64_t first_index, uint64_t count);

}  // namespace refit::internal
