// Routing by holdings: the part of an item that one class of receivers holds.
//
// A tensor-parallel shard keeps about 1/TP of each sharded tensor. When the coordinator groups
// receivers by what they hold (shard classes: every TP rank-k shard of every replica, and the
// unsharded receivers), each producer cuts every item it encodes to the elements each class holds
// and sends each class only its own cut, so a shard receives and decodes about 1/TP of the delta
// (docs/protocol.md "Routing by holdings").
//
//   item of q_proj [8, 4], XOR at 3 5 9 14 30      class of TP rank 0 holds rows 0:4
//     rows 0–3: 3 5 9 14   rows 4–7: 30        ─▶  cut: XOR at 3 5 9 14 (its values, same span)
//
// A cut keeps the item's op, span and value dtype and drops the locations (and their values) the
// class does not hold. A FULL item becomes one FULL item per maximal run of held elements in its
// span, each with the digest of its own run, so a cut anchor still writes every held element. A
// cut delta item keeps the digest of the whole item: only a receiver that holds the tensor whole
// can check an item digest (CanonicalLayout::held_whole), and such a receiver's class never cuts
// it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "refit/item.h"
#include "refit/status.h"
#include "refit/transfer.h"

namespace refit {

/// The cut of items for one class of receivers. Immutable after Make; thread-safe to share.
class ItemRoute {
 public:
  /// A route that holds everything: Cut passes every item whole.
  ItemRoute() = default;

  /// Compile `regions` (what every receiver of the class holds). Errors: InvalidArgument naming
  /// the tensor and the rectangle when a rectangle is empty or inverted, leaves its `cols`, or
  /// overlaps another, or `cols` is 0 while rectangles are given.
  static Result<ItemRoute> Make(const HeldRegions& regions);

  /// Append to `out` what the class holds of `item`: nothing, the item itself, or its cut.
  /// Errors: DataLoss for item locations that do not decode; InvalidArgument when the tensor's
  /// element count is not a multiple of its region's `cols` (the receivers described another
  /// shape).
  Status Cut(const ItemView& item, std::vector<Item>* out) const;

  /// Whether Cut passes every item whole.
  bool whole() const { return tensors_.empty(); }
  const HeldRegions& regions() const { return regions_; }

 private:
  struct TensorCut {
    bool skipped = false;
    uint64_t cols = 0;
    /// Sorted by (row_begin, col_begin); disjoint.
    std::vector<HeldRect> rects;
  };
  /// Whether the rectangles cover every element of a tensor of `numel` elements.
  static bool CoversAll(const TensorCut& cut, uint64_t numel);
  /// Append the maximal runs [begin, end) of held elements in [span_begin, span_end), in order.
  static void HeldRuns(const TensorCut& cut, uint64_t span_begin, uint64_t span_end,
                       std::vector<std::pair<uint64_t, uint64_t>>* runs);

  HeldRegions regions_;
  std::map<std::string, TensorCut, std::less<>> tensors_;
};

}  // namespace refit
