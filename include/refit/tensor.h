// Views of canonical tensors: a name, a dtype, a shape and little-endian bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "refit/dtype.h"
#include "refit/status.h"

namespace refit {

/// The shape of a tensor: one extent per dimension (empty for a scalar).
using Shape = std::vector<int64_t>;

/// Return the number of elements of `shape`, or InvalidArgument for a negative extent or a
/// product that overflows 2^63.
Result<uint64_t> NumElements(const Shape& shape);

/// Return the bytes a tensor of `shape` and `dtype` holds: NumElements × DTypeSize. Errors: as
/// NumElements; InvalidArgument when the product overflows 2^64.
Result<uint64_t> TensorBytes(const Shape& shape, DType dtype);

/// Return "[d0, d1, …]".
std::string ShapeToString(const Shape& shape);

/// A read-only view of one canonical tensor. Does not own the bytes; they must outlive the view.
struct TensorView {
  std::string name;
  DType dtype = DType::kUInt8;
  Shape shape;
  std::span<const std::byte> bytes;

  /// Number of elements (bytes.size() / element size).
  uint64_t numel() const { return bytes.size() / DTypeSize(dtype); }
};

/// A mutable view of one tensor. Does not own the bytes.
struct MutableTensorView {
  std::string name;
  DType dtype = DType::kUInt8;
  Shape shape;
  std::span<std::byte> bytes;

  uint64_t numel() const { return bytes.size() / DTypeSize(dtype); }
  TensorView AsConst() const { return TensorView{name, dtype, shape, bytes}; }
};

/// Check that `bytes.size()` equals numel(shape) × element size.
/// Errors: InvalidArgument naming the tensor, its shape and both sizes.
Status CheckTensorSize(const TensorView& tensor);

/// An owning tensor, for tests, tools and the simulator.
struct OwnedTensor {
  std::string name;
  DType dtype = DType::kUInt8;
  Shape shape;
  std::vector<std::byte> bytes;

  TensorView view() const { return TensorView{name, dtype, shape, bytes}; }
  MutableTensorView mutable_view() { return MutableTensorView{name, dtype, shape, bytes}; }
};

}  // namespace refit
