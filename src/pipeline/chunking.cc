// The export chunking rule and the list source built on it.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "pipeline/chunking.h"
#include "pipeline/staged_source.h"
#include "refit/chunk_source.h"

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
  std::vector<ExportTensor> host;
  host.reserve(tensors.size());
  for (const TensorView& tensor : tensors) host.push_back(ExportTensor::Host(tensor));
  return StagedTensorSource(std::move(host), chunk_bytes, nullptr);
}

Status AdoptOwnedBaseline(internal::DeltaTracker& tracker, std::span<const TensorView> model,
                          uint64_t chunk_bytes, uint32_t producer_id, uint32_t num_producers) {
  std::vector<ExportTensor> host;
  host.reserve(model.size());
  for (const TensorView& tensor : model) host.push_back(ExportTensor::Host(tensor));
  return AdoptOwnedBaseline(tracker, host, chunk_bytes, producer_id, num_producers, nullptr);
}

Status AdoptOwnedBaseline(internal::DeltaTracker& tracker, std::span<const ExportTensor> model,
                          uint64_t chunk_bytes, uint32_t producer_id, uint32_t num_producers,
                          StagingPool* pool) {
  std::vector<uint64_t> sizes;
  sizes.reserve(model.size());
  for (const ExportTensor& tensor : model) sizes.push_back(tensor.size_bytes());
  const std::vector<ChunkRange> chunks = PlanChunks(sizes, chunk_bytes);
  for (size_t k = 0; k < chunks.size(); ++k) {
    if (!OwnsChunk(k, producer_id, num_producers)) continue;
    for (size_t t = chunks[k].begin; t < chunks[k].end; ++t) {
      const ExportTensor& tensor = model[t];
      if (tensor.device == nullptr) {
        REFIT_RETURN_NOT_OK(tracker.AdoptBaseline(
            TensorView{tensor.name, tensor.dtype, tensor.shape, tensor.host}));
        continue;
      }
      REFIT_RETURN_NOT_OK(CheckExportTensorSize(tensor));
      if (tensor.size_bytes() == 0) {
        REFIT_RETURN_NOT_OK(
            tracker.AdoptBaseline(TensorView{tensor.name, tensor.dtype, tensor.shape, {}}));
        continue;
      }
      REFIT_ASSIGN_OR_RETURN(
          std::shared_ptr<StagingPool::Buffer> staged,
          AcquireStaging(pool, tensor.size_bytes(), fmt::format("tensor '{}'", tensor.name)));
      REFIT_RETURN_NOT_OK(
          tensor.device->Read(0, staged->bytes())
              .WithContext(fmt::format("adopting tensor '{}' as the baseline", tensor.name)));
      REFIT_RETURN_NOT_OK(tracker.AdoptBaseline(
          TensorView{tensor.name, tensor.dtype, tensor.shape, staged->bytes()}));
    }
  }
  // Also for a producer that owns none of the chunks: its empty baseline is complete, and its
  // next transfer must be a delta like everyone else's.
  return tracker.MarkBaselineAdopted();
}

}  // namespace refit
