#include "codec/canonical_box.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/digest.h"
#include "refit/status_format.h"

namespace refit {
namespace {

std::string BoxToString(const CanonicalBox& box, const Shape& extent) {
  std::string out = box.tensor + " [";
  for (size_t d = 0; d < box.offset.size() && d < extent.size(); ++d) {
    out += fmt::format("{}{}:{}", d > 0 ? ", " : "", box.offset[d], box.offset[d] + extent[d]);
  }
  return out + "]";
}

}  // namespace

Result<BoxIndexMap> BoxIndexMap::Make(const CanonicalBox& box, const Shape& extent) {
  const size_t ndim = box.shape.size();
  if (box.offset.size() != ndim || extent.size() != ndim) {
    return InvalidArgument(
        "tensor '{}': a box of shape {} needs an offset and an extent of rank {}, got offset "
        "rank {} and extent {}",
        box.tensor, ShapeToString(box.shape), ndim, box.offset.size(), ShapeToString(extent));
  }
  REFIT_RETURN_NOT_OK(NumElements(box.shape).status().WithContext(
      fmt::format("canonical tensor '{}'", box.tensor)));
  for (size_t d = 0; d < ndim; ++d) {
    if (box.offset[d] < 0 || extent[d] < 0 || box.offset[d] > box.shape[d] - extent[d]) {
      return InvalidArgument("box {} leaves canonical tensor '{}' of shape {} on dimension {}",
                             BoxToString(box, extent), box.tensor, ShapeToString(box.shape), d);
    }
  }
  BoxIndexMap map;
  map.box_ = box;
  map.extent_ = extent;
  REFIT_ASSIGN_OR_RETURN(map.numel_, NumElements(extent));
  if (map.numel_ == 0) return map;
  // Canonical row-major strides.
  std::vector<uint64_t> stride(ndim, 1);
  for (size_t d = ndim; d-- > 1;) stride[d - 1] = stride[d] * static_cast<uint64_t>(box.shape[d]);
  // A run: the trailing dimensions the box spans whole, and the first one (from the end) it does
  // not; the dimensions before that number the runs.
  size_t first_in_run = ndim;
  map.run_elements_ = 1;
  while (first_in_run > 0) {
    const size_t d = --first_in_run;
    map.run_elements_ *= static_cast<uint64_t>(extent[d]);
    if (extent[d] != box.shape[d]) break;
  }
  for (size_t d = 0; d < ndim; ++d) map.base_ += static_cast<uint64_t>(box.offset[d]) * stride[d];
  for (size_t d = 0; d < first_in_run; ++d) {
    map.outer_extent_.push_back(static_cast<uint64_t>(extent[d]));
    map.outer_stride_.push_back(stride[d]);
  }
  return map;
}

uint64_t BoxIndexMap::RunStart(uint64_t run) const {
  uint64_t start = base_;
  for (size_t d = outer_extent_.size(); d-- > 0;) {
    start += (run % outer_extent_[d]) * outer_stride_[d];
    run /= outer_extent_[d];
  }
  return start;
}

void BoxIndexMap::MapSorted(std::span<uint64_t> locations) const {
  if (contiguous()) {
    const uint64_t shift = start();
    for (uint64_t& location : locations) location += shift;
    return;
  }
  uint64_t run = UINT64_MAX;
  uint64_t run_start = 0;
  for (uint64_t& location : locations) {
    const uint64_t q = location / run_elements_;
    if (q != run) {
      run = q;
      run_start = RunStart(q);
    }
    location = run_start + location % run_elements_;
  }
}

uint64_t BoxIndexMap::Digest(std::span<const std::byte> local_bytes, uint32_t width, uint64_t begin,
                             uint64_t end) const {
  uint64_t sum = 0;
  for (uint64_t position = begin; position < end;) {
    const uint64_t run = position / run_elements_;
    const uint64_t within = position % run_elements_;
    const uint64_t count = std::min(run_elements_ - within, end - position);
    sum += RemappedDigestRange(local_bytes, width, position, RunStart(run) + within, count);
    position += count;
  }
  return sum;
}

}  // namespace refit
