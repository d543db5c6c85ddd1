// Tests of the location encodings (src/codec/locations.cc) and of the op / encoding names
// (src/codec/item.cc).
#include "codec/locations.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "refit/item.h"
#include "test_util.h"

namespace refit {
namespace {

constexpr uint64_t kMax64 = std::numeric_limits<uint64_t>::max();
constexpr uint64_t kTwoPow32 = uint64_t{1} << 32;
constexpr uint64_t kBitsPerByte = 8;
/// Round trips skip encodings larger than this (a bitmask over a 2^33-element span): the test is
/// about the numbers, not about allocating gigabytes.
constexpr uint64_t kMaxRoundTripBytes = uint64_t{1} << 20;

constexpr LocationEncoding kAllEncodings[] = {
    LocationEncoding::kAll,   LocationEncoding::kRange, LocationEncoding::kGap16,
    LocationEncoding::kGap32, LocationEncoding::kGap64, LocationEncoding::kBitmask,
};

// ---------------------------------------------------------------------------------------------
// Names.

TEST(ItemNamesTest, OpNamesRoundTrip) {
  const std::pair<Op, std::string_view> expected[] = {
      {Op::kXor, "xor"}, {Op::kOverwrite, "overwrite"}, {Op::kAdd, "add"}, {Op::kFull, "full"}};
  for (const auto& [op, name] : expected) {
    EXPECT_EQ(OpName(op), name);
    ASSERT_OK_AND_ASSIGN(Op parsed, ParseOp(name));
    EXPECT_EQ(parsed, op);
  }
}

TEST(ItemNamesTest, UnknownOpListsTheAcceptedNames) {
  EXPECT_STATUS_MSG(InvalidArgument, "'XOR'", ParseOp("XOR"));
  EXPECT_STATUS_MSG(InvalidArgument, "xor, overwrite, add, full", ParseOp("sub"));
  EXPECT_STATUS(InvalidArgument, ParseOp(""));
}

TEST(ItemNamesTest, EncodingNamesRoundTrip) {
  const std::pair<LocationEncoding, std::string_view> expected[] = {
      {LocationEncoding::kAll, "all"},     {LocationEncoding::kRange, "range"},
      {LocationEncoding::kGap16, "gap16"}, {LocationEncoding::kGap32, "gap32"},
      {LocationEncoding::kGap64, "gap64"}, {LocationEncoding::kBitmask, "bitmask"},
  };
  for (const auto& [encoding, name] : expected) {
    EXPECT_EQ(LocationEncodingName(encoding), name);
    ASSERT_OK_AND_ASSIGN(LocationEncoding parsed, ParseLocationEncoding(name));
    EXPECT_EQ(parsed, encoding);
  }
}

TEST(ItemNamesTest, UnknownEncodingListsTheAcceptedNames) {
  EXPECT_STATUS_MSG(InvalidArgument, "all, range, gap16, gap32, gap64, bitmask",
                    ParseLocationEncoding("gap8"));
  EXPECT_STATUS_MSG(InvalidArgument, "'Range'", ParseLocationEncoding("Range"));
}

TEST(ItemNamesTest, WireCodesAreStable) {
  EXPECT_EQ(static_cast<int>(Op::kXor), 1);
  EXPECT_EQ(static_cast<int>(Op::kFull), 4);
  EXPECT_EQ(static_cast<int>(LocationEncoding::kAll), 1);
  EXPECT_EQ(static_cast<int>(LocationEncoding::kRange), 2);
  EXPECT_EQ(static_cast<int>(LocationEncoding::kGap16), 3);
  EXPECT_EQ(static_cast<int>(LocationEncoding::kGap32), 4);
  EXPECT_EQ(static_cast<int>(LocationEncoding::kGap64), 5);
  EXPECT_EQ(static_cast<int>(LocationEncoding::kBitmask), 6);
}

// ---------------------------------------------------------------------------------------------
// Helpers.

std::vector<uint8_t> Encode(LocationEncoding encoding, const std::vector<uint64_t>& locations,
                            uint64_t span_begin, uint64_t span_end) {
  std::vector<uint8_t> bytes;
  Status status = EncodeLocations(encoding, locations, span_begin, span_end, &bytes);
  EXPECT_TRUE(status.ok()) << LocationEncodingName(encoding) << ": " << status.ToString();
  return bytes;
}

// Decode with Next() in batches of `batch` locations.
Result<std::vector<uint64_t>> DecodeInBatches(LocationEncoding encoding,
                                              std::span<const uint8_t> bytes, uint64_t count,
                                              uint64_t span_begin, uint64_t span_end,
                                              size_t batch) {
  REFIT_ASSIGN_OR_RETURN(LocationDecoder decoder,
                         LocationDecoder::Make(encoding, bytes, count, span_begin, span_end));
  std::vector<uint64_t> out;
  std::vector<uint64_t> buffer(batch);
  while (true) {
    REFIT_ASSIGN_OR_RETURN(const size_t n, decoder.Next(buffer));
    if (n == 0) return out;
    out.insert(out.end(), buffer.begin(), buffer.begin() + static_cast<ptrdiff_t>(n));
  }
}

Status DecodeStatus(LocationEncoding encoding, std::span<const uint8_t> bytes, uint64_t count,
                    uint64_t span_begin, uint64_t span_end) {
  return DecodeInBatches(encoding, bytes, count, span_begin, span_end, 7).status();
}

ItemView MakeView(LocationEncoding encoding, std::span<const uint8_t> bytes, uint64_t count,
                  uint64_t span_begin, uint64_t span_end) {
  ItemView item;
  item.location_encoding = encoding;
  item.locations = bytes;
  item.count = count;
  item.span_begin = span_begin;
  item.span_end = span_end;
  return item;
}

bool IsGapEncoding(LocationEncoding encoding) {
  return encoding == LocationEncoding::kGap16 || encoding == LocationEncoding::kGap32 ||
         encoding == LocationEncoding::kGap64;
}

/// Bytes per gap of a gap encoding (docs/format/payload.md: 2 / 4 / 8).
uint64_t GapWidth(LocationEncoding encoding) {
  switch (encoding) {
    case LocationEncoding::kGap16:
      return 2;
    case LocationEncoding::kGap32:
      return 4;
    default:
      return 8;
  }
}

/// The gaps the gap encodings store: g0 = L0 - span_begin, gi = Li - L(i-1) - 1.
std::vector<uint64_t> GapsOf(const std::vector<uint64_t>& locations, uint64_t span_begin) {
  std::vector<uint64_t> gaps;
  uint64_t next = span_begin;
  for (const uint64_t location : locations) {
    gaps.push_back(location - next);
    next = location + 1;
  }
  return gaps;
}

/// The bytes of `gap` up to its most significant non-zero one, at least one.
uint64_t SignificantBytes(uint64_t gap) {
  uint64_t bytes = 1;
  while (bytes < sizeof(uint64_t) && (gap >> (kBitsPerByte * bytes)) != 0) ++bytes;
  return bytes;
}

/// The chooser's cost model (src/codec/locations.cc, "Choosing"), restated here: a gap encoding
/// costs the significant bytes of its gaps whatever its width (zstd squeezes the all-zero parts
/// of the planes to nearly nothing); every other encoding costs its exact size; kMax64 when the
/// encoding cannot represent the locations.
uint64_t ChooserCost(LocationEncoding encoding, const std::vector<uint64_t>& locations,
                     uint64_t span_begin, uint64_t span_end) {
  const uint64_t bytes = EstimateLocationBytes(encoding, locations, span_begin, span_end);
  if (bytes == kMax64 || !IsGapEncoding(encoding)) return bytes;
  uint64_t cost = 0;
  for (const uint64_t gap : GapsOf(locations, span_begin)) cost += SignificantBytes(gap);
  return cost;
}

// Check that gap-encoded `bytes` are the planes of the gaps of `locations`: byte k of gap i at
// offset k·n + i, n × width bytes in all.
void ExpectPlanarGaps(LocationEncoding encoding, std::span<const uint8_t> bytes,
                      const std::vector<uint64_t>& locations, uint64_t span_begin) {
  const std::vector<uint64_t> gaps = GapsOf(locations, span_begin);
  const uint64_t width = GapWidth(encoding);
  const size_t n = gaps.size();
  ASSERT_EQ(bytes.size(), n * width);
  for (size_t i = 0; i < n; ++i) {
    for (size_t k = 0; k < width; ++k) {
      ASSERT_EQ(bytes[k * n + i], static_cast<uint8_t>(gaps[i] >> (kBitsPerByte * k)))
          << "byte " << k << " of gap #" << i << " = " << gaps[i];
    }
  }
}

// Encode `locations` with `encoding`, check the estimate is exact (and, for the gap encodings,
// the planar layout), and decode them back in several ways; every path must reproduce them.
void ExpectRoundTrip(LocationEncoding encoding, const std::vector<uint64_t>& locations,
                     uint64_t span_begin, uint64_t span_end) {
  SCOPED_TRACE(fmt::format("{} n={} span=[{}, {})", LocationEncodingName(encoding),
                           locations.size(), span_begin, span_end));
  const std::vector<uint8_t> bytes = Encode(encoding, locations, span_begin, span_end);
  EXPECT_EQ(EstimateLocationBytes(encoding, locations, span_begin, span_end), bytes.size());
  if (IsGapEncoding(encoding)) ExpectPlanarGaps(encoding, bytes, locations, span_begin);
  for (const size_t batch : {size_t{1}, size_t{3}, size_t{64}, size_t{100000}}) {
    ASSERT_OK_AND_ASSIGN(
        std::vector<uint64_t> decoded,
        DecodeInBatches(encoding, bytes, locations.size(), span_begin, span_end, batch));
    EXPECT_EQ(decoded, locations) << "batch " << batch;
  }
  ASSERT_OK_AND_ASSIGN(
      std::vector<uint64_t> all,
      DecodeAllLocations(MakeView(encoding, bytes, locations.size(), span_begin, span_end)));
  EXPECT_EQ(all, locations);
  ASSERT_OK_AND_ASSIGN(
      LocationDecoder decoder,
      LocationDecoder::Make(encoding, bytes, locations.size(), span_begin, span_end));
  EXPECT_EQ(decoder.count(), locations.size());
  EXPECT_OK(decoder.ValidateAll());
}

// Round-trip through every encoding that can represent `locations`, and through the chooser;
// check the chosen encoding has the lowest ChooserCost, ties going to the lower wire code, and
// that a chosen gap encoding is the narrowest that can represent the locations.
void ExpectRoundTripEverywhere(const std::vector<uint64_t>& locations, uint64_t span_begin,
                               uint64_t span_end) {
  uint64_t best_cost = kMax64;
  LocationEncoding best = LocationEncoding::kRange;
  std::optional<LocationEncoding> narrowest_gap;
  for (const LocationEncoding encoding : kAllEncodings) {  // In wire-code order.
    const uint64_t estimate = EstimateLocationBytes(encoding, locations, span_begin, span_end);
    if (estimate == kMax64) {
      EXPECT_EQ(ChooserCost(encoding, locations, span_begin, span_end), kMax64);
      EXPECT_STATUS(InvalidArgument,
                    ChooseLocationEncoding(locations, span_begin, span_end, encoding));
      std::vector<uint8_t> bytes;
      EXPECT_STATUS(InvalidArgument,
                    EncodeLocations(encoding, locations, span_begin, span_end, &bytes));
      continue;
    }
    if (IsGapEncoding(encoding)) {
      EXPECT_EQ(estimate, locations.size() * GapWidth(encoding));
      if (!narrowest_gap.has_value()) narrowest_gap = encoding;
    }
    const uint64_t cost = ChooserCost(encoding, locations, span_begin, span_end);
    if (cost < best_cost) {
      best_cost = cost;
      best = encoding;
    }
    ASSERT_OK_AND_ASSIGN(LocationEncoding forced,
                         ChooseLocationEncoding(locations, span_begin, span_end, encoding));
    EXPECT_EQ(forced, encoding);
    if (estimate <= kMaxRoundTripBytes) ExpectRoundTrip(encoding, locations, span_begin, span_end);
  }
  ASSERT_OK_AND_ASSIGN(LocationEncoding chosen,
                       ChooseLocationEncoding(locations, span_begin, span_end));
  EXPECT_EQ(chosen, best);
  if (IsGapEncoding(chosen)) {
    EXPECT_EQ(chosen, narrowest_gap);
  }
}

std::vector<uint64_t> RandomLocations(std::mt19937_64& rng, uint64_t span_begin,
                                      uint64_t span_length, double density) {
  std::vector<uint64_t> locations;
  std::bernoulli_distribution present(density);
  for (uint64_t i = 0; i < span_length; ++i) {
    if (present(rng)) locations.push_back(span_begin + i);
  }
  return locations;
}

// ---------------------------------------------------------------------------------------------
// Round trips.

// A full decode marks its state every kLocationMarkInterval locations, and a decoder of the same
// bytes moved to any mark decodes exactly the locations after it, in every encoding: what lets
// one item's apply run in slices on several threads.
TEST(LocationsTest, ADecoderSeekingAMarkGoesOnExactlyAsTheFullDecode) {
  const uint64_t span_begin = 1000;
  // Runs and gaps of every width the encodings hold: 3 marks and a partial slice after them.
  std::vector<uint64_t> sparse;
  std::mt19937_64 rng(7);
  for (uint64_t at = span_begin; sparse.size() < 3 * kLocationMarkInterval + 777;) {
    sparse.push_back(at);
    at += (rng() % 5 == 0) ? 1 + rng() % 200 : 1;
  }
  const uint64_t sparse_end = sparse.back() + 10;
  std::vector<uint64_t> dense;  // Every element of its span, for kAll.
  for (uint64_t at = span_begin; at < span_begin + 2 * kLocationMarkInterval + 5; ++at) {
    dense.push_back(at);
  }
  for (const LocationEncoding encoding : kAllEncodings) {
    SCOPED_TRACE(std::string(LocationEncodingName(encoding)));
    const std::vector<uint64_t>& locations = encoding == LocationEncoding::kAll ? dense : sparse;
    const uint64_t span_end = encoding == LocationEncoding::kAll ? dense.back() + 1 : sparse_end;
    std::vector<uint8_t> bytes;
    ASSERT_OK(EncodeLocations(encoding, locations, span_begin, span_end, &bytes));
    ASSERT_OK_AND_ASSIGN(
        LocationDecoder full,
        LocationDecoder::Make(encoding, bytes, locations.size(), span_begin, span_end));
    std::vector<LocationMark> marks;
    ASSERT_OK(full.ValidateAll(&marks));
    ASSERT_EQ(marks.size(), (locations.size() - 1) / kLocationMarkInterval);
    for (size_t k = 0; k < marks.size(); ++k) {
      SCOPED_TRACE(fmt::format("mark {}", k));
      ASSERT_EQ(marks[k].emitted, (k + 1) * kLocationMarkInterval);
      ASSERT_OK_AND_ASSIGN(
          LocationDecoder resumed,
          LocationDecoder::Make(encoding, bytes, locations.size(), span_begin, span_end));
      resumed.Seek(marks[k]);
      std::vector<uint64_t> rest(locations.size() - marks[k].emitted);
      ASSERT_OK_AND_ASSIGN(const size_t decoded, resumed.Next(rest));
      ASSERT_EQ(decoded, rest.size());
      EXPECT_TRUE(std::equal(rest.begin(), rest.end(), locations.begin() + marks[k].emitted));
      ASSERT_OK_AND_ASSIGN(const size_t after, resumed.Next(rest));
      EXPECT_EQ(after, 0u);  // The end, with its trailing-byte checks.
    }
  }
}

TEST(LocationsTest, EmptyLocationsInAnEmptySpanAreAll) {
  ExpectRoundTripEverywhere({}, 5, 5);
  ASSERT_OK_AND_ASSIGN(LocationEncoding chosen, ChooseLocationEncoding({}, 5, 5));
  EXPECT_EQ(chosen, LocationEncoding::kAll);
}

TEST(LocationsTest, EmptyLocationsInASpanAreAnEmptyRangeList) {
  ExpectRoundTripEverywhere({}, 0, 1000);
  // kRange and the gap encodings all cost 0 bytes: the tie goes to the lowest code.
  ASSERT_OK_AND_ASSIGN(LocationEncoding chosen, ChooseLocationEncoding({}, 0, 1000));
  EXPECT_EQ(chosen, LocationEncoding::kRange);
  EXPECT_TRUE(Encode(LocationEncoding::kRange, {}, 0, 1000).empty());
}

TEST(LocationsTest, SingleLocation) {
  for (const uint64_t location : {uint64_t{0}, uint64_t{1}, uint64_t{63}, uint64_t{999}}) {
    ExpectRoundTripEverywhere({location}, 0, 1000);
    // One gap of 1 or 2 significant bytes beats a (gap, length) pair of 2 or 3 varint bytes.
    ASSERT_OK_AND_ASSIGN(LocationEncoding chosen, ChooseLocationEncoding({{location}}, 0, 1000));
    EXPECT_EQ(chosen, LocationEncoding::kGap16) << location;
  }
  ExpectRoundTripEverywhere({10}, 10, 11);  // The whole span: kAll.
  ASSERT_OK_AND_ASSIGN(LocationEncoding chosen, ChooseLocationEncoding({{10}}, 10, 11));
  EXPECT_EQ(chosen, LocationEncoding::kAll);
}

TEST(LocationsTest, FullSpanIsAll) {
  std::vector<uint64_t> locations(777);
  for (size_t i = 0; i < locations.size(); ++i) locations[i] = 100 + i;
  ExpectRoundTripEverywhere(locations, 100, 877);
  ASSERT_OK_AND_ASSIGN(LocationEncoding chosen, ChooseLocationEncoding(locations, 100, 877));
  EXPECT_EQ(chosen, LocationEncoding::kAll);
  EXPECT_EQ(EstimateLocationBytes(LocationEncoding::kAll, locations, 100, 877), 0u);
  // One element short of the span: kAll cannot represent it.
  EXPECT_EQ(EstimateLocationBytes(LocationEncoding::kAll, locations, 100, 878), kMax64);
}

TEST(LocationsTest, RunsPreferRange) {
  std::vector<uint64_t> locations;
  for (uint64_t run = 0; run < 50; ++run) {
    for (uint64_t i = 0; i < 40; ++i) locations.push_back(run * 1000 + i);
  }
  ExpectRoundTripEverywhere(locations, 0, 50000);
  ASSERT_OK_AND_ASSIGN(LocationEncoding chosen, ChooseLocationEncoding(locations, 0, 50000));
  EXPECT_EQ(chosen, LocationEncoding::kRange);
}

TEST(LocationsTest, RangeBytesAreTheDocumentedVarintPairs) {
  // Runs [3, 5) and [135, 136) in span [0, 200): (gap 3, length 2), (gap 130, length 1).
  const std::vector<uint8_t> bytes = Encode(LocationEncoding::kRange, {3, 4, 135}, 0, 200);
  EXPECT_EQ(bytes, (std::vector<uint8_t>{0x03, 0x02, 0x82, 0x01, 0x01}));
  // The first run may start at the span begin (gap 0); locations are relative to it.
  EXPECT_EQ(Encode(LocationEncoding::kRange, {1000, 1001}, 1000, 1010),
            (std::vector<uint8_t>{0x00, 0x02}));
}

// Check that `locations` encode under `encoding` to exactly `expected` (worked out by hand), and
// that the decoder reads those bytes back to `locations` in batches of every size.
void ExpectGapBytes(LocationEncoding encoding, const std::vector<uint64_t>& locations,
                    uint64_t span_begin, uint64_t span_end, const std::vector<uint8_t>& expected) {
  SCOPED_TRACE(fmt::format("{} {}", LocationEncodingName(encoding), fmt::join(locations, ", ")));
  EXPECT_EQ(Encode(encoding, locations, span_begin, span_end), expected);
  for (const size_t batch : {size_t{1}, size_t{2}, size_t{64}}) {
    ASSERT_OK_AND_ASSIGN(
        std::vector<uint64_t> decoded,
        DecodeInBatches(encoding, expected, locations.size(), span_begin, span_end, batch));
    EXPECT_EQ(decoded, locations) << "batch " << batch;
  }
}

TEST(LocationsTest, GapBytesArePlanesOfGapsMinusOne) {
  // g0 = 5 - 2 = 3, g1 = 6 - 5 - 1 = 0: plane 0 = 03 00, plane 1 = 00 00.
  ExpectGapBytes(LocationEncoding::kGap16, {5, 6}, 2, 100, {0x03, 0x00, 0x00, 0x00});
  // g0 = 268 - 10 = 0x0102, g1 = 1041 - 268 - 1 = 0x0304, g2 = 1047 - 1041 - 1 = 0x0005:
  // plane 0 = 02 04 05, plane 1 = 01 03 00 (interleaved words would be 02 01 04 03 05 00).
  ExpectGapBytes(LocationEncoding::kGap16, {268, 1041, 1047}, 10, 2000,
                 {0x02, 0x04, 0x05, 0x01, 0x03, 0x00});
  // The same gaps forced to 32 bits: planes 2 and 3 are all zero.
  ExpectGapBytes(LocationEncoding::kGap32, {268, 1041, 1047}, 10, 2000,
                 {0x02, 0x04, 0x05, 0x01, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00});
  // g0 = 3, g1 = 0, g2 = 0x10007 - 6 - 1 = 0x10000: only plane 2 holds a bit of g2.
  ExpectGapBytes(LocationEncoding::kGap32, {5, 6, 0x10007}, 2, 0x20000,
                 {0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00});
  // g0 = 0x04030201, g1 = 0x04030207 - 0x04030201 - 1 = 5: planes 01 05 | 02 00 | 03 00 | 04 00.
  ExpectGapBytes(LocationEncoding::kGap32, {0x04030201, 0x04030207}, 0, 0x04030208,
                 {0x01, 0x05, 0x02, 0x00, 0x03, 0x00, 0x04, 0x00});
  // g0 = 0x0807060504030301 - 0x100 = 0x0807060504030201, g1 = 0x11: plane k = byte k of g0,
  // then byte k of g1.
  constexpr uint64_t kFirst = 0x0807060504030301;
  ExpectGapBytes(LocationEncoding::kGap64, {kFirst, kFirst + 0x12}, 0x100, kFirst + 0x13,
                 {0x01, 0x11, 0x02, 0x00, 0x03, 0x00, 0x04, 0x00, 0x05, 0x00, 0x06, 0x00, 0x07,
                  0x00, 0x08, 0x00});
  // One gap: a single plane byte per width, so the layout equals a little-endian word.
  ExpectGapBytes(LocationEncoding::kGap64, {0x0102 + 7}, 7, 0x10000,
                 {0x02, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00});
}

TEST(LocationsTest, BitmaskBytesAreLsbFirst) {
  // Span [10, 20): bits 0, 3, 9 → byte 0 = 0b00001001, byte 1 = 0b00000010.
  EXPECT_EQ(Encode(LocationEncoding::kBitmask, {10, 13, 19}, 10, 20),
            (std::vector<uint8_t>{0x09, 0x02}));
}

TEST(LocationsTest, DenseScatteredPrefersBitmask) {
  std::mt19937_64 rng(7);
  const std::vector<uint64_t> locations = RandomLocations(rng, 0, 10000, 0.4);
  ExpectRoundTripEverywhere(locations, 0, 10000);
  ASSERT_OK_AND_ASSIGN(LocationEncoding chosen, ChooseLocationEncoding(locations, 0, 10000));
  EXPECT_EQ(chosen, LocationEncoding::kBitmask);
}

TEST(LocationsTest, SparseScatteredPrefersGap16) {
  // Gaps of 19999: 2 significant bytes against a 3-byte gap varint and a length byte.
  std::vector<uint64_t> locations;
  for (uint64_t i = 0; i < 200; ++i) locations.push_back(i * 20000 + 17);
  ExpectRoundTripEverywhere(locations, 0, 200 * 20000);
  ASSERT_OK_AND_ASSIGN(LocationEncoding chosen, ChooseLocationEncoding(locations, 0, 4000000));
  EXPECT_EQ(chosen, LocationEncoding::kGap16);
}

TEST(LocationsTest, BitmaskSpansThatAreNotAMultipleOfEight) {
  for (uint64_t span_length = 1; span_length <= 70; ++span_length) {
    std::vector<uint64_t> locations;
    for (uint64_t i = 0; i < span_length; i += 3) locations.push_back(1000 + i);
    locations.push_back(1000 + span_length - 1);  // The very last bit.
    std::sort(locations.begin(), locations.end());
    locations.erase(std::unique(locations.begin(), locations.end()), locations.end());
    ExpectRoundTrip(LocationEncoding::kBitmask, locations, 1000, 1000 + span_length);
  }
}

// Locations whose maximal gap is `max_gap`: two of them, plus a run, so every encoding differs.
std::vector<uint64_t> WithMaxGap(uint64_t span_begin, uint64_t max_gap) {
  return {span_begin + 1, span_begin + 2, span_begin + 3 + max_gap};
}

TEST(LocationsTest, GapWidthBoundaries) {
  struct Case {
    uint64_t max_gap;
    LocationEncoding narrowest;
  };
  const Case cases[] = {
      {0xFFFF, LocationEncoding::kGap16},
      {0x10000, LocationEncoding::kGap32},
      {0xFFFFFFFF, LocationEncoding::kGap32},
      {kTwoPow32, LocationEncoding::kGap64},
  };
  const uint64_t span_begin = 12345;
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("max gap {:#x}", c.max_gap));
    const std::vector<uint64_t> locations = WithMaxGap(span_begin, c.max_gap);
    const uint64_t span_end = locations.back() + 1;
    LocationEncoding narrowest = LocationEncoding::kRange;
    for (const LocationEncoding gap :
         {LocationEncoding::kGap16, LocationEncoding::kGap32, LocationEncoding::kGap64}) {
      if (EstimateLocationBytes(gap, locations, span_begin, span_end) != kMax64) {
        narrowest = gap;
        break;
      }
    }
    EXPECT_EQ(narrowest, c.narrowest);
    EXPECT_EQ(EstimateLocationBytes(c.narrowest, locations, span_begin, span_end),
              locations.size() * GapWidth(c.narrowest));
    // Every width that fits costs the same, so the tie goes to the narrowest, and gaps 1 and 0
    // (1 byte each) plus the large one beat range's (1, 2) and (max_gap, 1) pairs.
    EXPECT_EQ(ChooserCost(c.narrowest, locations, span_begin, span_end),
              ChooserCost(LocationEncoding::kGap64, locations, span_begin, span_end));
    ASSERT_OK_AND_ASSIGN(LocationEncoding chosen,
                         ChooseLocationEncoding(locations, span_begin, span_end));
    EXPECT_EQ(chosen, c.narrowest);
    ExpectRoundTripEverywhere(locations, span_begin, span_end);
  }
}

