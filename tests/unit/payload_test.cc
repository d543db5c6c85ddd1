// Tests of payload format v1: round trips, the wire layout against an independent test-side
// writer of docs/format/payload.md, and hostile input (corruption, truncation, forged bodies,
// lying zstd frames, limits).
#include "refit/payload.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <functional>
#include <optional>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <xxhash.h>
#include <zstd.h>

#include "codec/locations.h"
#include "codec/values.h"
#include "refit/dtype.h"
#include "refit/item.h"
#include "test_util.h"

namespace refit {
namespace {

// ---- An independent writer of the v1 layout (docs/format/payload.md), for forging. -----------

// Header offsets, spelled out again from the spec rather than shared with the implementation.
constexpr size_t kMagicOffset = 0;
constexpr size_t kVersionOffset = 4;
constexpr size_t kFlagsOffset = 6;
constexpr size_t kTransferIdOffset = 8;
constexpr size_t kProducerIdOffset = 24;
constexpr size_t kPayloadIdOffset = 28;
constexpr size_t kBaseVersionOffset = 32;
constexpr size_t kTargetVersionOffset = 40;
constexpr size_t kItemCountOffset = 48;
constexpr size_t kCompressionOffset = 52;
constexpr size_t kMacAlgorithmOffset = 53;
constexpr size_t kReservedOffset = 54;
constexpr size_t kBodyBytesOffset = 56;
constexpr size_t kCompressedBytesOffset = 64;
constexpr size_t kChecksumOffset = 72;
constexpr size_t kMacOffset = 88;
constexpr size_t kHeaderChecksumOffset = 120;

void StoreAt(std::span<std::byte> bytes, size_t offset, uint64_t value, size_t width) {
  for (size_t i = 0; i < width; ++i) bytes[offset + i] = static_cast<std::byte>(value >> (8 * i));
}

uint64_t LoadAt(std::span<const std::byte> bytes, size_t offset, size_t width) {
  uint64_t value = 0;
  for (size_t i = 0; i < width; ++i) {
    value |= static_cast<uint64_t>(std::to_integer<uint8_t>(bytes[offset + i])) << (8 * i);
  }
  return value;
}

void Put(std::vector<std::byte>* out, uint64_t value, size_t width) {
  out->resize(out->size() + width);
  StoreAt(*out, out->size() - width, value, width);
}

/// One item table entry with raw wire codes, so tests can write values no encoder would.
struct RawItem {
  std::string name;
  uint8_t dtype = 0;
  uint8_t value_dtype = 0;
  uint8_t op = 0;
  uint8_t encoding = 0;
  std::vector<int64_t> dims;
  uint64_t span_begin = 0;
  uint64_t span_end = 0;
  uint64_t count = 0;
  std::vector<uint8_t> locations;
  /// Written instead of locations.size() when set.
  std::optional<uint64_t> location_bytes;
  uint64_t digest = 0;
  std::vector<std::byte> values;
  uint32_t value_width = 1;
};

struct RawGroup {
  uint8_t width = 0;
  uint64_t element_count = 0;
  std::vector<std::byte> bytes;
};

struct RawBody {
  std::vector<RawItem> items;
  std::vector<RawGroup> groups;
  std::vector<std::byte> trailing;
};

RawItem RawFromItem(const Item& item) {
  RawItem raw;
  raw.name = item.name;
  raw.dtype = static_cast<uint8_t>(item.dtype);
  raw.value_dtype = static_cast<uint8_t>(item.value_dtype);
  raw.op = static_cast<uint8_t>(item.op);
  raw.encoding = static_cast<uint8_t>(item.location_encoding);
  raw.dims = item.shape;
  raw.span_begin = item.span_begin;
  raw.span_end = item.span_end;
  raw.count = item.count;
  raw.locations = item.locations;
  raw.digest = item.digest;
  raw.values = item.values;
  raw.value_width = DTypeSize(item.value_dtype);
  return raw;
}

/// Group the items' values by width in first-seen order, as planes when `planes` (written here
/// byte by byte, independently of SplitBytePlanes).
void DeriveGroups(RawBody* body, bool planes) {
  body->groups.clear();
  for (const RawItem& item : body->items) {
    auto group = std::find_if(body->groups.begin(), body->groups.end(),
                              [&](const RawGroup& g) { return g.width == item.value_width; });
    if (group == body->groups.end()) {
      body->groups.push_back({static_cast<uint8_t>(item.value_width), 0, {}});
      group = body->groups.end() - 1;
    }
    group->element_count += item.values.size() / item.value_width;
    group->bytes.insert(group->bytes.end(), item.values.begin(), item.values.end());
  }
  if (!planes) return;
  for (RawGroup& group : body->groups) {
    std::vector<std::byte> split(group.bytes.size());
    for (uint64_t e = 0; e < group.element_count; ++e) {
      for (uint32_t p = 0; p < group.width; ++p) {
        split[p * group.element_count + e] = group.bytes[e * group.width + p];
      }
    }
    group.bytes = std::move(split);
  }
}

std::vector<std::byte> SerializeBody(const RawBody& body) {
  std::vector<std::byte> out;
  for (const RawItem& item : body.items) {
    Put(&out, item.name.size(), 2);
    for (char c : item.name) out.push_back(static_cast<std::byte>(c));
    Put(&out, item.dtype, 1);
    Put(&out, item.value_dtype, 1);
    Put(&out, item.op, 1);
    Put(&out, item.encoding, 1);
    Put(&out, item.dims.size(), 1);
    for (int64_t d : item.dims) Put(&out, static_cast<uint64_t>(d), 8);
    Put(&out, item.span_begin, 8);
    Put(&out, item.span_end, 8);
    Put(&out, item.count, 8);
    Put(&out, item.location_bytes.value_or(item.locations.size()), 8);
    Put(&out, item.digest, 8);
  }
  for (const RawItem& item : body.items) {
    for (uint8_t b : item.locations) out.push_back(static_cast<std::byte>(b));
  }
  for (const RawGroup& group : body.groups) {
    Put(&out, group.width, 1);
    Put(&out, group.element_count, 8);
    out.insert(out.end(), group.bytes.begin(), group.bytes.end());
  }
  out.insert(out.end(), body.trailing.begin(), body.trailing.end());
  return out;
}

PayloadIds TestIds() {
  PayloadIds ids;
  for (size_t i = 0; i < ids.transfer_id.bytes.size(); ++i) {
    ids.transfer_id.bytes[i] = static_cast<uint8_t>(0xA0 + i);
  }
  ids.producer_id = 3;
  ids.payload_id = 7;
  ids.base_version = 41;
  ids.target_version = 42;
  return ids;
}

/// Recompute the body checksum and the header checksum after an edit.
void FixChecksums(std::vector<std::byte>* payload) {
  const auto compressed = std::span<const std::byte>(*payload).subspan(kPayloadHeaderSize);
  const XXH128_hash_t hash = XXH3_128bits(compressed.data(), compressed.size());
  StoreAt(*payload, kChecksumOffset, hash.low64, 8);
  StoreAt(*payload, kChecksumOffset + 8, hash.high64, 8);
  StoreAt(*payload, kHeaderChecksumOffset, XXH3_64bits(payload->data(), kHeaderChecksumOffset), 8);
}

std::vector<std::byte> CompressFrame(std::span<const std::byte> body, bool content_size = true) {
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, 1);
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, content_size ? 1 : 0);
  std::vector<std::byte> frame(ZSTD_compressBound(body.size()));
  size_t n;
  if (content_size) {
    n = ZSTD_compress2(cctx, frame.data(), frame.size(), body.data(), body.size());
  } else {
    // Streaming with an unknown size: the only way zstd leaves the content size out.
    ZSTD_inBuffer in{body.data(), body.size(), 0};
    ZSTD_outBuffer out{frame.data(), frame.size(), 0};
    n = ZSTD_compressStream2(cctx, &out, &in, ZSTD_e_end);
    n = ZSTD_isError(n) ? n : out.pos;
  }
  ZSTD_freeCCtx(cctx);
  EXPECT_FALSE(ZSTD_isError(n)) << ZSTD_getErrorName(n);
  frame.resize(n);
  return frame;
}

