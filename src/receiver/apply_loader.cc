// ApplyPayload through a loader (apply_internal.h): each changed canonical element mapped to its
// local element in the receiver's pieces — whole rows, column blocks, fused qkv / gate_up, expert
// slices — in O(changes), host or device memory, with the piece digests kept current.
#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <memory>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "codec/locations.h"
#include "receiver/apply_internal.h"
#include "refit/loader.h"
#include "refit/status_format.h"
#include "util/check.h"
#include "util/mutex.h"
#include "util/thread_pool.h"

namespace refit::internal {
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
        const uint64_t delta = DigestChange(
            m, [&](size_t k) { return local[k]; },
            [&](size_t k) { return LoadBits(write.local.bytes, width, local[k]); },
            [&](size_t k) { return LoadBits(old_bits, width, k); });
        write.local_delta += delta;
        write.piece_delta += delta;
        continue;
      }
      const auto now = [&](size_t k) { return LoadBits(write.local.bytes, width, local[k]); };
      const auto before = [&](size_t k) { return LoadBits(old_bits, width, k); };
      write.local_delta += DigestChange(
          m, [&](size_t k) { return local[k]; }, now, before);
      write.piece_delta += DigestChange(
          m, [&](size_t k) { return canonical[k]; }, now, before);
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
        "producer's {:#018x}: the tensor this receiver holds at version {} differs from the "
        "producer's base (the trainer's baseline, e.g. `refit push --base FILE` or "
        "Publisher.adopt_baseline, is not what the receiver holds)",
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

}  // namespace

Status ApplyThroughLoader(const DecodedPayload& payload, WeightStore& store, UndoLog& undo,
                          int threads) {
  const PayloadHeader& header = payload.header();
  const auto items = payload.items();
  std::vector<const CanonicalLayout*> layouts(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    REFIT_ASSIGN_OR_RETURN(layouts[i], CheckApplicableThroughLoader(header, i, items[i], store));
  }

  const size_t savepoint = undo.Savepoint();
  auto fail = [&](Status status) {
    Status rollback = undo.RollbackTo(store, savepoint);
    if (!rollback.ok()) return rollback.WithContext(status.ToString());
    return status;
  };
  // Records through a loader are made while their items apply, so their spill ranges cannot be
  // set aside beforehand (ReserveFullSpans): with several threads, keeping old bits in the spill
  // file (its end) or marking the log inexact is serialized. Memory needs no lock: each record
  // keeps its own bits.
  Mutex keep_mutex;
  const bool keep_locked = threads > 1 && !undo.KeepsFullBitsPerRecord();
  auto keep_full = [&](UndoLog::Record& record, std::span<const std::byte> old_bits) {
    if (!keep_locked) return undo.KeepFullSpan(record, old_bits);
    MutexLock lock(keep_mutex);
    return undo.KeepFullSpan(record, old_bits);
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
      for (ItemWrites& mine : applied_items) undo.AppendRecords(std::move(mine.records));
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
  // One item's records, made as it applies; they join the log before anything can undo them.
  std::vector<UndoLog::Record> records;
  for (size_t i = 0; i < items.size(); ++i) {
    const ItemView& item = items[i];
    const CanonicalLayout& layout = *layouts[i];
    if (layout.skipped || layout.pieces.empty()) continue;
    writes.assign(layout.pieces.size(), PieceWrite{});
    for (size_t p = 0; p < layout.pieces.size(); ++p) {
      writes[p].local = *store.Find(layout.pieces[p].local_tensor);
      writes[p].device = store.DeviceMemory(layout.pieces[p].local_tensor);
    }
    Status applied = item.op == Op::kFull
                         ? ApplyFullToPieces(item, layout, store, writes, &records, keep_full)
                         : ApplyDeltaToPieces(item, layout, store, writes, *scratch, &records);
    undo.AppendRecords(std::move(records));
    if (!applied.ok()) return fail(applied);
    Status checked = CheckItemThroughLoader(header, i, item, layout, writes);
    if (!checked.ok()) return fail(checked);
    REFIT_RETURN_NOT_OK(AdjustDigestsThroughLoader(layout, writes, store));
  }
  return Status::OK();
}

}  // namespace refit::internal