TEST(LocationsTest, ChooserPicksTheNarrowestGapWidthWhenGapsWin) {
  // Every gap is 0xFFFF: gap16 (2 significant bytes each) beats range (3 + 1 bytes each).
  std::vector<uint64_t> gap16;
  for (uint64_t i = 0; i < 100; ++i) gap16.push_back(i * 0x10000 + 0xFFFF);
  ASSERT_OK_AND_ASSIGN(LocationEncoding chosen, ChooseLocationEncoding(gap16, 0, gap16.back() + 1));
  EXPECT_EQ(chosen, LocationEncoding::kGap16);
  // Every gap is 0xFFFFFFFF: gap32 (4) beats range (5 + 1) and ties gap64 (4), a lower code.
  std::vector<uint64_t> gap32;
  for (uint64_t i = 0; i < 100; ++i) gap32.push_back(i * kTwoPow32 + 0xFFFFFFFF);
  ASSERT_OK_AND_ASSIGN(chosen, ChooseLocationEncoding(gap32, 0, gap32.back() + 1));
  EXPECT_EQ(chosen, LocationEncoding::kGap32);
  // Gaps of 2^60 - 1 need 9 varint bytes: gap64 (8 significant bytes) wins.
  std::vector<uint64_t> gap64;
  for (uint64_t i = 0; i < 10; ++i) gap64.push_back(i * (uint64_t{1} << 60) + 5);
  ASSERT_OK_AND_ASSIGN(chosen, ChooseLocationEncoding(gap64, 0, kMax64));
  EXPECT_EQ(chosen, LocationEncoding::kGap64);
  ExpectRoundTripEverywhere(gap64, 0, kMax64);
}

