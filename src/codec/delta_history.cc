#include "codec/delta_history.h"

#include <algorithm>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "codec/xor_fold.h"
#include "refit/status_format.h"

namespace refit {
namespace {

// FNV-1a, 64-bit: a stable hash of a chunk's description (not of its bytes), compared only
// between the chunks of one producer's consecutive transfers.
constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ull;
constexpr uint64_t kFnvPrime = 0x100000001b3ull;

void HashBytes(uint64_t& hash, const void* data, size_t size) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) {
    hash ^= bytes[i];
    hash *= kFnvPrime;
  }
}

template <typename T>
void HashValue(uint64_t& hash, const T& value) {
  HashBytes(hash, &value, sizeof(value));
}

uint64_t ItemBytes(const Item& item) {
  return item.name.size() + item.locations.size() + item.values.size();
}

}  // namespace

uint64_t ChunkSignature(std::span<const TensorView> tensors) {
  uint64_t hash = kFnvOffset;
  for (const TensorView& tensor : tensors) {
    HashBytes(hash, tensor.name.data(), tensor.name.size());
    HashValue(hash, static_cast<uint8_t>(tensor.dtype));
    HashValue(hash, tensor.shape.size());
    for (int64_t dim : tensor.shape) HashValue(hash, dim);
    HashValue(hash, tensor.bytes.size());
  }
  return hash;
}

Result<std::unique_ptr<DeltaHistory>> DeltaHistory::Make(const DeltaHistoryOptions& options) {
  if (options.max_versions == 0 && options.max_bytes > 0) {
    return InvalidArgument(
        "delta history: max_versions is 0 but max_bytes is {}; set max_bytes to 0 to keep no "
        "history",
        options.max_bytes);
  }
  return std::unique_ptr<DeltaHistory>(new DeltaHistory(options));
}

void DeltaHistory::ClearLocked() {
  retained_.clear();
  retained_bytes_ = 0;
  stale_ = false;
}

void DeltaHistory::Begin(uint64_t base_version, bool anchor) {
  internal::MutexLock lock(mutex_);
  const bool chains = retained_.empty() || retained_.back().base_version + 1 == base_version;
  if (anchor || stale_ || !chains || options_.max_bytes == 0) ClearLocked();
  open_ = Delta{};
  open_->base_version = base_version;
  open_->foldable = !anchor && options_.max_bytes > 0;
}

void DeltaHistory::Record(uint64_t chunk, uint64_t signature, std::span<const Item> items) {
  internal::MutexLock lock(mutex_);
  if (!open_.has_value() || !open_->foldable) return;
  if (!retained_.empty()) {
    auto before = retained_.back().chunks.find(chunk);
    if (before != retained_.back().chunks.end() && before->second.signature != signature) {
      stale_ = true;  // The chunking changed: what is retained no longer lines up.
    }
  }
  ChunkDelta& recorded = open_->chunks[chunk];
  recorded.signature = signature;
  for (const Item& item : items) {
    if (item.op != Op::kXor) {
      // Only XOR composes; this transfer's changes cannot be folded, so nothing before it can.
      open_->foldable = false;
      open_->chunks.clear();
      open_->bytes = 0;
      return;
    }
    open_->bytes += ItemBytes(item);
    recorded.items.push_back(item);
  }
  if (open_->bytes > options_.max_bytes) {
    // Larger than the whole budget: it would be dropped at commit; stop copying now.
    open_->foldable = false;
    open_->chunks.clear();
    open_->bytes = 0;
  }
}

void DeltaHistory::Commit() {
  internal::MutexLock lock(mutex_);
  if (!open_.has_value()) return;
  Delta delta = std::move(*open_);
  open_.reset();
  if (!delta.foldable) {
    ClearLocked();
    return;
  }
  retained_bytes_ += delta.bytes;
  retained_.push_back(std::move(delta));
  while (!retained_.empty() &&
         (retained_.size() > options_.max_versions || retained_bytes_ > options_.max_bytes)) {
    retained_bytes_ -= retained_.front().bytes;
    retained_.erase(retained_.begin());
  }
}

void DeltaHistory::Abort() {
  internal::MutexLock lock(mutex_);
  open_.reset();
}

void DeltaHistory::Clear() {
  internal::MutexLock lock(mutex_);
  ClearLocked();
}

std::optional<uint64_t> DeltaHistory::oldest_version() const {
  internal::MutexLock lock(mutex_);
  if (!open_.has_value()) return std::nullopt;
  return retained_.empty() ? open_->base_version : retained_.front().base_version;
}

bool DeltaHistory::CanFold(uint64_t from) const {
  internal::MutexLock lock(mutex_);
  if (!open_.has_value() || !open_->foldable || stale_ || retained_.empty()) return false;
  return retained_.front().base_version <= from && from < open_->base_version;
}

Result<std::vector<Item>> DeltaHistory::FoldChunk(uint64_t from, uint64_t chunk, uint64_t signature,
                                                  std::span<const Item> current) const {
  internal::MutexLock lock(mutex_);
  if (!open_.has_value() || !open_->foldable || retained_.empty() ||
      from < retained_.front().base_version || from >= open_->base_version) {
    return FailedPrecondition(
        "delta history: chunk {}: cannot fold from version {}: it retains versions {} to {}", chunk,
        from, retained_.empty() ? 0 : retained_.front().base_version,
        open_.has_value() ? open_->base_version : 0);
  }
  // Every item of the deltas after `from`, then the open transfer's, grouped by tensor.
  std::map<std::string_view, std::vector<ItemView>> by_tensor;
  for (const Delta& delta : retained_) {
    if (delta.base_version < from) continue;
    auto it = delta.chunks.find(chunk);
    if (it == delta.chunks.end()) continue;
    if (it->second.signature != signature) {
      stale_ = true;
      return FailedPrecondition(
          "delta history: chunk {} has other tensors or shapes than at version {}: the folded "
          "deltas no longer apply (the history is dropped at the next transfer)",
          chunk, delta.base_version + 1);
    }
    for (const Item& item : it->second.items) by_tensor[item.name].push_back(item.view());
  }
  for (const Item& item : current) {
    if (item.op != Op::kXor) {
      return FailedPrecondition(
          "delta history: chunk {}: tensor '{}' is sent {}, which does not "
          "fold",
          chunk, item.name, OpName(item.op));
    }
    by_tensor[item.name].push_back(item.view());
  }
  std::vector<Item> folded;
  for (const auto& [name, items] : by_tensor) {
    Result<std::optional<Item>> one = FoldXorItems(items);
    if (!one.ok()) return one.status().WithContext(fmt::format("chunk {}", chunk));
    if (one->has_value()) folded.push_back(std::move(**one));
  }
  return folded;
}

uint32_t DeltaHistory::retained_versions() const {
  internal::MutexLock lock(mutex_);
  return static_cast<uint32_t>(retained_.size());
}

uint64_t DeltaHistory::retained_bytes() const {
  internal::MutexLock lock(mutex_);
  return retained_bytes_;
}

}  // namespace refit
