#include "refit/tensor.h"

#include <fmt/format.h>

#include "refit/status_format.h"

namespace refit {

Result<uint64_t> NumElements(const Shape& shape) {
  bool empty = false;
  for (int64_t extent : shape) {
    if (extent < 0) {
      return InvalidArgument("negative extent {} in shape {}", extent, ShapeToString(shape));
    }
    empty = empty || extent == 0;
  }
  // A zero extent makes the product 0 however large the others are.
  if (empty) return uint64_t{0};
  uint64_t count = 1;
  for (int64_t extent : shape) {
    if (count > (uint64_t{1} << 63) / static_cast<uint64_t>(extent)) {
      return InvalidArgument("shape {} has more than 2^63 elements", ShapeToString(shape));
    }
    count *= static_cast<uint64_t>(extent);
  }
  return count;
}

Result<uint64_t> TensorBytes(const Shape& shape, DType dtype) {
  REFIT_ASSIGN_OR_RETURN(const uint64_t numel, NumElements(shape));
  const uint64_t width = DTypeSize(dtype);
  if (numel > UINT64_MAX / width) {
    return InvalidArgument("shape {} of {} has more than 2^64 bytes", ShapeToString(shape),
                           DTypeName(dtype));
  }
  return numel * width;
}

std::string ShapeToString(const Shape& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

Status CheckTensorSize(const TensorView& tensor) {
  const Result<uint64_t> bytes = TensorBytes(tensor.shape, tensor.dtype);
  if (!bytes.ok()) return bytes.status().WithContext(fmt::format("tensor '{}'", tensor.name));
  if (*bytes != tensor.bytes.size()) {
    return InvalidArgument("tensor '{}': shape {} of {} needs {} bytes, got {}", tensor.name,
                           ShapeToString(tensor.shape), DTypeName(tensor.dtype), *bytes,
                           tensor.bytes.size());
  }
  return Status::OK();
}

}  // namespace refit