// Isolated changes every `stride` elements from `first`, `count` of them, each a run of `length`.
std::vector<uint64_t> Runs(uint64_t first, uint64_t stride, uint64_t count, uint64_t length) {
  std::vector<uint64_t> locations;
  for (uint64_t run = 0; run < count; ++run) {
    for (uint64_t i = 0; i < length; ++i) locations.push_back(first + run * stride + i);
  }
  return locations;
}

TEST(LocationsTest, ChooserPrefersGap16ForIsolatedChanges) {
  // 100 changes every 10th element: gaps 5, 9, 9, … cost 1 significant byte each (100); range
  // takes a 1-byte gap and a 1-byte length per change (200); the bitmask 125 bytes.
  const std::vector<uint64_t> locations = Runs(5, 10, 100, 1);
  ExpectRoundTripEverywhere(locations, 0, 1000);
  EXPECT_EQ(ChooserCost(LocationEncoding::kGap16, locations, 0, 1000), 100u);
  EXPECT_EQ(ChooserCost(LocationEncoding::kRange, locations, 0, 1000), 200u);
  EXPECT_EQ(ChooserCost(LocationEncoding::kBitmask, locations, 0, 1000), 125u);
  // Raw sizes tie at 200 bytes; the cost after compression is what decides.
  EXPECT_EQ(EstimateLocationBytes(LocationEncoding::kGap16, locations, 0, 1000), 200u);
  ASSERT_OK_AND_ASSIGN(LocationEncoding chosen, ChooseLocationEncoding(locations, 0, 1000));
  EXPECT_EQ(chosen, LocationEncoding::kGap16);
}

