// A small bf16 model that an optimizer moves step by step, for the fleet tests that sync it from
// Publishers to receivers embedded in the test (elastic_fleet_test, quorum_fleet_test,
// lineage_test).
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "refit/dtype.h"
#include "refit/tensor.h"

namespace refit::bf16_model {

struct Tensor {
  std::string name;
  std::vector<uint16_t> bits;

  uint64_t elements() const { return bits.size(); }
  // Its bits as a receiver registers them: the memory the receiver writes.
  MutableTensorView mutable_view() {
    return MutableTensorView{name,
                             DType::kBFloat16,
                             {static_cast<int64_t>(bits.size())},
                             std::as_writable_bytes(std::span<uint16_t>(bits))};
  }
  TensorView view() const {
    return TensorView{name,
                      DType::kBFloat16,
                      {static_cast<int64_t>(bits.size())},
                      std::as_bytes(std::span<const uint16_t>(bits))};
  }
};

// `tensors` bf16 tensors of 4096 elements ("model.layers.N.weight"), weights around ±0.02.
inline std::vector<Tensor> MakeModel(uint64_t seed, int tensors = 8) {
  std::mt19937_64 rng(seed);
  std::vector<Tensor> model;
  for (int t = 0; t < tensors; ++t) {
    Tensor tensor{"model.layers." + std::to_string(t) + ".weight", std::vector<uint16_t>(4096)};
    for (uint16_t& b : tensor.bits) {
      b = static_cast<uint16_t>(((rng() & 1) << 15) | (0x3c80 + rng() % 0x100));
    }
    model.push_back(std::move(tensor));
  }
  return model;
}

// One optimizer step as bf16 sees it: about 2 % of elements move by an ulp or two.
inline void Step(std::vector<Tensor>& model, std::mt19937_64& rng) {
  std::bernoulli_distribution changes(0.02);
  for (Tensor& t : model) {
    for (uint16_t& b : t.bits) {
      if (changes(rng)) b = static_cast<uint16_t>(b ^ (1 + rng() % 3));
    }
  }
}

inline std::vector<TensorView> Views(const std::vector<Tensor>& model) {
  std::vector<TensorView> views;
  for (const Tensor& t : model) views.push_back(t.view());
  return views;
}

}  // namespace refit::bf16_model
