// WeightStore: the receiver's copy of the model — named tensors it applies payloads to, each with
// its state digest kept current in O(changes).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "refit/safetensors.h"
#include "refit/status.h"
#include "refit/tensor.h"

namespace refit {

/// How WeightStore::Open holds a safetensors file.
enum class StoreMode : uint8_t {
  /// Copy every tensor into process memory.
  kMemory,
  /// mmap the file copy-on-write: untouched pages stay shared with the page cache; the file on
  /// disk is never modified.
  kMmap,
};

/// The receiver's tensors.
///
/// Thread-safety: the set of tensors is fixed after loading. Mutating element bytes (through
/// ApplyPayload) must be serialised by the caller (the receiver's apply queue); const accessors
/// may run concurrently with each other.
class WeightStore {
 public:
  ~WeightStore();
  WeightStore(const WeightStore&) = delete;
  WeightStore& operator=(const WeightStore&) = delete;

  /// Return an empty store.
  static std::unique_ptr<WeightStore> Make();
  /// Load every tensor of a safetensors file and compute its digests (O(model), once).
  /// Errors: as SafetensorsFile::Open.
  static Result<std::unique_ptr<WeightStore>> Open(const std::string& path,
                                                   StoreMode mode = StoreMode::kMemory);

  /// Add a tensor the store owns (a copy of `tensor`). Errors: AlreadyExists, InvalidArgument
  /// (size mismatch).
  Status AddCopy(const TensorView& tensor);
  /// Register caller-owned memory (e.g. an inference engine's weight buffer); it must outlive
  /// the store. Errors: as AddCopy.
  Status AddExternal(const MutableTensorView& tensor);

  /// Return the tensor named `name`. Errors: NotFound naming it.
  Result<MutableTensorView> Find(std::string_view name);
  Result<TensorView> Find(std::string_view name) const;
  /// The tensors in insertion order.
  std::vector<TensorView> tensors() const;
  size_t size() const;

  /// The current state digest of each tensor.
  std::map<std::string, uint64_t> Digests() const;
  /// The state digest of one tensor. Errors: NotFound.
  Result<uint64_t> Digest(std::string_view name) const;
  /// Move the digest of `name` by `delta` (mod 2^64), or set it. Used by the applier.
  Status AdjustDigest(std::string_view name, uint64_t delta);
  Status SetDigest(std::string_view name, uint64_t digest);
  /// Recompute every digest from the bytes (O(model)); for verification tools and tests.
  std::map<std::string, uint64_t> RecomputeDigests() const;

  /// The weight version the store holds (0 until set).
  uint64_t version() const { return version_; }
  void set_version(uint64_t version) { version_ = version; }

  /// Write all tensors to a safetensors file. Errors: as WriteSafetensors.
  Status Save(const std::string& path) const;

 private:
  struct Entry;
  WeightStore();
  Entry* FindEntry(std::string_view name) const;
  std::vector<std::unique_ptr<Entry>> entries_;
  std::map<std::string, Entry*, std::less<>> by_name_;
  /// The copy-on-write mapping behind StoreMode::kMmap tensors (type-erased: internal).
  std::shared_ptr<void> mapping_;
  uint64_t version_ = 0;
};

}  // namespace refit
