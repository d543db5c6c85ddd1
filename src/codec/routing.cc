#include "codec/routing.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <span>
#include <utility>

#include <fmt/format.h>

#include "codec/locations.h"
#include "core/digest.h"
#include "refit/status_format.h"

namespace refit {
namespace {

std::string RectString(const HeldRect& rect) {
  return fmt::format("rows {}:{} cols {}:{}", rect.row_begin, rect.row_end, rect.col_begin,
                     rect.col_end);
}

// An item of the same tensor and op as `view`, without span, locations or values.
Item EmptyLike(const ItemView& view) {
  Item item;
  item.name = std::string(view.name);
  item.dtype = view.dtype;
  item.shape = view.shape;
  item.op = view.op;
  item.value_dtype = view.value_dtype;
  return item;
}

Item OwnedItem(const ItemView& view) {
  Item item = EmptyLike(view);
  item.span_begin = view.span_begin;
  item.span_end = view.span_end;
  item.count = view.count;
  item.location_encoding = view.location_encoding;
  item.locations.assign(view.locations.begin(), view.locations.end());
  item.values.assign(view.values.begin(), view.values.end());
  item.digest = view.digest;
  return item;
}

}  // namespace

Result<ItemRoute> ItemRoute::Make(const HeldRegions& regions) {
  ItemRoute route;
  route.regions_ = regions;
  for (const auto& [name, region] : regions) {
    TensorCut cut{region.skipped, region.cols, region.rects};
    if (cut.skipped) {
      route.tensors_.emplace(name, std::move(cut));
      continue;
    }
    if (cut.cols == 0) {
      return InvalidArgument("held region of tensor '{}': cols is 0", name);
    }
    for (const HeldRect& rect : cut.rects) {
      if (rect.row_begin >= rect.row_end || rect.col_begin >= rect.col_end ||
          rect.col_end > cut.cols) {
        return InvalidArgument(
            "held region of tensor '{}': rectangle {} is empty, inverted or leaves its {} columns",
            name, RectString(rect), cut.cols);
      }
    }
    std::sort(cut.rects.begin(), cut.rects.end(), [](const HeldRect& a, const HeldRect& b) {
      return std::pair(a.row_begin, a.col_begin) < std::pair(b.row_begin, b.col_begin);
    });
    for (size_t i = 0; i < cut.rects.size(); ++i) {
      for (size_t j = i + 1; j < cut.rects.size(); ++j) {
        const HeldRect& a = cut.rects[i];
        const HeldRect& b = cut.rects[j];
        if (b.row_begin >= a.row_end) break;  // Sorted by row_begin: no later rect meets a.
        if (b.col_begin < a.col_end && a.col_begin < b.col_end) {
          return InvalidArgument("held region of tensor '{}': rectangles {} and {} overlap", name,
                                 RectString(a), RectString(b));
        }
      }
    }
    route.tensors_.emplace(name, std::move(cut));
  }
  return route;
}

bool ItemRoute::CoversAll(const TensorCut& cut, uint64_t numel) {
  uint64_t held = 0;
  for (const HeldRect& rect : cut.rects) {
    held += (rect.row_end - rect.row_begin) * (rect.col_end - rect.col_begin);
  }
  // The rectangles are disjoint and inside the tensor (checked by Make and Cut).
  return held == numel;
}

void ItemRoute::HeldRuns(const TensorCut& cut, uint64_t span_begin, uint64_t span_end,
                         std::vector<std::pair<uint64_t, uint64_t>>* runs) {
  if (span_begin >= span_end) return;
  const uint64_t first_row = span_begin / cut.cols;
  const uint64_t last_row = (span_end - 1) / cut.cols;
  for (const HeldRect& rect : cut.rects) {
    // A rectangle of whole rows is one run over all of them.
    if (rect.col_begin == 0 && rect.col_end == cut.cols) {
      const uint64_t begin = std::max(rect.row_begin * cut.cols, span_begin);
      const uint64_t end = std::min(rect.row_end * cut.cols, span_end);
      if (begin < end) runs->emplace_back(begin, end);
      continue;
    }
    const uint64_t row_lo = std::max(rect.row_begin, first_row);
    const uint64_t row_hi = std::min(rect.row_end, last_row + 1);
    for (uint64_t r = row_lo; r < row_hi; ++r) {
      const uint64_t begin = std::max(r * cut.cols + rect.col_begin, span_begin);
      const uint64_t end = std::min(r * cut.cols + rect.col_end, span_end);
      if (begin < end) runs->emplace_back(begin, end);
    }
  }
  // The rectangles are disjoint, so are their runs: sort, then join the ones that touch.
  std::sort(runs->begin(), runs->end());
  size_t kept = 0;
  for (size_t i = 0; i < runs->size(); ++i) {
    if (kept > 0 && (*runs)[kept - 1].second == (*runs)[i].first) {
      (*runs)[kept - 1].second = (*runs)[i].second;
    } else {
      (*runs)[kept++] = (*runs)[i];
    }
  }
  runs->resize(kept);
}

Status ItemRoute::Cut(const ItemView& item, std::vector<Item>* out) const {
  const auto found = tensors_.find(item.name);
  if (found == tensors_.end()) {
    out->push_back(OwnedItem(item));
    return Status::OK();
  }
  const TensorCut& cut = found->second;
  if (cut.skipped) return Status::OK();
  REFIT_ASSIGN_OR_RETURN(const uint64_t numel, NumElements(item.shape));
  if (numel % cut.cols != 0) {
    return InvalidArgument(
        "routing tensor '{}': its {} elements are not rows of the {} columns its receivers hold",
        item.name, numel, cut.cols);
  }
  const uint64_t rows = numel / cut.cols;
  for (const HeldRect& rect : cut.rects) {
    if (rect.row_end > rows) {
      return InvalidArgument("routing tensor '{}': held rectangle {} leaves its {} rows", item.name,
                             RectString(rect), rows);
    }
  }
  if (CoversAll(cut, numel)) {
    out->push_back(OwnedItem(item));
    return Status::OK();
  }
  std::vector<std::pair<uint64_t, uint64_t>> runs;
  HeldRuns(cut, item.span_begin, item.span_end, &runs);
  if (runs.empty()) return Status::OK();

  if (item.op == Op::kFull) {
    const uint32_t width = DTypeSize(item.dtype);
    for (const auto& [begin, end] : runs) {
      Item part = EmptyLike(item);
      part.span_begin = begin;
      part.span_end = end;
      part.count = end - begin;
      part.location_encoding = LocationEncoding::kAll;
      const auto values =
          item.values.subspan((begin - item.span_begin) * width, (end - begin) * width);
      part.values.assign(values.begin(), values.end());
      part.digest =
          RemappedDigestRange(item.values, width, begin - item.span_begin, begin, end - begin);
      out->push_back(std::move(part));
    }
    return Status::OK();
  }

  // A delta: keep the locations inside the runs, and their values, in order.
  const uint32_t value_width = DTypeSize(item.value_dtype);
  REFIT_ASSIGN_OR_RETURN(LocationDecoder decoder,
                         LocationDecoder::Make(item.location_encoding, item.locations, item.count,
                                               item.span_begin, item.span_end));
  std::vector<uint64_t> kept;
  std::vector<std::byte> values;
  std::array<uint64_t, 1024> batch;
  uint64_t index = 0;
  size_t run = 0;
  while (true) {
    REFIT_ASSIGN_OR_RETURN(const size_t n, decoder.Next(batch));
    if (n == 0) break;
    for (size_t k = 0; k < n; ++k, ++index) {
      const uint64_t location = batch[k];
      while (run < runs.size() && runs[run].second <= location) ++run;
      if (run == runs.size()) break;
      if (location < runs[run].first) continue;
      kept.push_back(location);
      const auto value = item.values.subspan(index * value_width, value_width);
      values.insert(values.end(), value.begin(), value.end());
    }
    if (run == runs.size()) break;
  }
  if (kept.empty()) return Status::OK();
  if (kept.size() == item.count) {
    out->push_back(OwnedItem(item));
    return Status::OK();
  }
  Item part = EmptyLike(item);
  part.span_begin = item.span_begin;
  part.span_end = item.span_end;
  part.count = kept.size();
  REFIT_ASSIGN_OR_RETURN(part.location_encoding,
                         ChooseAndEncodeLocations(kept, part.span_begin, part.span_end,
                                                  std::nullopt, &part.locations));
  part.values = std::move(values);
  part.digest = item.digest;
  out->push_back(std::move(part));
  return Status::OK();
}

}  // namespace refit
