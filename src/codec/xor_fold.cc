#include "codec/xor_fold.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "codec/locations.h"
#include "refit/status_format.h"

namespace refit {

Result<std::optional<Item>> FoldXorItems(std::span<const ItemView> items,
                                         std::optional<LocationEncoding> force) {
  if (items.empty()) return std::optional<Item>();
  const ItemView& first = items.front();
  const uint32_t width = DTypeSize(first.dtype);
  if (width == 0 || width > sizeof(uint64_t)) {
    return InvalidArgument(
        "fold of tensor '{}': dtype {} has {}-byte elements; XOR folding takes "
        "1 to 8",
        first.name, DTypeName(first.dtype), width);
  }
  uint64_t total = 0;
  uint64_t span_begin = UINT64_MAX;
  uint64_t span_end = 0;
  uint64_t digest = 0;
  for (size_t k = 0; k < items.size(); ++k) {
    const ItemView& item = items[k];
    if (item.op != Op::kXor) {
      return InvalidArgument("fold of tensor '{}': item {} is {}, only xor items fold", first.name,
                             k, OpName(item.op));
    }
    if (item.name != first.name || item.dtype != first.dtype || item.shape != first.shape ||
        item.value_dtype != item.dtype) {
      return InvalidArgument(
          "fold of tensor '{}' ({} {}): item {} is of '{}' ({} {}, values {}); every item of a "
          "fold is of one tensor, with values of its dtype",
          first.name, DTypeName(first.dtype), ShapeToString(first.shape), k, item.name,
          DTypeName(item.dtype), ShapeToString(item.shape), DTypeName(item.value_dtype));
    }
    if (item.values.size() != item.count * width) {
      return DataLoss(
          "fold of tensor '{}': item {} has {} value bytes for {} locations of {} bytes",
          first.name, k, item.values.size(), item.count, width);
    }
    total += item.count;
    span_begin = std::min(span_begin, item.span_begin);
    span_end = std::max(span_end, item.span_end);
    digest += item.digest;
  }
  // Every (location, value) of every item, then sorted by location: equal locations meet.
  std::vector<std::pair<uint64_t, uint64_t>> changes;
  changes.reserve(total);
  for (size_t k = 0; k < items.size(); ++k) {
    const ItemView& item = items[k];
    Result<std::vector<uint64_t>> locations = DecodeAllLocations(item);
    if (!locations.ok()) {
      return locations.status().WithContext(
          fmt::format("fold of tensor '{}', item {}", first.name, k));
    }
    for (size_t j = 0; j < locations->size(); ++j) {
      uint64_t value = 0;
      std::memcpy(&value, item.values.data() + j * width, width);
      changes.emplace_back((*locations)[j], value);
    }
  }
  std::stable_sort(changes.begin(), changes.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<uint64_t> locations;
  std::vector<std::byte> values;
  locations.reserve(changes.size());
  values.reserve(changes.size() * width);
  for (size_t j = 0; j < changes.size();) {
    const uint64_t location = changes[j].first;
    uint64_t value = 0;
    for (; j < changes.size() && changes[j].first == location; ++j) value ^= changes[j].second;
    if (value == 0) continue;  // Every delta that touched it was undone by a later one.
    locations.push_back(location);
    const size_t at = values.size();
    values.resize(at + width);
    std::memcpy(values.data() + at, &value, width);
  }
  if (locations.empty()) return std::optional<Item>();
  Item folded;
  folded.name = std::string(first.name);
  folded.dtype = first.dtype;
  folded.shape = first.shape;
  folded.op = Op::kXor;
  folded.value_dtype = first.dtype;
  folded.span_begin = span_begin;
  folded.span_end = span_end;
  folded.count = locations.size();
  folded.digest = digest;
  folded.values = std::move(values);
  REFIT_ASSIGN_OR_RETURN(
      folded.location_encoding,
      ChooseAndEncodeLocations(locations, span_begin, span_end, force, &folded.locations));
  return std::optional<Item>(std::move(folded));
}

}  // namespace refit
