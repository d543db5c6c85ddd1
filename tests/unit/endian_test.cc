#include "util/endian.h"

#include <gtest/gtest.h>

#include <array>
#include <cstdint>

namespace refit::internal {
namespace {

TEST(EndianTest, ByteSwapReversesTheBytesOfEveryWidth) {
  static_assert(ByteSwap(uint8_t{0xab}) == 0xab);
  static_assert(ByteSwap(uint16_t{0x0102}) == 0x0201);
  static_assert(ByteSwap(uint32_t{0x01020304}) == 0x04030201);
  static_assert(ByteSwap(uint64_t{0x0102030405060708}) == 0x0807060504030201);
  // Signed values swap their two's-complement bytes.
  static_assert(ByteSwap(int16_t{-2}) == static_cast<int16_t>(0xfeff));
  EXPECT_EQ(ByteSwap(ByteSwap(uint64_t{0x0123456789abcdef})), 0x0123456789abcdefULL);
}

TEST(EndianTest, LoadsAndStoresAreLittleEndianAndUnaligned) {
  std::array<unsigned char, 9> bytes{};
  // Offset 1: not aligned for a u64.
  StoreLittleEndian(bytes.data() + 1, uint64_t{0x0807060504030201});
  EXPECT_EQ(bytes, (std::array<unsigned char, 9>{0, 1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(LoadLittleEndian<uint64_t>(bytes.data() + 1), 0x0807060504030201ULL);
  EXPECT_EQ(LoadLittleEndian<uint32_t>(bytes.data() + 1), 0x04030201u);
  EXPECT_EQ(LoadLittleEndian<uint16_t>(bytes.data() + 7), 0x0807u);

  StoreLittleEndian(bytes.data(), int32_t{-2});
  EXPECT_EQ(bytes[0], 0xfe);
  EXPECT_EQ(bytes[3], 0xff);
  EXPECT_EQ(LoadLittleEndian<int32_t>(bytes.data()), -2);
}

}  // namespace
}  // namespace refit::internal