/// Build a complete payload around a compressed body, writing every header field by hand.
std::vector<std::byte> SealFrame(std::span<const std::byte> frame, uint64_t body_bytes,
                                 uint32_t item_count, uint16_t flags,
                                 const PayloadIds& ids = TestIds()) {
  std::vector<std::byte> payload(kPayloadHeaderSize);
  payload[0] = std::byte{'R'};
  payload[1] = std::byte{'F'};
  payload[2] = std::byte{'P'};
  payload[3] = std::byte{'L'};
  StoreAt(payload, kVersionOffset, 1, 2);
  StoreAt(payload, kFlagsOffset, flags, 2);
  for (size_t i = 0; i < 16; ++i) {
    payload[kTransferIdOffset + i] = static_cast<std::byte>(ids.transfer_id.bytes[i]);
  }
  StoreAt(payload, kProducerIdOffset, ids.producer_id, 4);
  StoreAt(payload, kPayloadIdOffset, ids.payload_id, 4);
  StoreAt(payload, kBaseVersionOffset, ids.base_version, 8);
  StoreAt(payload, kTargetVersionOffset, ids.target_version, 8);
  StoreAt(payload, kItemCountOffset, item_count, 4);
  StoreAt(payload, kCompressionOffset, 1, 1);
  StoreAt(payload, kBodyBytesOffset, body_bytes, 8);
  StoreAt(payload, kCompressedBytesOffset, frame.size(), 8);
  payload.insert(payload.end(), frame.begin(), frame.end());
  FixChecksums(&payload);
  return payload;
}

std::vector<std::byte> SealBody(std::span<const std::byte> body, uint32_t item_count,
                                uint16_t flags) {
  return SealFrame(CompressFrame(body), body.size(), item_count, flags);
}

std::vector<std::byte> SealRawBody(const RawBody& body, uint16_t flags = 0) {
  return SealBody(SerializeBody(body), static_cast<uint32_t>(body.items.size()), flags);
}

std::vector<std::byte> DecompressBody(std::span<const std::byte> payload) {
  const auto frame = payload.subspan(kPayloadHeaderSize);
  std::vector<std::byte> body(ZSTD_getFrameContentSize(frame.data(), frame.size()));
  const size_t n = ZSTD_decompress(body.data(), body.size(), frame.data(), frame.size());
  EXPECT_FALSE(ZSTD_isError(n));
  return body;
}

// ---- Item builders. ----------------------------------------------------------------------------

std::vector<std::byte> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>(rng());
  return out;
}

struct LocationCase {
  Shape shape;
  uint64_t span_begin;
  uint64_t span_end;
  std::vector<uint64_t> locations;
};

/// A span and locations that `encoding` can represent (and, for gap32/gap64, that need it).
LocationCase LocationsFor(LocationEncoding encoding) {
  switch (encoding) {
    case LocationEncoding::kAll: {
      LocationCase c{{3, 7}, 4, 17, {}};
      for (uint64_t i = c.span_begin; i < c.span_end; ++i) c.locations.push_back(i);
      return c;
    }
    case LocationEncoding::kRange: {
      LocationCase c{{1000}, 10, 900, {}};
      for (uint64_t i = 10; i < 15; ++i) c.locations.push_back(i);
      c.locations.insert(c.locations.end(), {40, 41, 100});
      for (uint64_t i = 500; i < 531; ++i) c.locations.push_back(i);
      c.locations.push_back(899);
      return c;
    }
    case LocationEncoding::kGap16: {
      LocationCase c{{64, 64}, 0, 4096, {}};
      for (uint64_t i = 0; i < 100; ++i) c.locations.push_back(3 + 37 * i);
      return c;
    }
    case LocationEncoding::kGap32:
      return {{300000}, 100, 300000, {100, 70000, 70001, 250000, 299999}};
    case LocationEncoding::kGap64: {
      constexpr uint64_t k4G = uint64_t{1} << 32;
      return {{3, static_cast<int64_t>(k4G)}, 1, 3 * k4G, {1, 2, k4G + 10, 2 * k4G + 77}};
    }
    case LocationEncoding::kBitmask: {
      LocationCase c{{2, 50}, 3, 97, {}};
      for (uint64_t i = 3; i < 97; i += 2) c.locations.push_back(i);
      c.locations.push_back(96);
      return c;
    }
    case LocationEncoding::kContext:  // Coded from old values: context_items_test.
      break;
  }
  return {};
}

Item MakeItem(std::string name, DType dtype, Op op, DType value_dtype, LocationEncoding encoding,
              uint64_t seed) {
  const LocationCase c = LocationsFor(encoding);
  Item item;
  item.name = std::move(name);
  item.dtype = dtype;
  item.shape = c.shape;
  item.op = op;
  item.value_dtype = value_dtype;
  item.span_begin = c.span_begin;
  item.span_end = c.span_end;
  item.count = c.locations.size();
  item.location_encoding = encoding;
  EXPECT_OK(EncodeLocations(encoding, c.locations, c.span_begin, c.span_end, &item.locations));
  item.values = RandomBytes(item.count * DTypeSize(value_dtype), seed);
  item.digest = seed * 0x9E3779B97F4A7C15ULL;
  return item;
}

std::vector<ItemView> Views(const std::vector<Item>& items) {
  std::vector<ItemView> views;
  for (const Item& item : items) views.push_back(item.view());
  return views;
}

void ExpectSameItem(const ItemView& actual, const ItemView& expected) {
  SCOPED_TRACE("item '" + std::string(expected.name) + "'");
  EXPECT_EQ(actual.name, expected.name);
  EXPECT_EQ(actual.dtype, expected.dtype);
  EXPECT_EQ(actual.shape, expected.shape);
  EXPECT_EQ(actual.op, expected.op);
  EXPECT_EQ(actual.value_dtype, expected.value_dtype);
  EXPECT_EQ(actual.span_begin, expected.span_begin);
  EXPECT_EQ(actual.span_end, expected.span_end);
  EXPECT_EQ(actual.count, expected.count);
  EXPECT_EQ(actual.location_encoding, expected.location_encoding);
  EXPECT_TRUE(std::ranges::equal(actual.locations, expected.locations));
  EXPECT_TRUE(std::ranges::equal(actual.values, expected.values));
  EXPECT_EQ(actual.digest, expected.digest);
}

void ExpectSameItems(std::span<const ItemView> actual, std::span<const ItemView> expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) ExpectSameItem(actual[i], expected[i]);
}

/// Several items over all four value widths, interleaved so that group order and in-group
/// order both matter; includes an add item and its demoted overwrite item on one tensor.
std::vector<Item> MixedItems() {
  std::vector<Item> items;
  items.push_back(MakeItem("w.bf16", DType::kBFloat16, Op::kXor, DType::kBFloat16,
                           LocationEncoding::kRange, 1));
  items.push_back(MakeItem("w.f32", DType::kFloat32, Op::kOverwrite, DType::kFloat32,
                           LocationEncoding::kGap16, 2));
  items.push_back(
      MakeItem("w.i8", DType::kInt8, Op::kXor, DType::kInt8, LocationEncoding::kBitmask, 3));
  items.push_back(
      MakeItem("w.add", DType::kBFloat16, Op::kAdd, DType::kFloat32, LocationEncoding::kGap32, 4));
  Item demoted = MakeItem("w.add", DType::kBFloat16, Op::kOverwrite, DType::kBFloat16,
                          LocationEncoding::kGap16, 5);
  demoted.shape = items.back().shape;  // Same tensor, disjoint locations.
  demoted.span_begin = items.back().span_begin;
  demoted.span_end = items.back().span_end;
  demoted.locations.clear();
  const std::vector<uint64_t> demoted_locations = {101, 102, 103};
  EXPECT_OK(EncodeLocations(LocationEncoding::kGap16, demoted_locations, demoted.span_begin,
                            demoted.span_end, &demoted.locations));
  demoted.count = demoted_locations.size();
  demoted.values = RandomBytes(demoted.count * 2, 6);
  items.push_back(std::move(demoted));
  items.push_back(
      MakeItem("w.f64", DType::kFloat64, Op::kFull, DType::kFloat64, LocationEncoding::kAll, 7));
  items.push_back(
      MakeItem("w.i16", DType::kInt16, Op::kXor, DType::kInt16, LocationEncoding::kGap64, 8));
  return items;
}

// ---- TransferId. -------------------------------------------------------------------------------

TEST(TransferIdTest, HexRoundTrip) {
  const TransferId id = TestIds().transfer_id;
  EXPECT_EQ(id.ToHex(), "a0a1a2a3a4a5a6a7a8a9aaabacadaeaf");
  ASSERT_OK_AND_ASSIGN(TransferId parsed, TransferId::FromHex(id.ToHex()));
  EXPECT_EQ(parsed, id);
  ASSERT_OK_AND_ASSIGN(TransferId upper, TransferId::FromHex("A0A1A2A3A4A5A6A7A8A9AAABACADAEAF"));
  EXPECT_EQ(upper, id);
}

