// Element types of canonical tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "refit/status.h"

namespace refit {

/// The element type of a tensor. The numeric values are the wire codes of payload format v1
/// (docs/format/payload.md) and must never change.
enum class DType : uint8_t {
  kBool = 1,
  kUInt8 = 2,
  kInt8 = 3,
  kInt16 = 4,
  kInt32 = 5,
  kInt64 = 6,
  kFloat16 = 7,
  kBFloat16 = 8,
  kFloat32 = 9,
  kFloat64 = 10,
  kFloat8E4M3FN = 11,
  kFloat8E5M2 = 12,
  kFloat8E4M3FNUZ = 13,
  kFloat8E5M2FNUZ = 14,
};

/// Static facts about one dtype.
struct DTypeInfo {
  DType dtype;
  /// The canonical name (PyTorch spelling without "torch."), e.g. "bfloat16".
  std::string_view name;
  /// The safetensors header code, e.g. "BF16".
  std::string_view safetensors_code;
  /// Bytes per element: 1, 2, 4 or 8.
  uint32_t size;
  /// True for IEEE-like floating formats (including FP8).
  bool is_floating;
};

/// Return the facts about `dtype`. Precondition: `dtype` is a valid enumerator.
const DTypeInfo& GetDTypeInfo(DType dtype);

/// Return every supported dtype, in wire-code order.
std::span<const DTypeInfo> AllDTypes();

/// Return the canonical name of `dtype`.
inline std::string_view DTypeName(DType dtype) { return GetDTypeInfo(dtype).name; }
/// Return the element size of `dtype` in bytes.
inline uint32_t DTypeSize(DType dtype) { return GetDTypeInfo(dtype).size; }
/// Return whether `dtype` is a floating-point format.
inline bool IsFloating(DType dtype) { return GetDTypeInfo(dtype).is_floating; }

/// Parse a dtype from its canonical name, an alias ("bf16", "half", "fp32", "float", "double",
/// "torch.bfloat16", …) or a safetensors code ("BF16", "F8_E4M3", …). Case-sensitive for
/// safetensors codes, as in the safetensors spec; aliases are lower case.
///
/// Errors: InvalidArgument naming `text` and listing the accepted names.
Result<DType> ParseDType(std::string_view text);

/// Parse a dtype from its wire code. Errors: InvalidArgument naming the code.
Result<DType> DTypeFromCode(uint8_t code);

}  // namespace refit
