// The payload bucketing rule and the in-memory packer built on it.
#include <algorithm>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "pipeline/bucketing.h"

namespace refit {

uint64_t BucketedBytes(const ItemView& item) { return item.locations.size() + item.values.size(); }

uint64_t FullPieceElements(uint64_t bucket_bytes, DType dtype) {
  return std::max<uint64_t>(1, std::max(bucket_bytes, kMinFullPieceBytes) / DTypeSize(dtype));
}

std::vector<std::pair<uint64_t, uint64_t>> CutSpans(uint64_t numel, uint64_t span_elements) {
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  if (numel == 0) return {{0, 0}};
  for (uint64_t begin = 0; begin < numel; begin += span_elements) {
    spans.emplace_back(begin, std::min(numel, begin + span_elements));
  }
  return spans;
}

Result<std::vector<std::vector<std::byte>>> PackPayloads(const PayloadIds& ids,
                                                         std::span<const Item> items,
                                                         uint64_t bucket_bytes,
                                                         const PayloadEncodeOptions& options) {
  std::vector<std::vector<std::byte>> payloads;
  PayloadBucketer bucketer(bucket_bytes);
  std::vector<ItemView> bucket;
  PayloadIds next = ids;
  auto emit = [&]() -> Status {
    REFIT_ASSIGN_OR_RETURN(std::vector<std::byte> payload, EncodePayload(next, bucket, options));
    payloads.push_back(std::move(payload));
    ++next.payload_id;
    bucket.clear();
    return Status::OK();
  };
  for (const Item& item : items) {
    const ItemView view = item.view();
    if (bucketer.Add(BucketedBytes(view)) && !bucket.empty()) REFIT_RETURN_NOT_OK(emit());
    bucket.push_back(view);
  }
  if (!bucket.empty()) REFIT_RETURN_NOT_OK(emit());
  return payloads;
}

}  // namespace refit
