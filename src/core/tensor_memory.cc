#include "refit/tensor_memory.h"

#include <cstring>
#include <limits>
#include <utility>

#include "refit/status_format.h"

namespace refit {

TensorMemory::TensorMemory(uint64_t size_bytes, std::string description)
    : size_bytes_(size_bytes), description_(std::move(description)) {}

TensorMemory::~TensorMemory() = default;

BoundaryTraffic TensorMemory::traffic() const {
  return BoundaryTraffic{.to_device_bytes = to_device_bytes_.load(std::memory_order_relaxed),
                         .from_device_bytes = from_device_bytes_.load(std::memory_order_relaxed),
                         .calls = calls_.load(std::memory_order_relaxed)};
}

uint64_t TensorMemory::PositionBytes(size_t count, uint32_t width) const {
  const uint64_t elements = size_bytes_ / width;
  const uint64_t position_width =
      elements <= static_cast<uint64_t>(std::numeric_limits<int32_t>::max()) ? 4 : 8;
  return count * position_width;
}

Status TensorMemory::CheckPositions(std::span<const uint64_t> positions, uint32_t width,
                                    size_t bits_size, const char* operation) const {
  if (width == 0 || size_bytes_ % width != 0) {
    return InvalidArgument("{} of {} ({} bytes): element width {} does not divide it", operation,
                           description_, size_bytes_, width);
  }
  if (bits_size != positions.size() * width) {
    return InvalidArgument("{} of {}: {} bytes of bits for {} positions of {} bytes", operation,
                           description_, bits_size, positions.size(), width);
  }
  const uint64_t elements = size_bytes_ / width;
  for (uint64_t position : positions) {
    if (position >= elements) {
      return InvalidArgument("{} of {}: position {} is past its {} elements", operation,
                             description_, position, elements);
    }
  }
  return Status::OK();
}

Status TensorMemory::CheckRange(uint64_t offset, uint64_t length, const char* operation) const {
  if (offset > size_bytes_ || length > size_bytes_ - offset) {
    return InvalidArgument("{} of {}: bytes [{}, {}) are past its {} bytes", operation,
                           description_, offset, offset + length, size_bytes_);
  }
  return Status::OK();
}

Status TensorMemory::Update(std::span<const uint64_t> positions, uint32_t width,
                            std::span<std::byte> bits,
                            const std::function<void(std::span<std::byte>)>& modify) {
  REFIT_RETURN_NOT_OK(CheckPositions(positions, width, bits.size(), "update"));
  if (positions.empty()) return Status::OK();
  calls_.fetch_add(2, std::memory_order_relaxed);
  to_device_bytes_.fetch_add(PositionBytes(positions.size(), width), std::memory_order_relaxed);
  from_device_bytes_.fetch_add(bits.size(), std::memory_order_relaxed);
  REFIT_RETURN_NOT_OK(DoGather(positions, width, bits));
  modify(bits);
  to_device_bytes_.fetch_add(bits.size(), std::memory_order_relaxed);
  return DoScatter(positions, width, bits, /*same_positions=*/true);
}

Status TensorMemory::Scatter(std::span<const uint64_t> positions, uint32_t width,
                             std::span<const std::byte> bits) {
  REFIT_RETURN_NOT_OK(CheckPositions(positions, width, bits.size(), "scatter"));
  if (positions.empty()) return Status::OK();
  calls_.fetch_add(1, std::memory_order_relaxed);
  to_device_bytes_.fetch_add(PositionBytes(positions.size(), width) + bits.size(),
                             std::memory_order_relaxed);
  return DoScatter(positions, width, bits, /*same_positions=*/false);
}

Status TensorMemory::Read(uint64_t offset, std::span<std::byte> out) {
  REFIT_RETURN_NOT_OK(CheckRange(offset, out.size(), "read"));
  if (out.empty()) return Status::OK();
  calls_.fetch_add(1, std::memory_order_relaxed);
  from_device_bytes_.fetch_add(out.size(), std::memory_order_relaxed);
  return DoRead(offset, out);
}

Status TensorMemory::Write(uint64_t offset, std::span<const std::byte> bytes) {
  REFIT_RETURN_NOT_OK(CheckRange(offset, bytes.size(), "write"));
  if (bytes.empty()) return Status::OK();
  calls_.fetch_add(1, std::memory_order_relaxed);
  to_device_bytes_.fetch_add(bytes.size(), std::memory_order_relaxed);
  return DoWrite(offset, bytes);
}

Status TensorMemory::Synchronize() {
  calls_.fetch_add(1, std::memory_order_relaxed);
  return DoSynchronize();
}

// ---- OpaqueTensorMemory -----------------------------------------------------------------------

std::shared_ptr<OpaqueTensorMemory> OpaqueTensorMemory::Make(std::span<const std::byte> bytes) {
  return std::shared_ptr<OpaqueTensorMemory>(new OpaqueTensorMemory(bytes));
}

OpaqueTensorMemory::OpaqueTensorMemory(std::span<const std::byte> bytes)
    : TensorMemory(bytes.size(), "test device memory"), bytes_(bytes.begin(), bytes.end()) {}

void OpaqueTensorMemory::FailAfter(uint64_t after, uint64_t calls) {
  fail_after_ = after;
  fail_calls_ = calls;
}

Status OpaqueTensorMemory::Fault(const char* operation) {
  if (fail_calls_ == 0) return Status::OK();
  if (fail_after_ > 0) {
    --fail_after_;
    return Status::OK();
  }
  --fail_calls_;
  return IoError("test device memory: injected failure of {}", operation);
}

Status OpaqueTensorMemory::DoGather(std::span<const uint64_t> positions, uint32_t width,
                                    std::span<std::byte> out) {
  REFIT_RETURN_NOT_OK(Fault("gather"));
  for (size_t k = 0; k < positions.size(); ++k) {
    std::memcpy(out.data() + k * width, bytes_.data() + positions[k] * width, width);
  }
  return Status::OK();
}

Status OpaqueTensorMemory::DoScatter(std::span<const uint64_t> positions, uint32_t width,
                                     std::span<const std::byte> bits, bool /*same_positions*/) {
  REFIT_RETURN_NOT_OK(Fault("scatter"));
  for (size_t k = 0; k < positions.size(); ++k) {
    std::memcpy(bytes_.data() + positions[k] * width, bits.data() + k * width, width);
  }
  return Status::OK();
}

Status OpaqueTensorMemory::DoRead(uint64_t offset, std::span<std::byte> out) {
  REFIT_RETURN_NOT_OK(Fault("read"));
  std::memcpy(out.data(), bytes_.data() + offset, out.size());
  return Status::OK();
}

Status OpaqueTensorMemory::DoWrite(uint64_t offset, std::span<const std::byte> bytes) {
  REFIT_RETURN_NOT_OK(Fault("write"));
  std::memcpy(bytes_.data() + offset, bytes.data(), bytes.size());
  return Status::OK();
}

Status OpaqueTensorMemory::DoSynchronize() { return Fault("synchronize"); }

}  // namespace refit
