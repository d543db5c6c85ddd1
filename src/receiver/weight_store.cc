#include "refit/weight_store.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>

#include "core/digest.h"
#include "core/mapped_file.h"
#include "refit/loader.h"
#include "refit/status_format.h"
#include "util/check.h"

namespace refit {

struct WeightStore::Entry {
  /// A device tensor's view has no bytes (`device` holds them).
  MutableTensorView view;
  uint64_t digest = 0;
  /// Backing for copies; empty for external or mmapped tensors.
  std::unique_ptr<std::byte[]> owned;
  /// The memory of a device tensor (AddDevice); null for a host tensor.
  std::shared_ptr<TensorMemory> device;
};

WeightStore::WeightStore() = default;
WeightStore::~WeightStore() = default;

std::unique_ptr<WeightStore> WeightStore::Make() {
  return std::unique_ptr<WeightStore>(new WeightStore());
}

namespace {

// Drop the whole pages of a read-only file mapping that lie inside `bytes` from this process
// (madvise MADV_DONTNEED: they are read again from the file if touched). Best effort.
void ReleaseMappedPages(std::span<const std::byte> bytes) {
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(bytes.data()) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(bytes.data()) + bytes.size()) / page * page;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

}  // namespace

Result<std::unique_ptr<WeightStore>> WeightStore::Open(const std::string& path, StoreMode mode) {
  auto store = Make();
  if (mode == StoreMode::kDeviceTest) {
    REFIT_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path, LoadMode::kMmap));
    for (const TensorView& tensor : file->tensors()) {
      REFIT_RETURN_NOT_OK(store->AddDevice(tensor.name, tensor.dtype, tensor.shape,
                                           OpaqueTensorMemory::Make(tensor.bytes)));
      ReleaseMappedPages(tensor.bytes);
    }
    return store;
  }
  if (mode == StoreMode::kMemory) {
    REFIT_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path, LoadMode::kMmap));
    for (const TensorView& tensor : file->tensors()) {
      REFIT_RETURN_NOT_OK(store->AddCopy(tensor));
      // The copied tensor's file pages would count in this process's RSS until the file is
      // closed, doubling the peak of a load: drop them as we go (they stay in the page cache).
      ReleaseMappedPages(tensor.bytes);
    }
    return store;
  }
  // Copy-on-write map: the views parsed from it point into memory this process may write.
  REFIT_ASSIGN_OR_RETURN(auto mapping, internal::MappedFile::OpenCopyOnWrite(path));
  REFIT_ASSIGN_OR_RETURN(std::vector<TensorView> views,
                         ParseSafetensors(mapping->bytes(), path, nullptr));
  std::byte* base = mapping->bytes().data();
  for (const TensorView& view : views) {
    const size_t offset = static_cast<size_t>(view.bytes.data() - mapping->bytes().data());
    MutableTensorView writable{view.name, view.dtype, view.shape,
                               std::span<std::byte>(base + offset, view.bytes.size())};
    REFIT_RETURN_NOT_OK(store->AddExternal(writable));
  }
  store->mapping_ = std::move(mapping);
  return store;
}

Status WeightStore::AddCopy(const TensorView& tensor) {
  REFIT_RETURN_NOT_OK(CheckTensorSize(tensor));
  if (by_name_.contains(tensor.name))
    return AlreadyExists("tensor '{}' is already in the store", tensor.name);
  auto entry = std::make_unique<Entry>();
  entry->owned = std::make_unique_for_overwrite<std::byte[]>(tensor.bytes.size());
  if (!tensor.bytes.empty())
    std::memcpy(entry->owned.get(), tensor.bytes.data(), tensor.bytes.size());
  entry->view = MutableTensorView{tensor.name, tensor.dtype, tensor.shape,
                                  std::span<std::byte>(entry->owned.get(), tensor.bytes.size())};
  entry->digest = TensorDigest(entry->view.AsConst());
  by_name_[entry->view.name] = entry.get();
  entries_.push_back(std::move(entry));
  return Status::OK();
}

Status WeightStore::AddExternal(const MutableTensorView& tensor) {
  REFIT_RETURN_NOT_OK(CheckTensorSize(tensor.AsConst()));
  if (by_name_.contains(tensor.name))
    return AlreadyExists("tensor '{}' is already in the store", tensor.name);
  auto entry = std::make_unique<Entry>();
  entry->view = tensor;
  entry->digest = TensorDigest(tensor.AsConst());
  by_name_[entry->view.name] = entry.get();
  entries_.push_back(std::move(entry));
  return Status::OK();
}

