// Golden payloads of format v2 (tests/golden/v2/README.md): context-coded items built from fixed
// inputs, and the compatibility of v1: every v1 golden file still decodes, as version 1.
//
// To make the v2 file again (only while v2 is not frozen in a release): run with
// REFIT_REGENERATE_GOLDEN_V2=1; the test then writes it and fails on purpose.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "codec/locations.h"
#include "codec/tracker.h"
#include "core/half_float.h"
#include "pipeline/context_items.h"
#include "receiver/apply.h"
#include "refit/payload.h"
#include "refit/status_format.h"
#include "test_util.h"
#include "util/splitmix64.h"

namespace refit {
namespace {

constexpr const char* kV1Dir = REFIT_GOLDEN_DIR "/v1";
constexpr const char* kV2File = REFIT_GOLDEN_DIR "/v2/context_xor_planes.rfpl";
constexpr const char* kRegenerateVariable = "REFIT_REGENERATE_GOLDEN_V2";

constexpr uint64_t Mix(uint64_t x) { return internal::SplitMix64Hash(x); }

/// Element i of a weight-like tensor: a sum of two uniforms, scaled to about σ = 0.02.
float Weight(uint64_t seed, uint64_t i) {
  const uint64_t r = Mix((seed << 32) + i);
  const double u = ((r & 0xffffffff) + (r >> 32)) / 4294967296.0 - 1.0;
  return static_cast<float>(u * 0.05);
}

void Store(OwnedTensor& t, uint64_t i, uint64_t bits) {
  const uint32_t width = DTypeSize(t.dtype);
  std::memcpy(t.bytes.data() + i * width, &bits, width);  // Little-endian hosts only, as refit.
}

uint64_t Load(const OwnedTensor& t, uint64_t i) {
  uint64_t bits = 0;
  std::memcpy(&bits, t.bytes.data() + i * DTypeSize(t.dtype), DTypeSize(t.dtype));
  return bits;
}

/// The fixed inputs: three tensors (bfloat16, float16, float32) before and after a step that
/// moves small magnitudes by one ulp more often than large ones, as Adam at a small rate does.
struct Inputs {
  std::vector<OwnedTensor> old_tensors;
  std::vector<OwnedTensor> new_tensors;
};

Inputs MakeInputs() {
  Inputs in;
  const struct {
    const char* name;
    DType dtype;
    int64_t numel;
  } specs[] = {{"layers.0.mlp.weight", DType::kBFloat16, 6000},
               {"layers.0.norm.weight", DType::kFloat16, 3000},
               {"layers.0.attn.weight", DType::kFloat32, 2000}};
  uint64_t seed = 1;
  for (const auto& spec : specs) {
    OwnedTensor old{spec.name, spec.dtype, {spec.numel}, {}};
    old.bytes.resize(spec.numel * DTypeSize(spec.dtype));
    for (int64_t i = 0; i < spec.numel; ++i) {
      const float w = Weight(seed, i);
      uint64_t bits = 0;
      if (spec.dtype == DType::kBFloat16) bits = FloatToBFloat16(w);
      if (spec.dtype == DType::kFloat16) bits = FloatToHalf(w);
      if (spec.dtype == DType::kFloat32) bits = std::bit_cast<uint32_t>(w);
      Store(old, i, bits);
    }
    OwnedTensor next = old;
    for (int64_t i = 0; i < spec.numel; ++i) {
      const double magnitude = std::fabs(Weight(seed, i)) + 1e-4;
      const uint64_t draw = Mix((seed << 40) + 0x9e37 + i);
      const double p = std::min(0.5, 4e-4 / magnitude);
      if (static_cast<double>(draw >> 11) * 0x1.0p-53 >= p) continue;
      const uint64_t bits = Load(old, i);
      Store(next, i, (draw & 1) != 0 ? bits + 1 : bits - 1);
    }
    in.old_tensors.push_back(std::move(old));
    in.new_tensors.push_back(std::move(next));
    ++seed;
  }
  return in;
}

const PayloadIds kIds = {*TransferId::FromHex("00112233445566778899aabbccddeeff"), 2, 5, 100, 101};

/// The plain XOR items of the step (the tracker's), and the payload: the bfloat16 and float16
/// items context-coded against the old tensors, the float32 item plain (a v2 payload may mix).
struct Built {
  std::vector<Item> plain;
  std::vector<Item> sent;
  std::vector<std::byte> payload;
};

Result<Built> Build(const Inputs& in) {
  TrackerOptions options;
  options.initial_version = kIds.base_version;
  REFIT_ASSIGN_OR_RETURN(auto tracker, internal::DeltaTracker::Make(options));
  for (const OwnedTensor& t : in.old_tensors) REFIT_RETURN_NOT_OK(tracker->AdoptBaseline(t.view()));
  REFIT_ASSIGN_OR_RETURN(TransferPlan plan, tracker->Begin(kIds.transfer_id));
  if (plan.base_version != kIds.base_version) return Internal("unexpected base version");
  Built built;
  for (size_t k = 0; k < in.new_tensors.size(); ++k) {
    REFIT_ASSIGN_OR_RETURN(internal::EncodeResult r,
                           tracker->Encode(kIds.transfer_id, in.new_tensors[k].view()));
    if (r.items.size() != 1) return Internal("expected one item per tensor");
    built.plain.push_back(r.items[0]);
    if (in.new_tensors[k].dtype == DType::kFloat32) {
      built.sent.push_back(std::move(r.items[0]));
      continue;
    }
    REFIT_ASSIGN_OR_RETURN(Item coded,
                           internal::ContextCodeItem(r.items[0].view(), in.old_tensors[k].bytes));
    built.sent.push_back(std::move(coded));
  }
  std::vector<ItemView> views;
  for (const Item& item : built.sent) views.push_back(item.view());
  REFIT_ASSIGN_OR_RETURN(built.payload, EncodePayload(kIds, views));
  return built;
}

std::optional<std::vector<std::byte>> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> bytes(chars.size());
  std::memcpy(bytes.data(), chars.data(), chars.size());
  return bytes;
}

bool Regenerating() {
  const char* value = std::getenv(kRegenerateVariable);
  return value != nullptr && std::string(value) == "1";
}

TEST(GoldenV2Test, EncoderReproducesTheFile) {
  const Inputs in = MakeInputs();
  ASSERT_OK_AND_ASSIGN(Built built, Build(in));
  if (Regenerating()) {
    std::filesystem::create_directories(std::filesystem::path(kV2File).parent_path());
    std::ofstream out(kV2File, std::ios::binary);
    out.write(reinterpret_cast<const char*>(built.payload.data()),
              static_cast<std::streamsize>(built.payload.size()));
    FAIL() << "wrote " << kV2File << " (" << built.payload.size() << " bytes, xxh3 " << std::hex
           << XXH3_64bits(built.payload.data(), built.payload.size())
           << "): record them in V2FileIsTheRecordedBytes";
  }
  const auto golden = ReadFile(kV2File);
  ASSERT_TRUE(golden.has_value()) << kV2File;
  EXPECT_EQ(built.payload, *golden)
      << "the encoder (or the context coder, or libzstd's level-1 output) no longer writes the "
         "v2 golden file";
}

TEST(GoldenV2Test, FileDecodesAgainstTheOldTensorsToTheStep) {
  if (Regenerating()) GTEST_SKIP() << "regenerating";
  const Inputs in = MakeInputs();
  ASSERT_OK_AND_ASSIGN(Built built, Build(in));
  const auto golden = ReadFile(kV2File);
  ASSERT_TRUE(golden.has_value()) << kV2File;
  ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(*golden));
  EXPECT_EQ(decoded.header().format_version, 2);
  EXPECT_EQ(decoded.header().ids, kIds);
  ASSERT_EQ(decoded.items().size(), 3u);
  EXPECT_EQ(decoded.items()[0].location_encoding, LocationEncoding::kContext);
  EXPECT_EQ(decoded.items()[1].location_encoding, LocationEncoding::kContext);
  EXPECT_NE(decoded.items()[2].location_encoding, LocationEncoding::kContext);
  // Decoded against the old tensors, every item is the tracker's plain XOR item of the step.
  ASSERT_OK_AND_ASSIGN(
      DecodedPayload expanded,
      ExpandContextItems(decoded, [&](const ItemView& item, std::span<std::byte> out) {
        for (const OwnedTensor& t : in.old_tensors) {
          if (t.name != item.name) continue;
          const uint32_t width = DTypeSize(t.dtype);
          std::memcpy(out.data(), t.bytes.data() + item.span_begin * width, out.size());
          return Result<bool>(true);
        }
        return Result<bool>(NotFound("no tensor '{}'", item.name));
      }));
  for (size_t k = 0; k < 3; ++k) {
    const ItemView& got = expanded.items()[k];
    const Item& want = built.plain[k];
    EXPECT_EQ(got.name, want.name);
    EXPECT_EQ(got.count, want.count);
    EXPECT_EQ(got.digest, want.digest);
    ASSERT_OK_AND_ASSIGN(std::vector<uint64_t> got_locations, DecodeAllLocations(got));
    ASSERT_OK_AND_ASSIGN(std::vector<uint64_t> want_locations, DecodeAllLocations(want.view()));
    EXPECT_EQ(got_locations, want_locations) << want.name;
    EXPECT_TRUE(std::ranges::equal(got.values, want.values)) << want.name;
  }
  // And a receiver holding the old tensors applies the file to the new ones, digests verified.
  auto store = WeightStore::Make();
  for (const OwnedTensor& t : in.old_tensors) ASSERT_OK(store->AddCopy(t.view()));
  internal::UndoLog undo;
  ASSERT_OK(internal::ApplyPayload(decoded, *store, &undo));
  for (const OwnedTensor& t : in.new_tensors) {
    ASSERT_OK_AND_ASSIGN(MutableTensorView now, store->Find(t.name));
    EXPECT_TRUE(std::ranges::equal(now.bytes, t.bytes)) << t.name;
  }
}

