// Checks a producer layout against the tensors it describes, by plain index arithmetic
// (independent of refit's box maps): every element of every piece's box, read from the local
// tensor at local_offset + j (viewed as local_shape), must be the canonical element at
// offset + j.
#ifndef REFIT_TESTS_LAYOUT_CHECK_H_
#define REFIT_TESTS_LAYOUT_CHECK_H_

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "refit/dtype.h"
#include "refit/producer_layout.h"
#include "refit/tensor.h"

namespace refit::testing {

/// Row-major flat index of `index` in `shape`.
inline uint64_t FlatIndex(const Shape& shape, const std::vector<int64_t>& index) {
  uint64_t flat = 0;
  for (size_t d = 0; d < shape.size(); ++d) {
    flat = flat * static_cast<uint64_t>(shape[d]) + static_cast<uint64_t>(index[d]);
  }
  return flat;
}

/// Expect every piece of `layout` to read its box: canonical tensors and locals by name.
inline void ExpectPiecesReadTheirBoxes(const ProducerLayout& layout,
                                       const std::map<std::string, const OwnedTensor*>& canonical,
                                       const std::map<std::string, const OwnedTensor*>& locals,
                                       const std::string& where) {
  for (const LayoutPiece& piece : layout.pieces) {
    const OwnedTensor& whole = *canonical.at(piece.tensor);
    const OwnedTensor& local = *locals.at(piece.local);
    ASSERT_EQ(piece.shape, whole.shape) << where << ": " << piece.ToString();
    ASSERT_EQ(*NumElements(piece.local_shape), *NumElements(local.shape))
        << where << ": " << piece.ToString() << " views " << piece.local;
    const size_t width = DTypeSize(whole.dtype);
    std::vector<int64_t> j(piece.extent.size(), 0);
    if (piece.numel() == 0) continue;
    for (;;) {
      std::vector<int64_t> at(j.size());
      std::vector<int64_t> local_at(j.size());
      for (size_t d = 0; d < j.size(); ++d) {
        at[d] = piece.offset[d] + j[d];
        local_at[d] = piece.local_offset[d] + j[d];
      }
      const uint64_t c = FlatIndex(whole.shape, at);
      const uint64_t l = FlatIndex(piece.local_shape, local_at);
      ASSERT_EQ(std::memcmp(whole.bytes.data() + c * width, local.bytes.data() + l * width, width),
                0)
          << where << ": " << piece.ToString() << " element " << c << " is not local '"
          << piece.local << "' element " << l;
      size_t d = j.size();
      while (d > 0 && ++j[d - 1] == piece.extent[d - 1]) j[--d] = 0;
      if (d == 0) break;
    }
  }
}

}  // namespace refit::testing

#endif  // REFIT_TESTS_LAYOUT_CHECK_H_