TEST(LocationsTest, ChooserPrefersRangeForRunsOfTwoOrMore) {
  // 100 runs, one every 100 elements of a 10000-element span (bitmask: 1250 bytes). A run of
  // length L costs the gaps L bytes (a 1-byte gap, then L - 1 zero gaps) and range 2 bytes.
  struct Case {
    uint64_t length;
    LocationEncoding chosen;
  };
  const Case cases[] = {
      {1, LocationEncoding::kGap16},  // 1 against 2.
      {2, LocationEncoding::kRange},  // 2 against 2: the tie goes to the lower code.
      {3, LocationEncoding::kRange},  // 3 against 2.
      {40, LocationEncoding::kRange},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("runs of length {}", c.length));
    const std::vector<uint64_t> locations = Runs(7, 100, 100, c.length);
    EXPECT_EQ(ChooserCost(LocationEncoding::kGap16, locations, 0, 10000), 100 * c.length);
    EXPECT_EQ(ChooserCost(LocationEncoding::kRange, locations, 0, 10000), 200u);
    ASSERT_OK_AND_ASSIGN(LocationEncoding chosen, ChooseLocationEncoding(locations, 0, 10000));
    EXPECT_EQ(chosen, c.chosen);
    ExpectRoundTripEverywhere(locations, 0, 10000);
  }
}

