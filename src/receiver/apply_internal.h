// What the applier's files share: the undo record, the batch sizes, the device boundary's batches
// and the loader path's entry point. apply.cc applies payloads without a loader and dispatches
// (ApplyPayload); apply_loader.cc applies them through a loader; undo_log.cc keeps and replays
// the old bits; device_apply.cc reaches tensors behind the device boundary. Internal.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "codec/values.h"
#include "core/digest.h"
#include "receiver/apply.h"
#include "refit/payload.h"
#include "refit/tensor_memory.h"
#include "refit/weight_store.h"

namespace refit {

struct internal::UndoLog::Record {
  /// The (local) tensor written.
  std::string tensor{};
  uint32_t width = 0;
  /// A FULL item: its old bits cover `full_bytes` bytes starting at element span_begin, in
  /// old_bits, in the spill file at spill_offset, or nowhere (UndoLog::KeepFullSpan).
  bool full = false;
  uint64_t span_begin = 0;
  uint64_t full_bytes = 0;
  uint64_t spill_offset = kNotSpilled;
  /// The spill range was set aside up front (ReserveFullSpans, for a parallel apply).
  bool spill_reserved = false;
  bool full_bits_lost = false;
  std::vector<uint64_t> locations{};
  std::vector<std::byte> old_bits{};
  uint64_t digest_before = 0;
  /// Through a loader: the canonical tensor and the piece whose partial digest the record moved.
  bool has_piece = false;
  std::string canonical{};
  size_t piece = 0;
  uint64_t piece_digest_before = 0;
  /// An XOR item undone by applying it again: item `item` of the kept payload `payload`
  /// (UndoLog::payloads_), or of the payload being applied while it is kCurrentPayload. Such a
  /// record holds no locations and no old bits.
  bool reapply = false;
  size_t payload = 0;
  size_t item = 0;

  static constexpr uint64_t kNotSpilled = UINT64_MAX;
};

namespace internal {

/// Locations decoded per batch: large enough to amortise the decoder call, small enough (32 KiB)
/// to stay in L1/L2 while the values are applied.
inline constexpr size_t kLocationBatch = 4096;
/// Bytes of a FULL item applied at a time: hashed, kept, copied and hashed again while in L2.
inline constexpr uint64_t kFullApplyBlockBytes = uint64_t{256} << 10;
/// The same for a device tensor, whose every block is a boundary call (a Python call, a copy
/// across PCIe): larger, to amortise the call; still a bounded host buffer.
inline constexpr uint64_t kDeviceFullBlockBytes = uint64_t{16} << 20;
/// Delta elements applied to a device tensor per boundary round trip (TensorMemory::Update):
/// enough to amortise a backend's per-call cost, few enough that the batch's host buffers
/// (positions, values, gathered bits: about 3 MiB for bf16) stay small.
inline constexpr size_t kDeviceBatch = size_t{1} << 18;
/// Record::payload of a record whose payload is still being applied (not yet kept).
inline constexpr size_t kCurrentPayload = SIZE_MAX;

/// 0, 1, 2, …: the locations of a compact buffer of gathered elements, to which ApplyOpValues
/// applies a batch's values as it would at the elements' places in host memory. n ≤ kDeviceBatch.
std::span<const uint64_t> Iota(size_t n);

/// Delta elements bound for one device tensor, applied in one boundary round trip when
/// kDeviceBatch are pending or the item ends: the old bits are gathered, the op is applied to them
/// on the host exactly as it would be in host memory (ApplyOpValues over a compact buffer), and the
/// new bits are scattered back. The record gets the positions and old bits (device deltas are
/// always undone from old bits: a re-applied XOR would be wrong after a scatter that failed
/// halfway).
class DeviceDeltaBatch {
 public:
  /// Queue `local` positions (with their canonical positions, or empty when the same) and values.
  void Add(std::span<const uint64_t> local, std::span<const uint64_t> canonical,
           std::span<const std::byte> values) {
    local_.insert(local_.end(), local.begin(), local.end());
    if (!canonical.empty() || !canonical_.empty()) {
      // Once positions differ, the canonical ones are kept for every element.
      if (canonical_.size() < local_.size() - local.size()) {
        canonical_.insert(canonical_.end(), local_.begin() + canonical_.size(),
                          local_.end() - local.size());
      }
      const std::span<const uint64_t> same = canonical.empty() ? local : canonical;
      canonical_.insert(canonical_.end(), same.begin(), same.end());
    }
    values_.insert(values_.end(), values.begin(), values.end());
  }
  size_t size() const { return local_.size(); }

