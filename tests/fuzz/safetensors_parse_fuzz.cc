// libFuzzer target for ParseSafetensors: any input must come back as a Status, never a crash;
// when it parses, every view must lie inside the input, match its shape, and the views must tile
// the data section in ascending order.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "refit/safetensors.h"

namespace {

// Report a broken invariant and abort, so libFuzzer records the input as a crash.
[[noreturn]] void Fail(const char* what, const refit::TensorView& tensor) {
  std::fprintf(stderr, "safetensors_parse_fuzz: %s (tensor '%s')\n", what, tensor.name.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> input(reinterpret_cast<const std::byte*>(data), size);
  std::map<std::string, std::string> metadata;
  refit::Result<std::vector<refit::TensorView>> parsed =
      refit::ParseSafetensors(input, "fuzz", &metadata);
  if (!parsed.ok()) {
    return 0;
  }

  // Compare addresses as integers: relational comparison of unrelated pointers is unspecified.
  const uintptr_t input_begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t input_end = input_begin + size;
  uintptr_t previous_end = 0;
  for (const refit::TensorView& tensor : *parsed) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(tensor.bytes.data());
    if (begin < input_begin || begin > input_end || tensor.bytes.size() > input_end - begin) {
      Fail("view outside the input buffer", tensor);
    }
    if (previous_end != 0 && begin != previous_end) {
      Fail("views do not tile the data", tensor);
    }
    previous_end = begin + tensor.bytes.size();
    if (!refit::CheckTensorSize(tensor).ok()) {
      Fail("view size does not match its shape", tensor);
    }
  }
  // Tiling ends exactly at the end of the input: no unused trailing bytes were accepted.
  if (!parsed->empty() && previous_end != input_end) {
    Fail("views end before the input", parsed->back());
  }
  return 0;
}