TEST(TransferIdTest, RejectsMalformedHex) {
  EXPECT_STATUS(InvalidArgument, TransferId::FromHex(""));
  EXPECT_STATUS(InvalidArgument, TransferId::FromHex("a0a1a2a3a4a5a6a7a8a9aaabacadaea"));
  EXPECT_STATUS(InvalidArgument, TransferId::FromHex("a0a1a2a3a4a5a6a7a8a9aaabacadaeaf0"));
  EXPECT_STATUS_MSG(InvalidArgument, "xyz",
                    TransferId::FromHex("a0a1a2a3a4a5a6a7a8a9aaabacadaxyz"));
  EXPECT_STATUS(InvalidArgument, TransferId::FromHex("a0a1a2a3a4a5a6a7a8a9aaabacad ae "));
}

TEST(TransferIdTest, RandomIdsDiffer) {
  std::set<std::string> seen;
  for (int i = 0; i < 64; ++i) seen.insert(TransferId::Random().ToHex());
  EXPECT_EQ(seen.size(), 64u);
  EXPECT_NE(TransferId::Random(), TransferId{});
}

// ---- Round trips. ------------------------------------------------------------------------------

struct RoundTripCase {
  DType dtype;
  Op op;
  DType value_dtype;
  LocationEncoding encoding;
  bool byte_planes;
};

std::string Describe(const RoundTripCase& c) {
  std::string name =
      fmt::format("{}_{}_{}_{}_{}", DTypeName(c.dtype), OpName(c.op), DTypeName(c.value_dtype),
                  LocationEncodingName(c.encoding), c.byte_planes ? "planes" : "flat");
  std::replace_if(
      name.begin(), name.end(), [](char ch) { return !std::isalnum(ch); }, '_');
  return name;
}

// gtest prints parameters of failing tests with these instead of a byte dump.
void PrintTo(const RoundTripCase& c, std::ostream* os) { *os << Describe(c); }

std::string CaseName(const ::testing::TestParamInfo<RoundTripCase>& info) {
  return Describe(info.param);
}

bool IsAddDType(DType dtype) {
  return dtype == DType::kFloat16 || dtype == DType::kBFloat16 || dtype == DType::kFloat32 ||
         dtype == DType::kFloat64;
}

/// Every valid (dtype, op, value dtype, encoding) combination, with and without byte planes.
std::vector<RoundTripCase> AllRoundTripCases() {
  std::vector<RoundTripCase> cases;
  for (const DTypeInfo& info : AllDTypes()) {
    for (uint8_t e = 1; e <= 6; ++e) {
      const auto encoding = static_cast<LocationEncoding>(e);
      for (bool planes : {false, true}) {
        cases.push_back({info.dtype, Op::kXor, info.dtype, encoding, planes});
        cases.push_back({info.dtype, Op::kOverwrite, info.dtype, encoding, planes});
        if (IsAddDType(info.dtype)) {
          // A delta dtype of another width, so the item's value group differs from its tensor.
          const DType delta = info.dtype == DType::kFloat32 ? DType::kBFloat16 : DType::kFloat32;
          cases.push_back({info.dtype, Op::kAdd, delta, encoding, planes});
        }
        if (encoding == LocationEncoding::kAll) {
          cases.push_back({info.dtype, Op::kFull, info.dtype, encoding, planes});
        }
      }
    }
  }
  return cases;
}

class PayloadRoundTripTest : public ::testing::TestWithParam<RoundTripCase> {};

TEST_P(PayloadRoundTripTest, DecodesToTheEncodedItems) {
  const RoundTripCase& c = GetParam();
  std::vector<Item> items;
  items.push_back(MakeItem("model.layers.0.weight", c.dtype, c.op, c.value_dtype, c.encoding, 11));
  // A second item of another width: two value groups.
  items.push_back(MakeItem("model.layers.0.bias", DType::kFloat64, Op::kXor, DType::kFloat64,
                           LocationEncoding::kRange, 12));
  const auto views = Views(items);
  PayloadEncodeOptions options;
  options.byte_planes = c.byte_planes;
  ASSERT_OK_AND_ASSIGN(auto payload, EncodePayload(TestIds(), views, options));
  ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(payload));
  EXPECT_EQ(decoded.header().flags, c.byte_planes ? kPayloadFlagBytePlanes : 0);
  ExpectSameItems(decoded.items(), views);
  // The decoded location bytes mean the locations the item was built from.
  ASSERT_OK_AND_ASSIGN(auto locations, DecodeAllLocations(decoded.items()[0]));
  EXPECT_EQ(locations, LocationsFor(c.encoding).locations);
}

INSTANTIATE_TEST_SUITE_P(AllCombinations, PayloadRoundTripTest,
                         ::testing::ValuesIn(AllRoundTripCases()), CaseName);

TEST(PayloadTest, EmptyPayloadRoundTrips) {
  ASSERT_OK_AND_ASSIGN(auto payload, EncodePayload(TestIds(), {}));
  ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(payload));
  EXPECT_TRUE(decoded.items().empty());
  EXPECT_EQ(decoded.header().item_count, 0u);
  EXPECT_EQ(decoded.header().body_bytes, 0u);
  EXPECT_EQ(decoded.header().ids.transfer_id, TestIds().transfer_id);
}

TEST(PayloadTest, MultipleItemsAndGroupsRoundTrip) {
  const std::vector<Item> items = MixedItems();
  const auto views = Views(items);
  for (bool planes : {false, true}) {
    PayloadEncodeOptions options;
    options.byte_planes = planes;
    ASSERT_OK_AND_ASSIGN(auto payload, EncodePayload(TestIds(), views, options));
    ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(payload));
    ExpectSameItems(decoded.items(), views);
    // The decoded payload stays valid when moved: items view an owned, stable buffer.
    DecodedPayload moved = std::move(decoded);
    ExpectSameItems(moved.items(), views);
  }
}

TEST(PayloadTest, FullItemOverEmptySpanAndScalar) {
  Item empty;
  empty.name = "empty";
  empty.dtype = empty.value_dtype = DType::kFloat32;
  empty.shape = {0, 5};
  empty.op = Op::kFull;
  Item scalar;
  scalar.name = "scalar";
  scalar.dtype = scalar.value_dtype = DType::kInt64;
  scalar.op = Op::kOverwrite;
  scalar.span_end = 1;
  scalar.count = 1;
  scalar.values = RandomBytes(8, 3);
  const std::vector<Item> items = {empty, scalar};
  ASSERT_OK_AND_ASSIGN(auto payload, EncodePayload(TestIds(), Views(items)));
  ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(payload));
  ExpectSameItems(decoded.items(), Views(items));
}

// compress = false writes the body as a zstd frame of raw blocks: the same items decode, the
// payload is the body plus 14 bytes of frame header and 3 per 128 KiB block, and an empty body
// is one empty last block.
TEST(PayloadTest, ARawBlockBodyDecodesToTheSameItems) {
  PayloadEncodeOptions raw;
  raw.compress = false;
  raw.byte_planes = false;
  Item big =
      MakeItem("big", DType::kBFloat16, Op::kFull, DType::kBFloat16, LocationEncoding::kAll, 1);
  // 300 KiB of values: three blocks, the last one partial.
  big.shape = {150 * 1024};
  big.span_begin = 0;
  big.span_end = big.count = 150 * 1024;
  big.values = RandomBytes(150 * 1024 * 2, 9);
  std::vector<Item> items = MixedItems();
  items.push_back(big);
  for (const std::vector<ItemView>& views : {Views(items), std::vector<ItemView>{}}) {
    ASSERT_OK_AND_ASSIGN(auto payload, EncodePayload(TestIds(), views, raw));
    ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(payload));
    ExpectSameItems(decoded.items(), views);
    const uint64_t body = decoded.header().body_bytes;
    const uint64_t blocks = std::max<uint64_t>(1, (body + (128 << 10) - 1) / (128 << 10));
    EXPECT_EQ(payload.size(), kPayloadHeaderSize + 14 + 3 * blocks + body);
    EXPECT_EQ(decoded.header().flags, 0u);
  }
  // A raw frame that lies about its size is refused like a compressed one.
  ASSERT_OK_AND_ASSIGN(auto payload, EncodePayload(TestIds(), Views(items), raw));
  payload.pop_back();
  EXPECT_FALSE(DecodePayload(payload).ok());
}

