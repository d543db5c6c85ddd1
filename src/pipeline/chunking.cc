// The export chunking rule and the list source built on it.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "refit/chunk_source.h"
#include "refit/chunking.h"

namespace refit {

bool Chunker::Add(uint64_t tensor_bytes) {
  // While open, chunk_bytes_ < target_bytes_, so the subtraction cannot wrap and the comparison
  // is exact even for sizes near 2^64.
  const bool starts = !open_ || tensor_bytes > target_bytes_ - chunk_bytes_;
  if (starts) {
    ++chunks_;
    chunk_bytes_ = tensor_bytes;
  } else {
    chunk_bytes_ += tensor_bytes;
  }
  open_ = chunk_bytes_ < target_bytes_;
  return starts;
}

std::vector<ChunkRange> PlanChunks(std::span<const uint64_t> tensor_bytes, uint64_t target_bytes) {
  std::vector<ChunkRange> chunks;
  Chunker chunker(target_bytes);
  for (size_t i = 0; i < tensor_bytes.size(); ++i) {
    if (chunker.Add(tensor_bytes[i])) chunks.push_back(ChunkRange{i, i, 0});
    chunks.back().end = i + 1;
    chunks.back().bytes = chunker.chunk_bytes();
  }
  return chunks;
}

ChunkSource TensorListSource(std::vector<TensorView> tensors, uint64_t chunk_bytes) {
  std::vector<uint64_t> sizes;
  sizes.reserve(tensors.size());
  for (const TensorView& tensor : tensors) sizes.push_back(tensor.bytes.size());
  // The walk is shared: std::function copies its callable, and a copy (one a caller keeps before
  // passing the source on) must continue the same walk rather than replay it.
  struct Walk {
    std::vector<TensorView> tensors;
    std::vector<ChunkRange> chunks;
    size_t next = 0;
  };
  auto walk = std::make_shared<Walk>();
  walk->chunks = PlanChunks(sizes, chunk_bytes);
  walk->tensors = std::move(tensors);
  return [walk]() -> Result<std::optional<ExportChunk>> {
    if (walk->next == walk->chunks.size()) return std::optional<ExportChunk>();
    const ChunkRange& range = walk->chunks[walk->next++];
    ExportChunk chunk;
    chunk.tensors.assign(walk->tensors.begin() + static_cast<ptrdiff_t>(range.begin),
                         walk->tensors.begin() + static_cast<ptrdiff_t>(range.end));
    return std::optional<ExportChunk>(std::move(chunk));
  };
}

Status AdoptOwnedBaseline(DeltaTracker& tracker, std::span<const TensorView> model,
                          uint64_t chunk_bytes, uint32_t producer_id, uint32_t num_producers) {
  std::vector<uint64_t> sizes;
  sizes.reserve(model.size());
  for (const TensorView& tensor : model) sizes.push_back(tensor.bytes.size());
  const std::vector<ChunkRange> chunks = PlanChunks(sizes, chunk_bytes);
  for (size_t k = 0; k < chunks.size(); ++k) {
    if (!OwnsChunk(k, producer_id, num_producers)) continue;
    for (size_t t = chunks[k].begin; t < chunks[k].end; ++t) {
      REFIT_RETURN_NOT_OK(tracker.AdoptBaseline(model[t]));
    }
  }
  // Also for a producer that owns none of the chunks: its empty baseline is complete, and its
  // next transfer must be a delta like everyone else's.
  return tracker.MarkBaselineAdopted();
}

}  // namespace refit