// The v2 file's size and XXH3-64 as made: a rewritten file fails here even if the encoder and the
// decoder changed with it.
constexpr uint64_t kRecordedSize = 1092;
constexpr uint64_t kRecordedXxh3 = 0x707aedbb14d50f30;

TEST(GoldenV2Test, V2FileIsTheRecordedBytes) {
  if (Regenerating()) GTEST_SKIP() << "regenerating";
  const auto golden = ReadFile(kV2File);
  ASSERT_TRUE(golden.has_value()) << kV2File;
  EXPECT_EQ(golden->size(), kRecordedSize);
  EXPECT_EQ(XXH3_64bits(golden->data(), golden->size()), kRecordedXxh3);
}

// Compatibility: every v1 golden file still decodes with today's decoder, as a version 1 payload
// without context items (GoldenTest checks their items in full).
TEST(GoldenV2Test, V1FilesStillDecodeAsVersion1) {
  size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kV1Dir)) {
    if (entry.path().extension() != ".rfpl") continue;
    ++files;
    const auto bytes = ReadFile(entry.path().string());
    ASSERT_TRUE(bytes.has_value()) << entry.path();
    ASSERT_OK_AND_ASSIGN(DecodedPayload decoded, DecodePayload(*bytes));
    EXPECT_EQ(decoded.header().format_version, 1) << entry.path();
    EXPECT_FALSE(decoded.has_context_items()) << entry.path();
    // Re-encoding the same items writes version 1 again: a v1 writer is unchanged.
    EXPECT_EQ(PayloadFormatVersionFor(decoded.items()), 1) << entry.path();
  }
  EXPECT_EQ(files, 5u);
}

}  // namespace
}  // namespace refit
