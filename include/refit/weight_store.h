// WeightStore: the receiver's copy of the model — named tensors it applies payloads to, each with
// its state digest kept current in O(changes).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "refit/lineage.h"
#include "refit/safetensors.h"
#include "refit/status.h"
#include "refit/tensor.h"
#include "refit/tensor_memory.h"
#include "refit/transfer.h"

namespace refit {

/// How WeightStore::Open holds a safetensors file.
enum class StoreMode : uint8_t {
  /// Copy every tensor into process memory.
  kMemory,
  /// mmap the file copy-on-write: untouched pages stay shared with the page cache; the file on
  /// disk is never modified.
  kMmap,
  /// Copy every tensor behind the device boundary, into its test backend (OpaqueTensorMemory):
  /// the applier reaches them only through TensorMemory, as it would GPU memory. For tests of
  /// whole daemons on the device path (`refit serve --device-memory-test`).
  kDeviceTest,
};

class Loader;
struct CanonicalLayout;

// CanonicalHolding (what a receiver holds of one canonical tensor) is in refit/transfer.h.

/// The receiver's tensors.
///
/// Thread-safety: the set of tensors is fixed after loading (attach the loader before the store
/// is shared). Mutating element bytes or digests (ApplyPayload, UndoLog::Rollback, the Set/Adjust
/// methods) must be serialised by the caller (the receiver's apply queue) and must not overlap
/// any other call; const accessors, Holdings and ResolveCanonical included, may run concurrently
/// with each other (the lazily built piece state is guarded by a mutex).
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

  /// Register a tensor in memory the store cannot address (GPU memory, through a backend): the
  /// applier reaches it only through `memory` (refit/tensor_memory.h), in O(changes) per delta.
  /// Its digest is computed once here, by reading it through the boundary in blocks.
  /// Errors: AlreadyExists; InvalidArgument (null memory, or its size is not the shape's);
  /// the backend's read error.
  Status AddDevice(std::string name, DType dtype, Shape shape,
                   std::shared_ptr<TensorMemory> memory);
  /// The device memory of tensor `name`, or null for a host tensor (or no such tensor).
  TensorMemory* DeviceMemory(std::string_view name) const;
  /// Whether any tensor is in device memory.
  bool has_device_tensors() const { return device_tensors_ > 0; }
  /// What crossed the boundary of every device tensor so far.
  BoundaryTraffic device_traffic() const;
  /// Synchronize every device tensor (TensorMemory::Synchronize): what was applied is visible to
  /// the tensors' readers. Errors: the first backend error, naming the tensor.
  Status SynchronizeDevices();
  /// Copy bytes [offset, offset + out.size()) of tensor `name`, host or device.
  /// Errors: NotFound; InvalidArgument (past the end); the backend's.
  Status ReadBytes(std::string_view name, uint64_t offset, std::span<std::byte> out) const;
  /// Return the tensor named `name`. A device tensor's view has no bytes (empty span): reach it
  /// through DeviceMemory. Errors: NotFound naming it.
  Result<MutableTensorView> Find(std::string_view name);
  Result<TensorView> Find(std::string_view name) const;
  /// The tensors in insertion order (a device tensor's without bytes, as Find).
  std::vector<TensorView> tensors() const;
  size_t size() const;

  /// The current state digest of each tensor.
  std::map<std::string, uint64_t> Digests() const;
  /// The state digest of one tensor. Errors: NotFound.
  Result<uint64_t> Digest(std::string_view name) const;
  /// Move the digest of `name` by `delta` (mod 2^64), or set it. Used by the applier.
  Status AdjustDigest(std::string_view name, uint64_t delta);
  Status SetDigest(std::string_view name, uint64_t digest);
  /// Recompute every digest from the bytes (O(model); device tensors read through their
  /// boundary, and a read that fails aborts); for verification tools and tests.
  std::map<std::string, uint64_t> RecomputeDigests() const;
  /// Set the digest of local tensor `name`, and the partial digest of every resolved piece it
  /// holds, to what its bytes give (O(tensor)). For a rollback that could not restore the bytes
  /// (UndoLog under AnchorUndo::kNone). Errors: NotFound.
  Status RehashTensor(std::string_view name);

