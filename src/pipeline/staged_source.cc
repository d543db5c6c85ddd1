// The whole-model export source over host and device tensors (staged_source.h): chunks with
// device tensors are staged into a bounded pool as the stream pulls the ones it reads.
#include <algorithm>
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
#include "refit/status_format.h"

namespace refit {

namespace {

/// The bytes of the device tensors in `range`.
uint64_t DeviceBytes(std::span<const ExportTensor> tensors, const ChunkRange& range) {
  uint64_t bytes = 0;
  for (size_t t = range.begin; t < range.end; ++t) {
    if (tensors[t].device != nullptr) bytes += tensors[t].size_bytes();
  }
  return bytes;
}

std::vector<uint64_t> Sizes(std::span<const ExportTensor> tensors) {
  std::vector<uint64_t> sizes;
  sizes.reserve(tensors.size());
  for (const ExportTensor& tensor : tensors) sizes.push_back(tensor.size_bytes());
  return sizes;
}

}  // namespace

Status CheckExportTensorSize(const ExportTensor& tensor) {
  if (tensor.device == nullptr) {
    return CheckTensorSize(TensorView{tensor.name, tensor.dtype, tensor.shape, tensor.host});
  }
  const Result<uint64_t> bytes = TensorBytes(tensor.shape, tensor.dtype);
  if (!bytes.ok()) return bytes.status().WithContext(fmt::format("tensor '{}'", tensor.name));
  if (*bytes != tensor.size_bytes()) {
    return InvalidArgument("tensor '{}': shape {} of {} needs {} bytes, {} holds {}", tensor.name,
                           ShapeToString(tensor.shape), DTypeName(tensor.dtype), *bytes,
                           tensor.device->description(), tensor.size_bytes());
  }
  return Status::OK();
}

Result<std::shared_ptr<StagingPool::Buffer>> AcquireStaging(StagingPool* pool, uint64_t bytes,
                                                            std::string_view what,
                                                            std::stop_token stop) {
  if (pool == nullptr || bytes > pool->budget_bytes()) {
    return InvalidArgument(
        "{} holds {} bytes in device memory, more than the staging budget of {} bytes (raise "
        "staging_bytes to at least this)",
        what, bytes, pool == nullptr ? 0 : pool->budget_bytes());
  }
  Result<std::shared_ptr<StagingPool::Buffer>> acquired = pool->Acquire(bytes, std::move(stop));
  if (acquired.status().code() == StatusCode::kCancelled) {
    return std::shared_ptr<StagingPool::Buffer>();
  }
  return acquired;
}

uint64_t LargestStagedChunkBytes(std::span<const ExportTensor> tensors, uint64_t chunk_bytes) {
  uint64_t largest = 0;
  for (const ChunkRange& range : PlanChunks(Sizes(tensors), chunk_bytes)) {
    largest = std::max(largest, DeviceBytes(tensors, range));
  }
  return largest;
}

ChunkSource StagedTensorSource(std::vector<ExportTensor> tensors, uint64_t chunk_bytes,
                               std::shared_ptr<StagingPool> pool) {
  // The walk is shared: std::function copies its callable, and a copy (one a caller keeps before
  // passing the source on) must continue the same walk rather than replay it.
  struct Walk {
    std::vector<ExportTensor> tensors;
    std::vector<ChunkRange> chunks;
    std::shared_ptr<StagingPool> pool;
    size_t next = 0;
  };
  auto walk = std::make_shared<Walk>();
  walk->chunks = PlanChunks(Sizes(tensors), chunk_bytes);
  walk->tensors = std::move(tensors);
  walk->pool = std::move(pool);
  return [walk](const ChunkPull& pull) -> Result<std::optional<ExportChunk>> {
    if (walk->next == walk->chunks.size()) return std::optional<ExportChunk>();
    const ChunkRange& range = walk->chunks[walk->next++];
    const std::span<const ExportTensor> listed(walk->tensors);
    const uint64_t device_bytes = DeviceBytes(listed, range);
    ExportChunk chunk;
    std::shared_ptr<StagingPool::Buffer> staged;
    if (device_bytes > 0 && pull.read) {
      REFIT_ASSIGN_OR_RETURN(
          staged, AcquireStaging(
                      walk->pool.get(), device_bytes,
                      fmt::format("the chunk starting with tensor '{}'", listed[range.begin].name),
                      pull.stop));
    }
    chunk.unread = device_bytes > 0 && staged == nullptr;
    uint64_t offset = 0;
    for (size_t t = range.begin; t < range.end; ++t) {
      const ExportTensor& tensor = listed[t];
      // An unread chunk is checked on its shapes' sizes: they must be the ones it was planned on.
      if (chunk.unread || tensor.device != nullptr) {
        REFIT_RETURN_NOT_OK(CheckExportTensorSize(tensor));
      }
      std::span<const std::byte> bytes;
      if (chunk.unread || (tensor.device != nullptr && tensor.size_bytes() == 0)) {
        bytes =
            {};  // An empty device tensor has nothing to stage (and may share a chunk with none).
      } else if (tensor.device == nullptr) {
        bytes = tensor.host;
      } else {
        const std::span<std::byte> out = staged->bytes().subspan(offset, tensor.size_bytes());
        REFIT_RETURN_NOT_OK(tensor.device->Read(0, out).WithContext(
            fmt::format("staging tensor '{}'", tensor.name)));
        offset += out.size();
        bytes = out;
      }
      chunk.tensors.push_back(TensorView{tensor.name, tensor.dtype, tensor.shape, bytes});
    }
    if (staged != nullptr) chunk.keepalive = std::move(staged);
    return std::optional<ExportChunk>(std::move(chunk));
  };
}

}  // namespace refit
