// Producer layouts: which boxes of which canonical tensors a trainer rank holds, and the plan of
// which rank sends each box.
//
// A sharded trainer rank does not hold canonical tensors. Under FSDP2 it holds 1/W of the rows of
// every parameter; under Megatron a TP slice of its pipeline stage's layers, fused (linear_qkv
// holds the q, k and v rows of its query groups); data-parallel ranks hold copies. A rank says
// what it holds as *pieces*: an N-d box of one canonical tensor, stored in one of its local
// tensors at an N-d offset. Rank 0 gathers every rank's layout and plans once:
//
//   rank 0: [0:3, 0:8] of w ─┐                     w [6, 8]
//   rank 1: [3:6, 0:8] of w ─┼─ PlanLayouts ─▶     box [0:3, 0:8] sent by rank 0
//   rank 2: [0:3, 0:8] of w ─┘  (tiling check)     box [3:6, 0:8] sent by rank 1
//                                                  rank 2 holds a copy of [0:3, 0:8]: it reports
//                                                  the box's digest, which must equal rank 0's
//
// The distinct boxes of each canonical tensor must tile it exactly; boxes that coincide are
// copies (data-parallel replicas, `Replicate`, kv heads replicated over TP), sent by the lowest
// rank that holds them. A box's digest is Σ h(canonical index, bits) over its elements, so the
// distinct boxes of a tensor add up to the whole tensor's state digest (src/core/digest.h).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "refit/dtype.h"
#include "refit/status.h"
#include "refit/tensor.h"

namespace refit {

/// One N-d box of a canonical tensor, held in one local tensor of a rank.
struct LayoutPiece {
  /// The canonical tensor: its name, dtype and whole shape.
  std::string tensor;
  DType dtype = DType::kUInt8;
  Shape shape;
  /// The box: elements [offset[d], offset[d] + extent[d]) on every dimension d. An extent may be
  /// 0 (an empty shard: more ranks than rows).
  std::vector<int64_t> offset;
  std::vector<int64_t> extent;
  /// The local tensor that holds the box, its shape, and where the box starts in it: the local
  /// tensor, viewed with the canonical tensor's rank as `local_shape`, has at local_offset + j the
  /// canonical element offset + j for every j < extent (row-major on both sides). local_shape is
  /// the local tensor's shape or a row-major reshape of it (the same element count): a stack of
  /// experts [experts, rows, cols] holding 2-D expert matrices is viewed as [experts·rows, cols].
  std::string local;
  Shape local_shape;
  std::vector<int64_t> local_offset;

  /// The elements in the box.
  uint64_t numel() const;
  /// "w [0:3, 0:8]": the tensor and the box, for errors and reports.
  std::string ToString() const;
};

/// What one rank holds.
struct ProducerLayout {
  std::vector<LayoutPiece> pieces;
};

/// Check one rank's layout on its own: every box and local box lies inside its tensor; the
/// pieces of one canonical tensor agree on dtype and shape and do not overlap; the pieces stored
/// in one local tensor agree on its shape and do not overlap there.
/// Errors: InvalidArgument naming the piece (tensor and box) and the value that is wrong.
Status CheckLayout(const ProducerLayout& layout);

/// Which rank sends one distinct box of a canonical tensor, and which ranks hold copies of it.
struct PlannedBox {
  std::vector<int64_t> offset;
  std::vector<int64_t> extent;
  uint32_t sender = 0;
  /// The other ranks that hold this box, ascending: they report its digest (CheckCopies).
  std::vector<uint32_t> copies;
};

/// One canonical tensor of the plan: its distinct boxes, sorted by offset.
struct PlannedTensor {
  std::string name;
  DType dtype = DType::kUInt8;
  Shape shape;
  std::vector<PlannedBox> boxes;
};

/// What one rank does with each of its pieces.
enum class PieceRole : uint8_t {
  /// The rank sends the box (it is the lowest rank holding it).
  kSend,
  /// Another rank sends it; this rank reports the box's digest so copies are compared.
  kCopy,
  /// The box holds no element (an empty shard): nothing to send or report.
  kEmpty,
};

/// The plan of a sharded transfer, decided by rank 0 from every rank's layout.
struct LayoutPlan {
  /// Every canonical tensor, sorted by name.
  std::vector<PlannedTensor> tensors;
  /// roles[r][i]: what rank r does with piece i of its layout.
  std::vector<std::vector<PieceRole>> roles;
};

/// Plan a transfer from the layouts of ranks 0 … W−1 (`layouts[r]` is rank r's): check each
/// layout (CheckLayout), that the ranks agree on every tensor's dtype and shape, and that the
/// distinct boxes of every tensor tile it exactly; assign every box to the lowest rank holding
/// it. Errors: InvalidArgument naming the tensor, the boxes and the ranks: a dtype or shape the
/// ranks disagree on; two boxes that overlap without coinciding; a tensor whose boxes leave
/// elements uncovered (with the first uncovered element when it can be found cheaply).
/// Complexity: O(P log P) for P pieces, plus O(B²) per tensor for B boxes that share a dim-0
/// range (column shards), plus the gap search for a tensor not covered.
Result<LayoutPlan> PlanLayouts(std::span<const ProducerLayout> layouts);

/// Return the canonical digest of `piece`: Σ h(canonical index, bits) over the box, read from
/// `local` (the piece's local tensor). Precondition: CheckLayout accepted the piece and `local`
/// has its local shape and dtype. Complexity: O(box elements).
uint64_t PieceDigest(const LayoutPiece& piece, const TensorView& local);

/// A rank's report of the digest of one box it holds (sent or copied).
struct BoxDigest {
  std::string tensor;
  std::vector<int64_t> offset;
  uint32_t rank = 0;
  uint64_t digest = 0;
};

/// Check that the copies of every box agree with the sender's digest, and return each tensor's
/// digest, Σ over its distinct boxes (the sender's), keyed by tensor name.
/// Errors: DataLoss naming the tensor, the box, the rank whose copy differs and the sender (a
/// data-parallel replica that diverged); InvalidArgument for a report of a box the plan does not
/// have, or a planned box without its sender's report.
Result<std::vector<std::pair<std::string, uint64_t>>> CheckCopies(
    const LayoutPlan& plan, std::span<const BoxDigest> reports);

}  // namespace refit