  /// Attach the loader that maps canonical tensors onto this store's (local) tensors; it must have
  /// been made for this store. From then on ApplyPayload routes every item through it. Piece
  /// digests are computed lazily, once per canonical tensor, when it is first resolved
  /// (O(piece)). Errors: InvalidArgument (null, or made for another store), FailedPrecondition
  /// (a loader is already attached).
  Status AttachLoader(std::unique_ptr<Loader> loader);
  bool has_loader() const { return loader_ != nullptr; }
  /// The attached loader, or null.
  const Loader* loader() const { return loader_.get(); }

  /// Return the holding of each named canonical tensor. Without a loader: one piece "" holding
  /// the tensor's digest. Errors: NotFound naming a tensor neither held nor skipped;
  /// InvalidArgument as Loader::Resolve. Complexity: O(names × pieces), plus O(piece) the first
  /// time a canonical tensor is resolved.
  Result<std::map<std::string, CanonicalHolding>> Holdings(
      std::span<const std::string> canonical_names) const;
  /// As Holdings, but every piece digest recomputed from the bytes (O(pieces)); for verification
  /// tools and tests.
  Result<std::map<std::string, CanonicalHolding>> RecomputeHoldings(
      std::span<const std::string> canonical_names) const;

  /// Resolve `canonical_name` through the loader and make sure its piece digests exist. Used by
  /// the applier. Errors: FailedPrecondition without a loader; as Loader::Resolve.
  Result<const CanonicalLayout*> ResolveCanonical(std::string_view canonical_name) const;
  /// The partial digest of piece `piece` of a resolved canonical tensor, moved by `delta` (mod
  /// 2^64) or set. Used by the applier. Errors: NotFound (not resolved, or no such piece).
  Result<uint64_t> PieceDigest(std::string_view canonical_name, size_t piece) const;
  Status AdjustPieceDigest(std::string_view canonical_name, size_t piece, uint64_t delta);
  Status SetPieceDigest(std::string_view canonical_name, size_t piece, uint64_t digest);

  /// The weight version the store holds (0 until set).
  uint64_t version() const { return version_; }
  void set_version(uint64_t version) { version_ = version; }
  /// The lineage of the version held (docs/protocol.md "Lineage and fencing"): none until set,
  /// from the model file's metadata or by a committed transfer.
  const HeldLineage& lineage() const { return lineage_; }
  void set_lineage(HeldLineage lineage) { lineage_ = std::move(lineage); }

  /// Write all tensors to a safetensors file (device tensors read through their boundary, one at
  /// a time). Errors: as WriteSafetensors; a backend's read error.
  Status Save(const std::string& path) const;

 private:
  struct Entry;
  /// The partial digests of one resolved canonical tensor, one per piece of its layout.
  struct Pieces {
    const CanonicalLayout* layout = nullptr;
    std::vector<uint64_t> digests;
  };
  WeightStore();
  Entry* FindEntry(std::string_view name) const;
  /// A view of `entry`'s bytes: its own for a host tensor; for a device tensor, a copy read into
  /// `scratch` (O(tensor), transient). Errors: the backend's read error.
  static Result<TensorView> HostView(const Entry& entry, std::vector<std::byte>& scratch);
  /// Return the piece state of `canonical_name`, resolving and hashing it on first use.
  /// Precondition: pieces_mutex_ held and a loader attached.
  Result<Pieces*> PiecesLocked(std::string_view canonical_name) const;
  Result<uint64_t*> PieceDigestSlot(std::string_view canonical_name, size_t piece) const;
  Result<std::map<std::string, CanonicalHolding>> CollectHoldings(
      std::span<const std::string> canonical_names, bool recompute) const;
  std::vector<std::unique_ptr<Entry>> entries_;
  std::map<std::string, Entry*, std::less<>> by_name_;
  /// The copy-on-write mapping behind StoreMode::kMmap tensors (type-erased: internal).
  std::shared_ptr<void> mapping_;
  uint64_t version_ = 0;
  HeldLineage lineage_;
  size_t device_tensors_ = 0;
  std::unique_ptr<Loader> loader_;
  mutable std::mutex pieces_mutex_;
  /// Canonical name → piece digests, filled lazily; entries are never removed.
  mutable std::map<std::string, Pieces, std::less<>> pieces_;
};

}  // namespace refit
