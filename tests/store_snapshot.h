// A comparable snapshot of a WeightStore: every tensor's bytes, its digests and its version, so a
// test can assert that a refused or rolled-back operation left the store exactly as it was.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "refit/weight_store.h"

namespace refit::testing {

struct StoreSnapshot {
  std::map<std::string, std::vector<std::byte>> bytes;
  std::map<std::string, uint64_t> digests;
  uint64_t version = 0;
  friend bool operator==(const StoreSnapshot&, const StoreSnapshot&) = default;
};

inline StoreSnapshot TakeSnapshot(const WeightStore& store) {
  StoreSnapshot snapshot;
  for (const TensorView& t : store.tensors()) {
    snapshot.bytes[t.name].assign(t.bytes.begin(), t.bytes.end());
  }
  snapshot.digests = store.Digests();
  snapshot.version = store.version();
  return snapshot;
}

}  // namespace refit::testing