namespace {
/// Bytes of a device tensor read (and hashed) at a time when it is registered or rehashed.
constexpr uint64_t kDeviceReadBlockBytes = uint64_t{16} << 20;
}  // namespace

Status WeightStore::AddDevice(std::string name, DType dtype, Shape shape,
                              std::shared_ptr<TensorMemory> memory) {
  if (memory == nullptr) return InvalidArgument("device tensor '{}': its memory is null", name);
  REFIT_ASSIGN_OR_RETURN(const uint64_t elements, NumElements(shape));
  const uint32_t width = DTypeSize(dtype);
  if (elements * width != memory->size_bytes()) {
    return InvalidArgument("device tensor '{}': {} {} is {} bytes but its memory ({}) has {}", name,
                           DTypeName(dtype), ShapeToString(shape), elements * width,
                           memory->description(), memory->size_bytes());
  }
  if (by_name_.contains(name)) return AlreadyExists("tensor '{}' is already in the store", name);
  auto entry = std::make_unique<Entry>();
  entry->view = MutableTensorView{std::move(name), dtype, std::move(shape), {}};
  // Hashed block by block: the host never holds more than one block of it.
  std::vector<std::byte> block;
  uint64_t digest = 0;
  for (uint64_t offset = 0; offset < memory->size_bytes(); offset += block.size()) {
    block.resize(std::min(kDeviceReadBlockBytes / width * width, memory->size_bytes() - offset));
    Status read = memory->Read(offset, block);
    if (!read.ok()) {
      return read.WithContext(fmt::format("hashing device tensor '{}'", entry->view.name));
    }
    digest += RemappedDigestRange(block, width, 0, offset / width, block.size() / width);
  }
  entry->digest = digest;
  entry->device = std::move(memory);
  by_name_[entry->view.name] = entry.get();
  entries_.push_back(std::move(entry));
  ++device_tensors_;
  return Status::OK();
}

TensorMemory* WeightStore::DeviceMemory(std::string_view name) const {
  const Entry* entry = FindEntry(name);
  return entry == nullptr ? nullptr : entry->device.get();
}

BoundaryTraffic WeightStore::device_traffic() const {
  BoundaryTraffic total;
  for (const auto& entry : entries_) {
    if (entry->device != nullptr) total += entry->device->traffic();
  }
  return total;
}

Status WeightStore::SynchronizeDevices() {
  for (const auto& entry : entries_) {
    if (entry->device == nullptr) continue;
    Status synced = entry->device->Synchronize();
    if (!synced.ok()) {
      return synced.WithContext(fmt::format("synchronizing device tensor '{}'", entry->view.name));
    }
  }
  return Status::OK();
}

Status WeightStore::ReadBytes(std::string_view name, uint64_t offset,
                              std::span<std::byte> out) const {
  const Entry* entry = FindEntry(name);
  if (entry == nullptr) return NotFound("unknown tensor '{}'", name);
  if (entry->device != nullptr) return entry->device->Read(offset, out);
  const std::span<const std::byte> bytes = entry->view.bytes;
  if (offset > bytes.size() || out.size() > bytes.size() - offset) {
    return InvalidArgument("tensor '{}': bytes [{}, {}) are past its {} bytes", name, offset,
                           offset + out.size(), bytes.size());
  }
  if (!out.empty()) std::memcpy(out.data(), bytes.data() + offset, out.size());
  return Status::OK();
}

Result<TensorView> WeightStore::HostView(const Entry& entry, std::vector<std::byte>& scratch) {
  if (entry.device == nullptr) return entry.view.AsConst();
  scratch.resize(entry.device->size_bytes());
  Status read = entry.device->Read(0, scratch);
  if (!read.ok())
    return read.WithContext(fmt::format("reading device tensor '{}'", entry.view.name));
  return TensorView{entry.view.name, entry.view.dtype, entry.view.shape, scratch};
}

