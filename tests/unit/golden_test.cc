// Golden files of payload format v1 (tests/golden/v1/, described in its README.md).
//
// Each file is rebuilt here from fixed inputs and must match byte for byte, so any change to the
// encoder's output fails this test; each file is also decoded and must give back the inputs, so
// a decoder change that misreads old payloads fails too. Files are (re)written only when
// REFIT_REGENERATE_GOLDEN=1, and the test then fails on purpose: regenerated golden files are a
// format change to review and commit deliberately (docs/format/payload.md, "Version").
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <ostream>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <xxhash.h>
#include <zstd.h>

#include "codec/locations.h"
#include "codec/values.h"
#include "core/digest.h"
#include "refit/dtype.h"
#include "refit/item.h"
#include "refit/payload.h"
#include "test_util.h"
#include "util/splitmix64.h"

namespace refit {
namespace {

constexpr const char* kGoldenDir = REFIT_GOLDEN_DIR "/v1";
constexpr const char* kRegenerateVariable = "REFIT_REGENERATE_GOLDEN";

// ---- Fixed inputs. -----------------------------------------------------------------------------

/// splitmix64: the element bits of the golden inputs are a pure function of (seed, index), the
/// same on every host (util/splitmix64.h).
constexpr uint64_t Mix(uint64_t x) { return internal::SplitMix64Hash(x); }

uint64_t WidthMask(uint32_t width) {
  return width == 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * width)) - 1;
}

/// Bits of a finite, normal value near 1 in a float dtype (for ADD inputs): a random sign and
/// mantissa with a biased exponent within 2 of the bias, so 1-ulp steps add exactly.
uint64_t ModerateFloatBits(DType dtype, uint64_t random) {
  struct Layout {
    uint32_t mantissa_bits;
    uint32_t exponent_bias;
  };
  Layout layout{};
  switch (dtype) {
    case DType::kFloat16:
      layout = {10, 15};
      break;
    case DType::kBFloat16:
      layout = {7, 127};
      break;
    case DType::kFloat32:
      layout = {23, 127};
      break;
    default:
      layout = {52, 1023};
      break;
  }
  const uint32_t width_bits = 8 * DTypeSize(dtype);
  const uint64_t mantissa = random & ((uint64_t{1} << layout.mantissa_bits) - 1);
  const uint64_t exponent = layout.exponent_bias - 2 + (random >> 60) % 5;
  const uint64_t sign = (random >> 59) & 1;
  return (sign << (width_bits - 1)) | (exponent << layout.mantissa_bits) | mantissa;
}

/// The old (base version) bits of element `index` of a golden tensor.
uint64_t OldBits(DType dtype, uint64_t seed, uint64_t index, bool moderate) {
  const uint64_t random = Mix(seed ^ Mix(index));
  if (dtype == DType::kBool) return random & 1;
  if (moderate) return ModerateFloatBits(dtype, random);
  return random & WidthMask(DTypeSize(dtype));
}

/// The new bits of a changed element: a low-bits change like an optimizer's 1-ulp step, or a
/// flip for bool. For ADD inputs every 5th element jumps to an unrelated value instead, whose
/// difference may need more mantissa bits than the delta dtype has; ADD cannot reproduce those,
/// and they are demoted to an OVERWRITE item, as the tracker does. (No NaNs: the bits of a NaN
/// sum are not pinned by the format, so they would make the golden bytes platform-dependent.)
uint64_t NewBits(DType dtype, uint64_t old_bits, uint64_t seed, uint64_t index, bool moderate) {
  if (dtype == DType::kBool) return old_bits ^ 1;
  if (moderate) {
    if (index % 5 == 0) return ModerateFloatBits(dtype, Mix(seed + index));
    return old_bits + 1;
  }
  return old_bits ^ (1 + Mix(seed + index) % 255);
}

/// One tensor's change, from which one item (or an ADD item and its demoted OVERWRITE item) is
/// built.
struct ChangeSpec {
  std::string name;
  DType dtype;
  Shape shape;
  Op op;
  DType value_dtype;
  uint64_t span_begin;
  uint64_t span_end;
  /// The changed locations (ignored for FULL, which covers the span).
  std::vector<uint64_t> locations;
  std::optional<LocationEncoding> force_encoding;
  uint64_t seed;
};

Item NewItem(const ChangeSpec& spec, Op op, DType value_dtype) {
  Item item;
  item.name = spec.name;
  item.dtype = spec.dtype;
  item.shape = spec.shape;
  item.op = op;
  item.value_dtype = value_dtype;
  item.span_begin = spec.span_begin;
  item.span_end = spec.span_end;
  return item;
}

