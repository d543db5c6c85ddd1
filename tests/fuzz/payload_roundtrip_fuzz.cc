// libFuzzer target: EncodePayload → DecodePayload round trip.
//
// The input drives a FuzzedDataProvider that derives up to six items — names (repeating, so one
// tensor can have several items), dtypes, shapes up to 2^33 elements, spans, ops, locations
// (dense runs or scattered, with a forced or chosen encoding), values and digests — and
// sometimes breaks one item on purpose. Checks, each an abort() on failure:
//   - a broken item makes EncodePayload fail with InvalidArgument; valid items encode;
//   - encoding twice gives identical bytes (determinism);
//   - the payload decodes, and the decoded items equal the inputs field by field and byte by
//     byte.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "codec/locations.h"
#include "codec/values.h"
#include "refit/dtype.h"
#include "refit/item.h"
#include "refit/payload.h"
#include "refit/tensor.h"

namespace {

constexpr size_t kMaxItems = 6;
/// Distinct names an item can take: few, so that items share tensors.
constexpr int kNameChoices = 4;
constexpr int kMaxRank = 3;
constexpr int64_t kMaxSmallExtent = 40;
/// A dimension that makes gap64 locations possible without materializing any tensor.
constexpr int64_t kHugeExtent = int64_t{1} << 33;
/// Caps that keep every item small even inside a huge tensor.
constexpr uint64_t kMaxFullSpan = 4096;
constexpr uint64_t kMaxLocations = 512;
constexpr uint64_t kMaxBitmaskSpan = uint64_t{1} << 16;
/// One item in this many is broken on purpose.
constexpr int kBreakOneIn = 16;

[[noreturn]] void Fail(const char* what, const refit::Status& status = refit::Status::OK()) {
  std::fprintf(stderr, "payload_roundtrip_fuzz: %s %s\n", what, status.ToString().c_str());
  std::abort();
}

struct TensorFacts {
  refit::DType dtype;
  refit::Shape shape;
};

bool IsAddDType(refit::DType dtype) {
  return dtype == refit::DType::kFloat16 || dtype == refit::DType::kBFloat16 ||
         dtype == refit::DType::kFloat32 || dtype == refit::DType::kFloat64;
}

TensorFacts PickTensor(FuzzedDataProvider& fdp) {
  TensorFacts facts;
  facts.dtype = static_cast<refit::DType>(fdp.ConsumeIntegralInRange<uint8_t>(1, 14));
  const int rank = fdp.ConsumeIntegralInRange(0, kMaxRank);
  for (int d = 0; d < rank; ++d) {
    facts.shape.push_back(fdp.ConsumeBool() && d == 0
                              ? kHugeExtent
                              : fdp.ConsumeIntegralInRange<int64_t>(0, kMaxSmallExtent));
  }
  return facts;
}

std::vector<uint64_t> PickLocations(FuzzedDataProvider& fdp, uint64_t begin, uint64_t end) {
  const uint64_t length = end - begin;
  const uint64_t n = fdp.ConsumeIntegralInRange<uint64_t>(1, std::min(length, kMaxLocations));
  std::vector<uint64_t> locations;
  if (fdp.ConsumeBool()) {  // One dense run.
    const uint64_t start = begin + fdp.ConsumeIntegralInRange<uint64_t>(0, length - n);
    for (uint64_t i = 0; i < n; ++i) locations.push_back(start + i);
    return locations;
  }
  for (uint64_t i = 0; i < n; ++i) {
    locations.push_back(begin + fdp.ConsumeIntegralInRange<uint64_t>(0, length - 1));
  }
  std::sort(locations.begin(), locations.end());
  locations.erase(std::unique(locations.begin(), locations.end()), locations.end());
  return locations;
}

/// Build one item that every encoder must accept.
refit::Item MakeValidItem(FuzzedDataProvider& fdp, std::map<std::string, TensorFacts>& tensors) {
  refit::Item item;
  item.name = "model.t" + std::to_string(fdp.ConsumeIntegralInRange(0, kNameChoices - 1));
  auto known = tensors.find(item.name);
  if (known == tensors.end()) known = tensors.emplace(item.name, PickTensor(fdp)).first;
  item.dtype = known->second.dtype;
  item.shape = known->second.shape;
  const uint64_t numel = *refit::NumElements(item.shape);
  item.span_begin = fdp.ConsumeIntegralInRange<uint64_t>(0, numel);
  item.span_end = fdp.ConsumeIntegralInRange<uint64_t>(item.span_begin, numel);
  item.op = static_cast<refit::Op>(fdp.ConsumeIntegralInRange<uint8_t>(1, 4));
  item.value_dtype = item.dtype;
  if (item.op == refit::Op::kAdd) {
    if (IsAddDType(item.dtype)) {
      constexpr refit::DType kDeltas[] = {refit::DType::kFloat16, refit::DType::kBFloat16,
                                          refit::DType::kFloat32, refit::DType::kFloat64};
      item.value_dtype = kDeltas[fdp.ConsumeIntegralInRange(0, 3)];
    } else {
      item.op = refit::Op::kXor;
    }
  }
  if (item.span_begin == item.span_end) item.op = refit::Op::kFull;  // The only empty item.
  if (item.op == refit::Op::kFull) {
    item.value_dtype = item.dtype;
    item.span_end = item.span_begin + std::min(item.span_end - item.span_begin, kMaxFullSpan);
    item.count = item.span_end - item.span_begin;
    item.location_encoding = refit::LocationEncoding::kAll;
  } else {
    const std::vector<uint64_t> locations = PickLocations(fdp, item.span_begin, item.span_end);
    item.count = locations.size();
    std::optional<refit::LocationEncoding> force;
    const uint8_t forced_code = fdp.ConsumeIntegralInRange<uint8_t>(0, 6);
    const bool bitmask_too_big = item.span_end - item.span_begin > kMaxBitmaskSpan;
    if (forced_code != 0 &&
        !(forced_code == static_cast<uint8_t>(refit::LocationEncoding::kBitmask) &&
          bitmask_too_big)) {
      force = static_cast<refit::LocationEncoding>(forced_code);
    }
    auto chosen = refit::ChooseLocationEncoding(locations, item.span_begin, item.span_end, force);
    if (!chosen.ok())
      chosen = refit::ChooseLocationEncoding(locations, item.span_begin, item.span_end);
    if (!chosen.ok()) Fail("no location encoding for valid locations", chosen.status());
    item.location_encoding = *chosen;
    refit::Status encoded = refit::EncodeLocations(item.location_encoding, locations,
                                                   item.span_begin, item.span_end, &item.locations);
    if (!encoded.ok()) Fail("EncodeLocations refused valid locations", encoded);
  }
  const size_t value_bytes = item.count * refit::DTypeSize(item.value_dtype);
  const std::vector<uint8_t> bytes = fdp.ConsumeBytes<uint8_t>(value_bytes);
  item.values.resize(value_bytes);
  for (size_t i = 0; i < bytes.size(); ++i) item.values[i] = static_cast<std::byte>(bytes[i]);
  item.digest = fdp.ConsumeIntegral<uint64_t>();
  return item;
}

/// Break `item` in a way every encoder must refuse.
void BreakItem(FuzzedDataProvider& fdp, refit::Item* item) {
  switch (fdp.ConsumeIntegralInRange(0, 2)) {
    case 0:
      item->values.push_back(std::byte{0});  // Value bytes no longer count × width.
      break;
    case 1:
      item->name.clear();
      break;
    default:
      item->span_end = *refit::NumElements(item->shape) + 1;
      break;
  }
}

bool SameItem(const refit::ItemView& a, const refit::ItemView& b) {
  return a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.op == b.op &&
         a.value_dtype == b.value_dtype && a.span_begin == b.span_begin &&
         a.span_end == b.span_end && a.count == b.count &&
         a.location_encoding == b.location_encoding && a.digest == b.digest &&
         std::ranges::equal(a.locations, b.locations) && std::ranges::equal(a.values, b.values);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider fdp(data, size);
  refit::PayloadIds ids;
  ids.producer_id = fdp.ConsumeIntegral<uint32_t>();
  ids.payload_id = fdp.ConsumeIntegral<uint32_t>();
  ids.base_version = fdp.ConsumeIntegralInRange<uint64_t>(0, UINT64_MAX - 1);
  ids.target_version = ids.base_version + 1;
  refit::PayloadEncodeOptions options;
  options.byte_planes = fdp.ConsumeBool();
  options.zstd_level = fdp.ConsumeIntegralInRange(-1, 3);

  std::map<std::string, TensorFacts> tensors;
  std::vector<refit::Item> items;
  bool broken = false;
  const size_t item_count = fdp.ConsumeIntegralInRange<size_t>(0, kMaxItems);
  for (size_t i = 0; i < item_count; ++i) {
    items.push_back(MakeValidItem(fdp, tensors));
    if (fdp.ConsumeIntegralInRange(0, kBreakOneIn - 1) == 0) {
      BreakItem(fdp, &items.back());
      broken = true;
    }
  }
  std::vector<refit::ItemView> views;
  for (const refit::Item& item : items) views.push_back(item.view());

  auto first = refit::EncodePayload(ids, views, options);
  if (broken) {
    if (first.ok()) Fail("EncodePayload accepted a broken item");
    if (first.status().code() != refit::StatusCode::kInvalidArgument) {
      Fail("EncodePayload refused a broken item with the wrong code", first.status());
    }
    return 0;
  }
  if (!first.ok()) Fail("EncodePayload refused valid items", first.status());
  auto second = refit::EncodePayload(ids, views, options);
  if (!second.ok() || *first != *second) Fail("EncodePayload is not deterministic");

  auto decoded = refit::DecodePayload(*first);
  if (!decoded.ok()) Fail("DecodePayload refused an encoded payload", decoded.status());
  const auto& header = decoded->header();
  if (header.ids.producer_id != ids.producer_id || header.ids.payload_id != ids.payload_id ||
      header.ids.base_version != ids.base_version ||
      header.ids.target_version != ids.target_version ||
      header.ids.transfer_id != ids.transfer_id) {
    Fail("decoded ids differ");
  }
  if (decoded->items().size() != views.size()) Fail("decoded item count differs");
  for (size_t i = 0; i < views.size(); ++i) {
    if (!SameItem(decoded->items()[i], views[i])) Fail("decoded item differs");
  }
  return 0;
}
