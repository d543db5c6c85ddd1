// Export chunk sources: what a producer pulls from the trainer, one export chunk at a time, the
// source over a tensor list, and the export tensor — host memory, or a GPU's memory reached
// through the device boundary (refit/tensor_memory.h). Publisher::Sync takes any of them; the
// producer's own sources (device chunks staged to the host within a budget, the pieces of a
// sharded rank) are internal (src/pipeline/staged_source.h, src/pipeline/piece_source.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <stop_token>
#include <string_view>
#include <vector>

#include "refit/status.h"
#include "refit/tensor.h"
#include "refit/tensor_memory.h"

namespace refit {

/// One export chunk as a source yields it: consecutive canonical tensors.
struct ExportChunk {
  /// Borrowed views; the bytes must stay valid until the stream releases the chunk (it drops
  /// `keepalive` and its copy of the views once the chunk is encoded, or at once when the chunk
  /// is not owned or the stream has failed), and in any case until Run returns.
  std::vector<TensorView> tensors;
  /// Optional owner of the bytes (e.g. the host copy of gathered tensors), released with the
  /// chunk so that the source's memory is bounded by ProducerStreamOptions::max_chunks_in_flight.
  std::shared_ptr<const void> keepalive;
  /// The tensors carry their names, dtypes and shapes but no bytes (empty spans): what a source
  /// may yield for a pull that does not read (ChunkPull::read false). The stream checks the
  /// chunking rule on the sizes the shapes give.
  bool unread = false;
};

/// What the stream asks of its source with each pull.
struct ChunkPull {
  /// The chunk's position in canonical order: 0, 1, … over the whole export.
  uint64_t index = 0;
  /// Whether the stream will read this chunk's bytes: true for a chunk this producer owns while
  /// the stream runs. When false the source may yield the chunk unread, so that a source which
  /// must copy bytes in first (device tensors staged to the host, StagedTensorSource below) copies
  /// only the chunks the producer sends.
  bool read = true;
  /// Requested once the stream stops (a failure anywhere): a source waiting for memory to stage
  /// a chunk into stops waiting and yields the chunk unread (the stream drops it).
  std::stop_token stop;
};

/// Yield the next export chunk in canonical order (chunk `pull.index`), or nullopt at the end.
/// Called on the thread that called ProducerStream::Run, one call at a time, for every chunk of
/// the model (owned or not: in a real trainer each pull may take part in collectives that all
/// ranks must join).
/// After the first failure anywhere (its own included) the stream keeps calling it and drops
/// what it yields, until it returns nullopt or fails again: a source that cannot go on after a
/// failure returns nullopt or an error on the next call.
using ChunkSource = std::function<Result<std::optional<ExportChunk>>(const ChunkPull& pull)>;

/// Return a source that yields `tensors` (borrowed) in the chunks PlanChunks makes of them.
/// Thread-safety: the source is a sequential iterator, like every ChunkSource.
ChunkSource TensorListSource(std::vector<TensorView> tensors, uint64_t chunk_bytes);

/// A tensor of a trainer's export: host memory, which the compare reads in place, or memory
/// behind the device boundary, which is staged to the host first.
struct ExportTensor {
  std::string name;
  DType dtype = DType::kUInt8;
  Shape shape;
  /// The bytes, when the tensor is in host memory (`device` null). Borrowed.
  std::span<const std::byte> host;
  /// The tensor's memory behind the device boundary, or null. Borrowed.
  TensorMemory* device = nullptr;

  /// A host tensor.
  static ExportTensor Host(const TensorView& view) {
    return ExportTensor{view.name, view.dtype, view.shape, view.bytes, nullptr};
  }
  uint64_t size_bytes() const { return device != nullptr ? device->size_bytes() : host.size(); }
};

/// Check that `tensor`'s size is its shape's and dtype's. Errors: InvalidArgument naming the
/// tensor, its shape and both sizes.
Status CheckExportTensorSize(const ExportTensor& tensor);

/// The device bytes of the largest chunk PlanChunks makes of `tensors`: the least staging budget
/// a source over them can work with.
uint64_t LargestStagedChunkBytes(std::span<const ExportTensor> tensors, uint64_t chunk_bytes);

}  // namespace refit