void AppendValue(Item* item, uint64_t bits) {
  const uint32_t width = DTypeSize(item->value_dtype);
  item->values.resize(item->values.size() + width);
  StoreBits(item->values, width, item->values.size() / width - 1, bits);
}

Status SetLocations(Item* item, const std::vector<uint64_t>& locations,
                    std::optional<LocationEncoding> force) {
  item->count = locations.size();
  REFIT_ASSIGN_OR_RETURN(
      item->location_encoding,
      ChooseLocationEncoding(locations, item->span_begin, item->span_end, force));
  return EncodeLocations(item->location_encoding, locations, item->span_begin, item->span_end,
                         &item->locations);
}

Status AppendItems(const ChangeSpec& spec, std::vector<Item>* items) {
  const bool add = spec.op == Op::kAdd;
  if (spec.op == Op::kFull) {
    Item item = NewItem(spec, Op::kFull, spec.dtype);
    item.count = spec.span_end - spec.span_begin;
    item.location_encoding = LocationEncoding::kAll;
    for (uint64_t i = spec.span_begin; i < spec.span_end; ++i) {
      const uint64_t bits = OldBits(spec.dtype, spec.seed, i, false);
      AppendValue(&item, bits);
      item.digest += ElementHash(i, bits);
    }
    items->push_back(std::move(item));
    return Status::OK();
  }
  Item item = NewItem(spec, spec.op, spec.value_dtype);
  Item demoted = NewItem(spec, Op::kOverwrite, spec.dtype);
  std::vector<uint64_t> kept;
  std::vector<uint64_t> demoted_locations;
  for (uint64_t i : spec.locations) {
    const uint64_t old_bits = OldBits(spec.dtype, spec.seed, i, add);
    const uint64_t new_bits = NewBits(spec.dtype, old_bits, spec.seed, i, add);
    const uint64_t change = ElementHash(i, new_bits) - ElementHash(i, old_bits);
    if (add) {
      const uint64_t delta = AddDelta(spec.dtype, spec.value_dtype, old_bits, new_bits);
      if (AddExact(spec.dtype, spec.value_dtype, old_bits, delta) == new_bits) {
        kept.push_back(i);
        AppendValue(&item, delta);
        item.digest += change;
      } else {
        demoted_locations.push_back(i);
        AppendValue(&demoted, new_bits);
        demoted.digest += change;
      }
      continue;
    }
    kept.push_back(i);
    AppendValue(&item, spec.op == Op::kXor ? (old_bits ^ new_bits) : new_bits);
    item.digest += change;
  }
  REFIT_RETURN_NOT_OK(SetLocations(&item, kept, spec.force_encoding));
  items->push_back(std::move(item));
  if (!demoted_locations.empty()) {
    REFIT_RETURN_NOT_OK(SetLocations(&demoted, demoted_locations, std::nullopt));
    items->push_back(std::move(demoted));
  }
  return Status::OK();
}

/// Locations in [begin, end) where Mix(seed, i) % period == 0.
std::vector<uint64_t> EveryNth(uint64_t begin, uint64_t end, uint64_t period, uint64_t seed) {
  std::vector<uint64_t> out;
  for (uint64_t i = begin; i < end; ++i) {
    if (Mix(seed ^ (i * 0x100000001b3ULL)) % period == 0) out.push_back(i);
  }
  return out;
}

std::vector<uint64_t> Interval(uint64_t begin, uint64_t end) {
  std::vector<uint64_t> out;
  for (uint64_t i = begin; i < end; ++i) out.push_back(i);
  return out;
}

PayloadIds GoldenIds(uint32_t payload_id) {
  PayloadIds ids;
  for (size_t i = 0; i < ids.transfer_id.bytes.size(); ++i) {
    ids.transfer_id.bytes[i] = static_cast<uint8_t>(0x10 * (i % 16) + i);
  }
  ids.producer_id = 2;
  ids.payload_id = payload_id;
  ids.base_version = 100;
  ids.target_version = 101;
  return ids;
}

struct GoldenCase {
  std::string file;
  PayloadIds ids;
  bool byte_planes;
  std::vector<ChangeSpec> changes;
};