// An anchor's payload sent raw (compress = false, FULL items only) stores its body as it is
// (compression 0): the payload is the header and the body, and a receiver that hands the payload
// over decodes it in the payload's own bytes, without a copy.
TEST(PayloadTest, AnAnchorsRawPayloadStoresItsBodyAndDecodesInPlace) {
  PayloadEncodeOptions raw;
  raw.compress = false;
  raw.byte_planes = false;
  std::vector<Item> items;
  for (int t = 0; t < 3; ++t) {
    Item full = MakeItem(fmt::format("layers.{}.weight", t), DType::kBFloat16, Op::kFull,
                         DType::kBFloat16, LocationEncoding::kAll, 1);
    full.shape = {70 * 1024};
    full.span_begin = 0;
    full.span_end = full.count = 70 * 1024;
    full.values = RandomBytes(70 * 1024 * 2, 20 + t);
    items.push_back(full);
  }
  ASSERT_OK_AND_ASSIGN(auto payload, EncodePayload(TestIds(), Views(items), raw));
  EXPECT_EQ(static_cast<uint8_t>(payload[kCompressionOffset]), 0u);
  ASSERT_OK_AND_ASSIGN(DecodedPayload copied, DecodePayload(payload));
  EXPECT_TRUE(copied.header().stored_body);
  EXPECT_EQ(payload.size(), kPayloadHeaderSize + copied.header().body_bytes);
  EXPECT_EQ(copied.header().compressed_bytes, copied.header().body_bytes);
  ExpectSameItems(copied.items(), Views(items));

  ASSERT_OK_AND_ASSIGN(ValidatedPayload validated, ValidatePayload(payload));
  const std::byte* first = validated.bytes().data();
  const std::byte* last = first + validated.size();
  ASSERT_OK_AND_ASSIGN(DecodedPayload taken, DecodePayload(std::move(validated)));
  ExpectSameItems(taken.items(), Views(items));
  for (const ItemView& item : taken.items()) {
    EXPECT_TRUE(item.values.data() >= first && item.values.data() + item.values.size() <= last)
        << item.name << ": its values are in the payload's own bytes";
  }

  // A flipped body byte fails the checksum on either path; nothing is decoded.
  std::vector<std::byte> corrupt = payload;
  corrupt[corrupt.size() / 2] ^= std::byte{1};
  EXPECT_STATUS_MSG(DataLoss, "checksum", DecodePayload(corrupt).status());
  ASSERT_OK_AND_ASSIGN(ValidatedPayload bad, ValidatePayload(corrupt));
  EXPECT_STATUS_MSG(DataLoss, "checksum", DecodePayload(std::move(bad)).status());
  // A stored body must be as long as body_bytes says.
  std::vector<std::byte> lying = payload;
  StoreAt(lying, kBodyBytesOffset, LoadAt(lying, kBodyBytesOffset, 8) + 1, 8);
  FixChecksums(&lying);
  EXPECT_STATUS_MSG(DataLoss, "stored body", DecodePayload(lying).status());
}

// A stored body carries FULL items only (its bytes are never kept to undo an XOR item with): a
// forged one with XOR items is refused by name, however consistent otherwise.
TEST(PayloadTest, AStoredBodyWithAnXorItemIsRefused) {
  PayloadEncodeOptions raw;
  raw.compress = false;
  raw.byte_planes = false;
  const std::vector<Item> items = MixedItems();
  ASSERT_OK_AND_ASSIGN(auto framed, EncodePayload(TestIds(), Views(items), raw));
  ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(framed));
  const uint64_t body_bytes = decoded.header().body_bytes;
  std::vector<std::byte> body(body_bytes);
  const size_t n = ZSTD_decompress(body.data(), body.size(), framed.data() + kPayloadHeaderSize,
                                   framed.size() - kPayloadHeaderSize);
  ASSERT_EQ(n, body_bytes);
  std::vector<std::byte> forged(framed.begin(), framed.begin() + kPayloadHeaderSize);
  forged.insert(forged.end(), body.begin(), body.end());
  forged[kCompressionOffset] = std::byte{0};
  StoreAt(forged, kCompressedBytesOffset, body_bytes, 8);
  FixChecksums(&forged);
  EXPECT_STATUS_MSG(DataLoss, "only FULL items", DecodePayload(forged).status());
  // An unknown compression is still refused in the header.
  forged[kCompressionOffset] = std::byte{2};
  FixChecksums(&forged);
  EXPECT_STATUS_MSG(InvalidArgument, "unsupported compression 2", DecodePayload(forged).status());
}

TEST(PayloadTest, EncodingIsDeterministic) {
  const std::vector<Item> items = MixedItems();
  const auto views = Views(items);
  ASSERT_OK_AND_ASSIGN(auto first, EncodePayload(TestIds(), views));
  ASSERT_OK_AND_ASSIGN(auto second, EncodePayload(TestIds(), views));
  EXPECT_EQ(first, second);
}

TEST(PayloadTest, BytePlanesShrinkLowBitXorValues) {
  // XOR values of 1-ulp changes: only the low byte of each float32 is nonzero.
  Item item = MakeItem("w", DType::kFloat32, Op::kXor, DType::kFloat32, LocationEncoding::kAll, 1);
  item.shape = {4096};
  item.span_begin = 0;
  item.span_end = item.count = 4096;
  item.values.assign(4096 * 4, std::byte{0});
  std::mt19937_64 rng(5);
  for (size_t i = 0; i < 4096; ++i) item.values[i * 4] = static_cast<std::byte>(rng() | 1);
  const std::vector<ItemView> views = {item.view()};
  PayloadEncodeOptions flat;
  flat.byte_planes = false;
  ASSERT_OK_AND_ASSIGN(auto flat_payload, EncodePayload(TestIds(), views, flat));
  ASSERT_OK_AND_ASSIGN(auto planes_payload, EncodePayload(TestIds(), views));
  EXPECT_LT(planes_payload.size(), flat_payload.size());
}

// ---- The wire layout, checked against the test-side writer. ------------------------------------

TEST(PayloadLayoutTest, HeaderFieldsSitAtTheirSpecifiedOffsets) {
  const std::vector<Item> items = MixedItems();
  const auto views = Views(items);
  ASSERT_OK_AND_ASSIGN(auto payload, EncodePayload(TestIds(), views));
  const std::span<const std::byte> p(payload);
  EXPECT_EQ(std::memcmp(p.data() + kMagicOffset, "RFPL", 4), 0);
  EXPECT_EQ(LoadAt(p, kVersionOffset, 2), 1u);
  EXPECT_EQ(LoadAt(p, kFlagsOffset, 2), kPayloadFlagBytePlanes);
  EXPECT_EQ(std::to_integer<uint8_t>(p[kTransferIdOffset]), 0xA0);
  EXPECT_EQ(std::to_integer<uint8_t>(p[kTransferIdOffset + 15]), 0xAF);
  EXPECT_EQ(LoadAt(p, kProducerIdOffset, 4), 3u);
  EXPECT_EQ(LoadAt(p, kPayloadIdOffset, 4), 7u);
  EXPECT_EQ(LoadAt(p, kBaseVersionOffset, 8), 41u);
  EXPECT_EQ(LoadAt(p, kTargetVersionOffset, 8), 42u);
  EXPECT_EQ(LoadAt(p, kItemCountOffset, 4), views.size());
  EXPECT_EQ(LoadAt(p, kCompressionOffset, 1), 1u);
  EXPECT_EQ(LoadAt(p, kMacAlgorithmOffset, 1), 0u);
  EXPECT_EQ(LoadAt(p, kReservedOffset, 2), 0u);
  EXPECT_EQ(LoadAt(p, kCompressedBytesOffset, 8), payload.size() - kPayloadHeaderSize);
  for (size_t i = 0; i < 32; ++i) EXPECT_EQ(p[kMacOffset + i], std::byte{0});
  const XXH128_hash_t hash =
      XXH3_128bits(p.data() + kPayloadHeaderSize, payload.size() - kPayloadHeaderSize);
  EXPECT_EQ(LoadAt(p, kChecksumOffset, 8), hash.low64);
  EXPECT_EQ(LoadAt(p, kChecksumOffset + 8, 8), hash.high64);
  EXPECT_EQ(LoadAt(p, kHeaderChecksumOffset, 8), XXH3_64bits(p.data(), kHeaderChecksumOffset));

  ASSERT_OK_AND_ASSIGN(PayloadHeader header, ValidatePayloadHeader(payload));
  EXPECT_EQ(header.body_bytes, LoadAt(p, kBodyBytesOffset, 8));
  EXPECT_EQ(header.ids.payload_id, 7u);
  EXPECT_EQ(std::memcmp(header.checksum.data(), p.data() + kChecksumOffset, 16), 0);
}

