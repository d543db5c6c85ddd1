// libFuzzer target for ManifestFromJson, the manifest an s3:// sender POSTs to each receiver's
// /v1/manifest (untrusted: anyone who reaches the control plane can send one).
//
// Invariants: a manifest that parses serializes (ManifestToJson) to one that parses to the same
// fields, and that serialization is canonical; every error is InvalidArgument.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "transport/s3/s3_layout.h"

namespace {

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "manifest_json_fuzz: %s\n", what);
  std::abort();
}

void Check(bool condition, const char* what) {
  if (!condition) Fail(what);
}

bool Same(const refit::internal::PayloadManifest& a, const refit::internal::PayloadManifest& b) {
  return a.transfer_id == b.transfer_id && a.producer_id == b.producer_id &&
         a.payload_id == b.payload_id && a.key == b.key && a.size == b.size &&
         a.checksum == b.checksum && a.mac == b.mac;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  refit::Result<refit::internal::PayloadManifest> manifest =
      refit::internal::ManifestFromJson(text);
  if (!manifest.ok()) {
    Check(manifest.status().code() == refit::StatusCode::kInvalidArgument,
          "a manifest error that is not InvalidArgument");
    return 0;
  }
  const std::string json = refit::internal::ManifestToJson(*manifest);
  refit::Result<refit::internal::PayloadManifest> again = refit::internal::ManifestFromJson(json);
  Check(again.ok(), "ManifestToJson wrote a manifest ManifestFromJson refuses");
  Check(Same(*again, *manifest), "a manifest does not survive serialize -> parse");
  Check(refit::internal::ManifestToJson(*again) == json, "ManifestToJson is not canonical");
  return 0;
}
