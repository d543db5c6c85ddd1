// Deterministic test tensors: random bits, and perturbations of a chosen density.
#pragma once

#include <cstring>
#include <random>
#include <string>

#include "refit/tensor.h"

namespace refit::testing {

/// Return a tensor of `numel` elements with random bits (every pattern, incl. NaN, ±0, FP8).
inline OwnedTensor RandomTensor(const std::string& name, DType dtype, Shape shape, uint64_t seed) {
  OwnedTensor t{name, dtype, shape, {}};
  uint64_t numel = 1;
  for (int64_t d : shape) numel *= static_cast<uint64_t>(d);
  t.bytes.resize(numel * DTypeSize(dtype));
  std::mt19937_64 rng(seed);
  for (auto& b : t.bytes) b = static_cast<std::byte>(rng());
  return t;
}

/// Return a copy of `base` where each element changed with probability `density`: its lowest
/// byte is XORed with a random nonzero value (a 1-ulp-like change for floats).
inline OwnedTensor Perturb(const OwnedTensor& base, double density, uint64_t seed) {
  OwnedTensor t = base;
  const uint32_t width = DTypeSize(base.dtype);
  std::mt19937_64 rng(seed);
  std::bernoulli_distribution pick(density);
  for (uint64_t i = 0; i < t.bytes.size() / width; ++i) {
    if (pick(rng)) {
      t.bytes[i * width] ^= static_cast<std::byte>(1 + rng() % 255);
    }
  }
  return t;
}

}  // namespace refit::testing
