#include "refit/producer_layout.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <optional>
#include <tuple>
#include <utility>

#include <fmt/ranges.h>

#include "core/digest.h"
#include "refit/status_format.h"

namespace refit {
namespace {

std::string BoxString(std::span<const int64_t> offset, std::span<const int64_t> extent) {
  if (offset.empty()) return "[scalar]";
  std::string out = "[";
  for (size_t d = 0; d < offset.size(); ++d) {
    if (d > 0) out += ", ";
    out += fmt::format("{}:{}", offset[d], offset[d] + extent[d]);
  }
  return out + "]";
}

std::string IndexString(std::span<const int64_t> index) {
  std::string out = "[";
  for (size_t d = 0; d < index.size(); ++d) out += fmt::format("{}{}", d > 0 ? ", " : "", index[d]);
  return out + "]";
}

bool IsEmpty(std::span<const int64_t> extent) {
  return std::any_of(extent.begin(), extent.end(), [](int64_t e) { return e == 0; });
}

uint64_t Volume(std::span<const int64_t> extent) {
  uint64_t n = 1;
  for (int64_t e : extent) n *= static_cast<uint64_t>(e);
  return n;
}

/// Whether two non-empty boxes of one tensor share an element (0-d boxes always do).
bool Overlap(std::span<const int64_t> a_offset, std::span<const int64_t> a_extent,
             std::span<const int64_t> b_offset, std::span<const int64_t> b_extent) {
  for (size_t d = 0; d < a_offset.size(); ++d) {
    if (a_offset[d] >= b_offset[d] + b_extent[d] || b_offset[d] >= a_offset[d] + a_extent[d]) {
      return false;
    }
  }
  return true;
}

/// A box taking part in an overlap search, with what an error should name.
struct SearchBox {
  std::span<const int64_t> offset;
  std::span<const int64_t> extent;
  size_t id;
};

/// Return the first pair of non-empty boxes that overlap (for `allow_equal`, boxes that coincide
/// do not count), by a sweep along dim 0: only boxes whose dim-0 ranges meet are compared.
std::optional<std::pair<size_t, size_t>> FindOverlap(std::vector<SearchBox> boxes,
                                                     bool allow_equal) {
  std::erase_if(boxes, [](const SearchBox& b) { return IsEmpty(b.extent); });
  const auto start = [](const SearchBox& b) { return b.offset.empty() ? 0 : b.offset[0]; };
  const auto end = [](const SearchBox& b) {
    return b.offset.empty() ? 1 : b.offset[0] + b.extent[0];
  };
  std::stable_sort(boxes.begin(), boxes.end(),
                   [&](const SearchBox& a, const SearchBox& b) { return start(a) < start(b); });
  std::vector<const SearchBox*> active;
  for (const SearchBox& box : boxes) {
    std::erase_if(active, [&](const SearchBox* a) { return end(*a) <= start(box); });
    for (const SearchBox* other : active) {
      const bool equal = std::ranges::equal(other->offset, box.offset) &&
                         std::ranges::equal(other->extent, box.extent);
      if (allow_equal && equal) continue;
      if (Overlap(other->offset, other->extent, box.offset, box.extent)) {
        return std::pair{other->id, box.id};
      }
    }
    active.push_back(&box);
  }
  return std::nullopt;
}

Status CheckPiece(const LayoutPiece& piece) {
  const size_t ndim = piece.shape.size();
  const auto where = [&] { return fmt::format("piece of tensor '{}'", piece.tensor); };
  if (piece.offset.size() != ndim || piece.extent.size() != ndim) {
    return InvalidArgument(
        "{}: offset has {} and extent {} dimensions; the tensor's shape {} has {}", where(),
        piece.offset.size(), piece.extent.size(), ShapeToString(piece.shape), ndim);
  }
  if (piece.local_shape.size() != ndim || piece.local_offset.size() != ndim) {
    return InvalidArgument(
        "{} {}: local tensor '{}' of shape {} with local offset of {} dimensions; a local "
        "tensor has the canonical tensor's {} dimensions",
        where(), BoxString(piece.offset, piece.extent), piece.local,
        ShapeToString(piece.local_shape), piece.local_offset.size(), ndim);
  }
  if (!NumElements(piece.shape).ok() || !NumElements(piece.local_shape).ok()) {
    return InvalidArgument("{}: shape {} or local shape {} is not a valid shape", where(),
                           ShapeToString(piece.shape), ShapeToString(piece.local_shape));
  }
  for (size_t d = 0; d < ndim; ++d) {
    // Valid shapes keep every extent ≤ 2^62, so these sums do not overflow once each term is.
    const int64_t offset = piece.offset[d];
    const int64_t extent = piece.extent[d];
    const int64_t local_offset = piece.local_offset[d];
    if (offset < 0 || extent < 0 || local_offset < 0 || offset > piece.shape[d] ||
        extent > piece.shape[d] - offset) {
      return InvalidArgument("{}: box {} on dimension {} is outside the shape {}", where(),
                             BoxString(piece.offset, piece.extent), d, ShapeToString(piece.shape));
    }
    if (local_offset > piece.local_shape[d] || extent > piece.local_shape[d] - local_offset) {
      return InvalidArgument(
          "{} {}: local box {} on dimension {} is outside local tensor '{}' of shape {}", where(),
          BoxString(piece.offset, piece.extent), BoxString(piece.local_offset, piece.extent), d,
          piece.local, ShapeToString(piece.local_shape));
    }
  }
  if (piece.tensor.empty() || piece.local.empty()) {
    return InvalidArgument("a piece needs a tensor name and a local tensor name (got '{}', '{}')",
                           piece.tensor, piece.local);
  }
  return Status::OK();
}

}  // namespace

uint64_t LayoutPiece::numel() const { return Volume(extent); }

std::string LayoutPiece::ToString() const {
  return fmt::format("'{}' {}", tensor, BoxString(offset, extent));
}

Status CheckLayout(const ProducerLayout& layout) {
  std::map<std::string_view, std::vector<size_t>> by_tensor;
  std::map<std::string_view, std::vector<size_t>> by_local;
  for (size_t i = 0; i < layout.pieces.size(); ++i) {
    const LayoutPiece& piece = layout.pieces[i];
    REFIT_RETURN_NOT_OK(CheckPiece(piece));
    by_tensor[piece.tensor].push_back(i);
    by_local[piece.local].push_back(i);
  }
  for (const auto& [name, indices] : by_tensor) {
    const LayoutPiece& first = layout.pieces[indices[0]];
    std::vector<SearchBox> boxes;
    for (size_t i : indices) {
      const LayoutPiece& piece = layout.pieces[i];
      if (piece.dtype != first.dtype || piece.shape != first.shape) {
        return InvalidArgument("tensor '{}' is {} {} in one piece and {} {} in another", name,
                               DTypeName(first.dtype), ShapeToString(first.shape),
                               DTypeName(piece.dtype), ShapeToString(piece.shape));
      }
      boxes.push_back({piece.offset, piece.extent, i});
    }
    if (auto overlap = FindOverlap(std::move(boxes), /*allow_equal=*/false)) {
      return InvalidArgument("pieces {} and {} of one rank overlap",
                             layout.pieces[overlap->first].ToString(),
                             layout.pieces[overlap->second].ToString());
    }
  }
  for (const auto& [name, indices] : by_local) {
    const LayoutPiece& first = layout.pieces[indices[0]];
    std::vector<SearchBox> boxes;
    for (size_t i : indices) {
      const LayoutPiece& piece = layout.pieces[i];
      if (piece.local_shape != first.local_shape || piece.dtype != first.dtype) {
        return InvalidArgument("local tensor '{}' is {} {} for piece {} and {} {} for piece {}",
                               name, DTypeName(first.dtype), ShapeToString(first.local_shape),
                               first.ToString(), DTypeName(piece.dtype),
                               ShapeToString(piece.local_shape), piece.ToString());
      }
      boxes.push_back({piece.local_offset, piece.extent, i});
    }
    if (auto overlap = FindOverlap(std::move(boxes), /*allow_equal=*/false)) {
      return InvalidArgument("pieces {} and {} overlap in local tensor '{}'",
                             layout.pieces[overlap->first].ToString(),
                             layout.pieces[overlap->second].ToString(), name);
    }
  }
  return Status::OK();
}

namespace {

/// Find an element of `shape` that no box holds, by coordinate compression: the box boundaries
/// cut every dimension into ranges, and the cells of that grid are either wholly inside a box or
/// wholly outside all of them. nullopt when the grid is too large to search cheaply.
std::optional<std::vector<int64_t>> FindUncovered(const Shape& shape,
                                                  const std::vector<PlannedBox>& boxes) {
  const size_t ndim = shape.size();
  std::vector<std::vector<int64_t>> cuts(ndim);
  uint64_t cells = 1;
  for (size_t d = 0; d < ndim; ++d) {
    cuts[d] = {0, shape[d]};
    for (const PlannedBox& box : boxes) {
      cuts[d].push_back(box.offset[d]);
      cuts[d].push_back(box.offset[d] + box.extent[d]);
    }
    std::ranges::sort(cuts[d]);
    cuts[d].erase(std::unique(cuts[d].begin(), cuts[d].end()), cuts[d].end());
    cells *= cuts[d].size() - 1;
    if (cells * std::max<size_t>(boxes.size(), 1) > (uint64_t{1} << 24)) return std::nullopt;
  }
  std::vector<size_t> cell(ndim, 0);
  while (true) {
    std::vector<int64_t> corner(ndim);
    for (size_t d = 0; d < ndim; ++d) corner[d] = cuts[d][cell[d]];
    const bool held = std::ranges::any_of(boxes, [&](const PlannedBox& box) {
      for (size_t d = 0; d < ndim; ++d) {
        if (corner[d] < box.offset[d] || corner[d] >= box.offset[d] + box.extent[d]) return false;
      }
      return true;
    });
    if (!held) return corner;
    // The next cell in row-major order.
    size_t d = ndim;
    while (true) {
      if (d == 0) return std::nullopt;
      --d;
      if (++cell[d] + 1 < cuts[d].size()) break;
      cell[d] = 0;
    }
  }
}

std::string BoxList(const std::vector<PlannedBox>& boxes) {
  constexpr size_t kShown = 8;
  std::string out;
  for (size_t i = 0; i < boxes.size() && i < kShown; ++i) {
    out += fmt::format("{}rank {} {}", i > 0 ? ", " : "", boxes[i].sender,
                       BoxString(boxes[i].offset, boxes[i].extent));
  }
  if (boxes.size() > kShown) out += fmt::format(", and {} more", boxes.size() - kShown);
  return out.empty() ? "none" : out;
}

}  // namespace

Result<LayoutPlan> PlanLayouts(std::span<const ProducerLayout> layouts) {
  LayoutPlan plan;
  plan.roles.resize(layouts.size());
  // Per tensor: its first holder, and its boxes keyed by (offset, extent).
  struct Entry {
    const LayoutPiece* first = nullptr;
    uint32_t first_rank = 0;
    std::map<std::pair<std::vector<int64_t>, std::vector<int64_t>>, PlannedBox> boxes;
  };
  std::map<std::string, Entry, std::less<>> tensors;
  for (uint32_t rank = 0; rank < layouts.size(); ++rank) {
    const ProducerLayout& layout = layouts[rank];
    if (Status status = CheckLayout(layout); !status.ok()) {
      return InvalidArgument("rank {}'s layout: {}", rank, status.message());
    }
    plan.roles[rank].assign(layout.pieces.size(), PieceRole::kSend);
    for (size_t i = 0; i < layout.pieces.size(); ++i) {
      const LayoutPiece& piece = layout.pieces[i];
      Entry& entry = tensors[piece.tensor];
      if (entry.first == nullptr) {
        entry.first = &piece;
        entry.first_rank = rank;
      } else if (piece.dtype != entry.first->dtype || piece.shape != entry.first->shape) {
        return InvalidArgument("tensor '{}': rank {} has {} {}, rank {} has {} {}", piece.tensor,
                               entry.first_rank, DTypeName(entry.first->dtype),
                               ShapeToString(entry.first->shape), rank, DTypeName(piece.dtype),
                               ShapeToString(piece.shape));
      }
      if (piece.numel() == 0) {
        plan.roles[rank][i] = PieceRole::kEmpty;
        continue;
      }
      auto [it, inserted] = entry.boxes.try_emplace({piece.offset, piece.extent});
      PlannedBox& box = it->second;
      if (inserted) {
        box.offset = piece.offset;
        box.extent = piece.extent;
        box.sender = rank;  // ranks are visited in order: the first holder is the lowest
      } else {
        box.copies.push_back(rank);
        plan.roles[rank][i] = PieceRole::kCopy;
      }
    }
  }
  for (auto& [name, entry] : tensors) {
    PlannedTensor tensor{name, entry.first->dtype, entry.first->shape, {}};
    for (auto& [key, box] : entry.boxes) tensor.boxes.push_back(std::move(box));
    std::vector<SearchBox> search;
    for (size_t b = 0; b < tensor.boxes.size(); ++b) {
      search.push_back({tensor.boxes[b].offset, tensor.boxes[b].extent, b});
    }
    if (auto overlap = FindOverlap(std::move(search), /*allow_equal=*/true)) {
      const PlannedBox& a = tensor.boxes[overlap->first];
      const PlannedBox& b = tensor.boxes[overlap->second];
      return InvalidArgument(
          "tensor '{}': rank {}'s box {} and rank {}'s box {} overlap without coinciding; "
          "copies of a piece must hold the same box",
          name, a.sender, BoxString(a.offset, a.extent), b.sender, BoxString(b.offset, b.extent));
    }
    uint64_t held = 0;
    for (const PlannedBox& box : tensor.boxes) held += Volume(box.extent);
    const uint64_t numel = Volume(tensor.shape);
    if (held != numel) {
      const std::optional<std::vector<int64_t>> gap = FindUncovered(tensor.shape, tensor.boxes);
      // A rank that states nothing at all is the likelier cause than a miscounted box.
      std::vector<uint32_t> empty;
      for (uint32_t rank = 0; rank < layouts.size(); ++rank) {
        if (layouts[rank].pieces.empty()) empty.push_back(rank);
      }
      return InvalidArgument(
          "tensor '{}' {}: the ranks' pieces hold {} of its {} elements{}; boxes: {}{}", name,
          ShapeToString(tensor.shape), held, numel,
          gap ? fmt::format(" (element {} is held by no rank)", IndexString(*gap)) : "",
          BoxList(tensor.boxes),
          empty.empty() ? ""
                        : fmt::format("; rank(s) {} hold no piece at all (a rank whose layout is "
                                      "missing?)",
                                      fmt::join(empty, ", ")));
    }
    plan.tensors.push_back(std::move(tensor));
  }
  return plan;
}

uint64_t PieceDigest(const LayoutPiece& piece, const TensorView& local) {
  const size_t ndim = piece.shape.size();
  const uint32_t width = DTypeSize(local.dtype);
  if (ndim == 0) return RemappedDigestRange(local.bytes, width, 0, 0, 1);
  if (piece.numel() == 0) return 0;
  // Row-major strides of the canonical and the local tensor.
  std::vector<uint64_t> canonical_stride(ndim, 1);
  std::vector<uint64_t> local_stride(ndim, 1);
  for (size_t d = ndim - 1; d > 0; --d) {
    canonical_stride[d - 1] = canonical_stride[d] * static_cast<uint64_t>(piece.shape[d]);
    local_stride[d - 1] = local_stride[d] * static_cast<uint64_t>(piece.local_shape[d]);
  }
  // One run per index of the leading dimensions: the last dimension is contiguous on both sides.
  const uint64_t run = static_cast<uint64_t>(piece.extent[ndim - 1]);
  std::vector<int64_t> index(ndim, 0);
  uint64_t sum = 0;
  while (true) {
    uint64_t canonical = 0;
    uint64_t local_begin = 0;
    for (size_t d = 0; d < ndim; ++d) {
      canonical += static_cast<uint64_t>(piece.offset[d] + index[d]) * canonical_stride[d];
      local_begin += static_cast<uint64_t>(piece.local_offset[d] + index[d]) * local_stride[d];
    }
    sum += RemappedDigestRange(local.bytes, width, local_begin, canonical, run);
    // The next index of the leading dimensions, in row-major order.
    size_t d = ndim - 1;
    while (true) {
      if (d == 0) return sum;
      --d;
      if (++index[d] < piece.extent[d]) break;
      index[d] = 0;
    }
  }
}

Result<std::vector<std::pair<std::string, uint64_t>>> CheckCopies(
    const LayoutPlan& plan, std::span<const BoxDigest> reports) {
  // (tensor, offset) → the box, and what its holders reported.
  struct Reported {
    const PlannedTensor* tensor;
    const PlannedBox* box;
    std::map<uint32_t, uint64_t> digests;
  };
  std::map<std::pair<std::string_view, std::vector<int64_t>>, Reported> boxes;
  for (const PlannedTensor& tensor : plan.tensors) {
    for (const PlannedBox& box : tensor.boxes) {
      boxes.emplace(std::pair{std::string_view(tensor.name), box.offset},
                    Reported{&tensor, &box, {}});
    }
  }
  for (const BoxDigest& report : reports) {
    auto it = boxes.find(std::pair{std::string_view(report.tensor), report.offset});
    if (it == boxes.end()) {
      return InvalidArgument(
          "rank {} reported a digest of tensor '{}' at {}, a box the plan does "
          "not have",
          report.rank, report.tensor, IndexString(report.offset));
    }
    const PlannedBox& box = *it->second.box;
    if (report.rank != box.sender && !std::ranges::binary_search(box.copies, report.rank)) {
      return InvalidArgument("rank {} reported a digest of tensor '{}' {}, which it does not hold",
                             report.rank, report.tensor, BoxString(box.offset, box.extent));
    }
    it->second.digests[report.rank] = report.digest;
  }
  std::map<std::string, uint64_t> sums;
  for (const auto& [key, reported] : boxes) {
    const PlannedBox& box = *reported.box;
    const std::string where =
        fmt::format("tensor '{}' {}", reported.tensor->name, BoxString(box.offset, box.extent));
    const auto sender = reported.digests.find(box.sender);
    if (sender == reported.digests.end()) {
      return InvalidArgument("{}: no digest from rank {}, which sends it", where, box.sender);
    }
    for (uint32_t rank : box.copies) {
      const auto copy = reported.digests.find(rank);
      if (copy == reported.digests.end()) {
        return InvalidArgument("{}: no digest from rank {}, which holds a copy", where, rank);
      }
      if (copy->second != sender->second) {
        return DataLoss(
            "{}: rank {}'s copy differs from rank {}'s (digest {:016x}, sender {:016x}): a "
            "data-parallel replica diverged",
            where, rank, box.sender, copy->second, sender->second);
      }
    }
    sums[reported.tensor->name] += sender->second;
  }
  // Tensors with no element (a 0 in the shape) have no box and digest 0.
  for (const PlannedTensor& tensor : plan.tensors) sums.try_emplace(tensor.name, 0);
  return std::vector<std::pair<std::string, uint64_t>>(sums.begin(), sums.end());
}

}  // namespace refit
