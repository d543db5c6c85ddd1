#include "refit/weight_store.h"

#include <cstring>

#include "core/mapped_file.h"
#include "refit/digest.h"

namespace refit {

struct WeightStore::Entry {
  MutableTensorView view;
  uint64_t digest = 0;
  /// Backing for copies; empty for external or mmapped tensors.
  std::unique_ptr<std::byte[]> owned;
};

WeightStore::WeightStore() = default;
WeightStore::~WeightStore() = default;

std::unique_ptr<WeightStore> WeightStore::Make() {
  return std::unique_ptr<WeightStore>(new WeightStore());
}

Result<std::unique_ptr<WeightStore>> WeightStore::Open(const std::string& path, StoreMode mode) {
  auto store = Make();
  if (mode == StoreMode::kMemory) {
    REFIT_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path, LoadMode::kMmap));
    for (const TensorView& tensor : file->tensors()) REFIT_RETURN_NOT_OK(store->AddCopy(tensor));
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
  for (const auto& entry : entries_) out[entry->view.name] = TensorDigest(entry->view.AsConst());
  return out;
}

Status WeightStore::Save(const std::string& path) const {
  return WriteSafetensors(path, tensors());
}

}  // namespace refit
