// The stream of a sharded trainer rank: the boxes it sends (refit/producer_layout.h), each as a
// tensor its tracker keeps in the box's own numbering (DeltaTracker::Place), chunked by the
// export-chunk rule.
#pragma once

#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "codec/canonical_box.h"
#include "pipeline/staging_pool.h"
#include "refit/chunk_source.h"
#include "refit/producer_layout.h"
#include "refit/status.h"
#include "refit/tensor.h"

namespace refit {

/// The name a rank's tracker keeps `piece` under: "'w' [0:3, 0:8]" (LayoutPiece::ToString), unique
/// within a rank (CheckLayout refuses overlapping pieces) and stable while the layout is.
std::string PieceKey(const LayoutPiece& piece);

/// The canonical box of `piece` (DeltaTracker::Place).
CanonicalBox PieceBox(const LayoutPiece& piece);

/// Check that every piece's local tensor is among `locals`, with the piece's dtype and local
/// shape, and return the locals by name. Errors: InvalidArgument naming the piece and the local
/// tensor (missing, another dtype or shape, a size that is not its shape's, two locals of one
/// name).
Result<std::map<std::string, ExportTensor>> LocalsOf(const ProducerLayout& layout,
                                                     std::span<const ExportTensor> locals);

/// Return a source of the pieces whose role is kSend, in layout order, each as a tensor named
/// PieceKey with the box's extent as its shape: a view of its local tensor where that is host
/// memory and the box is contiguous there (a row range), else a copy made when the chunk is
/// pulled and released with it — device pieces into one buffer of `pool` per chunk, read only
/// when the pull reads the chunk (as StagedTensorSource). Chunked by PlanChunks over the boxes'
/// bytes with `chunk_bytes`. `layout`, `roles` and `locals` are borrowed until the stream ends.
/// Precondition: LocalsOf accepted the layout and roles has one entry per piece; `pool` may be
/// null when no local is in device memory.
/// Errors of a pull: as StagedTensorSource's, naming the piece.
ChunkSource SentPiecesSource(const ProducerLayout& layout, std::span<const PieceRole> roles,
                             const std::map<std::string, ExportTensor>& locals,
                             uint64_t chunk_bytes, std::shared_ptr<StagingPool> pool = nullptr);

/// The staging budget SentPiecesSource and CopyDigest need for this rank's device pieces: its
/// largest chunk's device bytes, or its largest copied device box if that is larger.
uint64_t StagingBytesNeeded(const ProducerLayout& layout, std::span<const PieceRole> roles,
                            const std::map<std::string, ExportTensor>& locals,
                            uint64_t chunk_bytes);

/// The canonical digest of `piece` (PieceDigest) read from `local`: in place from host memory,
/// through a buffer of `pool` from device memory. Errors: InvalidArgument when the box exceeds the
/// pool's budget; the backend's.
Result<uint64_t> CopyDigest(const LayoutPiece& piece, const ExportTensor& local, StagingPool* pool);

}  // namespace refit