WeightStore::Entry* WeightStore::FindEntry(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

Result<MutableTensorView> WeightStore::Find(std::string_view name) {
  Entry* entry = FindEntry(name);
  if (entry == nullptr)
    return NotFound("unknown tensor '{}': the receiver's model has no such tensor", name);
  return entry->view;
}

Result<TensorView> WeightStore::Find(std::string_view name) const {
  const Entry* entry = FindEntry(name);
  if (entry == nullptr)
    return NotFound("unknown tensor '{}': the receiver's model has no such tensor", name);
  return entry->view.AsConst();
}

std::vector<TensorView> WeightStore::tensors() const {
  std::vector<TensorView> out;
  out.reserve(entries_.size());
  for (const auto& entry : entries_) out.push_back(entry->view.AsConst());
  return out;
}

size_t WeightStore::size() const { return entries_.size(); }

std::map<std::string, uint64_t> WeightStore::Digests() const {
  std::map<std::string, uint64_t> out;
  for (const auto& entry : entries_) out[entry->view.name] = entry->digest;
  return out;
}

Result<uint64_t> WeightStore::Digest(std::string_view name) const {
  const Entry* entry = FindEntry(name);
  if (entry == nullptr) return NotFound("unknown tensor '{}'", name);
  return entry->digest;
}

Status WeightStore::AdjustDigest(std::string_view name, uint64_t delta) {
  Entry* entry = FindEntry(name);
  if (entry == nullptr) return NotFound("unknown tensor '{}'", name);
  entry->digest += delta;
  return Status::OK();
}

Status WeightStore::SetDigest(std::string_view name, uint64_t digest) {
  Entry* entry = FindEntry(name);
  if (entry == nullptr) return NotFound("unknown tensor '{}'", name);
  entry->digest = digest;
  return Status::OK();
}

std::map<std::string, uint64_t> WeightStore::RecomputeDigests() const {
  std::map<std::string, uint64_t> out;
  std::vector<std::byte> scratch;
  for (const auto& entry : entries_) {
    Result<TensorView> view = HostView(*entry, scratch);
    if (!view.ok()) {
      // A tool's or a test's check: a device that cannot be read leaves nothing to compare.
      std::fprintf(stderr, "RecomputeDigests: %s\n", view.status().ToString().c_str());
      std::abort();
    }
    out[entry->view.name] = TensorDigest(*view);
  }
  return out;
}

Status WeightStore::RehashTensor(std::string_view name) {
  Entry* entry = FindEntry(name);
  if (entry == nullptr) return NotFound("unknown tensor '{}'", name);
  std::vector<std::byte> scratch;
  REFIT_ASSIGN_OR_RETURN(const TensorView view, HostView(*entry, scratch));
  entry->digest = TensorDigest(view);
  std::lock_guard lock(pieces_mutex_);
  for (auto& [canonical, state] : pieces_) {
    for (size_t p = 0; p < state.layout->pieces.size(); ++p) {
      const CanonicalPiece& piece = state.layout->pieces[p];
      if (piece.local_tensor != name) continue;
      state.digests[p] = PieceDigestOf(piece, state.layout->cols, view);
    }
  }
  return Status::OK();
}

Status WeightStore::AttachLoader(std::unique_ptr<Loader> loader) {
  if (loader == nullptr) return InvalidArgument("AttachLoader: the loader is null");
  if (loader->store() != this) {
    return InvalidArgument("AttachLoader: the loader was made for another store (or for shapes)");
  }
  if (loader_ != nullptr) {
    return FailedPrecondition("AttachLoader: the store already has a loader attached");
  }
  loader_ = std::move(loader);
  return Status::OK();
}

Result<WeightStore::Pieces*> WeightStore::PiecesLocked(std::string_view canonical_name) const {
  if (auto it = pieces_.find(canonical_name); it != pieces_.end()) return &it->second;
  REFIT_ASSIGN_OR_RETURN(const CanonicalLayout* layout, loader_->Resolve(canonical_name));
  Pieces state{layout, {}};
  // Hashed once from the bytes, when the tensor is first resolved (before any item of it is
  // applied); from then on the applier keeps the digests current in O(changes).
  std::vector<std::byte> scratch;
  for (const CanonicalPiece& piece : layout->pieces) {
    const Entry* local = FindEntry(piece.local_tensor);
    REFIT_DCHECK(local != nullptr, "a resolved piece names a tensor the store lacks");
    REFIT_ASSIGN_OR_RETURN(const TensorView view, HostView(*local, scratch));
    state.digests.push_back(PieceDigestOf(piece, layout->cols, view));
  }
  return &pieces_.emplace(std::string(canonical_name), std::move(state)).first->second;
}

Result<const CanonicalLayout*> WeightStore::ResolveCanonical(
    std::string_view canonical_name) const {
  if (loader_ == nullptr) {
    return FailedPrecondition("tensor '{}': the store has no loader to resolve it", canonical_name);
  }
  std::lock_guard lock(pieces_mutex_);
  REFIT_ASSIGN_OR_RETURN(Pieces * state, PiecesLocked(canonical_name));
  return state->layout;
}

Result<uint64_t*> WeightStore::PieceDigestSlot(std::string_view canonical_name,
                                               size_t piece) const {
  auto it = pieces_.find(canonical_name);
  if (it == pieces_.end()) return NotFound("canonical tensor '{}' is not resolved", canonical_name);
  if (piece >= it->second.digests.size()) {
    return NotFound("canonical tensor '{}' has {} pieces here, not piece {}", canonical_name,
                    it->second.digests.size(), piece);
  }
  return &it->second.digests[piece];
}

Result<uint64_t> WeightStore::PieceDigest(std::string_view canonical_name, size_t piece) const {
  std::lock_guard lock(pieces_mutex_);
  REFIT_ASSIGN_OR_RETURN(uint64_t * slot, PieceDigestSlot(canonical_name, piece));
  return *slot;
}

Status WeightStore::AdjustPieceDigest(std::string_view canonical_name, size_t piece,
                                      uint64_t delta) {
  std::lock_guard lock(pieces_mutex_);
  REFIT_ASSIGN_OR_RETURN(uint64_t * slot, PieceDigestSlot(canonical_name, piece));
  *slot += delta;
  return Status::OK();
}

Status WeightStore::SetPieceDigest(std::string_view canonical_name, size_t piece, uint64_t digest) {
  std::lock_guard lock(pieces_mutex_);
  REFIT_ASSIGN_OR_RETURN(uint64_t * slot, PieceDigestSlot(canonical_name, piece));
  *slot = digest;
  return Status::OK();
}

Result<std::map<std::string, CanonicalHolding>> WeightStore::CollectHoldings(
    std::span<const std::string> canonical_names, bool recompute) const {
  std::map<std::string, CanonicalHolding> out;
  if (loader_ == nullptr) {
    for (const std::string& name : canonical_names) {
      const Entry* entry = FindEntry(name);
      if (entry == nullptr) return NotFound("tensor '{}' is not in the receiver's store", name);
      if (!recompute) {
        out[name].pieces[""] = entry->digest;
        continue;
      }
      std::vector<std::byte> scratch;
      REFIT_ASSIGN_OR_RETURN(const TensorView view, HostView(*entry, scratch));
      out[name].pieces[""] = TensorDigest(view);
    }
    return out;
  }
  std::lock_guard lock(pieces_mutex_);
  for (const std::string& name : canonical_names) {
    REFIT_ASSIGN_OR_RETURN(const Pieces* state, PiecesLocked(name));
    CanonicalHolding& holding = out[name];
    holding.skipped = state->layout->skipped;
    for (size_t p = 0; p < state->layout->pieces.size(); ++p) {
      const CanonicalPiece& piece = state->layout->pieces[p];
      if (!recompute) {
        holding.pieces[piece.id] = state->digests[p];
        continue;
      }
      std::vector<std::byte> scratch;
      REFIT_ASSIGN_OR_RETURN(const TensorView view,
                             HostView(*FindEntry(piece.local_tensor), scratch));
      holding.pieces[piece.id] = PieceDigestOf(piece, state->layout->cols, view);
    }
  }
  return out;
}

Result<std::map<std::string, CanonicalHolding>> WeightStore::Holdings(
    std::span<const std::string> canonical_names) const {
  return CollectHoldings(canonical_names, /*recompute=*/false);
}

Result<std::map<std::string, CanonicalHolding>> WeightStore::RecomputeHoldings(
    std::span<const std::string> canonical_names) const {
  return CollectHoldings(canonical_names, /*recompute=*/true);
}

Status WeightStore::Save(const std::string& path) const {
  if (device_tensors_ == 0) return WriteSafetensors(path, tensors());
  // Device tensors are read to the host for the file: the model's size, once, for a save.
  std::vector<std::vector<std::byte>> copies(entries_.size());
  std::vector<TensorView> views;
  for (size_t i = 0; i < entries_.size(); ++i) {
    REFIT_ASSIGN_OR_RETURN(TensorView view, HostView(*entries_[i], copies[i]));
    views.push_back(std::move(view));
  }
  return WriteSafetensors(path, views);
}

}  // namespace refit
