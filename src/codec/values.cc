// Value operations of payload format v1: wire values per op, how a receiver applies them, and the
// byte-plane split of value sections.
//
// ADD is exact by construction: the producer keeps an element under ADD only when the receiver's
// fixed computation, AddExact(old, delta) = round_dtype(widen(old) + widen(delta)) with every
// rounding round-to-nearest-even, reproduces `new` bit for bit; every other element is demoted to
// OVERWRITE. An element whose delta is NaN (old or new NaN, or Inf − Inf) is always demoted: NaN
// payload propagation differs between CPU families, so a receiver must never compute one.
//
// This file is compiled once per SIMD target by Highway (foreach_target.h re-includes it); only
// the byte-plane kernels are per-target, everything else sits inside `#if HWY_ONCE`.
#include "codec/values.h"

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "core/half_float.h"
#include "refit/status_format.h"
#include "util/check.h"
#include "util/endian.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "codec/values.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace refit::internal::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Byte planes of 2-byte values: in = v0b0 v0b1 v1b0 …; out = all b0, then all b1.
void SplitBytePlanesOf2(const uint8_t* HWY_RESTRICT in, size_t count, uint8_t* HWY_RESTRICT out) {
  const hn::ScalableTag<uint8_t> d;
  const size_t lanes = hn::Lanes(d);
  uint8_t* HWY_RESTRICT plane0 = out;
  uint8_t* HWY_RESTRICT plane1 = out + count;
  size_t i = 0;
  for (; i + lanes <= count; i += lanes) {
    hn::Vec<decltype(d)> byte0, byte1;
    hn::LoadInterleaved2(d, in + 2 * i, byte0, byte1);
    hn::StoreU(byte0, d, plane0 + i);
    hn::StoreU(byte1, d, plane1 + i);
  }
  for (; i < count; ++i) {
    plane0[i] = in[2 * i];
    plane1[i] = in[2 * i + 1];
  }
}

void SplitBytePlanesOf4(const uint8_t* HWY_RESTRICT in, size_t count, uint8_t* HWY_RESTRICT out) {
  const hn::ScalableTag<uint8_t> d;
  const size_t lanes = hn::Lanes(d);
  uint8_t* HWY_RESTRICT plane0 = out;
  uint8_t* HWY_RESTRICT plane1 = out + count;
  uint8_t* HWY_RESTRICT plane2 = out + 2 * count;
  uint8_t* HWY_RESTRICT plane3 = out + 3 * count;
  size_t i = 0;
  for (; i + lanes <= count; i += lanes) {
    hn::Vec<decltype(d)> byte0, byte1, byte2, byte3;
    hn::LoadInterleaved4(d, in + 4 * i, byte0, byte1, byte2, byte3);
    hn::StoreU(byte0, d, plane0 + i);
    hn::StoreU(byte1, d, plane1 + i);
    hn::StoreU(byte2, d, plane2 + i);
    hn::StoreU(byte3, d, plane3 + i);
  }
  for (; i < count; ++i) {
    plane0[i] = in[4 * i];
    plane1[i] = in[4 * i + 1];
    plane2[i] = in[4 * i + 2];
    plane3[i] = in[4 * i + 3];
  }
}

void JoinBytePlanesOf2(const uint8_t* HWY_RESTRICT planes, size_t count,
                       uint8_t* HWY_RESTRICT out) {
  const hn::ScalableTag<uint8_t> d;
  const size_t lanes = hn::Lanes(d);
  const uint8_t* HWY_RESTRICT plane0 = planes;
  const uint8_t* HWY_RESTRICT plane1 = planes + count;
  size_t i = 0;
  for (; i + lanes <= count; i += lanes) {
    hn::StoreInterleaved2(hn::LoadU(d, plane0 + i), hn::LoadU(d, plane1 + i), d, out + 2 * i);
  }
  for (; i < count; ++i) {
    out[2 * i] = plane0[i];
    out[2 * i + 1] = plane1[i];
  }
}

