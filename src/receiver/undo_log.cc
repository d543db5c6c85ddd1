// UndoLog (apply.h): the old bits a transfer overwrote — in memory, spilled to a file, or
// kept as the payload an XOR item is undone by — and the rollback that restores them, host or
// device memory, newest first.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>

#include "codec/locations.h"
#include "receiver/apply_internal.h"
#include "refit/status_format.h"
#include "util/check.h"

namespace refit {
namespace {
constexpr std::pair<AnchorUndo, std::string_view> kAnchorUndoNames[] = {
    {AnchorUndo::kMemory, "memory"}, {AnchorUndo::kFile, "file"}, {AnchorUndo::kNone, "none"}};
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

namespace internal {
namespace {
std::string SpillDirectory(const UndoLogOptions& options) {
  if (!options.spill_directory.empty()) return options.spill_directory;
  const char* tmpdir = std::getenv("TMPDIR");
  return tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp";
}
}  // namespace

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

size_t UndoLog::Savepoint() const { return records_.size(); }

UndoLog::Record& UndoLog::AddRecord(Record record) {
  return records_.emplace_back(std::move(record));
}

void UndoLog::AppendRecords(std::vector<Record>&& records) {
  for (Record& record : records) records_.push_back(std::move(record));
  records.clear();
}

std::span<UndoLog::Record> UndoLog::RecordsFrom(size_t savepoint) {
  return std::span<Record>(records_).subspan(savepoint);
}

void UndoLog::KeepPayload(size_t savepoint, ValidatedPayload payload) {
  const size_t slot = payloads_.size();
  payloads_.push_back(std::move(payload));
  for (size_t r = savepoint; r < records_.size(); ++r) {
    if (records_[r].reapply) records_[r].payload = slot;
  }
}

uint64_t UndoLog::bytes() const {
  uint64_t total = payload_bytes();
  for (const Record& r : records_)
    total += r.locations.size() * sizeof(uint64_t) + r.old_bits.size();
  return total;
}

uint64_t UndoLog::payload_bytes() const {
  uint64_t total = 0;
  for (const ValidatedPayload& payload : payloads_) total += payload.size();
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
          const ValidatedPayload& kept = payloads_[r.payload];
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
  if (kept < payloads_.size())
    payloads_.erase(payloads_.begin() + static_cast<ptrdiff_t>(kept), payloads_.end());
  return Status::OK();
}

}  // namespace internal
}  // namespace refit