TEST(LocationsTest, ChooserPrefersBitmaskOnceGapsCostMore) {
  // Every 8th element of [0, 800): 100 one-byte gaps tie the 100-byte bitmask; gap16 has the
  // lower code.
  std::vector<uint64_t> locations = Runs(0, 8, 100, 1);
  EXPECT_EQ(ChooserCost(LocationEncoding::kGap16, locations, 0, 800), 100u);
  EXPECT_EQ(ChooserCost(LocationEncoding::kBitmask, locations, 0, 800), 100u);
  ASSERT_OK_AND_ASSIGN(LocationEncoding chosen, ChooseLocationEncoding(locations, 0, 800));
  EXPECT_EQ(chosen, LocationEncoding::kGap16);
  ExpectRoundTripEverywhere(locations, 0, 800);
  // One location more costs the gaps 101 bytes and leaves the bitmask at 100.
  locations.insert(locations.begin() + 1, 3);
  EXPECT_EQ(ChooserCost(LocationEncoding::kGap16, locations, 0, 800), 101u);
  ASSERT_OK_AND_ASSIGN(chosen, ChooseLocationEncoding(locations, 0, 800));
  EXPECT_EQ(chosen, LocationEncoding::kBitmask);
  ExpectRoundTripEverywhere(locations, 0, 800);
}

TEST(LocationsTest, ChooserPicksEachGapWidthForIsolatedChangesWithOneLargeGap) {
  // 200 isolated changes 10 apart with one gap of `max_gap` in the middle: one significant byte
  // per small gap against range's two, so a gap encoding wins even where its raw size (4 or 8
  // bytes a gap) is twice range's or more; the narrowest width holding max_gap is chosen.
  struct Case {
    uint64_t max_gap;
    LocationEncoding chosen;
  };
  const Case cases[] = {
      {0xFFFF, LocationEncoding::kGap16},
      {0x10000, LocationEncoding::kGap32},
      {0xFFFFFFFF, LocationEncoding::kGap32},
      {kTwoPow32, LocationEncoding::kGap64},
  };
  const uint64_t span_begin = 1000;
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("max gap {:#x}", c.max_gap));
    std::vector<uint64_t> locations = Runs(span_begin + 3, 10, 100, 1);
    const std::vector<uint64_t> after = Runs(locations.back() + 1 + c.max_gap, 10, 100, 1);
    locations.insert(locations.end(), after.begin(), after.end());
    const uint64_t span_end = locations.back() + 6;
    EXPECT_EQ(ChooserCost(c.chosen, locations, span_begin, span_end),
              199 + SignificantBytes(c.max_gap));
    ASSERT_OK_AND_ASSIGN(LocationEncoding chosen,
                         ChooseLocationEncoding(locations, span_begin, span_end));
    EXPECT_EQ(chosen, c.chosen);
    EXPECT_EQ(EstimateLocationBytes(chosen, locations, span_begin, span_end),
              locations.size() * GapWidth(c.chosen));
    ExpectRoundTripEverywhere(locations, span_begin, span_end);
  }
}

TEST(LocationsTest, ForcedEncodingThatCannotRepresentIsInvalidArgument) {
  const std::vector<uint64_t> locations = WithMaxGap(0, 0x10000);
  EXPECT_STATUS_MSG(
      InvalidArgument, "gap16",
      ChooseLocationEncoding(locations, 0, locations.back() + 1, LocationEncoding::kGap16));
  std::vector<uint8_t> bytes;
  EXPECT_STATUS_MSG(
      InvalidArgument, "gap16",
      EncodeLocations(LocationEncoding::kGap16, locations, 0, locations.back() + 1, &bytes));
  EXPECT_STATUS_MSG(
      InvalidArgument, "all",
      ChooseLocationEncoding(locations, 0, locations.back() + 1, LocationEncoding::kAll));
  EXPECT_STATUS(InvalidArgument, ChooseLocationEncoding(locations, 0, locations.back() + 1,
                                                        static_cast<LocationEncoding>(9)));
}

TEST(LocationsTest, EncoderRejectsInvalidLocations) {
  std::vector<uint8_t> bytes;
  for (const LocationEncoding encoding : kAllEncodings) {
    SCOPED_TRACE(LocationEncodingName(encoding));
    EXPECT_STATUS_MSG(InvalidArgument, "does not increase",
                      EncodeLocations(encoding, {{5, 4}}, 0, 10, &bytes));
    EXPECT_STATUS_MSG(InvalidArgument, "does not increase",
                      EncodeLocations(encoding, {{5, 5}}, 0, 10, &bytes));
    EXPECT_STATUS_MSG(InvalidArgument, "outside span",
                      EncodeLocations(encoding, {{5, 10}}, 0, 10, &bytes));
    EXPECT_STATUS_MSG(InvalidArgument, "below span begin",
                      EncodeLocations(encoding, {{2}}, 3, 10, &bytes));
    EXPECT_STATUS(InvalidArgument, EncodeLocations(encoding, {}, 10, 3, &bytes));
    EXPECT_TRUE(bytes.empty());
  }
  EXPECT_STATUS(InvalidArgument, ChooseLocationEncoding({{3, 3}}, 0, 10));
  EXPECT_EQ(EstimateLocationBytes(LocationEncoding::kRange, {{3, 3}}, 0, 10), kMax64);
}

TEST(LocationsTest, EncodeAppendsToExistingBytes) {
  std::vector<uint8_t> bytes = {0xAA};
  ASSERT_OK(EncodeLocations(LocationEncoding::kGap16, {{1}}, 0, 10, &bytes));
  ASSERT_OK(EncodeLocations(LocationEncoding::kBitmask, {{1}}, 0, 10, &bytes));
  EXPECT_EQ(bytes, (std::vector<uint8_t>{0xAA, 0x01, 0x00, 0x02, 0x00}));
  // The planes of several gaps are laid out from where the appended bytes begin: gaps 1, 3.
  ASSERT_OK(EncodeLocations(LocationEncoding::kGap16, {{1, 5}}, 0, 10, &bytes));
  EXPECT_EQ(bytes, (std::vector<uint8_t>{0xAA, 0x01, 0x00, 0x02, 0x00, 0x01, 0x03, 0x00, 0x00}));
}

