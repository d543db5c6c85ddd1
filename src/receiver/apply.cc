#include "refit/apply.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "refit/digest.h"
#include "refit/loader.h"
#include "refit/locations.h"
#include "refit/values.h"
#include "util/check.h"
#include "util/thread_pool.h"

namespace refit {
namespace {

/// Locations decoded per batch: large enough to amortise the decoder call, small enough (32 KiB)
/// to stay in L1/L2 while the values are applied.
constexpr size_t kLocationBatch = 4096;
/// Bytes of a FULL item applied at a time: hashed, kept, copied and hashed again while in L2.
constexpr uint64_t kFullApplyBlockBytes = uint64_t{256} << 10;
/// The same for a device tensor, whose every block is a boundary call (a Python call, a copy
/// across PCIe): larger, to amortise the call; still a bounded host buffer.
constexpr uint64_t kDeviceFullBlockBytes = uint64_t{16} << 20;
/// Delta elements applied to a device tensor per boundary round trip (TensorMemory::Update):
/// enough to amortise a backend's per-call cost, few enough that the batch's host buffers
/// (positions, values, gathered bits: about 3 MiB for bf16) stay small.
constexpr size_t kDeviceBatch = size_t{1} << 18;

/// 0, 1, 2, …: the locations of a compact buffer of gathered elements, to which ApplyOpValues
/// applies a batch's values as it would at the elements' places in host memory.
std::span<const uint64_t> Iota(size_t n) {
  static const std::vector<uint64_t> iota = [] {
    std::vector<uint64_t> values(kDeviceBatch);
    std::iota(values.begin(), values.end(), uint64_t{0});
    return values;
  }();
  REFIT_DCHECK(n <= iota.size(), "a device batch larger than kDeviceBatch");
  return std::span<const uint64_t>(iota.data(), n);
}

Status CheckApplicable(const PayloadHeader& header, size_t index, const ItemView& item,
                       const WeightStore& store) {
  auto tensor = store.Find(item.name);
  if (!tensor.ok()) {
    return tensor.status().WithContext(fmt::format("payload {} of producer {}, item {}",
                                                   header.ids.payload_id, header.ids.producer_id,
                                                   index));
  }
  if (tensor->dtype != item.dtype || tensor->shape != item.shape) {
    return InvalidArgument(
        "payload {} of producer {}, item {}: tensor '{}' is {} {} in the payload but {} {} in "
        "the receiver's model",
        header.ids.payload_id, header.ids.producer_id, index, item.name, DTypeName(item.dtype),
        ShapeToString(item.shape), DTypeName(tensor->dtype), ShapeToString(tensor->shape));
  }
  return Status::OK();
}

}  // namespace

struct UndoLog::Record {
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

namespace {
// Record::payload of a record whose payload is still being applied (not yet kept).
constexpr size_t kCurrentPayload = SIZE_MAX;

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
  Status Flush(TensorMemory& memory, const ItemView& item, UndoLog::Record& record,
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
Status ReadDevice(TensorMemory& memory, uint64_t offset, std::span<std::byte> out) {
  for (uint64_t done = 0; done < out.size(); done += kDeviceFullBlockBytes) {
    const uint64_t length = std::min<uint64_t>(kDeviceFullBlockBytes, out.size() - done);
    REFIT_RETURN_NOT_OK(memory.Read(offset + done, out.subspan(done, length)));
  }
  return Status::OK();
}

/// Write `bytes` at byte `offset` of a device tensor from a host buffer, in blocks (one boundary
/// call each).
Status WriteDevice(TensorMemory& memory, uint64_t offset, std::span<const std::byte> bytes) {
  for (uint64_t done = 0; done < bytes.size(); done += kDeviceFullBlockBytes) {
    const uint64_t length = std::min<uint64_t>(kDeviceFullBlockBytes, bytes.size() - done);
    REFIT_RETURN_NOT_OK(memory.Write(offset + done, bytes.subspan(done, length)));
  }
  return Status::OK();
}

constexpr std::pair<AnchorUndo, std::string_view> kAnchorUndoNames[] = {
    {AnchorUndo::kMemory, "memory"}, {AnchorUndo::kFile, "file"}, {AnchorUndo::kNone, "none"}};

std::string SpillDirectory(const UndoLogOptions& options) {
  if (!options.spill_directory.empty()) return options.spill_directory;
  const char* tmpdir = std::getenv("TMPDIR");
  return tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp";
}
}  // namespace

std::string_view AnchorUndoName(AnchorUndo policy) {
  for (const auto& [value, name] : kAnchorUndoNames) {
    if (value == policy) return name;
  }
  return "unknown";
}

Result<AnchorUndo> ParseAnchorUndo(std::string_view name) {
  for (const auto& [value, spelled] : kAnchorUndoNames) {
    if (spelled == name) return value;
  }
  return InvalidArgument("anchor_undo '{}' is not one of memory, file, none", name);
}

UndoLog::UndoLog() = default;
UndoLog::UndoLog(UndoLogOptions options) : options_(std::move(options)) {}

UndoLog::~UndoLog() {
  if (spill_fd_ >= 0) ::close(spill_fd_);
}

UndoLog::UndoLog(UndoLog&& other) noexcept
    : options_(std::move(other.options_)),
      records_(std::move(other.records_)),
      payloads_(std::move(other.payloads_)),
      spill_fd_(std::exchange(other.spill_fd_, -1)),
      spill_path_(std::move(other.spill_path_)),
      spill_end_(std::exchange(other.spill_end_, 0)),
      exact_(std::exchange(other.exact_, true)) {}

UndoLog& UndoLog::operator=(UndoLog&& other) noexcept {
  if (this != &other) {
    if (spill_fd_ >= 0) ::close(spill_fd_);
    options_ = std::move(other.options_);
    records_ = std::move(other.records_);
    payloads_ = std::move(other.payloads_);
    spill_fd_ = std::exchange(other.spill_fd_, -1);
    spill_path_ = std::move(other.spill_path_);
    spill_end_ = std::exchange(other.spill_end_, 0);
    exact_ = std::exchange(other.exact_, true);
  }
  return *this;
}

Status UndoLog::Validate(const UndoLogOptions& options) {
  if (options.anchor_undo != AnchorUndo::kFile) return Status::OK();
  const std::string directory = SpillDirectory(options);
  struct stat info {};
  if (::stat(directory.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
    return InvalidArgument("anchor_undo file: spill directory '{}' is not a directory", directory);
  }
  if (::access(directory.c_str(), W_OK | X_OK) != 0) {
    return InvalidArgument("anchor_undo file: spill directory '{}' is not writable", directory);
  }
  return Status::OK();
}

void UndoLog::Clear() {
  records_.clear();
  payloads_.clear();
  exact_ = true;
  TrimSpill();
}

void UndoLog::TrimSpill() {
  uint64_t end = 0;
  for (const Record& r : records_) {
    if (r.spill_offset != Record::kNotSpilled) end = std::max(end, r.spill_offset + r.full_bytes);
  }
  if (end == spill_end_) return;
  spill_end_ = end;
  // Give the disk space back; the (unlinked) file stays open for the next anchor. Should the
  // truncation fail, an empty log gives the file up instead, and a log still holding spilled
  // spans keeps it as it is (the next spill writes past `end` over what was there).
  if (::ftruncate(spill_fd_, static_cast<off_t>(end)) != 0 && end == 0) {
    ::close(spill_fd_);
    spill_fd_ = -1;
  }
}

Status UndoLog::KeepFullSpan(Record& record, std::span<const std::byte> old_bits) {
  switch (options_.anchor_undo) {
    case AnchorUndo::kMemory:
      record.old_bits.insert(record.old_bits.end(), old_bits.begin(), old_bits.end());
      record.full_bytes += old_bits.size();
      return Status::OK();
    case AnchorUndo::kNone:
      record.full_bits_lost = true;
      record.full_bytes += old_bits.size();
      // Read before written: a parallel apply has cleared it already (ReserveFullSpans).
      if (exact_) exact_ = false;
      return Status::OK();
    case AnchorUndo::kFile:
      break;
  }
  REFIT_RETURN_NOT_OK(OpenSpillFile());
  if (record.spill_offset == Record::kNotSpilled) record.spill_offset = spill_end_;
  // A record's spans are kept in order, so its bytes lie back to back from its first offset:
  // appended at the end of the file, or into the range ReserveFullSpans set aside.
  const uint64_t offset = record.spill_offset + record.full_bytes;
  for (size_t done = 0; done < old_bits.size();) {
    const ssize_t n = ::pwrite(spill_fd_, old_bits.data() + done, old_bits.size() - done,
                               static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return IoErrorFromErrno(n < 0 ? errno : ENOSPC,
                              fmt::format("anchor_undo file: writing {} bytes of '{}' to {}",
                                          old_bits.size(), record.tensor, spill_path_));
    }
    done += static_cast<size_t>(n);
  }
  record.full_bytes += old_bits.size();
  if (!record.spill_reserved) spill_end_ = offset + old_bits.size();
  return Status::OK();
}

Status UndoLog::OpenSpillFile() {
  if (spill_fd_ >= 0) return Status::OK();
  std::string path = SpillDirectory(options_) + "/refit-anchor-undo-XXXXXX";
  const int fd = ::mkstemp(path.data());
  if (fd < 0) return IoErrorFromErrno(errno, fmt::format("anchor_undo file: creating {}", path));
  // Unlinked at once: a receiver killed mid-anchor leaves nothing on disk.
  ::unlink(path.c_str());
  spill_fd_ = fd;
  spill_path_ = std::move(path);
  return Status::OK();
}

Status UndoLog::ReserveFullSpans(std::span<Record> records, std::span<const uint64_t> span_bytes) {
  switch (options_.anchor_undo) {
    case AnchorUndo::kMemory:
      for (size_t i = 0; i < records.size(); ++i) records[i].old_bits.reserve(span_bytes[i]);
      return Status::OK();
    case AnchorUndo::kNone:
      exact_ = false;
      return Status::OK();
    case AnchorUndo::kFile:
      break;
  }
  REFIT_RETURN_NOT_OK(OpenSpillFile());
  for (size_t i = 0; i < records.size(); ++i) {
    records[i].spill_offset = spill_end_;
    records[i].spill_reserved = true;
    spill_end_ += span_bytes[i];
  }
  return Status::OK();
}

Status UndoLog::ReadSpill(uint64_t offset, std::span<std::byte> out) const {
  for (size_t done = 0; done < out.size();) {
    const ssize_t n =
        ::pread(spill_fd_, out.data() + done, out.size() - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return IoErrorFromErrno(
          n < 0 ? errno : EIO,
          fmt::format("anchor_undo file: reading {} bytes back from {}", out.size(), spill_path_));
    }
    done += static_cast<size_t>(n);
  }
  return Status::OK();
}

size_t UndoLog::records() const { return records_.size(); }

uint64_t UndoLog::bytes() const {
  uint64_t total = payload_bytes();
  for (const Record& r : records_)
    total += r.locations.size() * sizeof(uint64_t) + r.old_bits.size();
  return total;
}

uint64_t UndoLog::payload_bytes() const {
  uint64_t total = 0;
  for (const std::vector<std::byte>& payload : payloads_) total += payload.size();
  return total;
}

Status UndoLog::Rollback(WeightStore& store) { return RollbackTo(store, 0); }

Status UndoLog::RollbackTo(WeightStore& store, size_t savepoint, const DecodedPayload* current) {
  for (size_t i = savepoint; i < records_.size(); ++i) {
    if (!store.Find(records_[i].tensor).ok()) {
      return NotFound("rollback: tensor '{}' is no longer in the store", records_[i].tensor);
    }
  }
  // The kept payload the XOR records being undone come from, decoded once for all its items
  // (records are undone newest first, so one payload's records are consecutive).
  std::optional<DecodedPayload> decoded;
  size_t decoded_slot = SIZE_MAX;
  std::array<uint64_t, kLocationBatch> batch;
  // Records whose FULL span kept no old bits (AnchorUndo::kNone).
  std::vector<size_t> lost;
  // Newest first, so an element touched twice ends at its oldest recorded bits.
  for (size_t i = records_.size(); i > savepoint; --i) {
    Record& r = records_[i - 1];
    MutableTensorView tensor = *store.Find(r.tensor);
    if (TensorMemory* device = store.DeviceMemory(r.tensor); device != nullptr) {
      // A device tensor: its records hold old bits (never a payload to re-apply).
      REFIT_DCHECK(!r.reapply, "a device tensor's record re-applies its payload");
      if (r.full && r.full_bits_lost) {
        lost.push_back(i - 1);
        continue;
      }
      Status restored = Status::OK();
      if (r.full && r.spill_offset != Record::kNotSpilled) {
        std::vector<std::byte> block;
        for (uint64_t done = 0; done < r.full_bytes && restored.ok(); done += block.size()) {
          block.resize(std::min(kDeviceFullBlockBytes, r.full_bytes - done));
          restored = ReadSpill(r.spill_offset + done, block);
          if (restored.ok()) restored = device->Write(r.span_begin * r.width + done, block);
        }
      } else if (r.full) {
        restored = WriteDevice(*device, r.span_begin * r.width, r.old_bits);
      } else {
        restored = device->Scatter(r.locations, r.width, r.old_bits);
      }
      if (!restored.ok()) {
        for (size_t k : lost) (void)store.RehashTensor(records_[k].tensor);
        records_.resize(i);
        return restored.WithContext(fmt::format("rollback of device tensor '{}'", r.tensor));
      }
    } else if (r.reapply) {
      const DecodedPayload* source = current;
      if (r.payload != kCurrentPayload) {
        if (decoded_slot != r.payload) {
          // These bytes were verified when they were applied; only their size bounds the decode.
          const std::vector<std::byte>& kept = payloads_[r.payload];
          PayloadLimits limits;
          limits.max_payload_bytes = kept.size();
          limits.max_body_bytes = std::numeric_limits<uint64_t>::max();
          limits.max_items = std::numeric_limits<uint32_t>::max();
          limits.max_name_length = std::numeric_limits<uint32_t>::max();
          limits.max_rank = std::numeric_limits<uint32_t>::max();
          Result<DecodedPayload> again = DecodePayload(kept, limits);
          if (!again.ok()) {
            return again.status().WithContext(
                fmt::format("rollback: decoding kept payload {} of '{}'", r.payload, r.tensor));
          }
          decoded = std::move(again).ValueOrDie();
          decoded_slot = r.payload;
        }
        source = &*decoded;
      }
      if (source == nullptr || r.item >= source->items().size()) {
        return Internal("rollback: the payload of an XOR record of '{}' is gone", r.tensor);
      }
      const ItemView& item = source->items()[r.item];
      REFIT_ASSIGN_OR_RETURN(LocationDecoder decoder,
                             LocationDecoder::Make(item.location_encoding, item.locations,
                                                   item.count, item.span_begin, item.span_end));
      const uint32_t value_width = DTypeSize(item.value_dtype);
      uint64_t done = 0;
      while (true) {
        REFIT_ASSIGN_OR_RETURN(const size_t n, decoder.Next(batch));
        if (n == 0) break;
        // XOR is its own inverse: applying the values again restores the old bits.
        ApplyOpValues(Op::kXor, item.dtype, item.value_dtype, tensor.bytes,
                      std::span<const uint64_t>(batch.data(), n),
                      item.values.subspan(done * value_width, n * value_width), nullptr);
        done += n;
      }
    } else if (r.full) {
      const std::span<std::byte> span = tensor.bytes.subspan(r.span_begin * r.width, r.full_bytes);
      if (r.full_bits_lost) {
        // Nothing to restore: the span keeps the anchor's bits, and the digests are recomputed
        // from the bytes below, once, after every record (AnchorUndo::kNone).
        lost.push_back(i - 1);
        continue;
      }
      if (r.spill_offset != Record::kNotSpilled) {
        Status read = ReadSpill(r.spill_offset, span);
        if (!read.ok()) {
          for (size_t k : lost) (void)store.RehashTensor(records_[k].tensor);
          records_.resize(i);
          return read.WithContext(fmt::format("rollback of '{}'", r.tensor));
        }
      } else {
        std::memcpy(span.data(), r.old_bits.data(), r.old_bits.size());
      }
    } else {
      for (size_t k = 0; k < r.locations.size(); ++k) {
        std::memcpy(tensor.bytes.data() + r.locations[k] * r.width, r.old_bits.data() + k * r.width,
                    r.width);
      }
    }
    REFIT_RETURN_NOT_OK(store.SetDigest(r.tensor, r.digest_before));
    if (r.has_piece) {
      REFIT_RETURN_NOT_OK(store.SetPieceDigest(r.canonical, r.piece, r.piece_digest_before));
    }
  }
  // The tensors a lost span touched hold bits no digest recorded: hash them again, so that the
  // store's digests match its bytes for the anchor that has to follow.
  for (size_t i : lost) REFIT_RETURN_NOT_OK(store.RehashTensor(records_[i].tensor));
  records_.resize(savepoint);
  TrimSpill();
  // Emptied, the log starts afresh; a payload's own rollback leaves its FULL spans written.
  if (savepoint == 0) exact_ = true;
  // Kept payloads no remaining record refers to go too.
  size_t kept = 0;
  for (const Record& r : records_) {
    if (r.reapply && r.payload != kCurrentPayload) kept = std::max(kept, r.payload + 1);
  }
  payloads_.resize(std::min(payloads_.size(), kept));
  return Status::OK();
}

namespace {

/// Reused buffers of one ApplyThroughLoader call: the locations and values of one batch that fall
/// in one piece (gathered for column pieces), and their local locations.
struct PieceScratch {
  std::array<uint64_t, kLocationBatch> batch;
  std::array<uint64_t, kLocationBatch> canonical;
  std::array<uint64_t, kLocationBatch> local;
  std::array<std::byte, kLocationBatch * sizeof(uint64_t)> values;
};

/// What one item does to one piece: its record (created at the first touch, so pieces an item
/// does not reach leave no record) and its digest changes.
struct PieceWrite {
  MutableTensorView local;
  /// The local tensor's device memory; null when it is in host memory (`local.bytes`).
  TensorMemory* device = nullptr;
  size_t record = SIZE_MAX;
  uint64_t local_delta = 0;
  uint64_t piece_delta = 0;
  /// FULL: the digest of the piece's part of the span after the copy (canonical coordinates).
  uint64_t span_digest = 0;
};

std::string ItemContext(const PayloadHeader& header, size_t index) {
  return fmt::format("payload {} of producer {}, item {}", header.ids.payload_id,
                     header.ids.producer_id, index);
}

Result<const CanonicalLayout*> CheckApplicableThroughLoader(const PayloadHeader& header,
                                                            size_t index, const ItemView& item,
                                                            const WeightStore& store) {
  Result<const CanonicalLayout*> layout = store.ResolveCanonical(item.name);
  if (!layout.ok()) return layout.status().WithContext(ItemContext(header, index));
  const CanonicalLayout& resolved = **layout;
  if (resolved.skipped) return &resolved;
  if (resolved.dtype != item.dtype || resolved.shape != item.shape) {
    return InvalidArgument(
        "{}: tensor '{}' is {} {} in the payload but {} {} in the receiver's loader ({})",
        ItemContext(header, index), item.name, DTypeName(item.dtype), ShapeToString(item.shape),
        DTypeName(resolved.dtype), ShapeToString(resolved.shape),
        resolved.pieces.empty()
            ? std::string("no piece held")
            : fmt::format("local tensor '{}'", resolved.pieces[0].local_tensor));
  }
  return &resolved;
}

/// Start the undo record of `write` if the item has not touched its piece yet.
UndoLog::Record& TouchPiece(const ItemView& item, const CanonicalLayout& layout, size_t piece,
                            bool full, uint64_t span_begin, WeightStore& store, PieceWrite& write,
                            std::vector<UndoLog::Record>* records) {
  if (write.record == SIZE_MAX) {
    write.record = records->size();
    const std::string& local_name = layout.pieces[piece].local_tensor;
    records->push_back(
        UndoLog::Record{.tensor = local_name,
                        .width = DTypeSize(item.dtype),
                        .full = full,
                        .span_begin = span_begin,
                        .digest_before = *store.Digest(local_name),
                        .has_piece = true,
                        .canonical = layout.canonical_name,
                        .piece = piece,
                        .piece_digest_before = *store.PieceDigest(layout.canonical_name, piece)});
  }
  return (*records)[write.record];
}

/// Apply a delta item (XOR / OVERWRITE / ADD) to the receiver's pieces of its tensor.
Status ApplyDeltaToPieces(const ItemView& item, const CanonicalLayout& layout, WeightStore& store,
                          std::vector<PieceWrite>& writes, PieceScratch& scratch,
                          std::vector<UndoLog::Record>* records) {
  const uint32_t width = DTypeSize(item.dtype);
  const uint32_t value_width = DTypeSize(item.value_dtype);
  const uint64_t cols = layout.cols;
  REFIT_ASSIGN_OR_RETURN(LocationDecoder decoder,
                         LocationDecoder::Make(item.location_encoding, item.locations, item.count,
                                               item.span_begin, item.span_end));
  // The elements bound for pieces in device memory, one batch per piece, applied when full and
  // at the end of the item.
  std::vector<DeviceDeltaBatch> device_batches(layout.pieces.size());
  const auto flush_device = [&](size_t p) {
    PieceWrite& write = writes[p];
    return device_batches[p].Flush(*write.device, item, (*records)[write.record],
                                   &write.local_delta, &write.piece_delta);
  };
  uint64_t applied = 0;
  while (true) {
    REFIT_ASSIGN_OR_RETURN(const size_t n, decoder.Next(scratch.batch));
    if (n == 0) break;
    const uint64_t* batch_begin = scratch.batch.data();
    const uint64_t* batch_end = batch_begin + n;
    const std::byte* batch_values = item.values.data() + applied * value_width;
    for (size_t p = 0; p < layout.pieces.size(); ++p) {
      const CanonicalPiece& piece = layout.pieces[p];
      // A piece's rows are one contiguous canonical range, so the sorted batch meets them in one
      // sub-range.
      const uint64_t* lo = std::lower_bound(batch_begin, batch_end, piece.row_begin * cols);
      const uint64_t* hi = std::lower_bound(lo, batch_end, piece.row_end * cols);
      if (lo == hi) continue;
      const uint64_t* canonical = lo;
      const uint64_t* local_locations = scratch.local.data();
      const std::byte* values = batch_values + (lo - batch_begin) * value_width;
      size_t m = static_cast<size_t>(hi - lo);
      if (piece.col_begin == 0 && piece.col_end == cols && piece.local_row_length == cols) {
        // Whole rows stored contiguously: the local location is the canonical one shifted
        // (mod 2^64, so a shift down wraps correctly); unshifted (identity, rename, rank 0 of a
        // row shard) the batch is used as it is.
        const uint64_t shift = piece.local_row_offset * cols - piece.row_begin * cols;
        if (shift == 0) {
          local_locations = lo;
        } else {
          for (size_t k = 0; k < m; ++k) scratch.local[k] = lo[k] + shift;
        }
      } else {
        // A column block: gather the locations inside it, with their values. One division per
        // canonical row reached, not per element.
        m = 0;
        uint64_t row = 0;
        uint64_t row_start = 0;
        uint64_t next_row_start = 0;
        for (const uint64_t* it = lo; it < hi; ++it) {
          const uint64_t location = *it;
          if (location >= next_row_start) {
            row = location / cols;
            row_start = row * cols;
            next_row_start = row_start + cols;
          }
          const uint64_t col = location - row_start;
          if (col < piece.col_begin || col >= piece.col_end) continue;
          scratch.canonical[m] = location;
          scratch.local[m] =
              (piece.local_row_offset + row - piece.row_begin) * piece.local_row_length +
              (col - piece.col_begin);
          std::memcpy(scratch.values.data() + m * value_width,
                      batch_values + (it - batch_begin) * value_width, value_width);
          ++m;
        }
        if (m == 0) continue;
        canonical = scratch.canonical.data();
        values = scratch.values.data();
      }
      PieceWrite& write = writes[p];
      const bool first_touch = write.record == SIZE_MAX;
      UndoLog::Record& record = TouchPiece(item, layout, p, false, 0, store, write, records);
      if (write.device != nullptr) {
        device_batches[p].Add(std::span<const uint64_t>(local_locations, m),
                              local_locations == canonical
                                  ? std::span<const uint64_t>()
                                  : std::span<const uint64_t>(canonical, m),
                              std::span<const std::byte>(values, m * value_width));
        if (device_batches[p].size() >= kDeviceBatch - kLocationBatch) {
          REFIT_RETURN_NOT_OK(flush_device(p));
        }
        continue;
      }
      if (first_touch && layout.held_whole()) {
        // Every location of the item lands here: size the record once, as without a loader. A
        // shard's share is unknown in advance, so its records grow instead of over-reserving.
        record.locations.reserve(item.count);
        record.old_bits.reserve(item.count * width);
      }
      const std::span<const uint64_t> local(local_locations, m);
      const size_t old_start = record.old_bits.size();
      ApplyOpValues(item.op, item.dtype, item.value_dtype, write.local.bytes, local,
                    std::span<const std::byte>(values, m * value_width), &record.old_bits);
      record.locations.insert(record.locations.end(), local.begin(), local.end());
      const std::span<const std::byte> old_bits(record.old_bits.data() + old_start, m * width);
      if (local_locations == canonical) {
        // Local and canonical indices coincide: one hash serves both digests.
        uint64_t delta = 0;
        for (size_t k = 0; k < m; ++k) {
          delta += ElementHash(local[k], LoadBits(write.local.bytes, width, local[k])) -
                   ElementHash(local[k], LoadBits(old_bits, width, k));
        }
        write.local_delta += delta;
        write.piece_delta += delta;
        continue;
      }
      for (size_t k = 0; k < m; ++k) {
        const uint64_t new_bits = LoadBits(write.local.bytes, width, local[k]);
        const uint64_t previous = LoadBits(old_bits, width, k);
        write.local_delta += ElementHash(local[k], new_bits) - ElementHash(local[k], previous);
        write.piece_delta +=
            ElementHash(canonical[k], new_bits) - ElementHash(canonical[k], previous);
      }
    }
    applied += n;
  }
  for (size_t p = 0; p < layout.pieces.size(); ++p) {
    if (device_batches[p].size() > 0) REFIT_RETURN_NOT_OK(flush_device(p));
  }
  return Status::OK();
}

/// Add the local and canonical digests of local elements [local_begin, local_begin + count),
/// which hold canonical elements [canonical_begin, …), to `local_sum` and `canonical_sum`.
void DigestSegment(std::span<const std::byte> local_bytes, uint32_t width, uint64_t local_begin,
                   uint64_t canonical_begin, uint64_t count, uint64_t* local_sum,
                   uint64_t* canonical_sum) {
  const uint64_t local = DigestRange(local_bytes, width, local_begin, local_begin + count);
  *local_sum += local;
  // Identity placement (the common case) hashes once.
  *canonical_sum +=
      local_begin == canonical_begin
          ? local
          : RemappedDigestRange(local_bytes, width, local_begin, canonical_begin, count);
}

/// Apply a FULL item (span [span_begin, span_end) of canonical elements) to the receiver's
/// pieces: one memcpy per piece for whole-row pieces, one per row segment for column blocks.
/// `keep_full(record, old_bits)` keeps the old bits of the local range as the log's policy says.
template <typename KeepFull>
Status ApplyFullToPieces(const ItemView& item, const CanonicalLayout& layout, WeightStore& store,
                         std::vector<PieceWrite>& writes, std::vector<UndoLog::Record>* records,
                         KeepFull&& keep_full) {
  const uint32_t width = DTypeSize(item.dtype);
  const uint64_t cols = layout.cols;
  const uint64_t span_begin = item.span_begin;
  const uint64_t span_end = item.span_end;
  if (span_begin >= span_end) return Status::OK();
  for (size_t p = 0; p < layout.pieces.size(); ++p) {
    const CanonicalPiece& piece = layout.pieces[p];
    PieceWrite& write = writes[p];
    // The piece's row segments the span reaches, in order: [canonical begin, end) → local begin.
    struct Segment {
      uint64_t canonical_begin;
      uint64_t canonical_end;
      uint64_t local_begin;
    };
    const auto for_each_segment = [&](auto&& visit) {
      if (piece.col_begin == 0 && piece.col_end == cols && piece.local_row_length == cols) {
        const uint64_t begin = std::max(span_begin, piece.row_begin * cols);
        const uint64_t end = std::min(span_end, piece.row_end * cols);
        if (begin < end) {
          visit(
              Segment{begin, end, begin - piece.row_begin * cols + piece.local_row_offset * cols});
        }
        return;
      }
      const uint64_t first_row = std::max(piece.row_begin, span_begin / cols);
      const uint64_t last_row = std::min(piece.row_end, (span_end - 1) / cols + 1);
      for (uint64_t r = first_row; r < last_row; ++r) {
        const uint64_t begin = std::max(r * cols + piece.col_begin, span_begin);
        const uint64_t end = std::min(r * cols + piece.col_end, span_end);
        if (begin >= end) continue;
        visit(Segment{begin, end,
                      (piece.local_row_offset + r - piece.row_begin) * piece.local_row_length +
                          (begin - r * cols - piece.col_begin)});
      }
    };
    // The local range the segments cover: saved whole, as one FULL record. Between the segments
    // of a column block it may hold elements this item does not write; restoring those to their
    // bits at this point is still exact, because rollback runs newest first.
    uint64_t local_lo = UINT64_MAX;
    uint64_t local_hi = 0;
    for_each_segment([&](const Segment& s) {
      local_lo = std::min(local_lo, s.local_begin);
      local_hi = std::max(local_hi, s.local_begin + (s.canonical_end - s.canonical_begin));
    });
    if (local_lo >= local_hi) continue;
    UndoLog::Record& record = TouchPiece(item, layout, p, true, local_lo, store, write, records);
    if (write.device != nullptr) {
      // In device memory: the local range is read, kept, hashed, patched and hashed again on
      // the host, and written back whole (elements between a column block's segments are
      // written with the bits they had).
      std::vector<std::byte> range((local_hi - local_lo) * width);
      REFIT_RETURN_NOT_OK(ReadDevice(*write.device, local_lo * width, range));
      REFIT_RETURN_NOT_OK(keep_full(record, std::span<const std::byte>(range)));
      uint64_t local_old = 0;
      uint64_t local_new = 0;
      uint64_t piece_old = 0;
      for_each_segment([&](const Segment& s) {
        const uint64_t count = s.canonical_end - s.canonical_begin;
        const uint64_t at = s.local_begin - local_lo;
        local_old += RemappedDigestRange(range, width, at, s.local_begin, count);
        piece_old += RemappedDigestRange(range, width, at, s.canonical_begin, count);
        std::memcpy(range.data() + at * width,
                    item.values.data() + (s.canonical_begin - span_begin) * width, count * width);
        local_new += RemappedDigestRange(range, width, at, s.local_begin, count);
        write.span_digest += RemappedDigestRange(range, width, at, s.canonical_begin, count);
      });
      REFIT_RETURN_NOT_OK(WriteDevice(*write.device, local_lo * width, range));
      write.local_delta = local_new - local_old;
      write.piece_delta = write.span_digest - piece_old;
      continue;
    }
    REFIT_RETURN_NOT_OK(
        keep_full(record, std::span<const std::byte>(write.local.bytes)
                              .subspan(local_lo * width, (local_hi - local_lo) * width)));
    uint64_t local_old = 0;
    uint64_t local_new = 0;
    uint64_t piece_old = 0;
    for_each_segment([&](const Segment& s) {
      const uint64_t count = s.canonical_end - s.canonical_begin;
      DigestSegment(write.local.bytes, width, s.local_begin, s.canonical_begin, count, &local_old,
                    &piece_old);
      std::memcpy(write.local.bytes.data() + s.local_begin * width,
                  item.values.data() + (s.canonical_begin - span_begin) * width, count * width);
      DigestSegment(write.local.bytes, width, s.local_begin, s.canonical_begin, count, &local_new,
                    &write.span_digest);
    });
    write.local_delta = local_new - local_old;
    write.piece_delta = write.span_digest - piece_old;
  }
  return Status::OK();
}

/// Check what an item applied through the loader did to its tensor against the producer's
/// digest. The producer's item digest covers every element of the item; a receiver can check it
/// only when it holds the whole tensor in one piece. A shard's partial digests are verified by
/// the coordinator at flush, which sums the distinct pieces of the shard group.
Status CheckItemThroughLoader(const PayloadHeader& header, size_t index, const ItemView& item,
                              const CanonicalLayout& layout,
                              const std::vector<PieceWrite>& writes) {
  if (!layout.held_whole()) return Status::OK();
  if (item.op == Op::kFull && writes[0].span_digest != item.digest) {
    return DataLoss(
        "payload {} of producer {}, item {} '{}': span digest after apply {:#018x} != "
        "producer's {:#018x}",
        header.ids.payload_id, header.ids.producer_id, index, item.name, writes[0].span_digest,
        item.digest);
  }
  if (item.op != Op::kFull && writes[0].piece_delta != item.digest) {
    return DataLoss(
        "payload {} of producer {}, item {} '{}': digest change after apply {:#018x} != "
        "producer's {:#018x}: the receiver's tensor is not at base version {}",
        header.ids.payload_id, header.ids.producer_id, index, item.name, writes[0].piece_delta,
        item.digest, header.ids.base_version);
  }
  return Status::OK();
}

/// Move the store's local and piece digests by what an item applied through the loader changed.
Status AdjustDigestsThroughLoader(const CanonicalLayout& layout,
                                  const std::vector<PieceWrite>& writes, WeightStore& store) {
  for (size_t p = 0; p < layout.pieces.size(); ++p) {
    if (writes[p].record == SIZE_MAX) continue;
    REFIT_RETURN_NOT_OK(store.AdjustDigest(layout.pieces[p].local_tensor, writes[p].local_delta));
    REFIT_RETURN_NOT_OK(store.AdjustPieceDigest(layout.canonical_name, p, writes[p].piece_delta));
  }
  return Status::OK();
}

/// The items of a payload applied through a loader, grouped so that no two groups write one
/// local tensor: items whose canonical tensors share a local tensor (q, k and v into one fused
/// qkv_proj; every item of one tensor) form one group, in item order. One thread applies a group,
/// so threads never write the same memory, even under a spec whose rules overlap. Items the
/// loader skips belong to no group.
std::vector<std::vector<size_t>> GroupByLocalTensor(
    std::span<const CanonicalLayout* const> layouts) {
  // Union-find over items, joined through the local tensors they write.
  std::vector<size_t> parent(layouts.size());
  for (size_t i = 0; i < parent.size(); ++i) parent[i] = i;
  const auto root = [&](size_t i) {
    while (parent[i] != i) i = parent[i] = parent[parent[i]];
    return i;
  };
  std::map<std::string_view, size_t> writer;  // Local tensor → an item writing it.
  for (size_t i = 0; i < layouts.size(); ++i) {
    if (layouts[i]->skipped) continue;
    for (const CanonicalPiece& piece : layouts[i]->pieces) {
      const auto [it, inserted] = writer.emplace(piece.local_tensor, i);
      if (!inserted) parent[root(i)] = root(it->second);
    }
  }
  std::map<size_t, std::vector<size_t>> by_root;
  for (size_t i = 0; i < layouts.size(); ++i) {
    if (!layouts[i]->skipped && !layouts[i]->pieces.empty()) by_root[root(i)].push_back(i);
  }
  std::vector<std::vector<size_t>> groups;
  groups.reserve(by_root.size());
  for (auto& [first, members] : by_root) groups.push_back(std::move(members));
  return groups;
}

/// ApplyPayload through the store's loader. `rollback_to(savepoint)` undoes the records from
/// `savepoint` on (UndoLog::RollbackTo) and `keep_full` keeps a FULL record's old bits
/// (UndoLog::KeepFullSpan), both of which only ApplyPayload may call; `keep_full` must be safe to
/// call from several threads at once for distinct records. `threads` > 1: a payload (deltas,
/// FULL items or both) whose items write more than one group of local tensors applies the groups
/// in parallel (GroupByLocalTensor), with the same all-or-nothing result.
template <typename RollbackTo, typename KeepFull>
Status ApplyThroughLoader(const DecodedPayload& payload, WeightStore& store,
                          std::vector<UndoLog::Record>* records, RollbackTo&& rollback_to,
                          KeepFull&& keep_full, int threads) {
  const PayloadHeader& header = payload.header();
  const auto items = payload.items();
  std::vector<const CanonicalLayout*> layouts(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    REFIT_ASSIGN_OR_RETURN(layouts[i], CheckApplicableThroughLoader(header, i, items[i], store));
  }

  const size_t savepoint = records->size();
  auto fail = [&](Status status) {
    Status rollback = rollback_to(savepoint);
    if (!rollback.ok()) return rollback.WithContext(status.ToString());
    return status;
  };

  // A payload of several groups: each group on one thread, its items in order, every item's
  // records and digest changes kept apart until all are done. The records then join the log in
  // item order, the digests are checked and moved in item order. The store's digests do not move
  // while the groups apply, so every record starts from the digests before the payload; the
  // payload's records are undone together (newest first), which restores exactly those. A FULL
  // record's old bits are kept as it is made (keep_full), wherever its record later lands in the
  // log: each record knows where its own bits are.
  if (threads > 1 && items.size() > 1) {
    const std::vector<std::vector<size_t>> groups = GroupByLocalTensor(layouts);
    if (groups.size() > 1) {
      struct ItemWrites {
        std::vector<PieceWrite> writes;
        std::vector<UndoLog::Record> records;
      };
      std::vector<ItemWrites> applied_items(items.size());
      const Status applied = internal::ParallelFor(
          std::min<int>(threads, static_cast<int>(groups.size())), groups.size(),
          [&](uint64_t begin, uint64_t end) -> Status {
            auto scratch = std::make_unique<PieceScratch>();
            for (uint64_t g = begin; g < end; ++g) {
              for (const size_t i : groups[g]) {
                const CanonicalLayout& layout = *layouts[i];
                ItemWrites& mine = applied_items[i];
                mine.writes.assign(layout.pieces.size(), PieceWrite{});
                for (size_t p = 0; p < layout.pieces.size(); ++p) {
                  mine.writes[p].local = *store.Find(layout.pieces[p].local_tensor);
                  mine.writes[p].device = store.DeviceMemory(layout.pieces[p].local_tensor);
                }
                REFIT_RETURN_NOT_OK(items[i].op == Op::kFull
                                        ? ApplyFullToPieces(items[i], layout, store, mine.writes,
                                                            &mine.records, keep_full)
                                        : ApplyDeltaToPieces(items[i], layout, store, mine.writes,
                                                             *scratch, &mine.records));
              }
            }
            return Status::OK();
          });
      // Whatever was written is in these records, after an error too: they join the log first.
      for (ItemWrites& mine : applied_items) {
        for (UndoLog::Record& record : mine.records) records->push_back(std::move(record));
      }
      if (!applied.ok()) return fail(applied);
      for (size_t i = 0; i < items.size(); ++i) {
        if (layouts[i]->skipped || layouts[i]->pieces.empty()) continue;
        Status checked =
            CheckItemThroughLoader(header, i, items[i], *layouts[i], applied_items[i].writes);
        if (!checked.ok()) return fail(checked);
      }
      for (size_t i = 0; i < items.size(); ++i) {
        if (layouts[i]->skipped || layouts[i]->pieces.empty()) continue;
        REFIT_RETURN_NOT_OK(
            AdjustDigestsThroughLoader(*layouts[i], applied_items[i].writes, store));
      }
      return Status::OK();
    }
  }

  // One scratch per payload (128 KiB): too large for the stack of an arbitrary caller thread.
  auto scratch = std::make_unique<PieceScratch>();
  std::vector<PieceWrite> writes;
  for (size_t i = 0; i < items.size(); ++i) {
    const ItemView& item = items[i];
    const CanonicalLayout& layout = *layouts[i];
    if (layout.skipped || layout.pieces.empty()) continue;
    writes.assign(layout.pieces.size(), PieceWrite{});
    for (size_t p = 0; p < layout.pieces.size(); ++p) {
      writes[p].local = *store.Find(layout.pieces[p].local_tensor);
      writes[p].device = store.DeviceMemory(layout.pieces[p].local_tensor);
    }
    if (item.op == Op::kFull) {
      Status applied = ApplyFullToPieces(item, layout, store, writes, records, keep_full);
      if (!applied.ok()) return fail(applied);
    } else {
      Status applied = ApplyDeltaToPieces(item, layout, store, writes, *scratch, records);
      if (!applied.ok()) return fail(applied);
    }
    Status checked = CheckItemThroughLoader(header, i, item, layout, writes);
    if (!checked.ok()) return fail(checked);
    REFIT_RETURN_NOT_OK(AdjustDigestsThroughLoader(layout, writes, store));
  }
  return Status::OK();
}

}  // namespace

namespace {

/// The digests of a FULL span: after the copy, and before it unless the span is the whole
/// tensor (whose digest the new one then replaces).
struct FullSpanDigests {
  bool whole = false;
  uint64_t before = 0;
  uint64_t after = 0;
};

/// Copy FULL item `item` into `tensor` block by block, so that each block's old bits are hashed
/// and kept (`keep(old_bits)`) and its new bits copied and hashed while it is in cache: one pass
/// over memory instead of four.
///
/// A device tensor (`device` non-null) is read and written through its boundary in larger blocks;
/// the new digest is that of the item's bytes. Its old bits are read only when they are needed:
/// for a partial span's digest, or when `old_bits_kept` (the log keeps them).
template <typename Keep>
Status CopyFullSpan(const ItemView& item, const MutableTensorView& tensor, TensorMemory* device,
                    bool old_bits_kept, FullSpanDigests& digests, Keep&& keep) {
  const uint32_t width = DTypeSize(item.dtype);
  if (device != nullptr) {
    digests.whole = item.span_begin == 0 && item.span_end * width == device->size_bytes();
    const uint64_t block = std::max<uint64_t>(1, kDeviceFullBlockBytes / width);
    std::vector<std::byte> old;
    for (uint64_t begin = item.span_begin; begin < item.span_end; begin += block) {
      const uint64_t end = std::min(item.span_end, begin + block);
      const uint64_t count = end - begin;
      old.resize(count * width);
      if (old_bits_kept || !digests.whole) {
        REFIT_RETURN_NOT_OK(device->Read(begin * width, old));
        if (!digests.whole) digests.before += RemappedDigestRange(old, width, 0, begin, count);
      }
      REFIT_RETURN_NOT_OK(keep(std::span<const std::byte>(old)));
      const std::span<const std::byte> fresh =
          item.values.subspan((begin - item.span_begin) * width, count * width);
      REFIT_RETURN_NOT_OK(device->Write(begin * width, fresh));
      digests.after += RemappedDigestRange(fresh, width, 0, begin, count);
    }
    return Status::OK();
  }
  digests.whole = item.span_begin == 0 && item.span_end == tensor.numel();
  const uint64_t block = std::max<uint64_t>(1, kFullApplyBlockBytes / width);
  for (uint64_t begin = item.span_begin; begin < item.span_end; begin += block) {
    const uint64_t end = std::min(item.span_end, begin + block);
    const std::span<std::byte> bytes = tensor.bytes.subspan(begin * width, (end - begin) * width);
    if (!digests.whole) digests.before += DigestRange(tensor.bytes, width, begin, end);
    REFIT_RETURN_NOT_OK(keep(std::span<const std::byte>(bytes)));
    std::memcpy(bytes.data(), item.values.data() + (begin - item.span_begin) * width, bytes.size());
    digests.after += DigestRange(tensor.bytes, width, begin, end);
  }
  return Status::OK();
}

/// Check a copied FULL span against the producer's digest and move the tensor's digest.
Status SetFullSpanDigest(const PayloadHeader& header, size_t index, const ItemView& item,
                         const FullSpanDigests& digests, WeightStore& store) {
  if (digests.after != item.digest) {
    return DataLoss(
        "payload {} of producer {}, item {} '{}': span digest after apply {:#018x} != "
        "producer's {:#018x}",
        header.ids.payload_id, header.ids.producer_id, index, item.name, digests.after,
        item.digest);
  }
  if (digests.whole) return store.SetDigest(item.name, digests.after);
  return store.AdjustDigest(item.name, digests.after - digests.before);
}

/// What applying one delta item needs besides the item: the decoded locations of a batch, and the
/// old bits of a batch that the log does not keep (an XOR record's, for the digest only). One per
/// applying thread.
struct DeltaScratch {
  std::array<uint64_t, kLocationBatch> batch;
  std::vector<std::byte> batch_old_bits;
};

/// Apply delta item `item` (not FULL) to `tensor`, recording into `record` the old bits and
/// locations unless the record is one that re-applies the item (Record::reapply), and return the
/// change of the tensor's digest. Touches nothing but `tensor`, `record` and `scratch`, so that
/// items of distinct tensors can be applied at once.
Result<uint64_t> ApplyDeltaItem(const ItemView& item, const MutableTensorView& tensor,
                                TensorMemory* device, UndoLog::Record& record,
                                DeltaScratch& scratch) {
  const uint32_t width = DTypeSize(item.dtype);
  const uint32_t value_width = DTypeSize(item.value_dtype);
  REFIT_ASSIGN_OR_RETURN(LocationDecoder decoder,
                         LocationDecoder::Make(item.location_encoding, item.locations, item.count,
                                               item.span_begin, item.span_end));
  if (device != nullptr) {
    REFIT_DCHECK(!record.reapply, "a device tensor's record re-applies its payload");
    DeviceDeltaBatch pending;
    uint64_t digest_delta = 0;
    uint64_t applied = 0;
    while (true) {
      REFIT_ASSIGN_OR_RETURN(const size_t n, decoder.Next(scratch.batch));
      if (n == 0) break;
      pending.Add(std::span<const uint64_t>(scratch.batch.data(), n), {},
                  item.values.subspan(applied * value_width, n * value_width));
      applied += n;
      if (pending.size() >= kDeviceBatch - kLocationBatch) {
        REFIT_RETURN_NOT_OK(pending.Flush(*device, item, record, &digest_delta, nullptr));
      }
    }
    REFIT_RETURN_NOT_OK(pending.Flush(*device, item, record, &digest_delta, nullptr));
    return digest_delta;
  }
  const bool reapply = record.reapply;
  if (!reapply) {
    record.locations.reserve(item.count);
    record.old_bits.reserve(item.count * width);
  }
  uint64_t digest_delta = 0;
  uint64_t applied = 0;
  while (true) {
    REFIT_ASSIGN_OR_RETURN(const size_t n, decoder.Next(scratch.batch));
    if (n == 0) break;
    const std::span<const uint64_t> locations(scratch.batch.data(), n);
    std::vector<std::byte>& old_out = reapply ? scratch.batch_old_bits : record.old_bits;
    if (reapply) scratch.batch_old_bits.clear();
    const size_t old_start = old_out.size();
    ApplyOpValues(item.op, item.dtype, item.value_dtype, tensor.bytes, locations,
                  item.values.subspan(applied * value_width, n * value_width), &old_out);
    if (!reapply) {
      record.locations.insert(record.locations.end(), locations.begin(), locations.end());
    }
    const std::span<const std::byte> old_bits(old_out.data() + old_start, n * width);
    for (size_t k = 0; k < n; ++k) {
      digest_delta += ElementHash(locations[k], LoadBits(tensor.bytes, width, locations[k])) -
                      ElementHash(locations[k], LoadBits(old_bits, width, k));
    }
    applied += n;
  }
  return digest_delta;
}

/// Check an applied delta item's digest change against the producer's.
Status CheckDeltaDigest(const PayloadHeader& header, size_t index, const ItemView& item,
                        uint64_t digest_delta) {
  if (digest_delta == item.digest) return Status::OK();
  return DataLoss(
      "payload {} of producer {}, item {} '{}': digest change after apply {:#018x} != "
      "producer's {:#018x}: the receiver's tensor is not at base version {}",
      header.ids.payload_id, header.ids.producer_id, index, item.name, digest_delta, item.digest,
      header.ids.base_version);
}

/// The payload's items grouped by tensor, each group in item order: what one thread applies, so
/// that the items of one tensor (which may overlap) keep their order and share nothing with the
/// other groups.
std::vector<std::vector<size_t>> GroupByTensor(std::span<const ItemView> items) {
  std::map<std::string_view, std::vector<size_t>> by_tensor;
  for (size_t i = 0; i < items.size(); ++i) by_tensor[items[i].name].push_back(i);
  std::vector<std::vector<size_t>> groups;
  groups.reserve(by_tensor.size());
  for (auto& [name, indices] : by_tensor) groups.push_back(std::move(indices));
  return groups;
}

}  // namespace

Status ApplyPayload(const DecodedPayload& payload, WeightStore& store, UndoLog* undo,
                    std::vector<std::byte>* payload_bytes, int threads) {
  if (undo == nullptr) return InvalidArgument("ApplyPayload needs an undo log");
  // The loader path is separate so that a store without one runs exactly the loop below.
  if (store.has_loader()) {
    // Records through a loader are made while their items apply, so their spill ranges cannot
    // be set aside beforehand (ReserveFullSpans): with several threads, keeping old bits in the
    // spill file (its end) or marking the log inexact is serialized. Memory needs no lock: each
    // record keeps its own bits.
    std::mutex keep_mutex;
    const bool keep_locked = threads > 1 && undo->options_.anchor_undo != AnchorUndo::kMemory;
    return ApplyThroughLoader(
        payload, store, &undo->records_,
        [&](size_t savepoint) { return undo->RollbackTo(store, savepoint); },
        [&](UndoLog::Record& record, std::span<const std::byte> old_bits) {
          std::unique_lock lock(keep_mutex, std::defer_lock);
          if (keep_locked) lock.lock();
          return undo->KeepFullSpan(record, old_bits);
        },
        threads);
  }
  const PayloadHeader& header = payload.header();
  const auto items = payload.items();
  for (size_t i = 0; i < items.size(); ++i) {
    REFIT_RETURN_NOT_OK(CheckApplicable(header, i, items[i], store));
  }

  const size_t savepoint = undo->records_.size();
  const bool old_bits_kept = undo->options_.anchor_undo != AnchorUndo::kNone;
  auto fail = [&](Status status) {
    Status rollback = undo->RollbackTo(store, savepoint, &payload);
    if (!rollback.ok()) return rollback.WithContext(status.ToString());
    return status;
  };

  // An anchor's payload (every item FULL) of more than one tensor: its tensors are copied in
  // parallel, each on one thread (spans of one tensor stay together: they share its digest), and
  // their digests checked and moved in item order afterwards. Still all or nothing: any error
  // rolls back every item of the payload.
  const bool all_full = std::all_of(items.begin(), items.end(),
                                    [](const ItemView& item) { return item.op == Op::kFull; });
  if (threads > 1 && all_full && items.size() > 1) {
    std::vector<uint64_t> span_bytes;
    for (size_t i = 0; i < items.size(); ++i) {
      const ItemView& item = items[i];
      const uint32_t width = DTypeSize(item.dtype);
      undo->records_.push_back(UndoLog::Record{.tensor = std::string(item.name),
                                               .width = width,
                                               .full = true,
                                               .span_begin = item.span_begin,
                                               .digest_before = *store.Digest(item.name)});
      span_bytes.push_back((item.span_end - item.span_begin) * width);
    }
    const std::span<UndoLog::Record> records =
        std::span<UndoLog::Record>(undo->records_).subspan(savepoint);
    Status reserved = undo->ReserveFullSpans(records, span_bytes);
    if (!reserved.ok()) return fail(reserved);
    const std::vector<std::vector<size_t>> groups = GroupByTensor(items);
    std::vector<FullSpanDigests> digests(items.size());
    Status copied = internal::ParallelFor(
        std::min<int>(threads, static_cast<int>(groups.size())), groups.size(),
        [&](uint64_t begin, uint64_t end) -> Status {
          for (uint64_t g = begin; g < end; ++g) {
            for (size_t i : groups[g]) {
              const MutableTensorView tensor = *store.Find(items[i].name);
              REFIT_RETURN_NOT_OK(CopyFullSpan(items[i], tensor, store.DeviceMemory(items[i].name),
                                               old_bits_kept, digests[i],
                                               [&](std::span<const std::byte> bits) {
                                                 return undo->KeepFullSpan(records[i], bits);
                                               }));
            }
          }
          return Status::OK();
        });
    if (!copied.ok()) return fail(copied);
    for (size_t i = 0; i < items.size(); ++i) {
      Status updated = SetFullSpanDigest(header, i, items[i], digests[i], store);
      if (!updated.ok()) return fail(updated);
    }
    return Status::OK();
  }

  // Bind the payload's XOR records to its bytes, which the log keeps from now on: they are
  // undone by applying them again.
  auto keep_payload = [&] {
    const size_t slot = undo->payloads_.size();
    undo->payloads_.push_back(std::move(*payload_bytes));
    payload_bytes->clear();
    for (size_t r = savepoint; r < undo->records_.size(); ++r) {
      if (undo->records_[r].reapply) undo->records_[r].payload = slot;
    }
  };

  // A delta payload (no FULL item) of more than one tensor: its tensors are applied in parallel,
  // each on one thread (the items of one tensor in order, on the same thread), and their digest
  // changes checked and moved in item order afterwards. Still all or nothing: any error rolls
  // back every item of the payload.
  const bool any_full = std::any_of(items.begin(), items.end(),
                                    [](const ItemView& item) { return item.op == Op::kFull; });
  if (threads > 1 && !any_full && items.size() > 1) {
    const std::vector<std::vector<size_t>> groups = GroupByTensor(items);
    if (groups.size() > 1) {
      bool reapplied = false;
      for (size_t i = 0; i < items.size(); ++i) {
        const ItemView& item = items[i];
        UndoLog::Record& record =
            undo->records_.emplace_back(UndoLog::Record{.tensor = std::string(item.name),
                                                        .width = DTypeSize(item.dtype),
                                                        .digest_before = *store.Digest(item.name)});
        if (payload_bytes != nullptr && item.op == Op::kXor &&
            store.DeviceMemory(item.name) == nullptr) {
          record.reapply = true;
          record.payload = kCurrentPayload;
          record.item = i;
          reapplied = true;
        }
      }
      const std::span<UndoLog::Record> records =
          std::span<UndoLog::Record>(undo->records_).subspan(savepoint);
      std::vector<uint64_t> digest_deltas(items.size());
      // Which items a thread began to apply: after an error, the others were never written, and
      // their records must not re-apply them on rollback.
      std::vector<char> started(items.size(), 0);
      Status applied = internal::ParallelFor(
          std::min<int>(threads, static_cast<int>(groups.size())), groups.size(),
          [&](uint64_t begin, uint64_t end) -> Status {
            auto scratch = std::make_unique<DeltaScratch>();
            for (uint64_t g = begin; g < end; ++g) {
              for (size_t i : groups[g]) {
                started[i] = 1;
                REFIT_ASSIGN_OR_RETURN(
                    digest_deltas[i],
                    ApplyDeltaItem(items[i], *store.Find(items[i].name),
                                   store.DeviceMemory(items[i].name), records[i], *scratch));
              }
            }
            return Status::OK();
          });
      if (!applied.ok()) {
        for (size_t i = 0; i < items.size(); ++i) {
          if (!started[i]) records[i].reapply = false;
        }
        return fail(applied);
      }
      for (size_t i = 0; i < items.size(); ++i) {
        Status checked = CheckDeltaDigest(header, i, items[i], digest_deltas[i]);
        if (!checked.ok()) return fail(checked);
      }
      for (size_t i = 0; i < items.size(); ++i) {
        REFIT_RETURN_NOT_OK(store.AdjustDigest(items[i].name, digest_deltas[i]));
      }
      if (reapplied) keep_payload();
      return Status::OK();
    }
  }

  auto scratch = std::make_unique<DeltaScratch>();
  bool reapplied = false;
  for (size_t i = 0; i < items.size(); ++i) {
    const ItemView& item = items[i];
    MutableTensorView tensor = *store.Find(item.name);
    undo->records_.push_back(UndoLog::Record{.tensor = std::string(item.name),
                                             .width = DTypeSize(item.dtype),
                                             .full = item.op == Op::kFull,
                                             .span_begin = item.span_begin,
                                             .digest_before = *store.Digest(item.name)});
    UndoLog::Record& record = undo->records_.back();

    if (item.op == Op::kFull) {
      FullSpanDigests digests;
      Status copied = CopyFullSpan(
          item, tensor, store.DeviceMemory(item.name), old_bits_kept, digests,
          [&](std::span<const std::byte> bits) { return undo->KeepFullSpan(record, bits); });
      if (!copied.ok()) return fail(copied);
      Status updated = SetFullSpanDigest(header, i, item, digests, store);
      if (!updated.ok()) return fail(updated);
      continue;
    }

    // An XOR item is undone by applying it again when the log can keep its payload (in host
    // memory: on a device, a scatter that failed halfway leaves elements a re-applied XOR would
    // corrupt, so device records keep old bits).
    const bool reapply =
        payload_bytes != nullptr && item.op == Op::kXor && store.DeviceMemory(item.name) == nullptr;
    if (reapply) {
      record.reapply = true;
      record.payload = kCurrentPayload;
      record.item = i;
      reapplied = true;
    }
    Result<uint64_t> digest_delta =
        ApplyDeltaItem(item, tensor, store.DeviceMemory(item.name), record, *scratch);
    if (!digest_delta.ok()) return fail(digest_delta.status());
    Status checked = CheckDeltaDigest(header, i, item, *digest_delta);
    if (!checked.ok()) return fail(checked);
    REFIT_RETURN_NOT_OK(store.AdjustDigest(item.name, *digest_delta));
  }
  if (reapplied) keep_payload();
  return Status::OK();
}

}  // namespace refit