TEST(PayloadLayoutTest, BodyMatchesTheSpecifiedLayout) {
  const std::vector<Item> items = MixedItems();
  for (bool planes : {false, true}) {
    PayloadEncodeOptions options;
    options.byte_planes = planes;
    ASSERT_OK_AND_ASSIGN(auto payload, EncodePayload(TestIds(), Views(items), options));
    RawBody expected;
    for (const Item& item : items) expected.items.push_back(RawFromItem(item));
    DeriveGroups(&expected, planes);
    // Widths in first-seen order: bf16 (2), f32 (4), i8 (1), then f64 (8).
    ASSERT_EQ(expected.groups.size(), 4u);
    EXPECT_EQ(expected.groups[0].width, 2);
    EXPECT_EQ(expected.groups[3].width, 8);
    EXPECT_EQ(DecompressBody(payload), SerializeBody(expected)) << "planes=" << planes;
    EXPECT_EQ(LoadAt(payload, kBodyBytesOffset, 8), SerializeBody(expected).size());
  }
}

TEST(PayloadLayoutTest, TestWriterPayloadDecodes) {
  // The forging tests below start from this body; it must be valid for them to mean anything.
  const std::vector<Item> items = MixedItems();
  RawBody body;
  for (const Item& item : items) body.items.push_back(RawFromItem(item));
  DeriveGroups(&body, true);
  ASSERT_OK_AND_ASSIGN(DecodedPayload decoded,
                       DecodePayload(SealRawBody(body, kPayloadFlagBytePlanes)));
  ExpectSameItems(decoded.items(), Views(items));
}

// ---- Encoder input validation. ------------------------------------------------------------------

struct BadItemCase {
  std::string label;
  std::function<void(Item*)> corrupt;
};

void PrintTo(const BadItemCase& c, std::ostream* os) { *os << c.label; }

class EncoderRejectsTest : public ::testing::TestWithParam<BadItemCase> {};

TEST_P(EncoderRejectsTest, InvalidArgumentNamingTheItem) {
  std::vector<Item> items = {
      MakeItem("ok", DType::kFloat32, Op::kXor, DType::kFloat32, LocationEncoding::kGap16, 1),
      MakeItem("bad.item", DType::kBFloat16, Op::kXor, DType::kBFloat16, LocationEncoding::kRange,
               2)};
  GetParam().corrupt(&items[1]);
  const auto result = EncodePayload(TestIds(), Views(items));
  EXPECT_STATUS(InvalidArgument, result);
  EXPECT_NE(result.status().message().find("item 1"), std::string::npos)
      << result.status().message();
}

INSTANTIATE_TEST_SUITE_P(
    BadItems, EncoderRejectsTest,
    ::testing::Values(
        BadItemCase{"ValueSize", [](Item* i) { i->values.pop_back(); }},
        BadItemCase{"TooManyValues", [](Item* i) { i->values.resize(i->values.size() + 2); }},
        BadItemCase{"SpanPastNumel", [](Item* i) { i->span_end = 1001; }},
        BadItemCase{"SpanReversed", [](Item* i) { i->span_begin = i->span_end + 1; }},
        BadItemCase{"NegativeDim", [](Item* i) { i->shape = {-1000}; }},
        BadItemCase{"EmptyName", [](Item* i) { i->name.clear(); }},
        BadItemCase{"NameTooLong", [](Item* i) { i->name.assign(1025, 'n'); }},
        BadItemCase{"NulInName", [](Item* i) { i->name.push_back('\0'); }},
        BadItemCase{"RankTooHigh", [](Item* i) { i->shape.assign(17, 1); }},
        BadItemCase{"FullWithoutAll", [](Item* i) { i->op = Op::kFull; }},
        BadItemCase{"AllWithWrongCount",
                    [](Item* i) {
                      i->location_encoding = LocationEncoding::kAll;
                      i->locations.clear();
                    }},
        BadItemCase{"CountMismatchesLocations",
                    [](Item* i) {
                      i->count -= 1;
                      i->values.resize(i->count * 2);
                    }},
        BadItemCase{"UnsortedLocationBytes", [](Item* i) { i->locations[0] ^= 0x40; }},
        BadItemCase{"ValueDTypeDiffers", [](Item* i) { i->value_dtype = DType::kFloat16; }},
        BadItemCase{"AddOnIntegers",
                    [](Item* i) {
                      i->dtype = i->value_dtype = DType::kInt16;
                      i->op = Op::kAdd;
                    }},
        BadItemCase{"UnknownOp", [](Item* i) { i->op = static_cast<Op>(9); }},
        BadItemCase{"UnknownDType", [](Item* i) { i->dtype = static_cast<DType>(0); }},
        BadItemCase{"UnknownEncoding",
                    [](Item* i) { i->location_encoding = static_cast<LocationEncoding>(7); }},
        BadItemCase{"SameNameOtherShape",
                    [](Item* i) {
                      i->name = "ok";
                      i->dtype = i->value_dtype = DType::kFloat32;
                      i->values.resize(i->count * 4);
                    }}),
    [](const auto& param_info) { return param_info.param.label; });

TEST(EncoderTest, RejectsTargetNotAfterBase) {
  PayloadIds ids = TestIds();
  ids.target_version = ids.base_version;
  EXPECT_STATUS_MSG(InvalidArgument, "target_version", EncodePayload(ids, {}));
}

TEST(EncoderTest, RejectsUnknownZstdLevel) {
  PayloadEncodeOptions options;
  options.zstd_level = ZSTD_maxCLevel() + 1;
  EXPECT_STATUS(InvalidArgument, EncodePayload(TestIds(), {}, options));
}

// ---- Hostile input: corruption, truncation, trailing bytes, limits. -----------------------------

std::vector<std::byte> SamplePayload() {
  auto result = EncodePayload(TestIds(), Views(MixedItems()));
  EXPECT_TRUE(result.ok()) << result.status().ToString();
  return std::move(result).ValueOrDie();
}

bool IsRejection(const Status& status) {
  return status.code() == StatusCode::kDataLoss || status.code() == StatusCode::kInvalidArgument;
}

TEST(PayloadHostileTest, EveryCorruptedByteIsRejected) {
  const std::vector<std::byte> payload = SamplePayload();
  for (size_t i = 0; i < payload.size(); ++i) {
    for (uint8_t mask : {0x01, 0x80, 0xFF}) {
      std::vector<std::byte> corrupt = payload;
      corrupt[i] ^= static_cast<std::byte>(mask);
      const auto decoded = DecodePayload(corrupt);
      ASSERT_FALSE(decoded.ok()) << "byte " << i << " ^ " << int{mask} << " was accepted";
      ASSERT_TRUE(IsRejection(decoded.status()))
          << "byte " << i << ": " << decoded.status().ToString();
      if (i < kPayloadHeaderSize) {
        EXPECT_FALSE(ValidatePayloadHeader(corrupt).ok()) << "header byte " << i;
      }
    }
  }
}

TEST(PayloadHostileTest, CorruptedHeaderFieldsWithValidChecksumsAreRejected) {
  // With both checksums fixed up, only the field rules stand between a flip and acceptance.
  // Fields whose every value is valid (ids, versions in range) may decode; all others must not.
  // Bit 1 is flipped: bit 0 of the flags is the (valid) byte-plane flag.
  const std::vector<std::byte> payload = SamplePayload();
  const std::vector<std::pair<size_t, size_t>> checked_fields = {
      {kMagicOffset, 4},     {kVersionOffset, 2},     {kFlagsOffset, 2},
      {kItemCountOffset, 4}, {kCompressionOffset, 1}, {kMacAlgorithmOffset, 1},
      {kReservedOffset, 2},  {kBodyBytesOffset, 8},   {kCompressedBytesOffset, 8},
      {kMacOffset, 32}};
  for (const auto& [offset, width] : checked_fields) {
    for (size_t i = offset; i < offset + width; ++i) {
      std::vector<std::byte> corrupt = payload;
      corrupt[i] ^= std::byte{0x02};
      FixChecksums(&corrupt);
      const auto decoded = DecodePayload(corrupt);
      EXPECT_FALSE(decoded.ok()) << "header byte " << i << " accepted";
      if (!decoded.ok()) {
        EXPECT_TRUE(IsRejection(decoded.status()) ||
                    decoded.status().code() == StatusCode::kResourceExhausted)
            << decoded.status().ToString();
      }
    }
  }
}