TEST(LocationsTest, RandomRoundTripsAcrossDensitiesAndSeeds) {
  const double densities[] = {0.0005, 0.01, 0.1, 0.5, 0.9, 0.999, 1.0};
  const uint64_t span_begins[] = {0, 3, 1u << 20, (uint64_t{1} << 40) + 5};
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    std::mt19937_64 rng(seed);
    for (const double density : densities) {
      for (const uint64_t span_begin : span_begins) {
        const uint64_t span_length = 1 + rng() % 5000;
        SCOPED_TRACE(fmt::format("seed {} density {} span [{}, +{})", seed, density, span_begin,
                                 span_length));
        const std::vector<uint64_t> locations =
            RandomLocations(rng, span_begin, span_length, density);
        ExpectRoundTripEverywhere(locations, span_begin, span_begin + span_length);
      }
    }
  }
}

TEST(LocationsTest, RandomClusteredRoundTrips) {
  // Runs of random lengths separated by gaps drawn from several magnitudes, so runs, all gap
  // widths and multi-byte varints all occur.
  for (uint64_t seed = 11; seed <= 16; ++seed) {
    std::mt19937_64 rng(seed);
    const uint64_t span_begin = rng() % (uint64_t{1} << 36);
    std::vector<uint64_t> locations;
    uint64_t next = span_begin;
    for (int run = 0; run < 300; ++run) {
      const int magnitude = static_cast<int>(rng() % 40);
      next += rng() % (uint64_t{1} << magnitude);
      const uint64_t length = 1 + rng() % 20;
      for (uint64_t i = 0; i < length; ++i) locations.push_back(next++);
      ++next;
    }
    SCOPED_TRACE(fmt::format("seed {}", seed));
    ExpectRoundTripEverywhere(locations, span_begin, next + rng() % 1000);
  }
}

// ---------------------------------------------------------------------------------------------
// 64-bit locations: spans beyond 2^32 elements (no tensor is allocated; locations are numbers).

TEST(LocationsTest, LocationsAbove32BitsRoundTrip) {
  const uint64_t span_begin = kTwoPow32 - 10;
  const uint64_t span_end = span_begin + 3 * kTwoPow32;
  const std::vector<uint64_t> locations = {span_begin,    kTwoPow32 - 1,     kTwoPow32,
                                           kTwoPow32 + 1, 2 * kTwoPow32 + 7, 3 * kTwoPow32 + 3,
                                           span_end - 1};
  ExpectRoundTripEverywhere(locations, span_begin, span_end);
  ASSERT_OK_AND_ASSIGN(LocationEncoding chosen,
                       ChooseLocationEncoding(locations, span_begin, span_end));
  EXPECT_NE(chosen, LocationEncoding::kBitmask);  // 1.5 GiB of bitmask would be absurd.
}

TEST(LocationsTest, LocationsAtTheTopOfTheUint64Range) {
  const uint64_t span_end = kMax64;
  const uint64_t span_begin = kMax64 - 200000;
  std::vector<uint64_t> sparse;
  for (uint64_t i = 0; i < 30; ++i) sparse.push_back(span_begin + i * 6000 + (i % 3));
  sparse.push_back(span_end - 1);
  ExpectRoundTripEverywhere(sparse, span_begin, span_end);
  std::vector<uint64_t> dense;
  for (uint64_t location = span_end - 300; location < span_end; location += 2) {
    dense.push_back(location);
  }
  ExpectRoundTripEverywhere(dense, span_end - 301, span_end);
  ExpectRoundTripEverywhere({kMax64 - 1}, 0, kMax64);
}

TEST(LocationsTest, SpanOfAllIsDecodedWithoutMaterializingIt) {
  // A 2^40-element kAll span: ValidateAll must not walk it, Next hands out the first ones.
  const uint64_t span_begin = uint64_t{1} << 41;
  const uint64_t span_length = uint64_t{1} << 40;
  ASSERT_OK_AND_ASSIGN(LocationDecoder decoder,
                       LocationDecoder::Make(LocationEncoding::kAll, {}, span_length, span_begin,
                                             span_begin + span_length));
  std::vector<uint64_t> first(3);
  ASSERT_OK_AND_ASSIGN(size_t n, decoder.Next(first));
  EXPECT_EQ(n, 3u);
  EXPECT_EQ(first, (std::vector<uint64_t>{span_begin, span_begin + 1, span_begin + 2}));
  EXPECT_OK(decoder.ValidateAll());
  ASSERT_OK_AND_ASSIGN(n, decoder.Next(first));
  EXPECT_EQ(n, 0u);
}

// ---------------------------------------------------------------------------------------------
// Hostile bytes: every inconsistency is DataLoss naming the encoding.

TEST(LocationDecoderTest, RejectsBadSpansCountsAndCodes) {
  EXPECT_STATUS_MSG(DataLoss, "begin > end",
                    LocationDecoder::Make(LocationEncoding::kRange, {}, 0, 10, 5));
  EXPECT_STATUS_MSG(DataLoss, "count 11 exceeds span length 10",
                    LocationDecoder::Make(LocationEncoding::kGap16, {}, 11, 0, 10));
  EXPECT_STATUS_MSG(DataLoss, "unknown location encoding code 0",
                    LocationDecoder::Make(static_cast<LocationEncoding>(0), {}, 0, 0, 10));
  EXPECT_STATUS_MSG(DataLoss, "unknown location encoding code 8",
                    LocationDecoder::Make(static_cast<LocationEncoding>(8), {}, 0, 0, 10));
  // 7 (format v2's context) is known, but no plug-in: it decodes only against the old span.
  EXPECT_STATUS_MSG(DataLoss, "without the old span",
                    LocationDecoder::Make(LocationEncoding::kContext, {}, 0, 0, 10));
}

TEST(LocationDecoderTest, AllNeedsTheWholeSpanAndNoBytes) {
  const std::vector<uint8_t> one_byte = {0};
  EXPECT_STATUS_MSG(DataLoss, "all", DecodeStatus(LocationEncoding::kAll, {}, 9, 0, 10));
  EXPECT_STATUS_MSG(DataLoss, "all", DecodeStatus(LocationEncoding::kAll, one_byte, 10, 0, 10));
  EXPECT_OK(DecodeStatus(LocationEncoding::kAll, {}, 10, 0, 10));
}

TEST(LocationDecoderTest, GapLengthMustMatchCount) {
  const std::vector<uint8_t> bytes = Encode(LocationEncoding::kGap32, {1, 2, 3}, 0, 10);
  EXPECT_OK(DecodeStatus(LocationEncoding::kGap32, bytes, 3, 0, 10));
  EXPECT_STATUS_MSG(DataLoss, "gap32", DecodeStatus(LocationEncoding::kGap32, bytes, 2, 0, 10));
  EXPECT_STATUS_MSG(DataLoss, "gap32", DecodeStatus(LocationEncoding::kGap32, bytes, 4, 0, 10));
  const std::span<const uint8_t> truncated(bytes.data(), bytes.size() - 1);
  EXPECT_STATUS_MSG(DataLoss, "gap32", DecodeStatus(LocationEncoding::kGap32, truncated, 3, 0, 10));
  std::vector<uint8_t> trailing = bytes;
  trailing.push_back(0);
  EXPECT_STATUS_MSG(DataLoss, "gap32", DecodeStatus(LocationEncoding::kGap32, trailing, 3, 0, 10));
}

