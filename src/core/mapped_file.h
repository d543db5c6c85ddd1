// RAII memory maps of files: the zero-copy backing of safetensors views, file-backed tracker
// baselines and mmapped weight stores.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>

#include "refit/status.h"

namespace refit::internal {

/// One mmap region. Unmapped (and its fd closed) on destruction.
///
/// Thread-safety: the object is immutable; concurrent access to the bytes is the caller's affair.
class MappedFile {
 public:
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  /// Map `path` read-only. Errors: IoError naming the path.
  static Result<std::unique_ptr<MappedFile>> OpenReadOnly(const std::string& path);
  /// Map `path` read-write and shared: writes reach the file.
  static Result<std::unique_ptr<MappedFile>> OpenReadWrite(const std::string& path);
  /// Map `path` copy-on-write (MAP_PRIVATE): writes stay in this process.
  static Result<std::unique_ptr<MappedFile>> OpenCopyOnWrite(const std::string& path);
  /// Create an unnamed temporary file of `size` bytes in `dir` (O_TMPFILE, or a named file
  /// unlinked at once), zero-filled, mapped read-write and shared. Its pages can be written back
  /// to disk under memory pressure instead of counting as anonymous memory.
  static Result<std::unique_ptr<MappedFile>> CreateTemporary(const std::string& dir, size_t size);

  std::span<std::byte> bytes() { return {static_cast<std::byte*>(base_), size_}; }
  std::span<const std::byte> bytes() const { return {static_cast<const std::byte*>(base_), size_}; }
  size_t size() const { return size_; }

 private:
  MappedFile(void* base, size_t size, int fd) : base_(base), size_(size), fd_(fd) {}
  void* base_;
  size_t size_;
  int fd_;
};

}  // namespace refit::internal
