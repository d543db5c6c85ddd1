// Little-endian loads and stores: every integer refit writes (payloads, locations, values,
// safetensors lengths) is little-endian on the wire and on disk, whatever the host.
#pragma once

#include <bit>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace refit::internal {

/// Return `value` with its bytes in reverse order (std::byteswap is C++23).
template <std::integral T>
constexpr T ByteSwap(T value) {
  using Unsigned = std::make_unsigned_t<T>;
  const auto bits = static_cast<Unsigned>(value);
  if constexpr (sizeof(T) == 1) {
    return value;
  } else if constexpr (sizeof(T) == 2) {
    return static_cast<T>(__builtin_bswap16(bits));
  } else if constexpr (sizeof(T) == 4) {
    return static_cast<T>(__builtin_bswap32(bits));
  } else {
    static_assert(sizeof(T) == 8, "ByteSwap takes 1-, 2-, 4- and 8-byte integers");
    return static_cast<T>(__builtin_bswap64(bits));
  }
}

/// Return the little-endian T at `source`, which need not be aligned. Compiles to a plain load on
/// a little-endian host.
template <std::integral T>
T LoadLittleEndian(const void* source) {
  T value;
  std::memcpy(&value, source, sizeof(T));
  if constexpr (std::endian::native == std::endian::big) value = ByteSwap(value);
  return value;
}

/// Write `value` little-endian at `destination`, which need not be aligned.
template <std::integral T>
void StoreLittleEndian(void* destination, T value) {
  if constexpr (std::endian::native == std::endian::big) value = ByteSwap(value);
  std::memcpy(destination, &value, sizeof(T));
}

}  // namespace refit::internal
