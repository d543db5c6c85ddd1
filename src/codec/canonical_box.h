// Canonical boxes: a tensor a trainer rank holds that is one N-d box of a canonical tensor, and
// the map from its element indices to the canonical tensor's.
//
// A sharded rank's tracker compares and keeps only the box it holds (O(shard) memory), in the
// box's own row-major numbering, while everything that leaves the rank speaks canonical
// coordinates: item spans and locations, and digests, Σ h(canonical index, bits), so that the
// boxes of a tensor add up to the whole tensor's digest (src/core/digest.h). The box is a sequence
// of *runs*, contiguous in both numberings; a row shard (a box spanning every dimension but the
// first) is a single run, so its map is a shift.
//
//   canonical w [4, 6], box offset [1, 2], extent [2, 3]:
//     . . . . . .
//     . . a b c .      local 0 1 2 | 3 4 5      two runs of 3 elements,
//     . . d e f .      canonical 8 9 10 | 14 15 16
//     . . . . . .
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "refit/status.h"
#include "refit/tensor.h"

namespace refit {

/// Where a local tensor sits in its canonical tensor: the canonical tensor's name and whole
/// shape, and the box's offset on every dimension. The box's extent is the local tensor's shape.
struct CanonicalBox {
  std::string tensor;
  Shape shape;
  std::vector<int64_t> offset;

  friend bool operator==(const CanonicalBox&, const CanonicalBox&) = default;
};

/// The flat-index map of one box. Immutable after Make; thread-safe to share.
class BoxIndexMap {
 public:
  BoxIndexMap() = default;

  /// Map a box of extent `extent` at `box`. Errors: InvalidArgument naming the tensor and the box
  /// when the ranks differ, an offset or extent is negative, or the box leaves the shape.
  static Result<BoxIndexMap> Make(const CanonicalBox& box, const Shape& extent);

  /// Elements of the box, of each run, and the number of runs (0 for an empty box).
  uint64_t numel() const { return numel_; }
  uint64_t run_elements() const { return run_elements_; }
  uint64_t runs() const { return run_elements_ == 0 ? 0 : numel_ / run_elements_; }
  /// One run: the map is local + start().
  bool contiguous() const { return runs() <= 1; }
  /// The canonical index of local element 0 (0 for an empty box).
  uint64_t start() const { return numel_ == 0 ? 0 : RunStart(0); }

  /// The canonical index of the first element of run `run` (< runs()). O(rank).
  uint64_t RunStart(uint64_t run) const;
  /// The canonical index of local element `local` (< numel()). O(rank).
  uint64_t Map(uint64_t local) const {
    return RunStart(local / run_elements_) + local % run_elements_;
  }
  /// Map sorted local indices to canonical ones in place; the order is kept (the map is
  /// increasing). O(n + rank × runs touched).
  void MapSorted(std::span<uint64_t> locations) const;

  /// Σ h(Map(i), bits of local element i) over i in [begin, end) of `local_bytes` (elements of
  /// `width` bytes), mod 2^64. O(end − begin).
  uint64_t Digest(std::span<const std::byte> local_bytes, uint32_t width, uint64_t begin,
                  uint64_t end) const;

  const CanonicalBox& box() const { return box_; }
  const Shape& extent() const { return extent_; }

 private:
  CanonicalBox box_;
  Shape extent_;
  uint64_t numel_ = 0;
  uint64_t run_elements_ = 0;
  // The leading dimensions that number the runs: their extents and canonical strides; the run
  // of outer index (i_0, …, i_k) starts at base_ + Σ i_d · outer_stride_[d].
  std::vector<uint64_t> outer_extent_;
  std::vector<uint64_t> outer_stride_;
  uint64_t base_ = 0;
};

}  // namespace refit