TEST(PayloadHostileTest, SpecificHeaderViolationsGetTheirCodes) {
  const std::vector<std::byte> payload = SamplePayload();
  auto with = [&](size_t offset, uint64_t value, size_t width) {
    std::vector<std::byte> edited = payload;
    StoreAt(edited, offset, value, width);
    FixChecksums(&edited);
    return edited;
  };
  EXPECT_STATUS(DataLoss, DecodePayload(with(kMagicOffset, 0x4C504652 + 1, 4)));
  EXPECT_STATUS_MSG(InvalidArgument, "format version 3", DecodePayload(with(kVersionOffset, 3, 2)));
  EXPECT_STATUS_MSG(InvalidArgument, "format version 0", DecodePayload(with(kVersionOffset, 0, 2)));
  EXPECT_STATUS_MSG(InvalidArgument, "flag", DecodePayload(with(kFlagsOffset, 0x3, 2)));
  EXPECT_STATUS_MSG(InvalidArgument, "compression", DecodePayload(with(kCompressionOffset, 2, 1)));
  EXPECT_STATUS_MSG(InvalidArgument, "MAC algorithm",
                    DecodePayload(with(kMacAlgorithmOffset, 1, 1)));
  EXPECT_STATUS_MSG(InvalidArgument, "reserved", DecodePayload(with(kReservedOffset, 1, 2)));
  EXPECT_STATUS_MSG(InvalidArgument, "MAC byte 31", DecodePayload(with(kMacOffset + 31, 1, 1)));
  EXPECT_STATUS_MSG(DataLoss, "target_version", DecodePayload(with(kTargetVersionOffset, 41, 8)));
  EXPECT_STATUS_MSG(DataLoss, "cannot fit", DecodePayload(with(kItemCountOffset, 100000, 4)));
  EXPECT_STATUS_MSG(ResourceExhausted, "body_bytes",
                    DecodePayload(with(kBodyBytesOffset, uint64_t{1} << 40, 8)));
  EXPECT_STATUS_MSG(ResourceExhausted, "limit",
                    DecodePayload(with(kCompressedBytesOffset, uint64_t{1} << 40, 8)));
  EXPECT_STATUS_MSG(DataLoss, "truncated",
                    DecodePayload(with(kCompressedBytesOffset, payload.size(), 8)));
  // A wrong header checksum alone.
  std::vector<std::byte> bad_checksum = payload;
  bad_checksum[kHeaderChecksumOffset] ^= std::byte{1};
  EXPECT_STATUS_MSG(DataLoss, "header checksum", ValidatePayloadHeader(bad_checksum));
  // A wrong body checksum passes the header check and fails the full decode.
  std::vector<std::byte> bad_body = payload;
  bad_body.back() ^= std::byte{1};
  EXPECT_OK(ValidatePayloadHeader(bad_body));
  EXPECT_STATUS_MSG(DataLoss, "body checksum", DecodePayload(bad_body));
}

TEST(PayloadHostileTest, EveryTruncationIsRejected) {
  const std::vector<std::byte> payload = SamplePayload();
  for (size_t length = 0; length < payload.size(); ++length) {
    const std::span<const std::byte> prefix(payload.data(), length);
    EXPECT_STATUS(DataLoss, ValidatePayloadHeader(prefix));
    EXPECT_STATUS(DataLoss, DecodePayload(prefix));
  }
}

TEST(PayloadHostileTest, TrailingBytesAreRejected) {
  std::vector<std::byte> payload = SamplePayload();
  payload.push_back(std::byte{0});
  EXPECT_STATUS_MSG(DataLoss, "trailing", ValidatePayloadHeader(payload));
  EXPECT_STATUS(DataLoss, DecodePayload(payload));
}

TEST(PayloadHostileTest, LimitsAreEnforced) {
  const std::vector<Item> items = MixedItems();
  const std::vector<std::byte> payload = SamplePayload();
  ASSERT_OK_AND_ASSIGN(PayloadHeader header, ValidatePayloadHeader(payload));
  PayloadLimits limits;
  limits.max_payload_bytes = payload.size() - 1;
  EXPECT_STATUS(ResourceExhausted, DecodePayload(payload, limits));
  limits = {};
  limits.max_body_bytes = header.body_bytes - 1;
  EXPECT_STATUS(ResourceExhausted, ValidatePayloadHeader(payload, limits));
  limits = {};
  limits.max_items = static_cast<uint32_t>(items.size() - 1);
  EXPECT_STATUS(ResourceExhausted, ValidatePayloadHeader(payload, limits));
  limits = {};
  limits.max_name_length = 5;  // "w.bf16" has 6 bytes.
  EXPECT_STATUS_MSG(ResourceExhausted, "name", DecodePayload(payload, limits));
  limits = {};
  limits.max_rank = 1;  // Several sample items have rank 2.
  EXPECT_STATUS_MSG(ResourceExhausted, "rank", DecodePayload(payload, limits));
  // At the limits exactly, the payload decodes.
  limits.max_payload_bytes = payload.size();
  limits.max_body_bytes = header.body_bytes;
  limits.max_items = static_cast<uint32_t>(items.size());
  limits.max_name_length = 6;
  limits.max_rank = 2;
  EXPECT_OK(DecodePayload(payload, limits));
}

// A listener validates a payload once (ValidatePayload); the session and the decoder take the
// typed payload and only compare its header's sizes with their own, possibly tighter, limits.
TEST(ValidatedPayloadTest, CarriesTheHeaderToTheDecoderAndMeetsEachStagesLimits) {
  const std::vector<std::byte> payload = SamplePayload();
  ASSERT_OK_AND_ASSIGN(const PayloadHeader header, ValidatePayloadHeader(payload));
  ASSERT_OK_AND_ASSIGN(const ValidatedPayload validated, ValidatePayload(payload));
  EXPECT_EQ(validated.header().ids, header.ids);
  EXPECT_EQ(validated.header().checksum, header.checksum);
  EXPECT_EQ(validated.size(), payload.size());
  EXPECT_TRUE(std::ranges::equal(validated.bytes(), payload));
  // From bytes the caller keeps (a received frame): the same, as a copy.
  ASSERT_OK_AND_ASSIGN(const ValidatedPayload copied,
                       ValidatePayload(std::span<const std::byte>(payload)));
  EXPECT_EQ(copied.header().ids, header.ids);
  EXPECT_TRUE(std::ranges::equal(copied.bytes(), payload));
  EXPECT_NE(copied.bytes().data(), payload.data());
  ASSERT_OK_AND_ASSIGN(const DecodedPayload from_bytes, DecodePayload(payload));
  ASSERT_OK_AND_ASSIGN(const DecodedPayload from_validated, DecodePayload(validated));
  ASSERT_EQ(from_validated.items().size(), from_bytes.items().size());
  for (size_t i = 0; i < from_bytes.items().size(); ++i) {
    EXPECT_EQ(from_validated.items()[i].name, from_bytes.items()[i].name);
    EXPECT_TRUE(std::ranges::equal(from_validated.items()[i].values, from_bytes.items()[i].values));
  }

  // Tighter limits downstream of the listener: refused by name, without parsing bytes.
  PayloadLimits limits;
  EXPECT_OK(CheckPayloadLimits(header, limits));
  limits.max_items = header.item_count - 1;
  EXPECT_STATUS_MSG(ResourceExhausted, "items > limit", CheckPayloadLimits(header, limits));
  EXPECT_STATUS_MSG(ResourceExhausted, "items > limit", DecodePayload(validated, limits));
  limits = {};
  limits.max_body_bytes = header.body_bytes - 1;
  EXPECT_STATUS_MSG(ResourceExhausted, "body_bytes", DecodePayload(validated, limits));
  limits = {};
  limits.max_payload_bytes = payload.size() - 1;
  EXPECT_STATUS_MSG(ResourceExhausted, "compressed body", DecodePayload(validated, limits));
  limits = {};
  limits.max_rank = 1;  // Body limits still apply to the items.
  EXPECT_STATUS_MSG(ResourceExhausted, "rank", DecodePayload(validated, limits));

  // What fails ValidatePayloadHeader fails ValidatePayload, and the body is still the decoder's.
  std::vector<std::byte> bad_header = payload;
  bad_header[kHeaderChecksumOffset] ^= std::byte{1};
  EXPECT_STATUS_MSG(DataLoss, "header checksum", ValidatePayload(bad_header));
  EXPECT_STATUS_MSG(DataLoss, "header checksum",
                    ValidatePayload(std::span<const std::byte>(bad_header)));
  std::vector<std::byte> bad_body = payload;
  bad_body.back() ^= std::byte{1};
  ASSERT_OK_AND_ASSIGN(const ValidatedPayload unchecked_body, ValidatePayload(bad_body));
  EXPECT_STATUS_MSG(DataLoss, "body checksum", DecodePayload(unchecked_body));
}