std::vector<GoldenCase> GoldenCases() {
  std::vector<GoldenCase> cases;
  cases.push_back({"empty.rfpl", GoldenIds(0), true, {}});

  // One XOR item per dtype, encodings chosen by size: dense, sparse and scattered changes.
  GoldenCase xor_case{"xor_all_dtypes_planes.rfpl", GoldenIds(1), true, {}};
  const Shape shapes[] = {{128}, {8, 16}, {2, 4, 16}};
  for (const DTypeInfo& info : AllDTypes()) {
    const auto code = static_cast<uint64_t>(info.dtype);
    const uint64_t periods[] = {1, 20, 3};
    std::vector<uint64_t> locations = EveryNth(0, 128, periods[code % 3], code);
    if (code % 3 == 0) locations.erase(locations.begin() + 60, locations.begin() + 64);
    xor_case.changes.push_back({fmt::format("layers.{}.{}", code, info.name), info.dtype,
                                shapes[code % 3], Op::kXor, info.dtype, 0, 128, locations,
                                std::nullopt, code});
  }
  cases.push_back(std::move(xor_case));

  // OVERWRITE items forcing each location encoding, including the 32- and 64-bit gaps.
  constexpr uint64_t k4G = uint64_t{1} << 32;
  GoldenCase encodings{"overwrite_encodings_flat.rfpl", GoldenIds(2), false, {}};
  encodings.changes = {
      {"enc.all",
       DType::kInt32,
       {4, 10},
       Op::kOverwrite,
       DType::kInt32,
       8,
       24,
       Interval(8, 24),
       LocationEncoding::kAll,
       21},
      {"enc.range",
       DType::kFloat16,
       {1000},
       Op::kOverwrite,
       DType::kFloat16,
       0,
       1000,
       [] {
         auto runs = Interval(10, 40);
         for (uint64_t i : Interval(300, 302)) runs.push_back(i);
         runs.push_back(999);
         return runs;
       }(),
       LocationEncoding::kRange,
       22},
      {"enc.gap16",
       DType::kUInt8,
       {64, 64},
       Op::kOverwrite,
       DType::kUInt8,
       0,
       4096,
       EveryNth(0, 4096, 90, 23),
       LocationEncoding::kGap16,
       23},
      {"enc.gap32",
       DType::kInt64,
       {200000},
       Op::kOverwrite,
       DType::kInt64,
       5,
       200000,
       {5, 6, 70000, 199999},
       LocationEncoding::kGap32,
       24},
      {"enc.gap64",
       DType::kFloat8E4M3FN,
       {3, static_cast<int64_t>(k4G)},
       Op::kOverwrite,
       DType::kFloat8E4M3FN,
       1,
       3 * k4G,
       {1, k4G + 9, 3 * k4G - 1},
       LocationEncoding::kGap64,
       25},
      {"enc.bitmask",
       DType::kBool,
       {10, 100},
       Op::kOverwrite,
       DType::kBool,
       100,
       1000,
       EveryNth(100, 1000, 4, 26),
       LocationEncoding::kBitmask,
       26},
  };
  cases.push_back(std::move(encodings));

  // ADD items for every float dtype, deltas in the same and in another width; the elements ADD
  // cannot reproduce (NaN payloads) travel in a demoted OVERWRITE item of the same tensor.
  GoldenCase add{"add_with_demotions_planes.rfpl", GoldenIds(3), true, {}};
  const std::pair<DType, DType> pairs[] = {
      {DType::kBFloat16, DType::kBFloat16}, {DType::kBFloat16, DType::kFloat32},
      {DType::kFloat16, DType::kFloat16},   {DType::kFloat16, DType::kFloat32},
      {DType::kFloat32, DType::kFloat32},   {DType::kFloat64, DType::kFloat64},
      {DType::kFloat64, DType::kFloat32}};
  uint64_t seed = 30;
  for (const auto& [dtype, delta] : pairs) {
    add.changes.push_back({fmt::format("add.{}.{}", DTypeName(dtype), DTypeName(delta)),
                           dtype,
                           {16, 16},
                           Op::kAdd,
                           delta,
                           0,
                           256,
                           EveryNth(0, 256, 6, seed),
                           std::nullopt,
                           seed});
    ++seed;
  }
  cases.push_back(std::move(add));

  // FULL items (an anchor): a tensor in two chunks, a scalar, an empty tensor, several widths.
  GoldenCase full{"full_anchor_flat.rfpl", GoldenIds(4), false, {}};
  full.changes = {
      {"full.chunked", DType::kBFloat16, {6, 8}, Op::kFull, DType::kBFloat16, 0, 24, {}, {}, 41},
      {"full.chunked", DType::kBFloat16, {6, 8}, Op::kFull, DType::kBFloat16, 24, 48, {}, {}, 41},
      {"full.scalar", DType::kFloat32, {}, Op::kFull, DType::kFloat32, 0, 1, {}, {}, 42},
      {"full.empty", DType::kInt16, {0, 3}, Op::kFull, DType::kInt16, 0, 0, {}, {}, 43},
      {"full.f8", DType::kFloat8E5M2, {33}, Op::kFull, DType::kFloat8E5M2, 0, 33, {}, {}, 44},
      {"full.f64", DType::kFloat64, {2, 5}, Op::kFull, DType::kFloat64, 0, 10, {}, {}, 45},
  };
  cases.push_back(std::move(full));
  return cases;
}

