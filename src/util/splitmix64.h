// SplitMix64 (Steele, Lea, Flood: "Fast splittable pseudorandom number generators", OOPSLA 2014):
// the counter-based generator behind every seeded, reproducible stream in refit (the simulator's
// weights and gradients, injected faults, golden and benchmark inputs). Its output is fixed here
// rather than taken from a standard library generator, whose sequence may differ by vendor.
#pragma once

#include <cstdint>

namespace refit::internal {

/// The generator's increment, 2^64 / φ (the golden ratio), odd: consecutive counters map to
/// well-separated inputs of the finalizer.
inline constexpr uint64_t kSplitMix64Gamma = 0x9e3779b97f4a7c15ULL;

/// Return splitmix64's output function of `z` (Stafford's "Mix13"): a bijection of 64-bit words
/// with full avalanche, so that hashing a counter gives independent-looking uniform bits.
constexpr uint64_t SplitMix64Finalize(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/// Return the output of a generator whose state is `x` before the step: the stateless form, for
/// drawing element `i` of a stream as SplitMix64Hash(key + i) without drawing the others.
constexpr uint64_t SplitMix64Hash(uint64_t x) { return SplitMix64Finalize(x + kSplitMix64Gamma); }

/// The sequential generator: period 2^64, 8 bytes of state.
///
/// Thread-safety: none; a value type, one per stream.
class SplitMix64 {
 public:
  explicit constexpr SplitMix64(uint64_t seed) : state_(seed) {}

  /// Return the next 64 uniform bits.
  constexpr uint64_t Next() {
    state_ += kSplitMix64Gamma;
    return SplitMix64Finalize(state_);
  }

 private:
  uint64_t state_;
};

}  // namespace refit::internal