TEST(PayloadHostileTest, FlippedBodyBytesWithValidChecksumsNeverCrash) {
  // Re-seal each single-byte corruption of the decompressed body with valid checksums: the
  // decoder must reject it with a documented code or accept it, and whatever it accepts must
  // re-encode to the very same body (v1 has one byte string per content).
  const std::vector<Item> items = MixedItems();
  RawBody raw;
  for (const Item& item : items) raw.items.push_back(RawFromItem(item));
  DeriveGroups(&raw, false);
  const std::vector<std::byte> body = SerializeBody(raw);
  size_t accepted = 0;
  for (size_t i = 0; i < body.size(); ++i) {
    std::vector<std::byte> corrupt = body;
    corrupt[i] ^= std::byte{0x01};
    const auto decoded = DecodePayload(SealBody(corrupt, static_cast<uint32_t>(items.size()), 0));
    if (!decoded.ok()) {
      ASSERT_TRUE(IsRejection(decoded.status()) ||
                  decoded.status().code() == StatusCode::kResourceExhausted)
          << "body byte " << i << ": " << decoded.status().ToString();
      continue;
    }
    ++accepted;
    PayloadEncodeOptions flat;
    flat.byte_planes = false;
    ASSERT_OK_AND_ASSIGN(auto reencoded, EncodePayload(TestIds(), decoded->items(), flat));
    ASSERT_EQ(DecompressBody(reencoded), corrupt) << "body byte " << i;
  }
  // Digests, values and name bytes are free-form, so some flips must have been accepted.
  EXPECT_GT(accepted, 0u);
  EXPECT_LT(accepted, body.size());
}

// ---- Forged bodies: valid checksums, inconsistent content. --------------------------------------

struct ForgedCase {
  std::string label;
  std::function<void(RawBody*)> forge;
  StatusCode code;
  std::string message;
};

/// A valid two-item body (a float32 tensor and an int16 tensor) without byte planes.
RawBody BaseBody() {
  RawBody body;
  body.items.push_back(RawFromItem(MakeItem("w.weight", DType::kFloat32, Op::kXor, DType::kFloat32,
                                            LocationEncoding::kGap16, 1)));
  body.items.push_back(RawFromItem(MakeItem("w.bias", DType::kInt16, Op::kOverwrite, DType::kInt16,
                                            LocationEncoding::kRange, 2)));
  DeriveGroups(&body, false);
  return body;
}

void PrintTo(const ForgedCase& c, std::ostream* os) { *os << c.label; }

class ForgedBodyTest : public ::testing::TestWithParam<ForgedCase> {};

TEST_P(ForgedBodyTest, IsRejected) {
  const ForgedCase& c = GetParam();
  RawBody body = BaseBody();
  ASSERT_OK(DecodePayload(SealRawBody(body)));
  c.forge(&body);
  const auto decoded = DecodePayload(SealRawBody(body));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), c.code) << decoded.status().ToString();
  EXPECT_NE(decoded.status().message().find(c.message), std::string::npos)
      << decoded.status().message();
  EXPECT_NE(decoded.status().message().find("payload 7 of producer 3"), std::string::npos)
      << decoded.status().message();
}

/// Change item 1 and re-derive the value groups, so only the intended rule is broken.
std::function<void(RawBody*)> OnItem1(std::function<void(RawItem*)> edit) {
  return [edit](RawBody* body) {
    edit(&body->items[1]);
    DeriveGroups(body, false);
  };
}

constexpr StatusCode kDataLoss = StatusCode::kDataLoss;
constexpr StatusCode kInvalid = StatusCode::kInvalidArgument;
constexpr StatusCode kExhausted = StatusCode::kResourceExhausted;

INSTANTIATE_TEST_SUITE_P(
    Forgeries, ForgedBodyTest,
    ::testing::Values(
        ForgedCase{"UnknownDType", OnItem1([](RawItem* i) { i->dtype = 15; }), kInvalid,
                   "item 1 'w.bias' dtype"},
        ForgedCase{"UnknownValueDType", OnItem1([](RawItem* i) { i->value_dtype = 0; }), kInvalid,
                   "value dtype"},
        ForgedCase{"UnknownOp", OnItem1([](RawItem* i) { i->op = 5; }), kInvalid, "op code 5"},
        ForgedCase{"UnknownEncoding", OnItem1([](RawItem* i) { i->encoding = 7; }), kInvalid,
                   "encoding code 7"},
        ForgedCase{"RankOverLimit", OnItem1([](RawItem* i) { i->dims.assign(17, 1); }),
                   kExhausted, "rank 17"},
        ForgedCase{"NameOverLimit", OnItem1([](RawItem* i) { i->name.assign(1025, 'x'); }),
                   kExhausted, "length 1025"},
        ForgedCase{"EmptyName", OnItem1([](RawItem* i) { i->name.clear(); }), kDataLoss,
                   "empty name"},
        ForgedCase{"NulInName", OnItem1([](RawItem* i) { i->name[1] = '\0'; }), kDataLoss,
                   "'w\\x00bias': name contains a NUL"},
        ForgedCase{"NegativeDim", OnItem1([](RawItem* i) { i->dims = {-1}; }), kDataLoss,
                   "negative extent -1"},
        ForgedCase{"DimsOverflow",
                   OnItem1([](RawItem* i) { i->dims = {int64_t{1} << 40, int64_t{1} << 40}; }),
                   kDataLoss, "2^63"},
        ForgedCase{"SpanPastNumel", OnItem1([](RawItem* i) { i->span_end = 1001; }), kDataLoss,
                   "span [10, 1001) is not inside numel 1000"},
        ForgedCase{"SpanReversed", OnItem1([](RawItem* i) { i->span_begin = 901; }), kDataLoss,
                   "span [901, 900)"},
        ForgedCase{"FullWithRange", OnItem1([](RawItem* i) { i->op = 4; }), kDataLoss,
                   "op full needs location encoding all"},
        ForgedCase{"AllWithWrongCount",
                   OnItem1([](RawItem* i) {
                     i->encoding = 1;
                     i->locations.clear();
                   }),
                   kDataLoss, "encoding all with count 40 != span length 890"},
        ForgedCase{"CountOverSpan",
                   OnItem1([](RawItem* i) {
                     i->span_end = 20;
                     i->dims = {20};
                     i->count = 30;
                   }),
                   kDataLoss, "count 30 > span length 10"},
        ForgedCase{"ZeroCountXor",
                   OnItem1([](RawItem* i) {
                     i->count = 0;
                     i->locations.clear();
                     i->values.clear();
                   }),
                   kDataLoss, "zero locations"},
        ForgedCase{"ValueDTypeDiffers", OnItem1([](RawItem* i) { i->value_dtype = 7; }),
                   kDataLoss, "needs value dtype int16"},
        ForgedCase{"AddOnIntegers", OnItem1([](RawItem* i) { i->op = 3; }), kInvalid,
                   "op add is not defined for dtype int16"},
        ForgedCase{"SameNameOtherShape",
                   [](RawBody* b) {
                     b->items[1].name = "w.weight";
                     b->items[1].dtype = b->items[1].value_dtype = 9;
                     b->items[1].value_width = 4;
                     b->items[1].values.resize(b->items[1].count * 4);
                     DeriveGroups(b, false);
                   },
                   kDataLoss, "disagrees with item 0"},
        ForgedCase{"BadLocationBytes", OnItem1([](RawItem* i) { i->locations.pop_back(); }),
                   kDataLoss, "item 1 'w.bias'"},
        ForgedCase{"LocationOutsideSpan",
                   [](RawBody* b) {
                     // The first gap16 gap becomes 65535, past the span end 4096.
                     b->items[0].locations[0] = 0xFF;
                     b->items[0].locations[1] = 0xFF;
                   },
                   kDataLoss, "item 0 'w.weight'"},
        ForgedCase{"AllWithLocationBytes",
                   [](RawBody* b) {
                     RawItem& i = b->items[1];
                     i.encoding = 1;
                     i.span_begin = 0;
                     i.span_end = i.count;
                     i.locations = {1, 2};
                   },
                   kDataLoss, "encoding all with 2 location bytes"},
        ForgedCase{"LocationSectionPastEnd",
                   OnItem1([](RawItem* i) { i->location_bytes = uint64_t{1} << 40; }), kDataLoss,
                   "locations needs 1099511627776 bytes"},
        ForgedCase{"GroupWidthLies", [](RawBody* b) { b->groups[0].width = 8; }, kDataLoss,
                   "declares width 8"},
        ForgedCase{"GroupCountLies", [](RawBody* b) { b->groups[1].element_count += 1; },
                   kDataLoss, "value group 1 declares"},
        ForgedCase{"GroupMissing", [](RawBody* b) { b->groups.pop_back(); }, kDataLoss,
                   "value group 1"},
        ForgedCase{"GroupsSwapped", [](RawBody* b) { std::swap(b->groups[0], b->groups[1]); },
                   kDataLoss, "value group 0 declares width 2"},
        ForgedCase{"ValuesTruncated", [](RawBody* b) { b->groups[1].bytes.pop_back(); },
                   kDataLoss, "value group 1"},
        ForgedCase{"ExtraGroup", [](RawBody* b) { b->groups.push_back({1, 0, {}}); }, kDataLoss,
                   "9 trailing bytes"},
        ForgedCase{"TrailingByte", [](RawBody* b) { b->trailing.push_back(std::byte{0}); },
                   kDataLoss, "1 trailing bytes"}),
    [](const auto& param_info) { return param_info.param.label; });