TEST(LocationDecoderTest, GapOutOfSpanNamesTheLocation) {
  // Gaps 2, 3, 4 from span begin 100 (planes 02 03 04 | 00 00 00): locations 102, 106, 111 —
  // the last is outside [100, 110).
  const std::vector<uint8_t> bytes = {2, 3, 4, 0, 0, 0};
  EXPECT_STATUS_MSG(DataLoss, "gap16 locations: location #2 is 111 >= span end 110",
                    DecodeStatus(LocationEncoding::kGap16, bytes, 3, 100, 110));
  EXPECT_OK(DecodeStatus(LocationEncoding::kGap16, bytes, 3, 100, 112));
  // In batches of one the error is found by the same check.
  EXPECT_STATUS_MSG(DataLoss, "111",
                    DecodeInBatches(LocationEncoding::kGap16, bytes, 3, 100, 110, 1));
}

TEST(LocationDecoderTest, GapDecoderReadsPlanesNotWords) {
  // Read as planes 02 00 03 | 00 04 00, these bytes are gaps 2, 0x400, 3 (as little-endian words
  // they would be 2, 3, 4): locations 102, 102 + 1 + 1024 = 1127, 1127 + 1 + 3 = 1131.
  const std::vector<uint8_t> bytes = {2, 0, 3, 0, 4, 0};
  for (const size_t batch : {size_t{1}, size_t{2}, size_t{3}}) {
    ASSERT_OK_AND_ASSIGN(std::vector<uint64_t> decoded,
                         DecodeInBatches(LocationEncoding::kGap16, bytes, 3, 100, 2000, batch));
    EXPECT_EQ(decoded, (std::vector<uint64_t>{102, 1127, 1131})) << "batch " << batch;
  }
  EXPECT_STATUS_MSG(DataLoss, "gap16 locations: location #1 is 1127 >= span end 1000",
                    DecodeStatus(LocationEncoding::kGap16, bytes, 3, 100, 1000));
}

TEST(LocationDecoderTest, GapInALaterBatchReadsItsHighPlaneAtTheCountStride) {
  // Gaps 1, 2, 3, 0x100, 4 in [0, 100): planes 01 02 03 00 04 | 00 00 00 01 00. Locations 1, 4,
  // 8, then 8 + 1 + 256 = 265, outside the span; whatever the batch size, location #3 is named.
  const std::vector<uint8_t> bytes = {1, 2, 3, 0, 4, 0, 0, 0, 1, 0};
  for (const size_t batch : {size_t{1}, size_t{2}, size_t{3}, size_t{7}}) {
    SCOPED_TRACE(fmt::format("batch {}", batch));
    EXPECT_STATUS_MSG(DataLoss, "gap16 locations: location #3 is 265 >= span end 100",
                      DecodeInBatches(LocationEncoding::kGap16, bytes, 5, 0, 100, batch));
  }
  ASSERT_OK_AND_ASSIGN(std::vector<uint64_t> decoded,
                       DecodeInBatches(LocationEncoding::kGap16, bytes, 5, 0, 300, 2));
  EXPECT_EQ(decoded, (std::vector<uint64_t>{1, 4, 8, 265, 270}));
}

TEST(LocationDecoderTest, Gap64OverflowIsDataLoss) {
  // Gaps 5 and 2^64 - 1 (planes 05 FF | 00 FF | … | 00 FF): 6 + (2^64 - 1) overflows.
  const std::vector<uint8_t> huge = {0x05, 0xFF, 0x00, 0xFF, 0x00, 0xFF, 0x00, 0xFF,
                                     0x00, 0xFF, 0x00, 0xFF, 0x00, 0xFF, 0x00, 0xFF};
  EXPECT_STATUS_MSG(DataLoss,
                    "gap64 locations: location #1: gap 18446744073709551615 after 6 overflows",
                    DecodeStatus(LocationEncoding::kGap64, huge, 2, 0, kMax64));
  // Gaps 5 and 2^32 (byte 4 of gap #1, plane 4, at offset 4 × 2 + 1): a large but valid gap
  // lands outside a small span.
  std::vector<uint8_t> far(16, 0);
  far[0] = 0x05;
  far[9] = 0x01;
  EXPECT_STATUS_MSG(DataLoss, "gap64 locations: location #1 is 4294967302 >= span end 1000",
                    DecodeStatus(LocationEncoding::kGap64, far, 2, 0, 1000));
  ASSERT_OK_AND_ASSIGN(std::vector<uint64_t> decoded,
                       DecodeInBatches(LocationEncoding::kGap64, far, 2, 0, kMax64, 1));
  EXPECT_EQ(decoded, (std::vector<uint64_t>{5, 6 + kTwoPow32}));
}

TEST(LocationDecoderTest, Gap16NearTheTopOfUint64UsesCheckedDecoding) {
  // From span begin 2^64 - 10, gaps of 0xFFFF would wrap around 2^64 without the checks.
  const uint64_t span_begin = kMax64 - 10;
  const std::vector<uint8_t> wrap = {0xFF, 0xFF, 0xFF, 0xFF};
  EXPECT_STATUS(DataLoss, DecodeStatus(LocationEncoding::kGap16, wrap, 2, span_begin, kMax64));
  const std::vector<uint8_t> valid = {1, 2, 0, 0};  // Gaps 1, 2.
  ASSERT_OK_AND_ASSIGN(std::vector<uint64_t> decoded,
                       DecodeInBatches(LocationEncoding::kGap16, valid, 2, span_begin, kMax64, 8));
  EXPECT_EQ(decoded, (std::vector<uint64_t>{span_begin + 1, span_begin + 4}));
}

TEST(LocationDecoderTest, RangeRejectsMalformedVarints) {
  struct Case {
    std::vector<uint8_t> bytes;
    uint64_t count;
    std::string message;
  };
  const Case cases[] = {
      {{0x80}, 1, "truncated"},                // Continuation bit on the last byte.
      {{0x01, 0x81}, 1, "truncated"},          // The length varint is cut short.
      {{0x80, 0x00, 0x01}, 1, "not minimal"},  // Gap 0 in two bytes.
      {{0x01, 0x81, 0x00}, 1, "not minimal"},  // Length 1 in two bytes.
      {{0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x02, 0x01}, 1, "exceeds 64 bits"},
      {{0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01, 0x01},
       1,
       "exceeds 64 bits"},  // Eleven bytes.
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("{:02x}", fmt::join(c.bytes, " ")));
    EXPECT_STATUS_MSG(DataLoss, c.message,
                      DecodeStatus(LocationEncoding::kRange, c.bytes, c.count, 0, 100));
    EXPECT_STATUS_MSG(DataLoss, "range locations",
                      DecodeStatus(LocationEncoding::kRange, c.bytes, c.count, 0, 100));
  }
  // Bit 63 alone in the 10th byte is a valid gap — outside any span starting at 0 but kMax64.
  const std::vector<uint8_t> top = {0x80, 0x80, 0x80, 0x80, 0x80, 0x80,
                                    0x80, 0x80, 0x80, 0x01, 0x01};
  ASSERT_OK_AND_ASSIGN(std::vector<uint64_t> decoded,
                       DecodeInBatches(LocationEncoding::kRange, top, 1, 0, kMax64, 4));
  EXPECT_EQ(decoded, (std::vector<uint64_t>{uint64_t{1} << 63}));
}

TEST(LocationDecoderTest, RangeRejectsNonCanonicalOrInconsistentRuns) {
  struct Case {
    std::vector<uint8_t> bytes;
    uint64_t count;
    std::string message;
  };
  const Case cases[] = {
      {{0x01, 0x02, 0x00, 0x01}, 3, "gap 0 after location 2"},  // Runs must be maximal.
      {{0x01, 0x00}, 1, "length 0"},
      {{0x01, 0x00, 0x01, 0x01}, 1, "length 0"},
      {{0x64, 0x01}, 1, "outside span end 100"},  // Starts at 100.
      {{0x60, 0x05}, 5, "passes span end 100"},   // [96, 101).
      {{0x01, 0x03}, 2, "exceeds the 2 locations left"},
      {{0x01, 0x02}, 3, "bytes end after 2 of 3"},
      {{0x01, 0x02, 0x01}, 2, "1 trailing bytes at byte offset 2"},
      {{0x01, 0x02, 0x05, 0x01}, 2, "trailing"},
      {{0x01, 0x01}, 0, "cannot hold 0 locations"},
      {{}, 1, "cannot hold 1 locations"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("{:02x} count {}", fmt::join(c.bytes, " "), c.count));
    EXPECT_STATUS_MSG(DataLoss, c.message,
                      DecodeStatus(LocationEncoding::kRange, c.bytes, c.count, 0, 100));
  }
}