  /// Apply the queued elements of `item` to `memory` and clear. Adds the digest changes in local
  /// and canonical coordinates to `local_delta` and `canonical_delta`. Whatever the device may
  /// have been given is in `record` when this returns, after an error too.
  Status Flush(TensorMemory& memory, const ItemView& item, internal::UndoLog::Record& record,
               uint64_t* local_delta, uint64_t* canonical_delta) {
    const size_t n = local_.size();
    if (n == 0) return Status::OK();
    const uint32_t width = DTypeSize(item.dtype);
    const std::span<const uint64_t> canonical = canonical_.empty() ? local_ : canonical_;
    bits_.resize(n * width);
    bool gathered = false;
    uint64_t local_sum = 0;
    uint64_t canonical_sum = 0;
    const Status updated = memory.Update(local_, width, bits_, [&](std::span<std::byte> bits) {
      gathered = true;
      record.old_bits.insert(record.old_bits.end(), bits.begin(), bits.end());
      for (size_t k = 0; k < n; ++k) {
        const uint64_t old = LoadBits(bits, width, k);
        local_sum -= ElementHash(local_[k], old);
        canonical_sum -= ElementHash(canonical[k], old);
      }
      ApplyOpValues(item.op, item.dtype, item.value_dtype, bits, Iota(n), values_, nullptr);
      for (size_t k = 0; k < n; ++k) {
        const uint64_t now = LoadBits(bits, width, k);
        local_sum += ElementHash(local_[k], now);
        canonical_sum += ElementHash(canonical[k], now);
      }
    });
    if (gathered) record.locations.insert(record.locations.end(), local_.begin(), local_.end());
    local_.clear();
    canonical_.clear();
    values_.clear();
    REFIT_RETURN_NOT_OK(updated);
    *local_delta += local_sum;
    if (canonical_delta != nullptr) *canonical_delta += canonical_sum;
    return Status::OK();
  }

 private:
  std::vector<uint64_t> local_;
  std::vector<uint64_t> canonical_;
  std::vector<std::byte> values_;
  std::vector<std::byte> bits_;
};

/// Read bytes at `offset` of a device tensor into `out`, in blocks (one boundary call each).
Status ReadDevice(TensorMemory& memory, uint64_t offset, std::span<std::byte> out);
/// Write `bytes` at byte `offset` of a device tensor from a host buffer, in blocks (one boundary
/// call each).
Status WriteDevice(TensorMemory& memory, uint64_t offset, std::span<const std::byte> bytes);

/// `payload` with its context-coded items (format v2) decoded against the bits `store` holds now
/// (ExpandContextItems): host tensors read in place, device tensors through TensorMemory::Read,
/// canonical tensors through the loader where one piece holds the whole tensor (FailedPrecondition
/// naming the tensor where the receiver holds only part of it); items of tensors a loader skips
/// stay as they are. Errors: DataLoss when an item does not decode against the old span (the
/// receiver is not at the payload's base); NotFound / InvalidArgument as ApplyPayload's checks.
Result<DecodedPayload> ExpandForApply(const DecodedPayload& payload, const WeightStore& store);

/// ApplyPayload through the store's loader (apply_loader.cc), recording into `undo`. `threads` > 1:
/// a payload (deltas, FULL items or both) whose items write more than one group of local tensors
/// applies the groups in parallel, with the same all-or-nothing result.
Status ApplyThroughLoader(const DecodedPayload& payload, WeightStore& store,
                          internal::UndoLog& undo, int threads);

}  // namespace internal
}  // namespace refit
