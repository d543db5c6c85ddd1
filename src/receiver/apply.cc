// ApplyPayload (apply.h): a decoded payload applied all or nothing — without a loader here,
// item by item or tensor groups in parallel; through a loader in apply_loader.cc — recording what
// it overwrites in the UndoLog (undo_log.cc).
#include "receiver/apply.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "codec/locations.h"
#include "receiver/apply_internal.h"
#include "refit/status_format.h"
#include "util/check.h"
#include "util/thread_pool.h"

namespace refit::internal {

namespace {

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

/// Apply the decoded `locations` of `item`, whose values start at change `first`, to `tensor`,
/// appending the bits they held to `old_out`; return their digest change,
/// Σ h(i, new) − h(i, old).
uint64_t ApplyDeltaBatch(const ItemView& item, std::span<std::byte> tensor,
                         std::span<const uint64_t> locations, uint64_t first,
                         std::vector<std::byte>& old_out) {
  const uint32_t width = DTypeSize(item.dtype);
  const uint32_t value_width = DTypeSize(item.value_dtype);
  const size_t n = locations.size();
  const size_t old_start = old_out.size();
  ApplyOpValues(item.op, item.dtype, item.value_dtype, tensor, locations,
                item.values.subspan(first * value_width, n * value_width), &old_out);
  const std::span<const std::byte> old_bits(old_out.data() + old_start, n * width);
  return DigestChange(
      n, [&](size_t k) { return locations[k]; },
      [&](size_t k) { return LoadBits(tensor, width, locations[k]); },
      [&](size_t k) { return LoadBits(old_bits, width, k); });
}

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
    digest_delta += ApplyDeltaBatch(item, tensor.bytes, locations, applied, old_out);
    if (!reapply) {
      record.locations.insert(record.locations.end(), locations.begin(), locations.end());
    }
    applied += n;
  }
  return digest_delta;
}

/// A large XOR item of a host tensor whose record re-applies its payload splits into slices at
/// its location marks (DecodedPayload::location_marks): each slice decodes from its mark and
/// applies its own changes, disjoint from every other slice's (locations strictly increase), so
/// the slices of one item run on several threads. Rolling it back re-applies the whole item,
/// which is exact once every slice ran, whatever the order.
bool SplitsIntoSlices(const ItemView& item, std::span<const LocationMark> marks, bool reapply) {
  return reapply && item.op == Op::kXor && !marks.empty();
}

/// Apply the changes [from, end) of `item` to the host tensor `tensor`, decoding from `mark`
/// (null: from the first location); return their digest change. Errors: Internal when the
/// decode, validated before, runs out early; DataLoss as LocationDecoder::Next.
Result<uint64_t> ApplyDeltaSlice(const ItemView& item, const MutableTensorView& tensor,
                                 const LocationMark* mark, uint64_t end, DeltaScratch& scratch) {
  REFIT_ASSIGN_OR_RETURN(LocationDecoder decoder,
                         LocationDecoder::Make(item.location_encoding, item.locations, item.count,
                                               item.span_begin, item.span_end));
  if (mark != nullptr) decoder.Seek(*mark);
  uint64_t applied = mark != nullptr ? mark->emitted : 0;
  uint64_t digest_delta = 0;
  while (applied < end) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(kLocationBatch, end - applied));
    REFIT_ASSIGN_OR_RETURN(const size_t n,
                           decoder.Next(std::span<uint64_t>(scratch.batch).first(want)));
    if (n != want) {
      return Internal("item '{}': {} of the locations {} … {} decoded", item.name, n, applied,
                      applied + want - 1);
    }
    scratch.batch_old_bits.clear();
    digest_delta +=
        ApplyDeltaBatch(item, tensor.bytes, std::span<const uint64_t>(scratch.batch.data(), n),
                        applied, scratch.batch_old_bits);
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
      "producer's {:#018x}: the tensor this receiver holds at version {} differs from the "
      "producer's base (the trainer's baseline, e.g. `refit push --base FILE` or "
      "Publisher.adopt_baseline, is not what the receiver holds)",
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

