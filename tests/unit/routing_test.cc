// ItemRoute: the cut of an item for a class of receivers, checked element by element against a
// plain membership test of the held rectangles.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "codec/locations.h"
#include "codec/routing.h"
#include "core/digest.h"
#include "test_util.h"

namespace refit {
namespace {

constexpr uint64_t kRows = 12;
constexpr uint64_t kCols = 10;

// A bf16 item of tensor "w" [kRows, kCols] over span [begin, end): FULL, or `op` at every
// location where `pick` says so, with value = the location's low 16 bits.
Item MakeItem(Op op, uint64_t begin, uint64_t end, const std::vector<uint64_t>& locations) {
  Item item;
  item.name = "w";
  item.dtype = DType::kBFloat16;
  item.shape = {static_cast<int64_t>(kRows), static_cast<int64_t>(kCols)};
  item.op = op;
  item.value_dtype = DType::kBFloat16;
  item.span_begin = begin;
  item.span_end = end;
  item.digest = 0x1234;
  const auto push_value = [&](uint64_t i) {
    const uint16_t v = static_cast<uint16_t>(i * 7 + 1);
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    item.values.insert(item.values.end(), p, p + 2);
  };
  if (op == Op::kFull) {
    item.count = end - begin;
    item.location_encoding = LocationEncoding::kAll;
    for (uint64_t i = begin; i < end; ++i) push_value(i);
    return item;
  }
  item.count = locations.size();
  item.location_encoding = *ChooseLocationEncoding(locations, begin, end);
  EXPECT_OK(EncodeLocations(item.location_encoding, locations, begin, end, &item.locations));
  for (uint64_t i : locations) push_value(i);
  return item;
}

bool Held(const HeldRegion& region, uint64_t i) {
  const uint64_t r = i / region.cols;
  const uint64_t c = i % region.cols;
  return std::any_of(region.rects.begin(), region.rects.end(), [&](const HeldRect& rect) {
    return r >= rect.row_begin && r < rect.row_end && c >= rect.col_begin && c < rect.col_end;
  });
}

uint16_t ValueAt(const Item& item, size_t k) {
  uint16_t v;
  std::memcpy(&v, item.values.data() + 2 * k, 2);
  return v;
}

// The (location, value) pairs of items, in order.
std::vector<std::pair<uint64_t, uint16_t>> Elements(const std::vector<Item>& items) {
  std::vector<std::pair<uint64_t, uint16_t>> out;
  for (const Item& item : items) {
    std::vector<uint64_t> locations;
    if (item.op == Op::kFull) {
      for (uint64_t i = item.span_begin; i < item.span_end; ++i) locations.push_back(i);
    } else {
      Result<std::vector<uint64_t>> decoded = DecodeAllLocations(item.view());
      EXPECT_OK(decoded.status());
      locations = *decoded;
    }
    for (size_t k = 0; k < locations.size(); ++k) out.emplace_back(locations[k], ValueAt(item, k));
  }
  return out;
}

struct Case {
  const char* name;
  HeldRegion region;
};

std::vector<Case> Regions() {
  return {
      {"rows 3:7", {false, kCols, {{3, 7, 0, kCols}}}},
      {"cols 2:5 (a row-parallel shard)", {false, kCols, {{0, kRows, 2, 5}}}},
      {"q, k and v blocks of a fused shard",
       {false, kCols, {{0, 2, 0, kCols}, {6, 7, 0, kCols}, {9, 10, 0, kCols}}}},
      {"two column blocks", {false, kCols, {{1, 11, 0, 3}, {1, 11, 7, 10}}}},
      {"nothing (a vocabulary shard of padding)", {false, kCols, {}}},
  };
}

TEST(ItemRouteTest, ADeltaKeepsExactlyTheHeldLocationsWithTheirValuesForEveryOp) {
  std::mt19937_64 rng(5);
  for (const Case& c : Regions()) {
    ASSERT_OK_AND_ASSIGN(ItemRoute route, ItemRoute::Make({{"w", c.region}}));
    for (Op op : {Op::kXor, Op::kOverwrite, Op::kAdd}) {
      for (int trial = 0; trial < 20; ++trial) {
        const uint64_t begin = rng() % 40;
        const uint64_t end = begin + 1 + rng() % (kRows * kCols - begin);
        std::vector<uint64_t> locations;
        for (uint64_t i = begin; i < end; ++i) {
          if (rng() % 3 == 0) locations.push_back(i);
        }
        if (locations.empty()) locations.push_back(begin);
        const Item item = MakeItem(op, begin, end, locations);
        std::vector<Item> cut;
        ASSERT_OK(route.Cut(item.view(), &cut));
        std::vector<std::pair<uint64_t, uint16_t>> want;
        for (const auto& element : Elements({item})) {
          if (Held(c.region, element.first)) want.push_back(element);
        }
        EXPECT_EQ(Elements(cut), want) << c.name << " " << OpName(op);
        for (const Item& part : cut) {
          EXPECT_EQ(part.op, op);
          EXPECT_EQ(part.span_begin, begin);
          EXPECT_EQ(part.span_end, end);
          EXPECT_EQ(part.digest, item.digest) << "a cut delta keeps the whole item's digest";
        }
        EXPECT_LE(cut.size(), 1u);
      }
    }
  }
}

TEST(ItemRouteTest, AFullItemBecomesOneFullItemPerHeldRunWithItsOwnDigest) {
  for (const Case& c : Regions()) {
    ASSERT_OK_AND_ASSIGN(ItemRoute route, ItemRoute::Make({{"w", c.region}}));
    const Item item = MakeItem(Op::kFull, 7, 95, {});
    std::vector<Item> cut;
    ASSERT_OK(route.Cut(item.view(), &cut));
    std::vector<std::pair<uint64_t, uint16_t>> want;
    for (const auto& element : Elements({item})) {
      if (Held(c.region, element.first)) want.push_back(element);
    }
    EXPECT_EQ(Elements(cut), want) << c.name;
    for (size_t k = 0; k < cut.size(); ++k) {
      const Item& part = cut[k];
      EXPECT_EQ(part.op, Op::kFull);
      EXPECT_EQ(part.count, part.span_end - part.span_begin);
      // Maximal runs: the next one does not start where this one ends.
      if (k + 1 < cut.size()) {
        EXPECT_LT(part.span_end, cut[k + 1].span_begin) << c.name;
      }
      EXPECT_EQ(part.digest, RemappedDigestRange(part.values, 2, 0, part.span_begin, part.count))
          << c.name;
    }
  }
}

TEST(ItemRouteTest, WholeSkippedAndUnnamedTensors) {
  const Item item = MakeItem(Op::kXor, 0, kRows * kCols, {1, 50, 99});
  std::vector<Item> cut;
  // A tensor the regions do not name, and rectangles that cover the tensor: the item, whole.
  ASSERT_OK_AND_ASSIGN(ItemRoute unnamed, ItemRoute::Make({{"other", {true, 0, {}}}}));
  ASSERT_OK(unnamed.Cut(item.view(), &cut));
  ASSERT_OK_AND_ASSIGN(
      ItemRoute covered,
      ItemRoute::Make(
          {{"w", {false, kCols, {{0, 5, 0, kCols}, {5, kRows, 0, 4}, {5, kRows, 4, kCols}}}}}));
  ASSERT_OK(covered.Cut(item.view(), &cut));
  ASSERT_EQ(cut.size(), 2u);
  for (const Item& whole : cut) {
    EXPECT_EQ(whole.locations, item.locations);
    EXPECT_EQ(whole.values, item.values);
  }
  // A skipped tensor: nothing.
  cut.clear();
  ASSERT_OK_AND_ASSIGN(ItemRoute skipped, ItemRoute::Make({{"w", {true, 0, {}}}}));
  ASSERT_OK(skipped.Cut(item.view(), &cut));
  EXPECT_TRUE(cut.empty());
  EXPECT_TRUE(ItemRoute().whole());
}

TEST(ItemRouteTest, MalformedRegionsAreRefusedNamingTheTensorAndTheRectangle) {
  const auto refused = [](HeldRegion region, std::string_view message) {
    Result<ItemRoute> route = ItemRoute::Make({{"w", std::move(region)}});
    ASSERT_FALSE(route.ok());
    EXPECT_EQ(route.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(route.status().message().find(message), std::string::npos)
        << route.status().ToString();
  };
  refused({false, 0, {{0, 1, 0, 1}}}, "tensor 'w': cols is 0");
  refused({false, kCols, {{3, 3, 0, 1}}}, "rectangle rows 3:3 cols 0:1 is empty");
  refused({false, kCols, {{0, 1, 4, 11}}}, "leaves its 10 columns");
  refused({false, kCols, {{0, 4, 0, 5}, {3, 6, 4, 8}}},
          "rectangles rows 0:4 cols 0:5 and rows 3:6 cols 4:8 overlap");
  // Rows past the tensor, and columns that do not divide it, are seen at the cut.
  const Item item = MakeItem(Op::kXor, 0, kRows * kCols, {1});
  std::vector<Item> cut;
  ASSERT_OK_AND_ASSIGN(ItemRoute tall, ItemRoute::Make({{"w", {false, kCols, {{10, 13, 0, 2}}}}}));
  Status st = tall.Cut(item.view(), &cut);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("leaves its 12 rows"), std::string::npos) << st.ToString();
  ASSERT_OK_AND_ASSIGN(ItemRoute odd, ItemRoute::Make({{"w", {false, 7, {{0, 1, 0, 2}}}}}));
  st = odd.Cut(item.view(), &cut);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("120 elements are not rows of the 7 columns"), std::string::npos)
      << st.ToString();
}

}  // namespace
}  // namespace refit
