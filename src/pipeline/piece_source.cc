#include "pipeline/piece_source.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>

#include <fmt/format.h>

#include "pipeline/chunking.h"
#include "pipeline/staged_source.h"
#include "refit/status_format.h"

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

/// Copy the box of `piece` out of `local` into `out` (box bytes), row-major over the box: one
/// range where the box is contiguous in the local tensor, else one last-dimension run at a time.
/// Errors: the device backend's, naming the piece.
Status ReadBox(const LayoutPiece& piece, const ExportTensor& local, std::span<std::byte> out) {
  const uint32_t width = DTypeSize(piece.dtype);
  const auto read = [&](uint64_t local_byte, std::span<std::byte> to) -> Status {
    if (local.device == nullptr) {
      std::memcpy(to.data(), local.host.data() + local_byte, to.size());
      return Status::OK();
    }
    return local.device->Read(local_byte, to)
        .WithContext(
            fmt::format("staging piece {} from local tensor '{}'", piece.ToString(), local.name));
  };
  if (out.empty()) return Status::OK();
  if (ContiguousInLocal(piece)) return read(LocalStart(piece) * width, out);
  const size_t ndim = piece.extent.size();
  const std::vector<uint64_t> stride = Strides(piece.local_shape);
  const uint64_t run = static_cast<uint64_t>(piece.extent[ndim - 1]) * width;
  std::vector<int64_t> index(ndim, 0);
  for (uint64_t written = 0; written < out.size(); written += run) {
    uint64_t element = 0;
    for (size_t d = 0; d < ndim; ++d) {
      element += static_cast<uint64_t>(piece.local_offset[d] + index[d]) * stride[d];
    }
    REFIT_RETURN_NOT_OK(read(element * width, out.subspan(written, run)));
    // The next index of the leading dimensions, row-major.
    for (size_t d = ndim - 1; d-- > 0;) {
      if (++index[d] < piece.extent[d]) break;
      index[d] = 0;
    }
  }
  return Status::OK();
}

uint64_t BoxBytes(const LayoutPiece& piece) { return piece.numel() * DTypeSize(piece.dtype); }

}  // namespace

std::string PieceKey(const LayoutPiece& piece) { return piece.ToString(); }

CanonicalBox PieceBox(const LayoutPiece& piece) {
  return CanonicalBox{piece.tensor, piece.shape, piece.offset};
}

Result<std::map<std::string, ExportTensor>> LocalsOf(const ProducerLayout& layout,
                                                     std::span<const ExportTensor> locals) {
  std::map<std::string, ExportTensor> by_name;
  for (const ExportTensor& local : locals) {
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
    const ExportTensor& local = it->second;
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
    REFIT_RETURN_NOT_OK(CheckExportTensorSize(local));
  }
  return by_name;
}

uint64_t StagingBytesNeeded(const ProducerLayout& layout, std::span<const PieceRole> roles,
                            const std::map<std::string, ExportTensor>& locals,
                            uint64_t chunk_bytes) {
  std::vector<uint64_t> sizes;
  std::vector<uint64_t> device_sizes;
  uint64_t largest_copy = 0;
  for (size_t i = 0; i < layout.pieces.size(); ++i) {
    const LayoutPiece& piece = layout.pieces[i];
    const bool device = locals.at(piece.local).device != nullptr;
    if (roles[i] == PieceRole::kSend) {
      sizes.push_back(BoxBytes(piece));
      device_sizes.push_back(device ? BoxBytes(piece) : 0);
    } else if (roles[i] == PieceRole::kCopy && device) {
      largest_copy = std::max(largest_copy, BoxBytes(piece));
    }
  }
  uint64_t largest_chunk = 0;
  for (const ChunkRange& range : PlanChunks(sizes, chunk_bytes)) {
    uint64_t bytes = 0;
    for (size_t p = range.begin; p < range.end; ++p) bytes += device_sizes[p];
    largest_chunk = std::max(largest_chunk, bytes);
  }
  return std::max(largest_chunk, largest_copy);
}