TEST(LocationDecoderTest, RangeFailsWhenTheBytesAreFarTooLongForTheCount) {
  const std::vector<uint8_t> bytes(100, 0x01);  // 50 runs cannot hold 2 locations.
  EXPECT_STATUS_MSG(DataLoss, "cannot hold",
                    LocationDecoder::Make(LocationEncoding::kRange, bytes, 2, 0, 1000));
}

TEST(LocationDecoderTest, BitmaskRejectsBadSizePaddingAndPopcount) {
  const std::vector<uint8_t> bytes = Encode(LocationEncoding::kBitmask, {0, 5, 11}, 0, 12);
  ASSERT_EQ(bytes.size(), 2u);
  EXPECT_OK(DecodeStatus(LocationEncoding::kBitmask, bytes, 3, 0, 12));
  EXPECT_STATUS_MSG(DataLoss, "bitmask locations: 2 bytes, expected 3",
                    DecodeStatus(LocationEncoding::kBitmask, bytes, 3, 0, 17));
  EXPECT_STATUS_MSG(DataLoss, "expected 1",
                    DecodeStatus(LocationEncoding::kBitmask, bytes, 3, 0, 8));
  std::vector<uint8_t> padded = bytes;
  padded[1] |= 0x10;  // Bit 12 of a 12-element span.
  EXPECT_STATUS_MSG(DataLoss, "padding bits",
                    DecodeStatus(LocationEncoding::kBitmask, padded, 3, 0, 12));
  EXPECT_STATUS_MSG(DataLoss, "surplus location 11",
                    DecodeStatus(LocationEncoding::kBitmask, bytes, 2, 0, 12));
  EXPECT_STATUS_MSG(DataLoss, "surplus location 5",
                    DecodeStatus(LocationEncoding::kBitmask, bytes, 1, 0, 12));
  EXPECT_STATUS_MSG(DataLoss, "3 bits set, count says 4",
                    DecodeStatus(LocationEncoding::kBitmask, bytes, 4, 0, 12));
}

TEST(LocationDecoderTest, BitmaskSurplusInALaterWordIsFound) {
  std::vector<uint8_t> bytes(40, 0);
  bytes[0] = 0x01;
  bytes[37] = 0x04;  // Location 37 * 8 + 2 = 298, beyond count 1.
  EXPECT_STATUS_MSG(DataLoss, "surplus location 298 (byte 37)",
                    DecodeStatus(LocationEncoding::kBitmask, bytes, 1, 0, 320));
}

TEST(LocationDecoderTest, ErrorsRepeatWhenNextIsCalledAgain) {
  const std::vector<uint8_t> range = {0x01, 0x02, 0x00, 0x01};  // Second run has gap 0.
  ASSERT_OK_AND_ASSIGN(LocationDecoder decoder,
                       LocationDecoder::Make(LocationEncoding::kRange, range, 3, 0, 100));
  std::vector<uint64_t> out(10);
  EXPECT_STATUS(DataLoss, decoder.Next(out));
  EXPECT_STATUS(DataLoss, decoder.Next(out));
  EXPECT_STATUS(DataLoss, decoder.ValidateAll());

  const std::vector<uint8_t> gaps = {2, 200, 0, 0};  // Gaps 2, 200: location #1 is 203.
  ASSERT_OK_AND_ASSIGN(LocationDecoder gap_decoder,
                       LocationDecoder::Make(LocationEncoding::kGap16, gaps, 2, 0, 100));
  EXPECT_STATUS(DataLoss, gap_decoder.Next(out));
  EXPECT_STATUS(DataLoss, gap_decoder.Next(out));

  const std::vector<uint8_t> mask = {0x07};
  ASSERT_OK_AND_ASSIGN(LocationDecoder mask_decoder,
                       LocationDecoder::Make(LocationEncoding::kBitmask, mask, 2, 0, 8));
  EXPECT_STATUS(DataLoss, mask_decoder.Next(out));
  EXPECT_STATUS(DataLoss, mask_decoder.Next(out));
}

TEST(LocationDecoderTest, EmptyOutputSpanDecodesNothing) {
  const std::vector<uint8_t> bytes = Encode(LocationEncoding::kGap16, {1, 2}, 0, 10);
  ASSERT_OK_AND_ASSIGN(LocationDecoder decoder,
                       LocationDecoder::Make(LocationEncoding::kGap16, bytes, 2, 0, 10));
  ASSERT_OK_AND_ASSIGN(size_t n, decoder.Next({}));
  EXPECT_EQ(n, 0u);
  std::vector<uint64_t> out(5);
  ASSERT_OK_AND_ASSIGN(n, decoder.Next(out));
  EXPECT_EQ(n, 2u);
}

// Flip, insert and delete random bytes of valid encodings: the decoder either fails with DataLoss
// or returns valid locations whose re-encoding is exactly the input (one encoding per set).
TEST(LocationDecoderTest, MutatedBytesFailOrDecodeCanonically) {
  std::mt19937_64 rng(99);
  int accepted = 0;
  int rejected = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const LocationEncoding encoding = kAllEncodings[1 + rng() % 5];
    const uint64_t span_begin = rng() % 3 == 0 ? (uint64_t{1} << 33) : rng() % 100;
    const uint64_t span_length = 1 + rng() % 300;
    std::vector<uint64_t> locations = RandomLocations(rng, span_begin, span_length, 0.2);
    std::vector<uint8_t> bytes;
    if (!EncodeLocations(encoding, locations, span_begin, span_begin + span_length, &bytes).ok()) {
      continue;
    }
    uint64_t count = locations.size();
    switch (rng() % 4) {
      case 0:
        if (!bytes.empty()) bytes[rng() % bytes.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
        break;
      case 1:
        bytes.insert(bytes.begin() + static_cast<ptrdiff_t>(rng() % (bytes.size() + 1)),
                     static_cast<uint8_t>(rng()));
        break;
      case 2:
        if (!bytes.empty())
          bytes.erase(bytes.begin() + static_cast<ptrdiff_t>(rng() % bytes.size()));
        break;
      default:  // Claim one location more or fewer (0 - 1 wraps to a count beyond the span).
        count = rng() % 2 == 0 ? count + 1 : count - 1;
        break;
    }
    Result<std::vector<uint64_t>> decoded = DecodeInBatches(
        encoding, bytes, count, span_begin, span_begin + span_length, 1 + rng() % 50);
    if (!decoded.ok()) {
      EXPECT_EQ(decoded.status().code(), StatusCode::kDataLoss) << decoded.status().ToString();
      ++rejected;
      continue;
    }
    ++accepted;
    ASSERT_EQ(decoded->size(), count);
    std::vector<uint8_t> again;
    ASSERT_OK(EncodeLocations(encoding, *decoded, span_begin, span_begin + span_length, &again));
    EXPECT_EQ(again, bytes);
  }
  // Both outcomes occur, so the test exercises both paths.
  EXPECT_GT(accepted, 40);
  EXPECT_GT(rejected, 100);
}

}  // namespace
}  // namespace refit
