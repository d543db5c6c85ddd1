#include "refit/apply.h"

#include <array>
#include <cstring>

#include "refit/digest.h"
#include "refit/locations.h"
#include "refit/values.h"

namespace refit {
namespace {

/// Locations decoded per batch: large enough to amortise the decoder call, small enough (32 KiB)
/// to stay in L1/L2 while the values are applied.
constexpr size_t kLocationBatch = 4096;

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
  std::string tensor;
  uint32_t width = 0;
  /// A FULL item: old_bits hold the whole span starting at span_begin.
  bool full = false;
  uint64_t span_begin = 0;
  std::vector<uint64_t> locations;
  std::vector<std::byte> old_bits;
  uint64_t digest_before = 0;
};

UndoLog::UndoLog() = default;
UndoLog::~UndoLog() = default;
UndoLog::UndoLog(UndoLog&&) noexcept = default;
UndoLog& UndoLog::operator=(UndoLog&&) noexcept = default;

void UndoLog::Clear() { records_.clear(); }

size_t UndoLog::records() const { return records_.size(); }

uint64_t UndoLog::bytes() const {
  uint64_t total = 0;
  for (const Record& r : records_)
    total += r.locations.size() * sizeof(uint64_t) + r.old_bits.size();
  return total;
}

Status UndoLog::Rollback(WeightStore& store) { return RollbackTo(store, 0); }

Status UndoLog::RollbackTo(WeightStore& store, size_t savepoint) {
  for (size_t i = savepoint; i < records_.size(); ++i) {
    if (!store.Find(records_[i].tensor).ok()) {
      return NotFound("rollback: tensor '{}' is no longer in the store", records_[i].tensor);
    }
  }
  // Newest first, so an element touched twice ends at its oldest recorded bits.
  for (size_t i = records_.size(); i > savepoint; --i) {
    Record& r = records_[i - 1];
    MutableTensorView tensor = *store.Find(r.tensor);
    if (r.full) {
      std::memcpy(tensor.bytes.data() + r.span_begin * r.width, r.old_bits.data(),
                  r.old_bits.size());
    } else {
      for (size_t k = 0; k < r.locations.size(); ++k) {
        std::memcpy(tensor.bytes.data() + r.locations[k] * r.width, r.old_bits.data() + k * r.width,
                    r.width);
      }
    }
    REFIT_RETURN_NOT_OK(store.SetDigest(r.tensor, r.digest_before));
  }
  records_.resize(savepoint);
  return Status::OK();
}

Status ApplyPayload(const DecodedPayload& payload, WeightStore& store, UndoLog* undo) {
  if (undo == nullptr) return InvalidArgument("ApplyPayload needs an undo log");
  const PayloadHeader& header = payload.header();
  const auto items = payload.items();
  for (size_t i = 0; i < items.size(); ++i) {
    REFIT_RETURN_NOT_OK(CheckApplicable(header, i, items[i], store));
  }

  const size_t savepoint = undo->records_.size();
  auto fail = [&](Status status) {
    Status rollback = undo->RollbackTo(store, savepoint);
    if (!rollback.ok()) return rollback.WithContext(status.ToString());
    return status;
  };

  std::array<uint64_t, kLocationBatch> batch;
  for (size_t i = 0; i < items.size(); ++i) {
    const ItemView& item = items[i];
    MutableTensorView tensor = *store.Find(item.name);
    const uint32_t width = DTypeSize(item.dtype);
    const uint32_t value_width = DTypeSize(item.value_dtype);
    undo->records_.push_back(UndoLog::Record{std::string(item.name),
                                             width,
                                             item.op == Op::kFull,
                                             item.span_begin,
                                             {},
                                             {},
                                             *store.Digest(item.name)});
    UndoLog::Record& record = undo->records_.back();

    if (item.op == Op::kFull) {
      const size_t offset = item.span_begin * width;
      const size_t length = (item.span_end - item.span_begin) * width;
      const uint64_t old_digest = DigestRange(tensor.bytes, width, item.span_begin, item.span_end);
      record.old_bits.assign(tensor.bytes.begin() + offset, tensor.bytes.begin() + offset + length);
      if (length > 0) std::memcpy(tensor.bytes.data() + offset, item.values.data(), length);
      const uint64_t new_digest = DigestRange(tensor.bytes, width, item.span_begin, item.span_end);
      if (new_digest != item.digest) {
        return fail(DataLoss(
            "payload {} of producer {}, item {} '{}': span digest after apply {:#018x} != "
            "producer's {:#018x}",
            header.ids.payload_id, header.ids.producer_id, i, item.name, new_digest, item.digest));
      }
      REFIT_RETURN_NOT_OK(store.AdjustDigest(item.name, new_digest - old_digest));
      continue;
    }

    REFIT_ASSIGN_OR_RETURN(LocationDecoder decoder,
                           LocationDecoder::Make(item.location_encoding, item.locations, item.count,
                                                 item.span_begin, item.span_end));
    record.locations.reserve(item.count);
    record.old_bits.reserve(item.count * width);
    uint64_t digest_delta = 0;
    uint64_t applied = 0;
    while (true) {
      Result<size_t> decoded = decoder.Next(batch);
      if (!decoded.ok()) return fail(decoded.status());
      const size_t n = *decoded;
      if (n == 0) break;
      const std::span<const uint64_t> locations(batch.data(), n);
      const size_t old_start = record.old_bits.size();
      ApplyOpValues(item.op, item.dtype, item.value_dtype, tensor.bytes, locations,
                    item.values.subspan(applied * value_width, n * value_width), &record.old_bits);
      record.locations.insert(record.locations.end(), locations.begin(), locations.end());
      const std::span<const std::byte> old_bits(record.old_bits.data() + old_start, n * width);
      for (size_t k = 0; k < n; ++k) {
        digest_delta += ElementHash(locations[k], LoadBits(tensor.bytes, width, locations[k])) -
                        ElementHash(locations[k], LoadBits(old_bits, width, k));
      }
      applied += n;
    }
    if (digest_delta != item.digest) {
      return fail(
          DataLoss("payload {} of producer {}, item {} '{}': digest change after apply {:#018x} != "
                   "producer's {:#018x}: the receiver's tensor is not at base version {}",
                   header.ids.payload_id, header.ids.producer_id, i, item.name, digest_delta,
                   item.digest, header.ids.base_version));
    }
    REFIT_RETURN_NOT_OK(store.AdjustDigest(item.name, digest_delta));
  }
  return Status::OK();
}

}  // namespace refit
