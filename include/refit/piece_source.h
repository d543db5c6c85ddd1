// The stream of a sharded trainer rank: the boxes it sends (refit/producer_layout.h), each as a
// tensor its tracker keeps in the box's own numbering (DeltaTracker::Place), chunked by the
// export-chunk rule.
#pragma once

#include <map>
#include <span>
#include <string>
#include <vector>

#include "refit/canonical_box.h"
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
/// tensor (missing, another dtype or shape, two locals of one name).
Result<std::map<std::string, TensorView>> LocalsOf(const ProducerLayout& layout,
                                                   std::span<const TensorView> locals);

/// Return a source of the pieces whose role is kSend, in layout order, each as a tensor named
/// PieceKey with the box's extent as its shape: a view of its local tensor where the box is
/// contiguous there (a row range), else a copy made when the chunk is pulled and released with
/// it. Chunked by PlanChunks over the boxes' bytes with `chunk_bytes`. `layout`, `roles` and
/// `locals` are borrowed until the stream ends. Precondition: LocalsOf accepted the layout and
/// roles has one entry per piece.
ChunkSource SentPiecesSource(const ProducerLayout& layout, std::span<const PieceRole> roles,
                             const std::map<std::string, TensorView>& locals, uint64_t chunk_bytes);

}  // namespace refit
