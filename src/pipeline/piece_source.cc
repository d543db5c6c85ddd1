#include "refit/piece_source.h"

#include <cstring>
#include <memory>
#include <utility>

namespace refit {
namespace {

/// Whether the box of `piece` is one contiguous byte range of its local tensor: it spans every
/// local dimension after its first non-trivial one (a row range, or a single element).
bool ContiguousInLocal(const LayoutPiece& piece) {
  const size_t ndim = piece.extent.size();
  size_t d = 0;
  while (d < ndim && piece.extent[d] == 1) ++d;  // Leading single indices do not break it.
  for (++d; d < ndim; ++d) {
    if (piece.local_offset[d] != 0 || piece.extent[d] != piece.local_shape[d]) return false;
  }
  return true;
}

/// Row-major strides of `shape`, in elements.
std::vector<uint64_t> Strides(const Shape& shape) {
  std::vector<uint64_t> stride(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;)
    stride[d - 1] = stride[d] * static_cast<uint64_t>(shape[d]);
  return stride;
}

/// The element of `local` where the box of `piece` starts.
uint64_t LocalStart(const LayoutPiece& piece) {
  const std::vector<uint64_t> stride = Strides(piece.local_shape);
  uint64_t start = 0;
  for (size_t d = 0; d < stride.size(); ++d) {
    start += static_cast<uint64_t>(piece.local_offset[d]) * stride[d];
  }
  return start;
}

/// Copy the box of `piece` out of `local`, row-major over the box, one last-dimension run at a
/// time.
std::vector<std::byte> CopyBox(const LayoutPiece& piece, const TensorView& local) {
  const uint32_t width = DTypeSize(piece.dtype);
  const size_t ndim = piece.extent.size();
  std::vector<std::byte> out(piece.numel() * width);
  if (out.empty()) return out;
  const std::vector<uint64_t> stride = Strides(piece.local_shape);
  const uint64_t run = static_cast<uint64_t>(piece.extent[ndim - 1]) * width;
  std::vector<int64_t> index(ndim, 0);
  for (uint64_t written = 0; written < out.size(); written += run) {
    uint64_t element = 0;
    for (size_t d = 0; d < ndim; ++d) {
      element += static_cast<uint64_t>(piece.local_offset[d] + index[d]) * stride[d];
    }
    std::memcpy(out.data() + written, local.bytes.data() + element * width, run);
    // The next index of the leading dimensions, row-major.
    for (size_t d = ndim - 1; d-- > 0;) {
      if (++index[d] < piece.extent[d]) break;
      index[d] = 0;
    }
  }
  return out;
}

}  // namespace

std::string PieceKey(const LayoutPiece& piece) { return piece.ToString(); }

CanonicalBox PieceBox(const LayoutPiece& piece) {
  return CanonicalBox{piece.tensor, piece.shape, piece.offset};
}

Result<std::map<std::string, TensorView>> LocalsOf(const ProducerLayout& layout,
                                                   std::span<const TensorView> locals) {
  std::map<std::string, TensorView> by_name;
  for (const TensorView& local : locals) {
    if (!by_name.emplace(local.name, local).second) {
      return InvalidArgument("local tensor '{}' is given twice", local.name);
    }
  }
  for (const LayoutPiece& piece : layout.pieces) {
    auto it = by_name.find(piece.local);
    if (it == by_name.end()) {
      return InvalidArgument("piece {} is stored in local tensor '{}', which was not given",
                             piece.ToString(), piece.local);
    }
    const TensorView& local = it->second;
    // The piece may view the local tensor reshaped (an expert stack [experts, rows, cols] seen as
    // [experts·rows, cols] by a piece of one expert's matrix): row-major, the elements coincide.
    const Result<uint64_t> local_elements = NumElements(local.shape);
    const Result<uint64_t> viewed_elements = NumElements(piece.local_shape);
    const bool same_elements =
        local.shape == piece.local_shape ||
        (local_elements.ok() && viewed_elements.ok() && *local_elements == *viewed_elements);
    if (local.dtype != piece.dtype || !same_elements) {
      return InvalidArgument(
          "piece {} is stored in local tensor '{}' as {} {}, but that tensor is {} {}",
          piece.ToString(), piece.local, DTypeName(piece.dtype), ShapeToString(piece.local_shape),
          DTypeName(local.dtype), ShapeToString(local.shape));
    }
    REFIT_RETURN_NOT_OK(CheckTensorSize(local));
  }
  return by_name;
}

ChunkSource SentPiecesSource(const ProducerLayout& layout, std::span<const PieceRole> roles,
                             const std::map<std::string, TensorView>& locals,
                             uint64_t chunk_bytes) {
  struct Walk {
    std::vector<const LayoutPiece*> pieces;
    std::vector<ChunkRange> chunks;
    const std::map<std::string, TensorView>* locals = nullptr;
    size_t next = 0;
  };
  auto walk = std::make_shared<Walk>();
  walk->locals = &locals;
  std::vector<uint64_t> sizes;
  for (size_t i = 0; i < layout.pieces.size(); ++i) {
    if (roles[i] != PieceRole::kSend) continue;
    walk->pieces.push_back(&layout.pieces[i]);
    sizes.push_back(layout.pieces[i].numel() * DTypeSize(layout.pieces[i].dtype));
  }
  walk->chunks = PlanChunks(sizes, chunk_bytes);
  return [walk]() -> Result<std::optional<ExportChunk>> {
    if (walk->next == walk->chunks.size()) return std::optional<ExportChunk>();
    const ChunkRange& range = walk->chunks[walk->next++];
    ExportChunk chunk;
    auto copies = std::make_shared<std::vector<std::vector<std::byte>>>();
    copies->reserve(range.end - range.begin);
    for (size_t p = range.begin; p < range.end; ++p) {
      const LayoutPiece& piece = *walk->pieces[p];
      const TensorView& local = walk->locals->at(piece.local);
      const uint32_t width = DTypeSize(piece.dtype);
      std::span<const std::byte> bytes;
      if (ContiguousInLocal(piece)) {
        bytes = local.bytes.subspan(LocalStart(piece) * width, piece.numel() * width);
      } else {
        copies->push_back(CopyBox(piece, local));
        bytes = copies->back();
      }
      chunk.tensors.push_back(TensorView{PieceKey(piece), piece.dtype, piece.extent, bytes});
    }
    if (!copies->empty()) chunk.keepalive = std::move(copies);
    return std::optional<ExportChunk>(std::move(chunk));
  };
}

}  // namespace refit