void JoinBytePlanesOf4(const uint8_t* HWY_RESTRICT planes, size_t count,
                       uint8_t* HWY_RESTRICT out) {
  const hn::ScalableTag<uint8_t> d;
  const size_t lanes = hn::Lanes(d);
  const uint8_t* HWY_RESTRICT plane0 = planes;
  const uint8_t* HWY_RESTRICT plane1 = planes + count;
  const uint8_t* HWY_RESTRICT plane2 = planes + 2 * count;
  const uint8_t* HWY_RESTRICT plane3 = planes + 3 * count;
  size_t i = 0;
  for (; i + lanes <= count; i += lanes) {
    hn::StoreInterleaved4(hn::LoadU(d, plane0 + i), hn::LoadU(d, plane1 + i),
                          hn::LoadU(d, plane2 + i), hn::LoadU(d, plane3 + i), d, out + 4 * i);
  }
  for (; i < count; ++i) {
    out[4 * i] = plane0[i];
    out[4 * i + 1] = plane1[i];
    out[4 * i + 2] = plane2[i];
    out[4 * i + 3] = plane3[i];
  }
}

}  // namespace refit::internal::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

// AddExact's rounding is part of the wire format: double arithmetic must be IEEE binary64 with no
// excess precision (x87) and no value-changing optimizations.
static_assert(FLT_EVAL_METHOD == 0, "ADD needs IEEE double arithmetic without excess precision");
#ifdef __FAST_MATH__
#error "values.cc must not be compiled with -ffast-math: ADD rounding is part of the wire format"
#endif