// ---- The test. ---------------------------------------------------------------------------------

std::string FilePath(const GoldenCase& c) { return std::string(kGoldenDir) + "/" + c.file; }

bool Regenerating() {
  const char* value = std::getenv(kRegenerateVariable);
  return value != nullptr && std::string(value) == "1";
}

/// The decompressed body of a payload, or an empty vector when it is not one zstd frame.
std::vector<std::byte> Decompress(std::span<const std::byte> payload) {
  if (payload.size() < kPayloadHeaderSize) return {};
  const auto frame = payload.subspan(kPayloadHeaderSize);
  const unsigned long long size = ZSTD_getFrameContentSize(frame.data(), frame.size());
  if (size == ZSTD_CONTENTSIZE_ERROR || size == ZSTD_CONTENTSIZE_UNKNOWN) return {};
  std::vector<std::byte> body(size);
  const size_t n = ZSTD_decompress(body.data(), body.size(), frame.data(), frame.size());
  if (ZSTD_isError(n)) return {};
  return body;
}

/// Return whether two payloads differ only in what the compressor decides: the compressed body,
/// its size and checksum, and the header checksum over them (docs/format/payload.md header
/// offsets 64–88 and 120–128). Tells a libzstd upgrade apart from a format change.
bool OnlyCompressionDiffers(std::span<const std::byte> a, std::span<const std::byte> b) {
  constexpr size_t kCompressedBytesOffset = 64;
  constexpr size_t kMacOffset = 88;
  constexpr size_t kHeaderChecksumOffset = 120;
  if (a.size() < kPayloadHeaderSize || b.size() < kPayloadHeaderSize) return false;
  auto same = [&](size_t begin, size_t end) {
    return std::equal(a.begin() + begin, a.begin() + end, b.begin() + begin);
  };
  return same(0, kCompressedBytesOffset) && same(kMacOffset, kHeaderChecksumOffset) &&
         Decompress(a) == Decompress(b);
}

std::optional<std::vector<std::byte>> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> bytes(chars.size());
  std::memcpy(bytes.data(), chars.data(), chars.size());
  return bytes;
}

void PrintTo(const GoldenCase& c, std::ostream* os) { *os << c.file; }

class GoldenTest : public ::testing::TestWithParam<GoldenCase> {
 protected:
  void SetUp() override {
    for (const ChangeSpec& spec : GetParam().changes) ASSERT_OK(AppendItems(spec, &items_));
    for (const Item& item : items_) views_.push_back(item.view());
  }

  std::vector<Item> items_;
  std::vector<ItemView> views_;
};

TEST_P(GoldenTest, EncoderReproducesTheFile) {
  const GoldenCase& c = GetParam();
  PayloadEncodeOptions options;
  options.byte_planes = c.byte_planes;
  ASSERT_OK_AND_ASSIGN(auto encoded, EncodePayload(c.ids, views_, options));
  if (Regenerating()) {
    FAIL() << "payload format v1 is frozen: its golden files are its definition and are never "
              "rewritten. A format change is a new version, with files of its own in "
              "tests/golden/v<N>/ (docs/format/payload.md, \"Version\"). Unset "
           << kRegenerateVariable << ".";
  }
  const auto golden = ReadFile(FilePath(c));
  ASSERT_TRUE(golden.has_value()) << "missing golden file " << FilePath(c) << "; generate it with "
                                  << kRegenerateVariable << "=1";
  if (encoded == *golden) return;
  const auto mismatch =
      std::mismatch(encoded.begin(), encoded.end(), golden->begin(), golden->end());
  ADD_FAILURE() << c.file << ": the encoder's output (" << encoded.size()
                << " bytes) differs from the golden file (" << golden->size()
                << " bytes) from byte " << (mismatch.first - encoded.begin()) << "; "
                << (OnlyCompressionDiffers(encoded, *golden)
                        ? "header fields and decompressed body are identical, so only libzstd's "
                          "compressed bytes changed (this libzstd: "
                        : "the payload's content changed (libzstd ")
                << ZSTD_versionString() << ")";
}

