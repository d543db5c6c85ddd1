// Reading and writing safetensors files (https://github.com/huggingface/safetensors format):
// an 8-byte little-endian header length N, N bytes of JSON header, then the tensor data.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "refit/status.h"
#include "refit/tensor.h"

namespace refit {

namespace internal {
class MappedFile;
}  // namespace internal

/// How a file's bytes are brought into memory.
enum class LoadMode : uint8_t {
  /// mmap the file read-only (zero-copy; pages load on first touch).
  kMmap,
  /// Read the whole file into an owned buffer.
  kRead,
};

/// An open, fully validated safetensors file.
///
/// Thread-safety: immutable after Open; tensor views may be read from many threads. Views stay
/// valid as long as the SafetensorsFile lives.
class SafetensorsFile {
 public:
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  /// Open and validate `path`: header length within the file, well-formed JSON, known dtypes,
  /// shape × dtype size equal to each tensor's byte range, ranges inside the data section, no
  /// overlaps, no gaps. Errors: IoError (open/read/mmap), InvalidArgument (malformed file, naming
  /// the path, the tensor and the offending value).
  static Result<std::unique_ptr<SafetensorsFile>> Open(const std::string& path,
                                                       LoadMode mode = LoadMode::kMmap);

  /// The tensors in file order (ascending data offset).
  const std::vector<TensorView>& tensors() const { return tensors_; }
  /// The "__metadata__" string map (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// Return the tensor named `name`. Errors: NotFound naming it.
  Result<TensorView> Find(std::string_view name) const;
  const std::string& path() const { return path_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  std::vector<TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
  // Either an mmap region or an owned buffer backs the views.
  std::unique_ptr<internal::MappedFile> mapping_;
  std::vector<std::byte> owned_;
};

/// Validate `file_bytes` as a safetensors image and return views into it. Exposed for fuzzing
/// and for buffers that did not come from a file. `origin` names the source in errors.
Result<std::vector<TensorView>> ParseSafetensors(std::span<const std::byte> file_bytes,
                                                 const std::string& origin,
                                                 std::map<std::string, std::string>* metadata);

/// Write `tensors` to `path` (atomically: a temporary file renamed into place), in the given
/// order, data 8-byte aligned as the safetensors spec recommends. Errors: InvalidArgument
/// (duplicate names, size mismatch), IoError.
Status WriteSafetensors(const std::string& path, const std::vector<TensorView>& tensors,
                        const std::map<std::string, std::string>& metadata = {});

/// The metadata key holding a checkpoint's weight version (written by refit's tools).
inline constexpr const char* kWeightVersionMetadataKey = "refit.version";

/// Return the weight version recorded in `file`'s metadata (kWeightVersionMetadataKey), or 0
/// when absent or not a number.
uint64_t WeightVersionOf(const SafetensorsFile& file);

}  // namespace refit