namespace refit {
namespace internal {
namespace {

HWY_EXPORT(SplitBytePlanesOf2);
HWY_EXPORT(SplitBytePlanesOf4);
HWY_EXPORT(JoinBytePlanesOf2);
HWY_EXPORT(JoinBytePlanesOf4);

// Run the best SIMD kernel for `width` on this CPU; return false when there is none for it.
bool SplitBytePlanesSimd(const uint8_t* in, size_t count, uint32_t width, uint8_t* out) {
  switch (width) {
    case 2:
      HWY_DYNAMIC_DISPATCH(SplitBytePlanesOf2)(in, count, out);
      return true;
    case 4:
      HWY_DYNAMIC_DISPATCH(SplitBytePlanesOf4)(in, count, out);
      return true;
    default:
      return false;
  }
}

bool JoinBytePlanesSimd(const uint8_t* planes, size_t count, uint32_t width, uint8_t* out) {
  switch (width) {
    case 2:
      HWY_DYNAMIC_DISPATCH(JoinBytePlanesOf2)(planes, count, out);
      return true;
    case 4:
      HWY_DYNAMIC_DISPATCH(JoinBytePlanesOf4)(planes, count, out);
      return true;
    default:
      return false;
  }
}

}  // namespace
}  // namespace internal

namespace {

// Element `index` of little-endian `bytes` as a host integer.
template <typename T>
T LoadElement(const std::byte* bytes, uint64_t index) {
  return internal::LoadLittleEndian<T>(bytes + index * sizeof(T));
}

template <typename T>
void StoreElement(std::byte* bytes, uint64_t index, T value) {
  internal::StoreLittleEndian(bytes + index * sizeof(T), value);
}

// Call `visitor(std::type_identity<T>{})` with T the unsigned integer of `width` bytes.
template <typename Visitor>
void VisitWidth(uint32_t width, Visitor&& visitor) {
  switch (width) {
    case 1:
      return visitor(std::type_identity<uint8_t>{});
    case 2:
      return visitor(std::type_identity<uint16_t>{});
    case 4:
      return visitor(std::type_identity<uint32_t>{});
    case 8:
      return visitor(std::type_identity<uint64_t>{});
    default:
      REFIT_DCHECK(false, "element width must be 1, 2, 4 or 8");
  }
}

// The four ADD formats: their bits, exact widening to double and RNE narrowing from double.
struct Half {
  using Bits = uint16_t;
  static double Widen(Bits bits) { return HalfToFloat(bits); }
  static Bits Narrow(double value) { return DoubleToHalf(value); }
};
struct BFloat16 {
  using Bits = uint16_t;
  static double Widen(Bits bits) { return BFloat16ToFloat(bits); }
  static Bits Narrow(double value) { return DoubleToBFloat16(value); }
};
struct Single {
  using Bits = uint32_t;
  static double Widen(Bits bits) { return std::bit_cast<float>(bits); }
  // The C++ conversion rounds with the current mode, which the library never changes from RNE.
  static Bits Narrow(double value) { return std::bit_cast<Bits>(static_cast<float>(value)); }
};
struct Double {
  using Bits = uint64_t;
  static double Widen(Bits bits) { return std::bit_cast<double>(bits); }
  static Bits Narrow(double value) { return std::bit_cast<Bits>(value); }
};

// Call `visitor(Format{})` for the ADD format of `dtype`; return false (without calling) when
// `dtype` has none.
template <typename Visitor>
bool VisitAddFormat(DType dtype, Visitor&& visitor) {
  switch (dtype) {
    case DType::kFloat16:
      visitor(Half{});
      return true;
    case DType::kBFloat16:
      visitor(BFloat16{});
      return true;
    case DType::kFloat32:
      visitor(Single{});
      return true;
    case DType::kFloat64:
      visitor(Double{});
      return true;
    default:
      return false;
  }
}

template <typename Visitor>
bool VisitAddPair(DType dtype, DType delta_dtype, Visitor&& visitor) {
  bool supported = false;
  VisitAddFormat(dtype, [&](auto target) {
    supported = VisitAddFormat(delta_dtype, [&](auto delta) { visitor(target, delta); });
  });
  return supported;
}

template <typename Target, typename Delta>
typename Target::Bits AddExactIn(typename Target::Bits old_bits, typename Delta::Bits delta_bits) {
  return Target::Narrow(Target::Widen(old_bits) + Delta::Widen(delta_bits));
}

template <typename Target, typename Delta>
typename Delta::Bits AddDeltaIn(typename Target::Bits old_bits, typename Target::Bits new_bits) {
  return Delta::Narrow(Target::Widen(new_bits) - Target::Widen(old_bits));
}

enum class BitwiseOp { kXor, kOverwrite };

// The hot apply loop for XOR / OVERWRITE / FULL: one width, one op, undo or not, all fixed at
// compile time, so the loop body is a load, an optional copy, a xor and a store.
template <typename T, BitwiseOp kOp, bool kUndo>
void ApplyBitwise(std::byte* tensor, std::span<const uint64_t> locations, const std::byte* values,
                  std::byte* undo) {
  for (size_t i = 0; i < locations.size(); ++i) {
    std::byte* element = tensor + locations[i] * sizeof(T);
    if constexpr (kUndo) std::memcpy(undo + i * sizeof(T), element, sizeof(T));
    if constexpr (kOp == BitwiseOp::kXor) {
      T current;
      T delta;
      std::memcpy(&current, element, sizeof(T));
      std::memcpy(&delta, values + i * sizeof(T), sizeof(T));
      current = static_cast<T>(current ^ delta);
      std::memcpy(element, &current, sizeof(T));
    } else {
      std::memcpy(element, values + i * sizeof(T), sizeof(T));
    }
  }
}

template <BitwiseOp kOp, bool kUndo>
void ApplyBitwiseOfWidth(uint32_t width, std::byte* tensor, std::span<const uint64_t> locations,
                         const std::byte* values, std::byte* undo) {
  VisitWidth(width, [&](auto type) {
    ApplyBitwise<typename decltype(type)::type, kOp, kUndo>(tensor, locations, values, undo);
  });
}

template <typename Target, typename Delta, bool kUndo>
void ApplyAdd(std::byte* tensor, std::span<const uint64_t> locations, const std::byte* values,
              std::byte* undo) {
  using TargetBits = typename Target::Bits;
  for (size_t i = 0; i < locations.size(); ++i) {
    const TargetBits old_bits = LoadElement<TargetBits>(tensor, locations[i]);
    if constexpr (kUndo) StoreElement<TargetBits>(undo, i, old_bits);
    const auto delta_bits = LoadElement<typename Delta::Bits>(values, i);
    StoreElement<TargetBits>(tensor, locations[i], AddExactIn<Target, Delta>(old_bits, delta_bits));
  }
}

// Gather `new ^ old` (kXor) or `new` (kOverwrite) at `locations` into `out`.
template <typename T, BitwiseOp kOp>
void GatherBitwise(const std::byte* old_bytes, const std::byte* new_bytes,
                   std::span<const uint64_t> locations, std::byte* out) {
  for (size_t i = 0; i < locations.size(); ++i) {
    const uint64_t offset = locations[i] * sizeof(T);
    if constexpr (kOp == BitwiseOp::kXor) {
      T old_value;
      T new_value;
      std::memcpy(&old_value, old_bytes + offset, sizeof(T));
      std::memcpy(&new_value, new_bytes + offset, sizeof(T));
      const T delta = static_cast<T>(old_value ^ new_value);
      std::memcpy(out + i * sizeof(T), &delta, sizeof(T));
    } else {
      std::memcpy(out + i * sizeof(T), new_bytes + offset, sizeof(T));
    }
  }
}

// Split `result->locations` into those ADD reproduces exactly (kept in place, deltas in
// result->values) and the rest (moved to result->demoted_*).
template <typename Target, typename Delta>
void SplitAddable(const std::byte* old_bytes, const std::byte* new_bytes, OpValues* result) {
  using TargetBits = typename Target::Bits;
  using DeltaBits = typename Delta::Bits;
  std::vector<uint64_t>& locations = result->locations;
  result->values.resize(locations.size() * sizeof(DeltaBits));
  size_t kept = 0;
  for (size_t i = 0; i < locations.size(); ++i) {
    const uint64_t location = locations[i];
    const TargetBits old_bits = LoadElement<TargetBits>(old_bytes, location);
    const TargetBits new_bits = LoadElement<TargetBits>(new_bytes, location);
    const DeltaBits delta_bits = AddDeltaIn<Target, Delta>(old_bits, new_bits);
    if (!std::isnan(Delta::Widen(delta_bits)) &&
        AddExactIn<Target, Delta>(old_bits, delta_bits) == new_bits) {
      StoreElement<DeltaBits>(result->values.data(), kept, delta_bits);
      locations[kept++] = location;
    } else {
      result->demoted_locations.push_back(location);
      const size_t offset = result->demoted_values.size();
      result->demoted_values.resize(offset + sizeof(TargetBits));
      StoreElement<TargetBits>(result->demoted_values.data() + offset, 0, new_bits);
    }
  }
  locations.resize(kept);
  result->values.resize(kept * sizeof(DeltaBits));
}

// The generic byte-plane transposition, for widths without a SIMD kernel (8).
void SplitPlanesScalar(const std::byte* in, size_t count, uint32_t width, std::byte* out) {
  for (uint32_t plane = 0; plane < width; ++plane) {
    std::byte* destination = out + plane * count;
    for (size_t i = 0; i < count; ++i) destination[i] = in[i * width + plane];
  }
}

void JoinPlanesScalar(const std::byte* planes, size_t count, uint32_t width, std::byte* out) {
  for (uint32_t plane = 0; plane < width; ++plane) {
    const std::byte* source = planes + plane * count;
    for (size_t i = 0; i < count; ++i) out[i * width + plane] = source[i];
  }
}

const uint8_t* AsBytes(const std::byte* bytes) { return reinterpret_cast<const uint8_t*>(bytes); }
uint8_t* AsBytes(std::byte* bytes) { return reinterpret_cast<uint8_t*>(bytes); }

}  // namespace

uint64_t LoadBits(std::span<const std::byte> bytes, uint32_t width, uint64_t index) {
  REFIT_DCHECK((index + 1) * width <= bytes.size(), "LoadBits index out of range");
  uint64_t bits = 0;
  VisitWidth(width, [&](auto type) {
    bits = LoadElement<typename decltype(type)::type>(bytes.data(), index);
  });
  return bits;
}

void StoreBits(std::span<std::byte> bytes, uint32_t width, uint64_t index, uint64_t bits) {
  REFIT_DCHECK((index + 1) * width <= bytes.size(), "StoreBits index out of range");
  VisitWidth(width, [&](auto type) {
    using T = typename decltype(type)::type;
    StoreElement<T>(bytes.data(), index, static_cast<T>(bits));
  });
}

bool AddSupported(DType dtype, DType delta_dtype) {
  return VisitAddPair(dtype, delta_dtype, [](auto, auto) {});
}

uint64_t AddExact(DType dtype, DType delta_dtype, uint64_t old_bits, uint64_t delta_bits) {
  uint64_t result = old_bits;
  const bool supported = VisitAddPair(dtype, delta_dtype, [&](auto target, auto delta) {
    using Target = decltype(target);
    using Delta = decltype(delta);
    result = AddExactIn<Target, Delta>(static_cast<typename Target::Bits>(old_bits),
                                       static_cast<typename Delta::Bits>(delta_bits));
  });
  REFIT_DCHECK(supported, "AddExact on a dtype pairing without ADD");
  return result;
}

uint64_t AddDelta(DType dtype, DType delta_dtype, uint64_t old_bits, uint64_t new_bits) {
  uint64_t result = 0;
  const bool supported = VisitAddPair(dtype, delta_dtype, [&](auto target, auto delta) {
    using Target = decltype(target);
    using Delta = decltype(delta);
    result = AddDeltaIn<Target, Delta>(static_cast<typename Target::Bits>(old_bits),
                                       static_cast<typename Target::Bits>(new_bits));
  });
  REFIT_DCHECK(supported, "AddDelta on a dtype pairing without ADD");
  return result;
}

Result<OpValues> MakeOpValues(Op op, DType dtype, DType value_dtype,
                              std::span<const std::byte> old_bytes,
                              std::span<const std::byte> new_bytes,
                              std::vector<uint64_t> locations) {
  if (op != Op::kXor && op != Op::kOverwrite && op != Op::kAdd) {
    return InvalidArgument("op '{}' has no per-location values (expected xor, overwrite or add)",
                           OpName(op));
  }
  if (op == Op::kAdd) {
    if (!AddSupported(dtype, value_dtype)) {
      return InvalidArgument(
          "add is not defined for a {} tensor with {} deltas (both must be float16, bfloat16, "
          "float32 or float64)",
          DTypeName(dtype), DTypeName(value_dtype));
    }
  } else if (value_dtype != dtype) {
    return InvalidArgument("op '{}' needs value dtype {} equal to the tensor dtype, got {}",
                           OpName(op), DTypeName(dtype), DTypeName(value_dtype));
  }
  const uint32_t width = DTypeSize(dtype);
  if (old_bytes.size() != new_bytes.size() || old_bytes.size() % width != 0) {
    return InvalidArgument("{} tensor: old has {} bytes and new {}, expected equal multiples of {}",
                           DTypeName(dtype), old_bytes.size(), new_bytes.size(), width);
  }
  const uint64_t numel = old_bytes.size() / width;
  for (size_t i = 0; i < locations.size(); ++i) {
    if (locations[i] >= numel) {
      return InvalidArgument("location #{} = {} >= numel {}", i, locations[i], numel);
    }
  }
  OpValues result;
  result.locations = std::move(locations);
  if (op == Op::kAdd) {
    VisitAddPair(dtype, value_dtype, [&](auto target, auto delta) {
      SplitAddable<decltype(target), decltype(delta)>(old_bytes.data(), new_bytes.data(), &result);
    });
    return result;
  }
  result.values.resize(result.locations.size() * width);
  VisitWidth(width, [&](auto type) {
    using T = typename decltype(type)::type;
    if (op == Op::kXor) {
      GatherBitwise<T, BitwiseOp::kXor>(old_bytes.data(), new_bytes.data(), result.locations,
                                        result.values.data());
    } else {
      GatherBitwise<T, BitwiseOp::kOverwrite>(old_bytes.data(), new_bytes.data(), result.locations,
                                              result.values.data());
    }
  });
  return result;
}

void ApplyOpValues(Op op, DType dtype, DType value_dtype, std::span<std::byte> tensor,
                   std::span<const uint64_t> locations, std::span<const std::byte> values,
                   std::vector<std::byte>* undo) {
  const uint32_t width = DTypeSize(dtype);
  REFIT_DCHECK(values.size() == locations.size() * DTypeSize(value_dtype),
               "ApplyOpValues: values size does not match the location count");
  std::byte* undo_out = nullptr;
  if (undo != nullptr) {
    const size_t offset = undo->size();
    undo->resize(offset + locations.size() * width);
    undo_out = undo->data() + offset;
  }
  switch (op) {
    case Op::kXor:
      if (undo_out != nullptr) {
        ApplyBitwiseOfWidth<BitwiseOp::kXor, true>(width, tensor.data(), locations, values.data(),
                                                   undo_out);
      } else {
        ApplyBitwiseOfWidth<BitwiseOp::kXor, false>(width, tensor.data(), locations, values.data(),
                                                    undo_out);
      }
      return;
    case Op::kOverwrite:
    case Op::kFull:
      if (undo_out != nullptr) {
        ApplyBitwiseOfWidth<BitwiseOp::kOverwrite, true>(width, tensor.data(), locations,
                                                         values.data(), undo_out);
      } else {
        ApplyBitwiseOfWidth<BitwiseOp::kOverwrite, false>(width, tensor.data(), locations,
                                                          values.data(), undo_out);
      }
      return;
    case Op::kAdd: {
      const bool supported = VisitAddPair(dtype, value_dtype, [&](auto target, auto delta) {
        using Target = decltype(target);
        using Delta = decltype(delta);
        if (undo_out != nullptr) {
          ApplyAdd<Target, Delta, true>(tensor.data(), locations, values.data(), undo_out);
        } else {
          ApplyAdd<Target, Delta, false>(tensor.data(), locations, values.data(), undo_out);
        }
      });
      REFIT_DCHECK(supported, "ApplyOpValues: add on a dtype pairing without ADD");
      return;
    }
  }
  REFIT_DCHECK(false, "ApplyOpValues: unknown op");
}

void SplitBytePlanes(std::span<const std::byte> values, uint32_t width,
                     std::vector<std::byte>* out) {
  REFIT_DCHECK(width > 0 && values.size() % width == 0,
               "SplitBytePlanes: size is not a multiple of the width");
  const size_t count = values.size() / width;
  const size_t offset = out->size();
  out->resize(offset + values.size());
  std::byte* destination = out->data() + offset;
  if (width == 1) {  // One plane: the values themselves.
    if (!values.empty()) std::memcpy(destination, values.data(), values.size());
  } else if (!internal::SplitBytePlanesSimd(AsBytes(values.data()), count, width,
                                            AsBytes(destination))) {
    SplitPlanesScalar(values.data(), count, width, destination);
  }
}

void JoinBytePlanes(std::span<const std::byte> planes, uint32_t width, std::span<std::byte> out) {
  REFIT_DCHECK(width > 0 && planes.size() % width == 0 && out.size() == planes.size(),
               "JoinBytePlanes: sizes do not match");
  const size_t count = planes.size() / width;
  if (width == 1) {
    if (!planes.empty()) std::memcpy(out.data(), planes.data(), planes.size());
  } else if (!internal::JoinBytePlanesSimd(AsBytes(planes.data()), count, width,
                                           AsBytes(out.data()))) {
    JoinPlanesScalar(planes.data(), count, width, out.data());
  }
}

}  // namespace refit

#endif  // HWY_ONCE
