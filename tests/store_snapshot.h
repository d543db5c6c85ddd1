// A comparable snapshot of a WeightStore: every tensor's bytes, its digests and its version, so a
// test can assert that a refused or rolled-back operation left the store exactly as it was. And
// the switch that runs a store test against device memory: with REFIT_TEST_DEVICE_MEMORY=1 in the
// environment (ctest's `device.` variants), AddTestTensor registers every tensor in the test
// backend (OpaqueTensorMemory), which the core reaches only through the device boundary.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "refit/status_format.h"
#include "refit/tensor_memory.h"
#include "refit/weight_store.h"

namespace refit::testing {

struct StoreSnapshot {
  std::map<std::string, std::vector<std::byte>> bytes;
  std::map<std::string, uint64_t> digests;
  uint64_t version = 0;
  friend bool operator==(const StoreSnapshot&, const StoreSnapshot&) = default;
};

/// Whether store tests register their tensors in device memory (REFIT_TEST_DEVICE_MEMORY=1).
inline bool DeviceMemoryForced() {
  const char* value = std::getenv("REFIT_TEST_DEVICE_MEMORY");
  return value != nullptr && std::string_view(value) == "1";
}

/// Add a copy of `tensor` to `store`: in host memory, or in the test backend when
/// DeviceMemoryForced().
inline Status AddTestTensor(WeightStore& store, const TensorView& tensor) {
  if (!DeviceMemoryForced()) return store.AddCopy(tensor);
  REFIT_RETURN_NOT_OK(CheckTensorSize(tensor));
  return store.AddDevice(tensor.name, tensor.dtype, tensor.shape,
                         OpaqueTensorMemory::Make(tensor.bytes));
}

/// The bytes of tensor `name` (empty if there is none), wherever it lives; reading the test
/// backend this way does not count as boundary traffic.
inline std::vector<std::byte> StoreBytes(const WeightStore& store, std::string_view name) {
  if (TensorMemory* device = store.DeviceMemory(name); device != nullptr) {
    if (auto* opaque = dynamic_cast<OpaqueTensorMemory*>(device); opaque != nullptr) {
      return opaque->Snapshot();
    }
    std::vector<std::byte> bytes(device->size_bytes());
    if (!store.ReadBytes(name, 0, bytes).ok()) return {};
    return bytes;
  }
  Result<TensorView> tensor = store.Find(name);
  if (!tensor.ok()) return {};
  return std::vector<std::byte>(tensor->bytes.begin(), tensor->bytes.end());
}

/// Flip bit 6 of byte `offset` of tensor `name` behind the applier's back (a diverged receiver),
/// wherever the tensor lives.
inline Status FlipByte(WeightStore& store, std::string_view name, uint64_t offset) {
  if (TensorMemory* device = store.DeviceMemory(name); device != nullptr) {
    std::byte value{};
    REFIT_RETURN_NOT_OK(device->Read(offset, std::span<std::byte>(&value, 1)));
    value ^= std::byte{0x40};
    return device->Write(offset, std::span<const std::byte>(&value, 1));
  }
  REFIT_ASSIGN_OR_RETURN(MutableTensorView tensor, store.Find(name));
  if (offset >= tensor.bytes.size()) return InvalidArgument("FlipByte: offset {} is past", offset);
  tensor.bytes[offset] ^= std::byte{0x40};
  return Status::OK();
}

inline StoreSnapshot TakeSnapshot(const WeightStore& store) {
  StoreSnapshot snapshot;
  for (const TensorView& t : store.tensors()) snapshot.bytes[t.name] = StoreBytes(store, t.name);
  snapshot.digests = store.Digests();
  snapshot.version = store.version();
  return snapshot;
}

}  // namespace refit::testing