/// Undo a failed payload's records (those from `savepoint` on) and return why it failed.
Status RollBackPayload(UndoLog& undo, WeightStore& store, size_t savepoint,
                       const DecodedPayload& payload, Status why) {
  Status rollback = undo.RollbackTo(store, savepoint, &payload);
  if (!rollback.ok()) return rollback.WithContext(why.ToString());
  return why;
}

/// Whether XOR item `item` is recorded to be undone by applying it again, with its payload kept
/// (`received` given): in host memory only — on a device, a scatter that failed halfway leaves
/// elements a re-applied XOR would corrupt, so device records keep old bits.
bool ReappliesItem(const ItemView& item, const WeightStore& store,
                   const ValidatedPayload* received) {
  return received != nullptr && item.op == Op::kXor && store.DeviceMemory(item.name) == nullptr;
}

/// An anchor's payload (every item FULL) of more than one tensor on several threads: its tensors
/// are copied in parallel, each on one thread (spans of one tensor stay together: they share its
/// digest), and their digests checked and moved in item order afterwards. Still all or nothing:
/// any error rolls back every item of the payload.
Status ApplyAnchorInParallel(const DecodedPayload& payload, WeightStore& store, UndoLog& undo,
                             int threads) {
  const PayloadHeader& header = payload.header();
  const auto items = payload.items();
  const size_t savepoint = undo.Savepoint();
  auto fail = [&](Status status) {
    return RollBackPayload(undo, store, savepoint, payload, std::move(status));
  };
  std::vector<uint64_t> span_bytes;
  for (const ItemView& item : items) {
    const uint32_t width = DTypeSize(item.dtype);
    undo.AddRecord(UndoLog::Record{.tensor = std::string(item.name),
                                   .width = width,
                                   .full = true,
                                   .span_begin = item.span_begin,
                                   .digest_before = *store.Digest(item.name)});
    span_bytes.push_back((item.span_end - item.span_begin) * width);
  }
  const std::span<UndoLog::Record> records = undo.RecordsFrom(savepoint);
  Status reserved = undo.ReserveFullSpans(records, span_bytes);
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
                                             undo.KeepsFullBits(), digests[i],
                                             [&](std::span<const std::byte> bits) {
                                               return undo.KeepFullSpan(records[i], bits);
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

/// One task of a parallel delta apply: a tensor (its items in order), or a slice of a tensor's
/// one splittable XOR item.
struct DeltaTask {
  size_t group = 0;
  bool slice = false;
  size_t index = 0;  // The slice's index: it starts at mark index − 1 (the first at 0).
};

/// The tasks a delta payload splits into (ApplyDeltaInParallel): one per tensor, or per slice of
/// a tensor's one large XOR item (SplitsIntoSlices).
std::vector<DeltaTask> DeltaTasks(const DecodedPayload& payload,
                                  const std::vector<std::vector<size_t>>& groups,
                                  const WeightStore& store, const ValidatedPayload* received) {
  const auto items = payload.items();
  std::vector<DeltaTask> tasks;
  for (size_t g = 0; g < groups.size(); ++g) {
    const size_t first = groups[g].front();
    const std::span<const LocationMark> marks = payload.location_marks(first);
    if (groups[g].size() == 1 &&
        SplitsIntoSlices(items[first], marks, ReappliesItem(items[first], store, received))) {
      for (size_t k = 0; k <= marks.size(); ++k) tasks.push_back({g, true, k});
    } else {
      tasks.push_back({g, false, 0});
    }
  }
  return tasks;
}

/// A delta payload (no FULL item) of several tasks (DeltaTasks) on several threads: the tasks run
/// in parallel; the digest changes are checked and moved in item order afterwards. Still all or
/// nothing: any error rolls back every item of the payload.
Status ApplyDeltaInParallel(const DecodedPayload& payload, WeightStore& store, UndoLog& undo,
                            ValidatedPayload* received, int threads,
                            const std::vector<std::vector<size_t>>& groups,
                            const std::vector<DeltaTask>& tasks) {
  const PayloadHeader& header = payload.header();
  const auto items = payload.items();
  const size_t savepoint = undo.Savepoint();
  auto fail = [&](Status status) {
    return RollBackPayload(undo, store, savepoint, payload, std::move(status));
  };
  bool reapplied = false;
  for (size_t i = 0; i < items.size(); ++i) {
    const ItemView& item = items[i];
    UndoLog::Record& record =
        undo.AddRecord(UndoLog::Record{.tensor = std::string(item.name),
                                       .width = DTypeSize(item.dtype),
                                       .digest_before = *store.Digest(item.name)});
    if (ReappliesItem(item, store, received)) {
      record.reapply = true;
      record.payload = kCurrentPayload;
      record.item = i;
      reapplied = true;
    }
  }
  const std::span<UndoLog::Record> records = undo.RecordsFrom(savepoint);
  std::vector<uint64_t> digest_deltas(items.size());
  std::vector<uint64_t> slice_digests(tasks.size());
  std::vector<Status> task_status(tasks.size());
  std::vector<char> ran(tasks.size(), 0);
  // Which items a thread began to apply: after an error, the others were never written, and
  // their records must not re-apply them on rollback. A split item always runs whole.
  std::vector<char> started(items.size(), 0);
  for (const DeltaTask& task : tasks) {
    if (task.slice) started[groups[task.group].front()] = 1;
  }
  auto run = [&](size_t t, DeltaScratch& scratch) {
    const DeltaTask& task = tasks[t];
    if (task.slice) {
      const size_t i = groups[task.group].front();
      const std::span<const LocationMark> marks = payload.location_marks(i);
      const LocationMark* mark = task.index == 0 ? nullptr : &marks[task.index - 1];
      const uint64_t end = task.index < marks.size() ? marks[task.index].emitted : items[i].count;
      Result<uint64_t> delta =
          ApplyDeltaSlice(items[i], *store.Find(items[i].name), mark, end, scratch);
      if (delta.ok()) {
        slice_digests[t] = *delta;
      } else {
        task_status[t] = delta.status();
      }
    } else {
      for (size_t i : groups[task.group]) {
        started[i] = 1;
        Result<uint64_t> delta =
            ApplyDeltaItem(items[i], *store.Find(items[i].name), store.DeviceMemory(items[i].name),
                           records[i], scratch);
        if (!delta.ok()) {
          task_status[t] = delta.status();
          break;
        }
        digest_deltas[i] = *delta;
      }
    }
    ran[t] = 1;
  };
  // Every task runs, even after another failed: a split item's record re-applies it whole, which
  // is exact only once all its slices ran.
  const Status pooled =
      internal::ParallelFor(std::min<int>(threads, static_cast<int>(tasks.size())), tasks.size(),
                            [&](uint64_t begin, uint64_t end) -> Status {
                              auto scratch = std::make_unique<DeltaScratch>();
                              for (uint64_t t = begin; t < end; ++t) run(t, *scratch);
                              return Status::OK();
                            });
  if (!pooled.ok()) {
    // No threads (the pool could not start): what did not run, runs here.
    auto scratch = std::make_unique<DeltaScratch>();
    for (size_t t = 0; t < tasks.size(); ++t) {
      if (!ran[t]) run(t, *scratch);
    }
  }
  for (size_t t = 0; t < tasks.size(); ++t) {
    if (tasks[t].slice) digest_deltas[groups[tasks[t].group].front()] += slice_digests[t];
  }
  for (const Status& status : task_status) {
    if (status.ok()) continue;
    for (size_t i = 0; i < items.size(); ++i) {
      if (!started[i]) records[i].reapply = false;
    }
    return fail(status);
  }
  for (size_t i = 0; i < items.size(); ++i) {
    Status checked = CheckDeltaDigest(header, i, items[i], digest_deltas[i]);
    if (!checked.ok()) return fail(checked);
  }
  for (size_t i = 0; i < items.size(); ++i) {
    REFIT_RETURN_NOT_OK(store.AdjustDigest(items[i].name, digest_deltas[i]));
  }
  // The payload's XOR records are undone by applying it again: the log keeps its bytes.
  if (reapplied) undo.KeepPayload(savepoint, std::move(*received));
  return Status::OK();
}

/// Any payload, item by item in order on the calling thread.
Status ApplyInOrder(const DecodedPayload& payload, WeightStore& store, UndoLog& undo,
                    ValidatedPayload* received) {
  const PayloadHeader& header = payload.header();
  const auto items = payload.items();
  const size_t savepoint = undo.Savepoint();
  auto fail = [&](Status status) {
    return RollBackPayload(undo, store, savepoint, payload, std::move(status));
  };
  auto scratch = std::make_unique<DeltaScratch>();
  bool reapplied = false;
  for (size_t i = 0; i < items.size(); ++i) {
    const ItemView& item = items[i];
    MutableTensorView tensor = *store.Find(item.name);
    UndoLog::Record& record =
        undo.AddRecord(UndoLog::Record{.tensor = std::string(item.name),
                                       .width = DTypeSize(item.dtype),
                                       .full = item.op == Op::kFull,
                                       .span_begin = item.span_begin,
                                       .digest_before = *store.Digest(item.name)});
    if (item.op == Op::kFull) {
      FullSpanDigests digests;
      Status copied = CopyFullSpan(
          item, tensor, store.DeviceMemory(item.name), undo.KeepsFullBits(), digests,
          [&](std::span<const std::byte> bits) { return undo.KeepFullSpan(record, bits); });
      if (!copied.ok()) return fail(copied);
      Status updated = SetFullSpanDigest(header, i, item, digests, store);
      if (!updated.ok()) return fail(updated);
      continue;
    }
    if (ReappliesItem(item, store, received)) {
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
  if (reapplied) undo.KeepPayload(savepoint, std::move(*received));
  return Status::OK();
}

}  // namespace

namespace {

/// ApplyPayload of a payload whose context-coded items were expanded (or that has none).
Status ApplyExpanded(const DecodedPayload& payload, WeightStore& store, UndoLog* undo,
                     ValidatedPayload* received, int threads) {
  // The loader path is separate so that a store without one runs exactly the paths below.
  if (store.has_loader()) return internal::ApplyThroughLoader(payload, store, *undo, threads);
  const PayloadHeader& header = payload.header();
  const auto items = payload.items();
  for (size_t i = 0; i < items.size(); ++i) {
    REFIT_RETURN_NOT_OK(CheckApplicable(header, i, items[i], store));
  }
  const bool all_full = std::all_of(items.begin(), items.end(),
                                    [](const ItemView& item) { return item.op == Op::kFull; });
  const bool any_full = std::any_of(items.begin(), items.end(),
                                    [](const ItemView& item) { return item.op == Op::kFull; });
  if (threads > 1 && all_full && items.size() > 1) {
    return ApplyAnchorInParallel(payload, store, *undo, threads);
  }
  if (threads > 1 && !any_full) {
    const std::vector<std::vector<size_t>> groups = GroupByTensor(items);
    const std::vector<DeltaTask> tasks = DeltaTasks(payload, groups, store, received);
    if (tasks.size() > 1) {
      return ApplyDeltaInParallel(payload, store, *undo, received, threads, groups, tasks);
    }
  }
  return ApplyInOrder(payload, store, *undo, received);
}

}  // namespace

Status ApplyPayload(const DecodedPayload& payload, WeightStore& store, UndoLog* undo,
                    ValidatedPayload* received, int threads) {
  if (undo == nullptr) return InvalidArgument("ApplyPayload needs an undo log");
  if (!payload.has_context_items()) return ApplyExpanded(payload, store, undo, received, threads);
  // Decoded against the bits the payload applies to, now that every payload before it has
  // applied (a decode thread ahead of the apply could not know them), then applied as plain XOR
  // items undone from their old bits: applying the kept payload again would decode it against the
  // bits this apply changed. Items of tensors a loader skips stay context-coded and are ignored.
  REFIT_ASSIGN_OR_RETURN(DecodedPayload expanded, internal::ExpandForApply(payload, store));
  return ApplyExpanded(expanded, store, undo, /*received=*/nullptr, threads);
}

}  // namespace refit::internal