TEST(ForgedBodyTest, TruncatedItemTableIsDataLoss) {
  const std::vector<std::byte> body = SerializeBody(BaseBody());
  for (size_t length : {size_t{0}, size_t{1}, size_t{5}, size_t{20}, size_t{60}}) {
    const auto payload = SealBody(std::span(body).first(length), 2, 0);
    // item_count 2 cannot fit a body under 96 bytes: the header check already refuses it.
    SCOPED_TRACE(fmt::format("length {}", length));
    EXPECT_STATUS(DataLoss, DecodePayload(payload));
  }
  // A table that fits the count check but ends inside the second entry.
  const auto payload = SealBody(std::span(body).first(100), 2, 0);
  EXPECT_STATUS_MSG(DataLoss, "item 1", DecodePayload(payload));
}

TEST(ForgedBodyTest, ItemCountLowerThanTheTableIsDataLoss) {
  const std::vector<std::byte> body = SerializeBody(BaseBody());
  EXPECT_STATUS(DataLoss, DecodePayload(SealBody(body, 1, 0)));
}

TEST(ForgedBodyTest, FullItemOverEmptySpanIsTheOnlyItemWithoutLocations) {
  RawBody body;
  RawItem full;
  full.name = "empty";
  full.dtype = full.value_dtype = 9;
  full.op = 4;
  full.encoding = 1;
  full.dims = {0};
  full.value_width = 4;
  body.items.push_back(full);
  DeriveGroups(&body, false);
  ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(SealRawBody(body)));
  ASSERT_EQ(decoded.items().size(), 1u);
  EXPECT_EQ(decoded.items()[0].count, 0u);
  body.items[0].op = 1;  // The same as xor: no locations to change is an error.
  EXPECT_STATUS(DataLoss, DecodePayload(SealRawBody(body)));
}

// ---- Lying zstd frames.
// --------------------------------------------------------------------------

TEST(ZstdFrameTest, ContentSizeDifferentFromBodyBytes) {
  const std::vector<std::byte> body = SerializeBody(BaseBody());
  const auto frame = CompressFrame(body);
  EXPECT_STATUS_MSG(DataLoss, "content size",
                    DecodePayload(SealFrame(frame, body.size() + 1, 2, 0)));
  EXPECT_STATUS_MSG(DataLoss, "content size",
                    DecodePayload(SealFrame(frame, body.size() - 1, 2, 0)));
}

TEST(ZstdFrameTest, FrameWhoseContentSizeLies) {
  // Patch Frame_Content_Size in the zstd frame header (RFC 8878 §3.1.1.1) so the frame claims
  // one byte more or less than it decodes to; the header's body_bytes agrees with the lie.
  const std::vector<std::byte> body = SerializeBody(BaseBody());
  const auto frame = CompressFrame(body);
  const uint8_t descriptor = std::to_integer<uint8_t>(frame[4]);
  const bool single_segment = (descriptor >> 5) & 1;
  const unsigned fcs_flag = descriptor >> 6;
  const unsigned dict_id_sizes[] = {0, 1, 2, 4};
  const size_t fcs_offset = 5 + (single_segment ? 0 : 1) + dict_id_sizes[descriptor & 3];
  const size_t fcs_sizes[] = {single_segment ? size_t{1} : 0, 2, 4, 8};
  const size_t fcs_size = fcs_sizes[fcs_flag];
  ASSERT_GT(fcs_size, 0u);
  const uint64_t fcs_bias = fcs_size == 2 ? 256 : 0;
  ASSERT_EQ(LoadAt(frame, fcs_offset, fcs_size) + fcs_bias, body.size());
  for (int64_t lie : {-1, 1}) {
    std::vector<std::byte> lying = frame;
    const uint64_t claimed = body.size() + lie;
    StoreAt(lying, fcs_offset, claimed - fcs_bias, fcs_size);
    SCOPED_TRACE(fmt::format("lie {}", lie));
    EXPECT_STATUS(DataLoss, DecodePayload(SealFrame(lying, claimed, 2, 0)));
  }
}

TEST(ZstdFrameTest, FrameWithoutContentSize) {
  const std::vector<std::byte> body = SerializeBody(BaseBody());
  const auto frame = CompressFrame(body, /*content_size=*/false);
  ASSERT_EQ(ZSTD_getFrameContentSize(frame.data(), frame.size()), ZSTD_CONTENTSIZE_UNKNOWN);
  EXPECT_STATUS_MSG(DataLoss, "does not declare its content size",
                    DecodePayload(SealFrame(frame, body.size(), 2, 0)));
}

TEST(ZstdFrameTest, TwoFramesOrTrailingBytes) {
  const std::vector<std::byte> body = SerializeBody(BaseBody());
  auto frames = CompressFrame(body);
  const auto second = CompressFrame(std::span(body).first(0));
  frames.insert(frames.end(), second.begin(), second.end());
  EXPECT_STATUS_MSG(DataLoss, "zstd frame spans",
                    DecodePayload(SealFrame(frames, body.size(), 2, 0)));
  auto trailing = CompressFrame(body);
  trailing.push_back(std::byte{0});
  EXPECT_STATUS(DataLoss, DecodePayload(SealFrame(trailing, body.size(), 2, 0)));
}

TEST(ZstdFrameTest, SkippableFrameIsNotABody) {
  // A skippable frame (magic 0x184D2A50, u32 size, data) declares content size 0.
  std::vector<std::byte> skippable(8);
  StoreAt(skippable, 0, 0x184D2A50, 4);
  StoreAt(skippable, 4, 0, 4);
  EXPECT_STATUS_MSG(DataLoss, "not a zstd frame", DecodePayload(SealFrame(skippable, 0, 0, 0)));
}

TEST(ZstdFrameTest, CorruptFrameWithValidChecksum) {
  const std::vector<std::byte> body = SerializeBody(BaseBody());
  auto frame = CompressFrame(body);
  frame[frame.size() / 2] ^= std::byte{0x5A};
  const auto decoded = DecodePayload(SealFrame(frame, body.size(), 2, 0));
  // zstd either detects the damage or produces other bytes, which the table checks then judge.
  if (!decoded.ok()) {
    EXPECT_TRUE(IsRejection(decoded.status())) << decoded.status().ToString();
  }
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {

TEST(PayloadSizeAtTest, SplitsPayloadsStoredBackToBack) {
  PayloadIds ids{TransferId::Random(), 1, 0, 4, 5};
  auto first = EncodePayload(ids, {});
  ids.payload_id = 1;
  auto second = EncodePayload(ids, {});
  ASSERT_TRUE(first.ok() && second.ok());
  std::vector<std::byte> stream = *first;
  stream.insert(stream.end(), second->begin(), second->end());
  ASSERT_OK_AND_ASSIGN(uint64_t size, PayloadSizeAt(stream));
  EXPECT_EQ(size, first->size());
  ASSERT_OK_AND_ASSIGN(uint64_t next, PayloadSizeAt(std::span(stream).subspan(size)));
  EXPECT_EQ(next, second->size());
  // Truncated inside the second payload, and a corrupted header: both refused.
  EXPECT_STATUS(DataLoss, PayloadSizeAt(std::span(stream).subspan(size, next - 1)));
  stream[size + 30] ^= std::byte{1};
  EXPECT_STATUS(DataLoss, PayloadSizeAt(std::span(stream).subspan(size)));
  EXPECT_STATUS(DataLoss, PayloadSizeAt(std::span(stream).first(10)));
}

}  // namespace
}  // namespace refit