Result<uint64_t> CopyDigest(const LayoutPiece& piece, const ExportTensor& local,
                            StagingPool* pool) {
  if (local.device == nullptr) {
    return PieceDigest(piece, TensorView{local.name, local.dtype, local.shape, local.host});
  }
  const uint64_t bytes = BoxBytes(piece);
  if (bytes == 0) return uint64_t{0};
  REFIT_ASSIGN_OR_RETURN(std::shared_ptr<StagingPool::Buffer> staged,
                         AcquireStaging(pool, bytes, fmt::format("piece {}", piece.ToString())));
  REFIT_RETURN_NOT_OK(ReadBox(piece, local, staged->bytes()));
  // The staged box is a local tensor of its own: the whole of it, at local offset 0.
  LayoutPiece box = piece;
  box.local_shape = piece.extent;
  box.local_offset.assign(piece.extent.size(), 0);
  return PieceDigest(box, TensorView{local.name, local.dtype, piece.extent, staged->bytes()});
}

ChunkSource SentPiecesSource(const ProducerLayout& layout, std::span<const PieceRole> roles,
                             const std::map<std::string, ExportTensor>& locals,
                             uint64_t chunk_bytes, std::shared_ptr<StagingPool> pool) {
  struct Walk {
    std::vector<const LayoutPiece*> pieces;
    std::vector<ChunkRange> chunks;
    const std::map<std::string, ExportTensor>* locals = nullptr;
    std::shared_ptr<StagingPool> pool;
    size_t next = 0;
  };
  auto walk = std::make_shared<Walk>();
  walk->locals = &locals;
  walk->pool = std::move(pool);
  std::vector<uint64_t> sizes;
  for (size_t i = 0; i < layout.pieces.size(); ++i) {
    if (roles[i] != PieceRole::kSend) continue;
    walk->pieces.push_back(&layout.pieces[i]);
    sizes.push_back(BoxBytes(layout.pieces[i]));
  }
  walk->chunks = PlanChunks(sizes, chunk_bytes);
  return [walk](const ChunkPull& pull) -> Result<std::optional<ExportChunk>> {
    if (walk->next == walk->chunks.size()) return std::optional<ExportChunk>();
    const ChunkRange& range = walk->chunks[walk->next++];
    // What the chunk copies: the device pieces (staged through the pool) and the host pieces not
    // contiguous in their local tensor (copied on the heap).
    uint64_t staged_bytes = 0;
    for (size_t p = range.begin; p < range.end; ++p) {
      const LayoutPiece& piece = *walk->pieces[p];
      if (walk->locals->at(piece.local).device != nullptr) staged_bytes += BoxBytes(piece);
    }
    ExportChunk chunk;
    std::shared_ptr<StagingPool::Buffer> staged;
    if (staged_bytes > 0 && pull.read) {
      REFIT_ASSIGN_OR_RETURN(staged,
                             AcquireStaging(walk->pool.get(), staged_bytes,
                                            fmt::format("the chunk starting with piece {}",
                                                        walk->pieces[range.begin]->ToString()),
                                            pull.stop));
    }
    chunk.unread = staged_bytes > 0 && staged == nullptr;
    auto copies = std::make_shared<std::vector<std::vector<std::byte>>>();
    copies->reserve(range.end - range.begin);
    uint64_t offset = 0;
    for (size_t p = range.begin; p < range.end; ++p) {
      const LayoutPiece& piece = *walk->pieces[p];
      const ExportTensor& local = walk->locals->at(piece.local);
      const uint32_t width = DTypeSize(piece.dtype);
      std::span<const std::byte> bytes;
      if (chunk.unread || (local.device != nullptr && BoxBytes(piece) == 0)) {
        bytes = {};  // An empty device box has nothing to stage (and may share a chunk with none).
      } else if (local.device != nullptr) {
        const std::span<std::byte> out = staged->bytes().subspan(offset, BoxBytes(piece));
        REFIT_RETURN_NOT_OK(ReadBox(piece, local, out));
        offset += out.size();
        bytes = out;
      } else if (ContiguousInLocal(piece)) {
        bytes = local.host.subspan(LocalStart(piece) * width, piece.numel() * width);
      } else {
        copies->emplace_back(BoxBytes(piece));
        REFIT_RETURN_NOT_OK(ReadBox(piece, local, copies->back()));
        bytes = copies->back();
      }
      chunk.tensors.push_back(TensorView{PieceKey(piece), piece.dtype, piece.extent, bytes});
    }
    if (staged != nullptr || !copies->empty()) {
      chunk.keepalive =
          std::make_shared<std::pair<std::shared_ptr<StagingPool::Buffer>, decltype(copies)>>(
              std::move(staged), std::move(copies));
    }
    return std::optional<ExportChunk>(std::move(chunk));
  };
}

}  // namespace refit
