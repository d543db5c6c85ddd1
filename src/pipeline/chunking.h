// The export chunking rule: how the canonical tensor list is cut into export chunks, and which
// producer owns each chunk. Every producer of a transfer and every transfer must apply the same
// rule with the same target to the same canonical list, or tensors silently move between
// producers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace refit {

/// The place of one export chunk in the canonical tensor list: tensors [begin, end), holding
/// `bytes` bytes in total.
struct ChunkRange {
  size_t begin = 0;
  size_t end = 0;
  uint64_t bytes = 0;

  friend bool operator==(const ChunkRange&, const ChunkRange&) = default;
};

/// The export chunking rule (upstream `iter_sparse_weight_chunks`), applied one tensor at a time
/// so that a trainer can form chunks while its export is still producing tensors:
///   - tensors are appended while the chunk's running byte total stays ≤ the target;
///   - a tensor that would push a non-empty chunk over the target starts the next chunk;
///   - once the total reaches or passes the target after an append, the chunk closes;
///   - so a tensor larger than the target forms a chunk of its own.
/// Ownership (`chunk_index % W`) is only stable while every producer and every transfer uses
/// this same rule with the same target, the same canonical order and the same shapes.
///
/// Thread-safety: none; a value type, one per tensor walk.
class Chunker {
 public:
  /// A target of 0 closes every chunk after its first tensor.
  explicit Chunker(uint64_t target_bytes) : target_bytes_(target_bytes) {}

  /// Place the next tensor, of `tensor_bytes` bytes. Return true when it starts a new chunk,
  /// i.e. the previous chunk (if any) is complete without it. O(1).
  bool Add(uint64_t tensor_bytes);

  /// Number of chunks started so far; the chunk of the last added tensor is `chunks() - 1`.
  uint64_t chunks() const { return chunks_; }
  /// Bytes in the chunk of the last added tensor.
  uint64_t chunk_bytes() const { return chunk_bytes_; }
  uint64_t target_bytes() const { return target_bytes_; }

 private:
  uint64_t target_bytes_;
  uint64_t chunks_ = 0;
  uint64_t chunk_bytes_ = 0;
  // True while the current chunk may still take tensors (started and below the target).
  bool open_ = false;
};

/// Split tensors of the given sizes, in canonical order, into chunks by the Chunker rule.
/// An empty list gives no chunks. O(number of tensors).
std::vector<ChunkRange> PlanChunks(std::span<const uint64_t> tensor_bytes, uint64_t target_bytes);

/// Return whether producer `producer_id` of `num_producers` owns chunk `chunk_index`: the
/// upstream rule `chunk_index % num_producers == producer_id`, recomputed on every walk, never
/// stored. Precondition: num_producers > 0.
constexpr bool OwnsChunk(uint64_t chunk_index, uint32_t producer_id, uint32_t num_producers) {
  return chunk_index % num_producers == producer_id;
}

}  // namespace refit
