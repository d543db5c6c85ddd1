// XOR folding: the deltas a receiver missed, composed into one.
//
// An XOR item carries v = new ^ old at its locations, and XOR is associative and commutative, so
// the k deltas that take a tensor from version v to v + k compose exactly: the folded value at a
// location is the XOR of the values every delta carries there, and a location whose values XOR
// to zero came back to its old bits and is dropped. Applying the folded item once is
// bit-identical to applying the k items one by one, for every dtype (the values are bit
// patterns).
//
//   d1: XOR at 3 5 9     d2: XOR at 5 12        fold: XOR at 3 9 12 (5 cancelled when d1 ^ d2 = 0)
//
// The folded item never carries more locations or values than the items it folds. Its digest is
// the sum of theirs (mod 2^64): item digests are Σ h(i, new) − h(i, old), which telescope, and a
// cancelled location contributes zero to both sides.
#pragma once

#include <optional>
#include <span>

#include "refit/item.h"
#include "refit/status.h"

namespace refit {

/// Fold XOR items of one tensor (in any order) into one XOR item over the union of their spans,
/// or nullopt when every change cancels. `force` pins the location encoding (tests), as in
/// ChooseLocationEncoding.
/// Errors: InvalidArgument naming the item when one is not kXor, names another tensor, dtype or
/// shape, carries values of another dtype or of an element wider than 8 bytes, or repeats a
/// location; DataLoss for locations that do not decode or values of the wrong length.
/// Complexity: O(n log n) time and O(n) memory in the total number of locations n.
Result<std::optional<Item>> FoldXorItems(std::span<const ItemView> items,
                                         std::optional<LocationEncoding> force = {});

}  // namespace refit
