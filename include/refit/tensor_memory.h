// The boundary between refit's core and tensor memory it cannot address: a receiver's weight in
// GPU memory, reached only through a small batched interface (gather, scatter, byte ranges).
//
// The applier keeps everything it knows how to do on the host — decoding, the op arithmetic,
// digests, the undo log — and sends the device only what changes: for a delta it gathers the old
// bits at the changed positions, computes the new bits on the host exactly as for host memory,
// and scatters them back to the same positions. The per-element cost across the boundary is the
// position once (4 bytes below 2^31 elements) plus the old and the new bits — O(changes), with no
// copy of the model on either side.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "refit/status.h"

namespace refit {

/// Bytes and calls that crossed a tensor-memory boundary.
struct BoundaryTraffic {
  /// Host → device: positions, new bits, written byte ranges.
  uint64_t to_device_bytes = 0;
  /// Device → host: gathered old bits, read byte ranges.
  uint64_t from_device_bytes = 0;
  /// Calls across the boundary (each gather, scatter, read, write or synchronize).
  uint64_t calls = 0;

  BoundaryTraffic& operator+=(const BoundaryTraffic& other) {
    to_device_bytes += other.to_device_bytes;
    from_device_bytes += other.from_device_bytes;
    calls += other.calls;
    return *this;
  }
};

/// One tensor's memory behind the boundary: `size_bytes` bytes the core never addresses. A
/// backend (torch, CUDA, the test backend below) implements the Do* operations; the public
/// methods check bounds and count the traffic, so every backend is counted alike.
///
/// Positions are element indices of the tensor's flat view; the elements are `width` bytes each.
/// A backend sends positions as 32-bit integers when the tensor has fewer than 2^31 elements and
/// as 64-bit ones otherwise, which is what the traffic counts.
///
/// Thread-safety: calls on one object must not overlap (the applier touches one tensor from one
/// thread at a time); distinct objects may be used from distinct threads. traffic() may be read
/// at any time.
class TensorMemory {
 public:
  virtual ~TensorMemory();
  TensorMemory(const TensorMemory&) = delete;
  TensorMemory& operator=(const TensorMemory&) = delete;

  /// The tensor's size in bytes.
  uint64_t size_bytes() const { return size_bytes_; }
  /// What the backend is, for messages ("torch cuda:0", "test").
  const std::string& description() const { return description_; }

  /// Read-modify-write the elements at `positions` (distinct): their old bits are gathered into
  /// `bits` (positions.size() × width bytes), `modify(bits)` turns them into the new bits on the
  /// host, and those are scattered back to the same positions — which cross the boundary once.
  /// Errors: InvalidArgument for a position past the end or a wrong `bits` size (nothing is
  /// touched); the backend's error (the device may then hold part of the batch: the caller's undo
  /// log restores it).
  Status Update(std::span<const uint64_t> positions, uint32_t width, std::span<std::byte> bits,
                const std::function<void(std::span<std::byte>)>& modify);
  /// Overwrite the elements at `positions` (distinct) with `bits`. Errors: as Update.
  Status Scatter(std::span<const uint64_t> positions, uint32_t width,
                 std::span<const std::byte> bits);
  /// Copy bytes [offset, offset + out.size()) out. Errors: InvalidArgument (past the end); the
  /// backend's.
  Status Read(uint64_t offset, std::span<std::byte> out);
  /// Overwrite bytes [offset, offset + bytes.size()). Errors: InvalidArgument (past the end); the
  /// backend's.
  Status Write(uint64_t offset, std::span<const std::byte> bytes);
  /// Wait until every write issued so far is visible to the tensor's other users (the device
  /// stream the weights are read on). Errors: the backend's.
  Status Synchronize();

  /// What crossed the boundary so far.
  BoundaryTraffic traffic() const;

 protected:
  TensorMemory(uint64_t size_bytes, std::string description);

  /// Gather the elements at `positions` into `out` (positions.size() × width bytes).
  virtual Status DoGather(std::span<const uint64_t> positions, uint32_t width,
                          std::span<std::byte> out) = 0;
  /// Write `bits` at `positions`. `same_positions`: the positions are those of the DoGather just
  /// before, which a backend may have kept on the device (Update).
  virtual Status DoScatter(std::span<const uint64_t> positions, uint32_t width,
                           std::span<const std::byte> bits, bool same_positions) = 0;
  virtual Status DoRead(uint64_t offset, std::span<std::byte> out) = 0;
  virtual Status DoWrite(uint64_t offset, std::span<const std::byte> bytes) = 0;
  virtual Status DoSynchronize() = 0;

 private:
  Status CheckPositions(std::span<const uint64_t> positions, uint32_t width, size_t bits_size,
                        const char* operation) const;
  Status CheckRange(uint64_t offset, uint64_t length, const char* operation) const;
  uint64_t PositionBytes(size_t count, uint32_t width) const;

  const uint64_t size_bytes_;
  const std::string description_;
  std::atomic<uint64_t> to_device_bytes_{0};
  std::atomic<uint64_t> from_device_bytes_{0};
  std::atomic<uint64_t> calls_{0};
};

/// The test backend: memory the core can reach only through TensorMemory's interface (the bytes
/// live in a private buffer), so that every receiver path can run "on a device" without one.
class OpaqueTensorMemory final : public TensorMemory {
 public:
  /// A tensor of `bytes.size()` bytes starting as a copy of `bytes`.
  static std::shared_ptr<OpaqueTensorMemory> Make(std::span<const std::byte> bytes);

  /// Fail the next `calls` operations after `after` more have succeeded (fault injection for
  /// rollback tests): each returns IoError.
  void FailAfter(uint64_t after, uint64_t calls = 1);
  /// A copy of the bytes, for tests' assertions (does not count as traffic).
  std::vector<std::byte> Snapshot() const { return bytes_; }

 private:
  explicit OpaqueTensorMemory(std::span<const std::byte> bytes);
  Status Fault(const char* operation);
  Status DoGather(std::span<const uint64_t> positions, uint32_t width,
                  std::span<std::byte> out) override;
  Status DoScatter(std::span<const uint64_t> positions, uint32_t width,
                   std::span<const std::byte> bits, bool same_positions) override;
  Status DoRead(uint64_t offset, std::span<std::byte> out) override;
  Status DoWrite(uint64_t offset, std::span<const std::byte> bytes) override;
  Status DoSynchronize() override;

  std::vector<std::byte> bytes_;
  uint64_t fail_after_ = UINT64_MAX;
  uint64_t fail_calls_ = 0;
};

}  // namespace refit
