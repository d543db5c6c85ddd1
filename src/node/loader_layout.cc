#include "refit/loader_layout.h"

#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "refit/status_format.h"

namespace refit {
namespace {

/// A contiguous run of canonical rows of the loader's 2-D view, as an N-d box over the row
/// dimensions (one, or two for the stacked expert kinds: rows = shape[0] × shape[1]) together
/// with the local row it starts at.
struct RowBox {
  std::vector<int64_t> offset;
  std::vector<int64_t> extent;
  uint64_t local_row = 0;
};

/// Split the canonical rows [begin, end) of a view whose row dimensions are {outer, inner}
/// (inner = shape[1]) into boxes: a partial first block of `inner` rows, whole blocks, a partial
/// last block. `local_row` is the local row of canonical row `begin`.
std::vector<RowBox> SplitRows(uint64_t begin, uint64_t end, uint64_t inner, uint64_t local_row) {
  std::vector<RowBox> out;
  uint64_t at = begin;
  const auto emit = [&](uint64_t stop) {
    RowBox box;
    if (at % inner == 0 && stop % inner == 0 && stop > at) {
      box.offset = {static_cast<int64_t>(at / inner), 0};
      box.extent = {static_cast<int64_t>((stop - at) / inner), static_cast<int64_t>(inner)};
    } else {
      box.offset = {static_cast<int64_t>(at / inner), static_cast<int64_t>(at % inner)};
      box.extent = {1, static_cast<int64_t>(stop - at)};
    }
    box.local_row = local_row + (at - begin);
    out.push_back(std::move(box));
    at = stop;
  };
  if (at < end && at % inner != 0) emit(std::min(end, (at / inner + 1) * inner));
  if (end / inner * inner > at) emit(end / inner * inner);
  if (at < end) emit(end);
  return out;
}

/// Turn one loader piece of `layout` (a rectangle of its 2-D view, stored in `local`) into the
/// N-d boxes of the canonical tensor it covers, appended to `out`.
Status AppendBoxes(const CanonicalLayout& layout, const CanonicalPiece& piece,
                   const TensorView& local, std::vector<LayoutPiece>* out) {
  const Shape& shape = layout.shape;
  const size_t rank = shape.size();
  const auto unexpressible = [&](std::string_view why) {
    return InvalidArgument(
        "tensor '{}' {} → local tensor '{}' {}: the loader's piece ({}) cannot be described as "
        "boxes: {}",
        layout.canonical_name, ShapeToString(shape), local.name, ShapeToString(local.shape),
        piece.id, why);
  };
  LayoutPiece base{.tensor = layout.canonical_name,
                   .dtype = layout.dtype,
                   .shape = shape,
                   .offset = {},
                   .extent = {},
                   .local = piece.local_tensor,
                   .local_shape = {},
                   .local_offset = {}};
  if (rank == 0) {
    out->push_back(std::move(base));
    return Status::OK();
  }
  // The view's row dimensions: shape[0], or shape[0] × shape[1] for the stacked expert kinds.
  const auto dim0 = static_cast<uint64_t>(shape[0]);
  const size_t row_dims = layout.rows == dim0 ? 1 : 2;
  if (row_dims == 2 && (rank < 3 || layout.rows != dim0 * static_cast<uint64_t>(shape[1]))) {
    return unexpressible("its view has rows that are neither dim 0 nor dims 0 and 1");
  }
  // The columns: [col_begin, col_end) must be whole blocks of the dimensions after the first
  // column dimension, so the rectangle's columns are one box of the column dimensions.
  uint64_t inner = 1;
  for (size_t d = row_dims + 1; d < rank; ++d) inner *= static_cast<uint64_t>(shape[d]);
  const uint64_t row_length = piece.local_row_length;
  if (piece.col_begin % inner != 0 || piece.col_end % inner != 0 || row_length % inner != 0) {
    return unexpressible("its columns split the inner dimensions");
  }
  const Result<uint64_t> local_elements = NumElements(local.shape);
  if (!local_elements.ok() || row_length == 0 || *local_elements % row_length != 0) {
    return unexpressible("the local tensor is not a whole number of its rows");
  }
  const uint64_t local_rows = *local_elements / row_length;
  // The local view: [local rows] or [slots, rows per slot], then the column dimensions with the
  // first one narrowed to the local row length.
  Shape view;
  uint64_t rows_per_slot = 1;
  if (row_dims == 1) {
    view.push_back(static_cast<int64_t>(local_rows));
  } else {
    if (local.shape.size() < 2 || local.shape[1] <= 0 ||
        local_rows % static_cast<uint64_t>(local.shape[1]) != 0) {
      return unexpressible("a stacked tensor's local tensor is not [slots, rows, …]");
    }
    rows_per_slot = static_cast<uint64_t>(local.shape[1]);
    view.push_back(static_cast<int64_t>(local_rows / rows_per_slot));
    view.push_back(static_cast<int64_t>(rows_per_slot));
  }
  if (rank > row_dims) {
    view.push_back(static_cast<int64_t>(row_length / inner));
    for (size_t d = row_dims + 1; d < rank; ++d) view.push_back(shape[d]);
  }

  const uint64_t first_local_row = piece.local_row_offset;
  std::vector<RowBox> rows;
  if (row_dims == 1) {
    rows.push_back(RowBox{{static_cast<int64_t>(piece.row_begin)},
                          {static_cast<int64_t>(piece.row_end - piece.row_begin)},
                          first_local_row});
  } else {
    rows =
        SplitRows(piece.row_begin, piece.row_end, static_cast<uint64_t>(shape[1]), first_local_row);
  }
  for (RowBox& row : rows) {
    LayoutPiece box = base;
    box.offset = std::move(row.offset);
    box.extent = std::move(row.extent);
    if (row_dims == 1) {
      box.local_offset = {static_cast<int64_t>(row.local_row)};
    } else {
      // The box must sit in slots the way it sits in the canonical experts.
      const uint64_t slot = row.local_row / rows_per_slot;
      const uint64_t within = row.local_row % rows_per_slot;
      const auto span = static_cast<uint64_t>(box.extent[1]);
      const bool fits = box.extent[0] == 1 ? within + span <= rows_per_slot
                                           : within == 0 && span == rows_per_slot;
      if (!fits) return unexpressible("its rows do not fall into the local stack's slots alike");
      box.local_offset = {static_cast<int64_t>(slot), static_cast<int64_t>(within)};
    }
    if (rank > row_dims) {
      box.offset.push_back(static_cast<int64_t>(piece.col_begin / inner));
      box.extent.push_back(static_cast<int64_t>((piece.col_end - piece.col_begin) / inner));
      box.local_offset.push_back(0);
      for (size_t d = row_dims + 1; d < rank; ++d) {
        box.offset.push_back(0);
        box.extent.push_back(shape[d]);
        box.local_offset.push_back(0);
      }
    }
    box.local_shape = view;
    out->push_back(std::move(box));
  }
  return Status::OK();
}

}  // namespace

Result<ProducerLayout> ProducerLayoutFromLoader(const LoaderSpec& spec,
                                                std::span<const TensorView> locals,
                                                std::span<const std::string> canonical_names) {
  REFIT_ASSIGN_OR_RETURN(std::unique_ptr<Loader> loader, Loader::ForShapes(spec, locals));
  std::map<std::string_view, const TensorView*> by_name;
  for (const TensorView& local : locals) by_name.emplace(local.name, &local);
  ProducerLayout layout;
  std::set<std::string, std::less<>> used;
  std::set<std::string_view> seen;
  for (const std::string& name : canonical_names) {
    if (!seen.insert(name).second) {
      return InvalidArgument("canonical tensor '{}' is named twice", name);
    }
    REFIT_ASSIGN_OR_RETURN(const CanonicalLayout* resolved, loader->Resolve(name));
    if (resolved->skipped) continue;
    // A vocabulary shard holding only padding has no piece, but is accounted for.
    used.insert(resolved->local_tensor);
    for (const CanonicalPiece& piece : resolved->pieces) {
      auto it = by_name.find(piece.local_tensor);
      if (it == by_name.end()) return Internal("the loader named an unknown local tensor");
      REFIT_RETURN_NOT_OK(AppendBoxes(*resolved, piece, *it->second, &layout.pieces));
    }
  }
  for (const TensorView& local : locals) {
    if (!used.contains(local.name)) {
      return InvalidArgument(
          "local tensor '{}' {} holds no piece of the {} canonical tensors given: is its canonical "
          "name missing from the list, or does a rule map it elsewhere?",
          local.name, ShapeToString(local.shape), canonical_names.size());
    }
  }
  REFIT_RETURN_NOT_OK(CheckLayout(layout));
  return layout;
}

}  // namespace refit