TEST_P(GoldenTest, FileDecodesToTheInputs) {
  const GoldenCase& c = GetParam();
  if (Regenerating()) GTEST_SKIP() << "regenerating";
  const auto golden = ReadFile(FilePath(c));
  ASSERT_TRUE(golden.has_value()) << "missing golden file " << FilePath(c);
  ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(*golden));
  EXPECT_EQ(decoded.header().ids.transfer_id, c.ids.transfer_id);
  EXPECT_EQ(decoded.header().ids.producer_id, c.ids.producer_id);
  EXPECT_EQ(decoded.header().ids.payload_id, c.ids.payload_id);
  EXPECT_EQ(decoded.header().ids.base_version, c.ids.base_version);
  EXPECT_EQ(decoded.header().ids.target_version, c.ids.target_version);
  EXPECT_EQ(decoded.header().flags, c.byte_planes ? kPayloadFlagBytePlanes : 0);
  const auto items = decoded.items();
  ASSERT_EQ(items.size(), views_.size());
  for (size_t i = 0; i < items.size(); ++i) {
    SCOPED_TRACE(fmt::format("{} item {} '{}'", c.file, i, views_[i].name));
    EXPECT_EQ(items[i].name, views_[i].name);
    EXPECT_EQ(items[i].dtype, views_[i].dtype);
    EXPECT_EQ(items[i].shape, views_[i].shape);
    EXPECT_EQ(items[i].op, views_[i].op);
    EXPECT_EQ(items[i].value_dtype, views_[i].value_dtype);
    EXPECT_EQ(items[i].span_begin, views_[i].span_begin);
    EXPECT_EQ(items[i].span_end, views_[i].span_end);
    EXPECT_EQ(items[i].count, views_[i].count);
    EXPECT_EQ(items[i].location_encoding, views_[i].location_encoding);
    EXPECT_TRUE(std::ranges::equal(items[i].locations, views_[i].locations));
    EXPECT_TRUE(std::ranges::equal(items[i].values, views_[i].values));
    EXPECT_EQ(items[i].digest, views_[i].digest);
  }
}

/// "xor_all_dtypes_planes.rfpl" → "xor_all_dtypes_planes".
std::string CaseName(const ::testing::TestParamInfo<GoldenCase>& param_info) {
  return param_info.param.file.substr(0, param_info.param.file.find('.'));
}

INSTANTIATE_TEST_SUITE_P(V1, GoldenTest, ::testing::ValuesIn(GoldenCases()), CaseName);

// The frozen bytes of v1: each file's size and XXH3-64, recorded when v1 was frozen. A rewritten
// file fails here even if encoder and decoder changed with it.
TEST(GoldenFreezeTest, V1FilesAreTheFrozenBytes) {
  struct Frozen {
    const char* file;
    size_t size;
    uint64_t xxh3;
  };
  constexpr Frozen kFrozen[] = {
      {"add_with_demotions_planes.rfpl", 1265, 0xef4f5f894200db78},
      {"empty.rfpl", 137, 0x3ab4264d49b8d417},
      {"full_anchor_flat.rfpl", 552, 0x629443c84e1ec79a},
      {"overwrite_encodings_flat.rfpl", 864, 0xfd77103ab5dbab19},
      {"xor_all_dtypes_planes.rfpl", 1102, 0x4ff40fe7a526275f},
  };
  for (const Frozen& frozen : kFrozen) {
    const std::string path = std::string(kGoldenDir) + "/" + frozen.file;
    const auto bytes = ReadFile(path);
    ASSERT_TRUE(bytes.has_value()) << "missing frozen golden file " << path;
    EXPECT_EQ(bytes->size(), frozen.size) << path;
    EXPECT_EQ(XXH3_64bits(bytes->data(), bytes->size()), frozen.xxh3) << path << " was rewritten";
  }
}

TEST(GoldenCoverageTest, FilesCoverEveryDTypeOpEncodingAndFlag) {
  std::set<DType> dtypes;
  std::set<Op> ops;
  std::set<LocationEncoding> encodings;
  std::set<bool> planes;
  for (const GoldenCase& c : GoldenCases()) {
    std::vector<Item> items;
    for (const ChangeSpec& spec : c.changes) ASSERT_OK(AppendItems(spec, &items));
    for (const Item& item : items) {
      dtypes.insert(item.dtype);
      ops.insert(item.op);
      encodings.insert(item.location_encoding);
    }
    planes.insert(c.byte_planes);
  }
  EXPECT_EQ(dtypes.size(), AllDTypes().size());
  EXPECT_EQ(ops.size(), 4u);
  EXPECT_EQ(encodings.size(), 6u);
  EXPECT_EQ(planes.size(), 2u);
}

}  // namespace
}  // namespace refit
