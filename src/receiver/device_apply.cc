// The device boundary's helpers of the applier (apply_internal.h): the compact positions a
// gathered batch is applied at, and byte ranges read and written in bounded blocks.
#include <algorithm>
#include <numeric>

#include "receiver/apply_internal.h"
#include "util/check.h"

namespace refit::internal {

std::span<const uint64_t> Iota(size_t n) {
  static const std::vector<uint64_t> iota = [] {
    std::vector<uint64_t> values(kDeviceBatch);
    std::iota(values.begin(), values.end(), uint64_t{0});
    return values;
  }();
  REFIT_DCHECK(n <= iota.size(), "a device batch larger than kDeviceBatch");
  return std::span<const uint64_t>(iota.data(), n);
}

Status ReadDevice(TensorMemory& memory, uint64_t offset, std::span<std::byte> out) {
  for (uint64_t done = 0; done < out.size(); done += kDeviceFullBlockBytes) {
    const uint64_t length = std::min<uint64_t>(kDeviceFullBlockBytes, out.size() - done);
    REFIT_RETURN_NOT_OK(memory.Read(offset + done, out.subspan(done, length)));
  }
  return Status::OK();
}

Status WriteDevice(TensorMemory& memory, uint64_t offset, std::span<const std::byte> bytes) {
  for (uint64_t done = 0; done < bytes.size(); done += kDeviceFullBlockBytes) {
    const uint64_t length = std::min<uint64_t>(kDeviceFullBlockBytes, bytes.size() - done);
    REFIT_RETURN_NOT_OK(memory.Write(offset + done, bytes.subspan(done, length)));
  }
  return Status::OK();
}

}  // namespace refit::internal
